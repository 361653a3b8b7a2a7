"""The on-disk ERA5 layout shared by the data tools: names, one-file writer, statistics.

Layout (read by ``utils/data_loader.py``)::

    <data_path>/train/<name>.h5, <data_path>/valid/<name>.h5   one file per year (or year+member)
    <data_path>/stats/global_means.npy   (1, C, 1, 1) float32, per-channel mean, training split only
    <data_path>/stats/global_stds.npy    (1, C, 1, 1) float32, per-channel std (ddof=0), training only
    <data_path>/stats/time_means.npy     (1, C, H, W) float32, mean over training time steps

Each ``.h5`` file holds ``fields`` (T, C, H, W) float32 chunked one time step per chunk with
attributes ``channel_names`` and ``dt_hours``, ``latitude`` (H,) float64 descending and
``longitude`` (W,) float64 ascending. Optional attributes of ``fields``: ``start_time``, the
ISO 8601-like time of step 0 (``2001-02-30T06:00:00`` is valid in a 360-day calendar), and
``calendar``, the CF calendar that ``start_time`` and ``dt_hours`` are counted in (``standard``,
``proleptic_gregorian``, ``noleap``, ``360_day``, ...; as cftime names it, so ``365_day`` is stored
as ``noleap`` and ``gregorian`` as ``standard``). The converter always writes both; a file without
``calendar`` (e.g. synthetic data) is in the standard calendar.

Both ``tools/make_synthetic_data.py`` and ``tools/convert_era5.py`` write through this module so
that the two produce byte-for-byte the same kind of files and statistics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import h5py
import numpy as np

from utils.errors import UserError

# dataset and attribute names of one .h5 file
FIELDS = "fields"
LATITUDE = "latitude"
LONGITUDE = "longitude"
ATTR_CHANNEL_NAMES = "channel_names"
ATTR_DT_HOURS = "dt_hours"
ATTR_START_TIME = "start_time"  # optional, ISO 8601 time of fields[0]
ATTR_CALENDAR = "calendar"  # optional, CF calendar of start_time; absent means standard

# folder and file names of the layout
TRAIN = "train"
VALID = "valid"
SPLITS = (TRAIN, VALID)
STATS = "stats"
GLOBAL_MEANS = "global_means.npy"
GLOBAL_STDS = "global_stds.npy"
TIME_MEANS = "time_means.npy"
STATS_FILES = (GLOBAL_MEANS, GLOBAL_STDS, TIME_MEANS)
SUFFIX = ".h5"
PARTIAL_SUFFIX = ".h5.part"  # written first, renamed once complete: loaders never see half files


class LayoutError(UserError, ValueError):
    """Bad input or arguments for the data tools; the message names the problem and the fix."""


class InputNotFoundError(UserError, FileNotFoundError):
    """An input file or folder the data tools need does not exist."""


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line, for error messages (library messages may hold newlines)."""
    return " ".join(str(exc).split())


def split_files(data_path: str | Path, split: str) -> list[Path]:
    """Sorted ``.h5`` files of one split (``"train"`` or ``"valid"``) of a layout folder.

    Returns an empty list when the split folder does not exist.
    """
    return sorted((Path(data_path) / split).glob("*" + SUFFIX))


def prepare_output_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """Create ``out_dir/{train,valid,stats}``; refuse to mix with a previous dataset.

    A loader reads every ``*.h5`` of a split, so stale files from an earlier run would silently
    join the new dataset. With ``overwrite`` they (and old stats and partial files) are deleted.

    Raises:
        LayoutError: ``out_dir`` already holds layout files and ``overwrite`` is False,
            ``out_dir`` exists and is not a folder, or the folders cannot be made (or old
            files deleted), e.g. no permission, a read-only file system or a file on the path.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LayoutError(f"output path {out} exists and is not a folder; pass another --out")
    old = [p for s in SPLITS for p in (out / s).glob("*.h5*")]
    old += [out / STATS / n for n in STATS_FILES if (out / STATS / n).exists()]
    if old and not overwrite:
        raise LayoutError(f"{out} already holds a dataset ({len(old)} files, e.g. {old[0]}); "
                          "pass --overwrite (overwrite=True) to replace it or choose another --out")
    try:
        for p in old:
            p.unlink()
        for sub in (*SPLITS, STATS):
            (out / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LayoutError(f"cannot write the output folder {out} ({one_line(exc)}); "
                          "pass a writable --out") from None
    return out


def _check_grid(latitude: np.ndarray, longitude: np.ndarray) -> None:
    if latitude.ndim != 1 or longitude.ndim != 1:
        raise LayoutError(f"latitude and longitude must be 1-D, got shapes {latitude.shape} and {longitude.shape}")
    if latitude.size > 1 and not np.all(np.diff(latitude) < 0):
        raise LayoutError("latitude must be strictly descending (north to south); flip it before writing")
    if longitude.size > 1 and not np.all(np.diff(longitude) > 0):
        raise LayoutError("longitude must be strictly ascending; sort it before writing")


class FieldFileWriter:
    """Write one ``.h5`` file of the layout block by block (context manager).

    The file is created as ``<path>.part`` and renamed to ``path`` only when all ``n_steps``
    time steps were written and the writer is closed without an exception, so an interrupted
    run never leaves a truncated file that a loader would pick up.

    Args:
        path: destination, ``<data_path>/<split>/<name>.h5``.
        channel_names: C channel names, e.g. ``["t850", "z500"]``.
        latitude: (H,) degrees north, strictly descending.
        longitude: (W,) degrees east, strictly ascending.
        n_steps: T, number of time steps the file will hold.
        dt_hours: hours between consecutive time steps (> 0).
        start_time: optional ISO 8601 time of step 0, stored as attribute ``start_time``.
        calendar: optional CF calendar name of ``start_time`` (e.g. ``"360_day"``), stored as
            attribute ``calendar``.

    Raises:
        LayoutError: inconsistent shapes, unsorted coordinates, ``n_steps < 1`` or ``dt_hours <= 0``,
            or the file cannot be created.
    """

    def __init__(self, path: str | Path, channel_names: Sequence[str], latitude: np.ndarray,
                 longitude: np.ndarray, n_steps: int, dt_hours: float, start_time: str | None = None,
                 calendar: str | None = None):
        lat = np.asarray(latitude, dtype=np.float64)
        lon = np.asarray(longitude, dtype=np.float64)
        _check_grid(lat, lon)
        if n_steps < 1:
            raise LayoutError(f"a file needs at least one time step, got n_steps={n_steps}")
        if not dt_hours > 0:
            raise LayoutError(f"dt_hours must be > 0, got {dt_hours}")
        self.path = Path(path)
        self.shape = (int(n_steps), len(channel_names), lat.size, lon.size)
        self._written = np.zeros(n_steps, dtype=bool)
        self._tmp = self.path.with_name(self.path.stem + PARTIAL_SUFFIX)
        try:
            self._file = h5py.File(self._tmp, "w")
        except OSError as exc:
            raise LayoutError(f"cannot create {self._tmp} ({one_line(exc)}); pass a writable --out") from None
        try:
            self._fields = self._create(channel_names, lat, lon, dt_hours, start_time, calendar)
        except BaseException:
            self.close(ok=False)
            raise

    def _create(self, channel_names, lat, lon, dt_hours, start_time, calendar) -> h5py.Dataset:
        # one time step per chunk: the loader reads single steps; no compression for speed
        ds = self._file.create_dataset(FIELDS, shape=self.shape, dtype=np.float32,
                                       chunks=(1, *self.shape[1:]))
        ds.attrs[ATTR_CHANNEL_NAMES] = [str(n) for n in channel_names]
        ds.attrs[ATTR_DT_HOURS] = float(dt_hours)
        if start_time is not None:
            ds.attrs[ATTR_START_TIME] = str(start_time)
        if calendar is not None:
            ds.attrs[ATTR_CALENDAR] = str(calendar)
        self._file.create_dataset(LATITUDE, data=lat)
        self._file.create_dataset(LONGITUDE, data=lon)
        return ds

    def write(self, start: int, block: np.ndarray) -> None:
        """Write time steps ``start .. start + n - 1`` from ``block`` of shape (n, C, H, W).

        Raises:
            LayoutError: wrong block shape, a range outside ``[0, T)``, or a failed write (disk full).
        """
        if block.ndim != 4 or block.shape[1:] != self.shape[1:]:
            raise LayoutError(f"block of shape {block.shape} does not fit a file of shape {self.shape}")
        stop = start + block.shape[0]
        if start < 0 or stop > self.shape[0]:
            raise LayoutError(f"time steps {start}..{stop - 1} outside 0..{self.shape[0] - 1}")
        try:
            self._fields[start:stop] = np.asarray(block, dtype=np.float32)
        except OSError as exc:
            raise LayoutError(f"cannot write {self._tmp} ({one_line(exc)}); free disk space or pass another "
                              "--out") from None
        self._written[start:stop] = True

    def close(self, ok: bool = True) -> Path:
        """Finish the file: rename it into place if ``ok``, else delete the partial file.

        Raises:
            LayoutError: ``ok`` but some time steps were never written (the file is deleted).
        """
        self._file.close()
        if ok and not self._written.all():
            missing = int((~self._written).sum())
            self._tmp.unlink()
            raise LayoutError(f"{self.path}: {missing} of {self.shape[0]} time steps were never written")
        if ok:
            os.replace(self._tmp, self.path)
        else:
            self._tmp.unlink(missing_ok=True)
        return self.path

    def __enter__(self) -> "FieldFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)


def write_field_file(path: str | Path, fields: np.ndarray, channel_names: Sequence[str],
                     latitude: np.ndarray, longitude: np.ndarray, dt_hours: float,
                     start_time: str | None = None) -> Path:
    """Write a whole (T, C, H, W) array as one ``.h5`` file of the layout (cast to float32).

    Raises:
        LayoutError: as :class:`FieldFileWriter`, or if C differs from ``len(channel_names)``.
    """
    fields = np.asarray(fields)
    if fields.ndim != 4 or fields.shape[1] != len(channel_names):
        raise LayoutError(f"fields of shape {fields.shape} do not match {len(channel_names)} channel names")
    with FieldFileWriter(path, channel_names, latitude, longitude, fields.shape[0], dt_hours,
                         start_time) as writer:
        writer.write(0, fields)
    return Path(path)


def _decode(name) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def read_channel_names(h5_path: str | Path) -> list[str]:
    """Channel names (length C) stored in attribute ``channel_names`` of ``fields`` of a file.

    Raises:
        InputNotFoundError: the file does not exist.
        LayoutError: the file is not readable HDF5, or has no ``fields`` dataset or no
            ``channel_names`` attribute.
    """
    path = Path(h5_path)
    if not path.is_file():
        raise InputNotFoundError(f"{path} does not exist")
    fix = "write it with tools.convert_era5 or tools.make_synthetic_data"
    try:
        with h5py.File(path, "r") as f:
            if FIELDS not in f or ATTR_CHANNEL_NAMES not in f[FIELDS].attrs:
                raise LayoutError(f"{path} has no '{FIELDS}' dataset with a '{ATTR_CHANNEL_NAMES}' attribute; {fix}")
            return [_decode(n) for n in f[FIELDS].attrs[ATTR_CHANNEL_NAMES]]
    except OSError as exc:
        raise LayoutError(f"cannot read {path} as HDF5 ({one_line(exc)}); {fix}") from None


class StatsAccumulator:
    """Streaming per-channel mean/std and time-mean climatology over training blocks.

    Blocks are merged with Chan et al.'s parallel update in float64, so the result does not
    depend on how the data were blocked beyond rounding, and geopotential-sized values
    (~1e5) do not lose precision the way a naive sum of squares would.

    Args:
        channel_names: C names, used in error messages.
        grid: (H, W) of the fields.
    """

    def __init__(self, channel_names: Sequence[str], grid: tuple[int, int]):
        self.channel_names = list(channel_names)
        c = len(self.channel_names)
        self.grid = tuple(grid)
        self.count = 0  # values per channel seen so far (time steps * H * W)
        self.mean = np.zeros(c, dtype=np.float64)
        self.m2 = np.zeros(c, dtype=np.float64)  # sum of squared deviations from the mean
        self.time_sum = np.zeros((c, *self.grid), dtype=np.float64)
        self.n_steps = 0

    def update(self, block: np.ndarray) -> None:
        """Add training time steps ``block`` of shape (n, C, H, W) (any float dtype, physical units).

        Raises:
            LayoutError: the block's channel count or grid differs from the accumulator's.
        """
        c = len(self.channel_names)
        if block.ndim != 4 or block.shape[1] != c or block.shape[2:] != self.grid:
            raise LayoutError(f"stats block of shape {block.shape} does not match (n, {c}, {self.grid[0]}, {self.grid[1]})")
        n = block.shape[0] * self.grid[0] * self.grid[1]
        if n == 0:
            return
        b_mean = block.mean(axis=(0, 2, 3), dtype=np.float64)
        b_m2 = np.empty(c, dtype=np.float64)
        for i in range(c):  # one channel at a time keeps the float64 temporary small
            dev = block[:, i].astype(np.float64).ravel() - b_mean[i]
            b_m2[i] = dev @ dev
        self._combine(n, b_mean, b_m2, block.sum(axis=0, dtype=np.float64), block.shape[0])

    def merge(self, other: "StatsAccumulator") -> None:
        """Add the data seen by ``other`` (e.g. a worker process's accumulator of the same grid)."""
        if other.count:
            self._combine(other.count, other.mean, other.m2, other.time_sum, other.n_steps)

    def _combine(self, n: int, b_mean: np.ndarray, b_m2: np.ndarray, time_sum: np.ndarray, n_steps: int) -> None:
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * (n / total)
        self.m2 += b_m2 + delta ** 2 * (self.count * n / total)
        self.count = total
        self.time_sum += time_sum
        self.n_steps += n_steps

    def result(self) -> dict[str, np.ndarray]:
        """The statistics as float32 arrays keyed by file name without ``.npy``.

        Returns:
            ``{"global_means": (1, C, 1, 1), "global_stds": (1, C, 1, 1), "time_means": (1, C, H, W)}``;
            stds are population stds (ddof=0), as ``np.std``.

        Raises:
            LayoutError: no data were added, or a channel is constant (std 0 would make
                normalization divide by zero).
        """
        if self.count == 0:
            raise LayoutError("no training data to compute statistics from; the training split is empty")
        std = np.sqrt(self.m2 / self.count)
        flat = [n for n, s in zip(self.channel_names, std) if not s > 0]
        if flat:
            raise LayoutError(f"channels {flat} are constant over the training split (std 0), so they cannot "
                              "be normalized; drop them from --variables/--levels")
        c = len(self.channel_names)
        return {
            "global_means": self.mean.reshape(1, c, 1, 1).astype(np.float32),
            "global_stds": std.reshape(1, c, 1, 1).astype(np.float32),
            "time_means": (self.time_sum / self.n_steps)[None].astype(np.float32),
        }

    def save(self, data_path: str | Path) -> dict[str, np.ndarray]:
        """Write the three ``.npy`` files to ``<data_path>/stats/`` and return them (see :meth:`result`)."""
        stats = self.result()
        save_stats(data_path, stats)
        return stats


def save_stats(data_path: str | Path, stats: dict[str, np.ndarray]) -> Path:
    """Save ``stats`` (keys ``global_means``, ``global_stds``, ``time_means``) to ``<data_path>/stats/``.

    Returns the stats folder.

    Raises:
        LayoutError: the folder or a file cannot be written.
    """
    stats_dir = Path(data_path) / STATS
    try:
        stats_dir.mkdir(parents=True, exist_ok=True)
        for file_name in STATS_FILES:
            np.save(stats_dir / file_name, stats[file_name[:-len(".npy")]].astype(np.float32))
    except OSError as exc:
        raise LayoutError(f"cannot write the statistics to {stats_dir} ({one_line(exc)}); free disk space or "
                          "pass another --out") from None
    return stats_dir


def compute_and_save_stats(data_path: str | Path, train_arrays: Iterable[np.ndarray],
                           channel_names: Sequence[str]) -> dict[str, np.ndarray]:
    """Compute the statistics over all training arrays (each (T, C, H, W)) and save them.

    Every time step of every array (year, ensemble member) counts once. Returns the float32
    arrays (see :meth:`StatsAccumulator.result`).

    Raises:
        LayoutError: no arrays, mismatching shapes, or a constant channel.
    """
    acc = None
    for arr in train_arrays:
        if acc is None:
            acc = StatsAccumulator(channel_names, tuple(arr.shape[2:]))
        acc.update(arr)
    if acc is None:
        raise LayoutError("no training arrays given; the training split is empty")
    return acc.save(data_path)


def format_stats(stats: dict[str, np.ndarray], channel_names: Sequence[str]) -> str:
    """A small table of per-channel mean and std for printed summaries."""
    width = max(8, *(len(n) for n in channel_names))
    lines = [f"  {'channel':<{width}} {'mean':>14} {'std':>14}"]
    for i, name in enumerate(channel_names):
        lines.append(f"  {name:<{width}} {stats['global_means'][0, i, 0, 0]:>14.6g} "
                     f"{stats['global_stds'][0, i, 0, 0]:>14.6g}")
    return "\n".join(lines)
