"""Writing datasets in the layout (``utils/data/layout.py``): one ``.h5`` file block by block, and the
training statistics. The data tools (``tools/convert_era5.py``, ``tools/make_synthetic_data.py``) write
through this module, so both produce the same kind of files and statistics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import h5py
import numpy as np

from utils.core.errors import one_line
from utils.core.files import check_replaceable
from utils.data.layout import (ATTR_CALENDAR, ATTR_CHANNEL_NAMES, ATTR_CHANNEL_UNITS, ATTR_DT_HOURS, ATTR_START_TIME,
                               ATTR_TIME_STEP, ATTR_TIME_UNIT, FIELDS, LATITUDE, LONGITUDE, PARTIAL_SUFFIX, STATS,
                               STATS_FILES, LayoutError)
from utils.data.timestep import TimeStep


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
        dt_hours: hours between consecutive time steps (> 0); None with ``step`` in months or years.
        start_time: optional ISO 8601 time of step 0, stored as attribute ``start_time``.
        calendar: optional CF calendar name of ``start_time`` (e.g. ``"360_day"``), stored as
            attribute ``calendar``.
        step: the time step in its own unit (default: ``dt_hours`` as hours, or days when whole days),
            stored as ``time_step`` and ``time_step_unit``; ``dt_hours`` is stored for hours and days.
        channel_units: optional C unit strings (e.g. ``"K"``), stored as ``channel_units``.

    Raises:
        LayoutError: inconsistent shapes, unsorted coordinates, ``n_steps < 1``, no positive time step,
            or the file cannot be created.
    """

    def __init__(self, path: str | Path, channel_names: Sequence[str], latitude: np.ndarray,
                 longitude: np.ndarray, n_steps: int, dt_hours: float | None, start_time: str | None = None,
                 calendar: str | None = None, *, step: TimeStep | None = None,
                 channel_units: Sequence[str] | None = None):
        lat = np.asarray(latitude, dtype=np.float64)
        lon = np.asarray(longitude, dtype=np.float64)
        _check_grid(lat, lon)
        if n_steps < 1:
            raise LayoutError(f"a file needs at least one time step, got n_steps={n_steps}")
        if step is None and not (dt_hours is not None and dt_hours > 0):
            raise LayoutError(f"dt_hours must be > 0, got {dt_hours}")
        if channel_units is not None and len(channel_units) != len(channel_names):
            raise LayoutError(f"{len(channel_units)} channel units for {len(channel_names)} channels")
        step = step or TimeStep.from_hours(float(dt_hours))
        self.path = Path(path)
        self.shape = (int(n_steps), len(channel_names), lat.size, lon.size)
        self._written = np.zeros(n_steps, dtype=bool)
        self._tmp = self.path.with_name(self.path.stem + PARTIAL_SUFFIX)
        try:
            check_replaceable(self.path)  # never over a link, FIFO or device
            self._tmp.unlink(missing_ok=True)  # a leftover, or a planted link: the link itself goes
            self._file = h5py.File(self._tmp, "x")
        except OSError as exc:
            raise LayoutError(f"cannot create {self._tmp} ({one_line(exc)}); pass a writable --out") from None
        try:
            self._fields = self._create(channel_names, lat, lon, step, start_time, calendar, channel_units)
        except BaseException:
            self.close(ok=False)
            raise

    def _create(self, channel_names, lat, lon, step: TimeStep, start_time, calendar, units) -> h5py.Dataset:
        # one time step per chunk: the loader reads single steps; no compression for speed
        ds = self._file.create_dataset(FIELDS, shape=self.shape, dtype=np.float32,
                                       chunks=(1, *self.shape[1:]))
        ds.attrs[ATTR_CHANNEL_NAMES] = [str(n) for n in channel_names]
        ds.attrs[ATTR_TIME_STEP] = float(step.value)
        ds.attrs[ATTR_TIME_UNIT] = step.unit
        if not step.calendar_based:  # readers of hours keep working for hourly and daily data
            ds.attrs[ATTR_DT_HOURS] = step.hours()
        if units is not None:
            ds.attrs[ATTR_CHANNEL_UNITS] = [str(u) for u in units]
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
