"""Generate a synthetic ERA5-like dataset in the layout of ``utils/data/layout.py`` (the command line:
``tools/make_synthetic_data.py``).

Each channel is an analytic function of position and time:

* a latitude-dependent background (warm tropics / cold poles, jets, subtropical highs) with a
  small seasonal shift and a stationary longitude pattern ("continents"),
* a few smooth large-scale waves ``cos(phi)^m cos(n phi + chi) cos(m (lambda - omega t) + psi)``
  advected eastward at a channel-dependent speed ``omega`` (faster aloft),
* a diurnal heating bump that follows the sun (period ``24 / dt_hours`` steps),

scaled to plausible physical magnitudes (K, m^2/s^2, m/s, Pa, %, kg/m^2) so that normalization
matters. The dynamics are shared by all files while wave phases differ per file, so a model
that learns advection and the diurnal cycle beats persistence on unseen (validation) years.

Usage::

    python -m tools.make_synthetic_data --out data/synthetic
    python -m tools.make_synthetic_data --out data/era5_like --channels 20 --img_size 360 720 \\
        --train_years 1 --steps_per_year 520 --valid_years 1
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from utils.data import layout
from utils.preprocess.climatology_builder import ClimatologyAccumulator, climatology_fits
from utils.preprocess.writer import FieldFileWriter, StatsAccumulator, format_stats

# the 20 channels of the NERSC ViT/ERA5 tutorial, in its order
BASE_CHANNELS = ("u10m", "v10m", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850",
                 "v850", "z850", "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv")
# more pressure-level channels for C > 20, in this order (level-major)
EXTRA_LEVELS = (925, 700, 600, 400, 300, 250, 200, 150, 100)
EXTRA_VARIABLES = ("z", "t", "u", "v", "r")

START_YEAR = 2000
N_WAVES = 4  # travelling waves per file
BLOCK_BYTES = 256 * 2 ** 20  # time steps generated (and held) at once, in bytes of float32
MAX_STEP_BYTES = 2 * 2 ** 30  # one time step of float32 fields at most (the block holds at least one)
G = 9.80665  # m/s^2, to turn heights into geopotential


def channel_names(n_channels: int) -> list[str]:
    """ERA5-like names for ``n_channels`` channels: the tutorial's 20, then more pressure levels.

    Raises:
        LayoutError: ``n_channels < 1`` or more than the available names.
    """
    names = list(BASE_CHANNELS)
    names += [f"{v}{lev}" for lev in EXTRA_LEVELS for v in EXTRA_VARIABLES if f"{v}{lev}" not in names]
    if not 1 <= n_channels <= len(names):
        raise layout.LayoutError(f"--channels must be between 1 and {len(names)}, got {n_channels}")
    return names[:n_channels]


@dataclass(frozen=True)
class ChannelClimate:
    """Physical scales of one channel (all in the channel's units, e.g. K or m^2/s^2)."""

    name: str
    pressure: float  # hPa; 1000 for near-surface and column channels
    wave_amp: float  # RMS-like amplitude of the travelling waves
    diurnal_amp: float  # peak of the heating bump
    speed: float  # eastward advection, degrees longitude per day


def _pressure(name: str) -> tuple[str, float]:
    """Split ``t850`` -> (``t``, 850.); surface names (``t2m``, ``u10m``, ``sp``) get 1000 hPa."""
    m = re.fullmatch(r"([a-z]+?)(\d+)(m?)", name)
    if m is None:
        return name, 1000.0
    return m.group(1), 1000.0 if m.group(3) else float(m.group(2))


def _wave_and_diurnal(var: str, p: float, z_mean: float) -> tuple[float, float]:
    surf = (p / 1000.0) ** 6  # the diurnal cycle is a boundary-layer effect
    return {
        "t": (3.0, 4.0 * surf),
        "z": (0.02 * z_mean + 200.0, 0.001 * z_mean),
        "u": (6.0 + 6.0 * (1 - p / 1000), 1.0 * surf),
        "v": (6.0 + 6.0 * (1 - p / 1000), 0.8 * surf),
        "sp": (600.0, 100.0),
        "msl": (800.0, 100.0),
        "r": (7.0, 3.0 * (p / 1000) ** 2),
        "tcwv": (4.0, 1.0),
    }.get(var, (1.0, 0.2))


def _z_mean(p: float) -> float:
    return G * 7400.0 * np.log(1013.25 / p)  # isothermal atmosphere, 7.4 km scale height


def _background(var: str, p: float, phi: np.ndarray) -> np.ndarray:
    """Zonal-mean climate as a function of latitude ``phi`` (radians, any shape)."""
    s2, c2 = np.sin(phi) ** 2, np.cos(phi) ** 2
    if var == "t":
        t_eq = 300.0 * (p / 1000.0) ** 0.19
        return t_eq - (45.0 * (p / 1000.0) ** 0.5 + 5.0) * s2
    if var == "z":
        zm = _z_mean(p)
        return zm + (0.1 * zm + 300.0) * (c2 - 0.5)
    if var == "u":  # westerly jets at mid-latitudes, easterly trades
        return (8.0 + 22.0 * (1 - p / 1000)) * np.sin(2 * phi) ** 2 - 5.0 * c2 ** 4
    if var == "sp":
        return 98500.0 - 2500.0 * s2 - 700.0 * np.cos(6 * phi)
    if var == "msl":  # subtropical highs, subpolar lows
        return 101300.0 - 700.0 * np.cos(6 * phi)
    if var == "r":
        return 60.0 + 15.0 * np.cos(2 * phi)
    if var == "tcwv":
        return 5.0 + 40.0 * c2 ** 2
    return np.zeros_like(phi)  # v and unknown variables


UNITS = {"t": "K", "z": "m**2 s**-2", "u": "m s**-1", "v": "m s**-1", "sp": "Pa", "msl": "Pa", "r": "%",
         "tcwv": "kg m**-2"}


def channel_units(name: str) -> str:
    """The physical unit of channel ``name`` (``t850`` -> ``K``), as ERA5 writes it; ``""`` when unknown."""
    return UNITS.get(_pressure(name)[0], "")


def channel_climate(name: str, rng: np.random.Generator) -> ChannelClimate:
    """Scales of channel ``name``; ``rng`` adds a small per-channel jitter to the speed."""
    var, p = _pressure(name)
    wave, diurnal = _wave_and_diurnal(var, p, _z_mean(p))
    # deg/day, faster aloft; several times real wave speeds so that one step moves features by
    # grid cells and persistence is a weak baseline that a small model can learn to beat
    speed = 40.0 + 60.0 * (1 - p / 1000) + rng.uniform(-4.0, 4.0)
    return ChannelClimate(name, p, wave, diurnal, speed)


def grid(img_size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """ERA5-style grid: latitude (H,) from 90 down to -90 + 180/H, longitude (W,) from 0 by 360/W.

    Both float64 degrees; the south pole row is left out like the tutorial's 720x1440 ERA5 crop.
    """
    h, w = img_size
    return 90.0 - np.arange(h) * (180.0 / h), np.arange(w) * (360.0 / w)


class SyntheticFile:
    """The analytic fields of one file (year): per-file wave phases, dataset-wide climate.

    Args:
        climates: C channel climates (shared by all files).
        stationary: (C, H, W) stationary longitude pattern (shared by all files).
        lat, lon: grid in degrees.
        rng: per-file generator for the wave modes and phases.
        t0_hours: hours since ``START_YEAR``-01-01T00 of the file's first step.
        dt_hours: hours between steps.
    """

    def __init__(self, climates, stationary, lat, lon, rng, t0_hours, dt_hours):
        self.climates, self.stationary = climates, stationary
        self.phi, self.lam = np.deg2rad(lat), np.deg2rad(lon)
        self.t0, self.dt = t0_hours, dt_hours
        c, k = len(climates), N_WAVES
        m_max = max(1, min(8, lon.size // 8))  # keep waves >= 8 grid cells long
        self.m = rng.integers(1, m_max + 1, size=k)
        n = rng.integers(1, 5, size=k)
        chi, self.psi = rng.uniform(0, 2 * np.pi, size=(2, k))
        # latitude structure of each wave: vanishes at the poles, smooth everywhere
        self.lat_modes = np.cos(self.phi)[:, None] ** self.m * np.cos(n * self.phi[:, None] + chi)  # (H, K)
        weights = rng.normal(size=(c, k))
        weights *= np.sqrt(2.0) / np.linalg.norm(weights, axis=1, keepdims=True)  # RMS ~ wave_amp
        self.amps = weights * np.array([cl.wave_amp for cl in climates])[:, None]  # (C, K)

    def block(self, start: int, stop: int) -> np.ndarray:
        """Time steps ``start .. stop - 1`` as float32 (n, C, H, W)."""
        t = self.t0 + self.dt * np.arange(start, stop, dtype=np.float64)  # hours
        out = np.empty((t.size, len(self.climates), self.phi.size, self.lam.size), dtype=np.float32)
        for i, cl in enumerate(self.climates):
            out[:, i] = self._channel(i, cl, t)
        return out

    def _channel(self, i: int, cl: ChannelClimate, t: np.ndarray) -> np.ndarray:
        var, p = _pressure(cl.name)
        # waves and the diurnal bump are separable in (lat) x (time, lon): one batched matmul
        shift = np.deg2rad(cl.speed / 24.0) * t  # radians of eastward advection
        arg = self.m[None, :, None] * (self.lam[None, None, :] - shift[:, None, None]) + self.psi[None, :, None]
        lon_part = self.amps[i][None, :, None] * np.cos(arg)  # (n, K, W)
        lat_part = self.lat_modes  # (H, K)
        if cl.diurnal_amp:
            # heating peaks at 15 local solar time, i.e. at longitude (15 - UTC) * 15 degrees
            peak = np.deg2rad((15.0 - t % 24.0) * 15.0)
            bump = np.exp(1.5 * (np.cos(self.lam[None, :] - peak[:, None]) - 1.0))  # (n, W)
            lon_part = np.concatenate([lon_part, cl.diurnal_amp * bump[:, None, :]], axis=1)
            lat_part = np.concatenate([lat_part, np.cos(self.phi)[:, None] ** 2], axis=1)
        field = np.matmul(lat_part[None], lon_part)  # (n, H, W)
        # the seasons move the background north and south by up to 8 degrees
        season = np.deg2rad(8.0) * np.sin(2 * np.pi * (t / 24.0 - 80.0) / 365.25)
        field += _background(var, p, self.phi[None, :] - season[:, None])[:, :, None]
        field += self.stationary[i]
        return field


def _stationary(climates, lat, lon, rng) -> np.ndarray:
    """(C, H, W) fixed longitude pattern (continents, orography), 20% of each wave amplitude."""
    phi, lam = np.deg2rad(lat)[:, None], np.deg2rad(lon)[None, :]
    psi = rng.uniform(0, 2 * np.pi, size=2)
    pattern = np.cos(phi) ** 2 * (np.cos(2 * lam + psi[0]) + 0.5 * np.sin(3 * lam + psi[1]) * np.sin(2 * phi))
    return np.stack([0.2 * cl.wave_amp * pattern for cl in climates])


def _plan(train_years: int, valid_years: int) -> list[tuple[str, int]]:
    years = range(START_YEAR, START_YEAR + train_years + valid_years)
    return [(layout.TRAIN if y < START_YEAR + train_years else layout.VALID, y) for y in years]


def _hours_since_start(year: int) -> float:
    delta = np.datetime64(f"{year}-01-01T00", "h") - np.datetime64(f"{START_YEAR}-01-01T00", "h")
    return float(delta.astype(np.int64))


def _check_args(channels, img_size, train_years, valid_years, steps_per_year, dt_hours, seed, workers=1) -> None:
    h, w = img_size
    if workers < 1:
        raise layout.LayoutError(f"--workers must be >= 1, got {workers}")
    if h < 2 or w < 2:
        raise layout.LayoutError(f"--img_size must be at least 2 2, got {h} {w}")
    if train_years < 1 or valid_years < 1:
        raise layout.LayoutError("--train_years and --valid_years must be >= 1")
    if steps_per_year < 2:
        raise layout.LayoutError(f"--steps_per_year must be >= 2 (a sample needs two steps), got {steps_per_year}")
    if not 0 < dt_hours <= 24 * 366 / steps_per_year:
        raise layout.LayoutError(f"--dt_hours must be > 0 and keep {steps_per_year} steps within a year, got {dt_hours}")
    if seed < 0:  # NumPy seeds are non-negative
        raise layout.LayoutError(f"--seed must be >= 0, got {seed}")
    channel_names(channels)
    step = channels * h * w * 4
    if step > MAX_STEP_BYTES:  # one step is generated, held and accumulated at once: bounded before any work
        raise layout.LayoutError(f"--img_size {h} {w} with {channels} channels makes one time step {step / 2**30:.1f} "
                                 f"GiB, over the {MAX_STEP_BYTES / 2**30:.0f} GiB one step may take in memory; pass a "
                                 "smaller --img_size (ERA5 at 0.25 degrees is 721 1440)")


def _check_space(out_dir: str | Path, total: int) -> None:
    """Refuse a dataset of ``total`` bytes that the file system under ``out_dir`` has no room for (before
    anything is written)."""
    import shutil
    parent = Path(out_dir).absolute()
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        return
    if total > free:
        raise layout.LayoutError(f"the dataset would take {total / 2**30:.1f} GiB, more than the {free / 2**30:.1f} "
                                 f"GiB free under {parent}; pass fewer --steps_per_year, years, channels or a smaller "
                                 "--img_size, or another --out")


@dataclass
class _FileJob:
    """Generate and write one file; returns its statistics accumulator for training files (picklable)."""

    out: Path
    names: list
    climates: list
    stationary: np.ndarray
    lat: np.ndarray
    lon: np.ndarray
    img_size: tuple
    steps: int
    dt_hours: float
    seed: int
    verbose: bool

    climatology: bool

    def __call__(self, item: tuple[str, int]):
        """Returns ``(stats, climatology)`` accumulators of a training file, ``(None, None)`` for validation."""
        import cftime
        split, year = item
        synth = SyntheticFile(self.climates, self.stationary, self.lat, self.lon,
                              np.random.default_rng([self.seed, 1, year]), _hours_since_start(year), self.dt_hours)
        train = split == layout.TRAIN
        stats = StatsAccumulator(self.names, self.img_size) if train else None
        clim = ClimatologyAccumulator("standard") if train and self.climatology else None
        path = self.out / split / f"{year}{layout.SUFFIX}"
        block = max(1, min(self.steps, BLOCK_BYTES // (len(self.names) * self.img_size[0] * self.img_size[1] * 4)))
        t_start, start_time = time.perf_counter(), f"{year}-01-01T00:00:00"
        with FieldFileWriter(path, self.names, self.lat, self.lon, self.steps, self.dt_hours, start_time=start_time,
                             channel_units=[channel_units(n) for n in self.names]) as writer:
            for start in range(0, self.steps, block):
                stop = min(start + block, self.steps)
                data = synth.block(start, stop)
                writer.write(start, data)
                if stats is not None:
                    stats.update(data)
                if clim is not None:
                    hours = self.dt_hours * np.arange(start, stop)
                    clim.update(data, cftime.num2date(hours, f"hours since {start_time}", calendar="standard"))
        if self.verbose:
            print(f"  {split}/{path.name}: {self.steps} steps ({time.perf_counter() - t_start:.1f} s)", flush=True)
        return stats, clim


def make_synthetic_dataset(out_dir: str | Path, channels: int = 4, img_size: tuple[int, int] = (32, 64),
                           train_years: int = 2, valid_years: int = 1, steps_per_year: int = 64,
                           dt_hours: float = 6.0, seed: int = 0, overwrite: bool = False,
                           verbose: bool = False, workers: int = 1) -> Path:
    """Write a synthetic dataset in the ERA5 layout and return ``out_dir``.

    Files ``train/2000.h5 ..`` then ``valid/..`` (years continue after the training years), each
    with ``fields`` float32 (steps_per_year, channels, H, W) starting on Jan 1 00 UTC of its year;
    ``stats/`` computed over the training files only (with the climatology by day of year and hour of day,
    ``stats/climatology.h5``, when it fits in memory). Output is fully determined by the
    arguments (same seed -> identical files). Memory use is bounded by ~256 MiB blocks.

    Args:
        out_dir: dataset folder (created).
        channels: C, 1..65; names from :func:`channel_names`.
        img_size: (H, W) grid, see :func:`grid`.
        train_years, valid_years: number of files per split.
        steps_per_year: T, time steps per file.
        dt_hours: hours between steps.
        seed: random seed of the wave modes and phases.
        overwrite: replace an existing dataset in ``out_dir``.
        verbose: print progress.
        workers: files generated in parallel processes (same output as 1).

    Raises:
        LayoutError: invalid arguments (one time step over :data:`MAX_STEP_BYTES`), a dataset larger than the
            free space, ``out_dir`` holds a dataset and ``overwrite`` is False, or ``out_dir`` cannot be written.
    """
    img_size = (int(img_size[0]), int(img_size[1]))
    _check_args(channels, img_size, train_years, valid_years, steps_per_year, dt_hours, seed, workers)
    _check_space(out_dir, (train_years + valid_years) * steps_per_year * channels * img_size[0] * img_size[1] * 4)
    out = layout.prepare_output_dir(out_dir, overwrite)
    names = channel_names(channels)
    lat, lon = grid(img_size)
    rng = np.random.default_rng([seed, 0])
    climates = [channel_climate(n, rng) for n in names]
    stationary = _stationary(climates, lat, lon, rng)
    with_clim = climatology_fits(train_years * steps_per_year, (channels, *img_size))
    job = _FileJob(out, names, climates, stationary, lat, lon, img_size, steps_per_year, dt_hours, seed, verbose,
                   with_clim)
    plan = _plan(train_years, valid_years)
    if workers > 1:
        with ProcessPoolExecutor(min(workers, len(plan))) as pool:
            partial = list(pool.map(job, plan))
    else:
        partial = [job(item) for item in plan]
    stats, clim = StatsAccumulator(names, img_size), ClimatologyAccumulator("standard")
    for part, part_clim in partial:
        if part is not None:
            stats.merge(part)
        if part_clim is not None:
            clim.merge(part_clim)
    result = stats.save(out)
    if with_clim:
        clim.save(out / layout.STATS / layout.CLIMATOLOGY, names)
    if verbose:
        print(f"wrote {train_years} train + {valid_years} valid files of shape "
              f"({steps_per_year}, {channels}, {img_size[0]}, {img_size[1]}), dt {dt_hours} h, to {out}")
        print("training statistics:\n" + format_stats(result, names))
        print(f"climatology: {layout.STATS}/{layout.CLIMATOLOGY}" if with_clim else
              f"climatology: skipped (too large to accumulate in memory); run python -m tools.make_climatology {out}")
    return out
