"""The climatology by day of year and hour of day (``stats/climatology.h5``): computing, writing and reading it.

WeatherBench 2 (Rasp et al. 2024, "WeatherBench 2: A benchmark for the next generation of data-driven global
weather models", section 3.3 "Climatology"; its ``compute_climatology`` script) scores ACC against, and
compares forecasts with, a climatology that depends on the day of year and the hour of day: for each hour of
day, the fields of each day of year are averaged over the years, and the mean is smoothed over day of year
with a centered moving window of 61 days whose weights fall linearly from the center to zero at the ends
(:func:`window_weights`); the window wraps around the end of the year. Day 366 of a 365-day year takes
that year's day 365 (WeatherBench 2 fills it so). Here the mean is taken over the training years only, in
the dataset's own calendar (``360_day``, ``noleap``, ... as cftime counts them: 360, 365 or 366 days).

Streaming form: per (day, hour) the sum ``S`` and count ``N`` of the fields; the smoothed climatology is
``sum_j w_j S[d + j] / sum_j w_j N[d + j]`` over the window ``j = -30 .. 30``, the same weighted mean over
(window, year) as WeatherBench 2's. Cells the window reaches no data for (data covering part of the year,
monthly or annual data) hold the time mean of all training steps.

File: ``climatology`` float32 ``(D, K, C, H, W)`` (D days of the calendar year, K hours of day), ``dayofyear``
int32 ``(D,)`` 1..D, ``hour`` float64 ``(K,)``, ``count`` int64 ``(D, K)`` (training steps per cell before
smoothing); attributes ``calendar``, ``window_days``, ``channel_names``, ``years``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from utils.core.errors import UserError, one_line
from utils.core.files import check_replaceable
from utils.data.layout import (CLIMATOLOGY, FIELDS, STATS, STATS_HINT, TRAIN, InputNotFoundError, LayoutError,
                               split_files)
from utils.data.metadata import read_metadata, read_time_axis

WINDOW_DAYS = 61  # WeatherBench 2's window_size


TABLE_CACHE_BYTES = 1 << 30  # a climatology up to this size is read into memory once


ACCUMULATOR_BYTES = 4 << 30  # the data tools accumulate a climatology in one pass up to this size


MAX_HOURS = 24  # hours of day a cell table may hold (hourly data)


FIX = "recompute it with python -m tools.make_climatology DATA_PATH"


def window_weights(size: int = WINDOW_DAYS) -> np.ndarray:
    """WeatherBench 2's window: weights rising linearly from 0 to 1 at the center and back to 0, ``size`` odd."""
    half = size // 2
    return np.concatenate([np.linspace(0.0, 1.0, half + 1), np.linspace(1.0, 0.0, half + 1)[1:]])


def days_in_year(calendar: str) -> int:
    """Days of the longest year of a CF calendar (cftime's names): 360, 365 (noleap) or 366."""
    return {"360_day": 360, "noleap": 365}.get(calendar, 366)


def hour_of_day(t) -> float:
    """Hours since midnight of a datetime (fractions for minutes and seconds)."""
    return t.hour + t.minute / 60.0 + t.second / 3600.0


def climatology_fits(n_steps: int, field_shape: Sequence[int], budget: int = ACCUMULATOR_BYTES) -> bool:
    """Whether the sums of ``n_steps`` training steps of ``(C, H, W)`` fields (at most one cell each, at most
    366 x 24 cells) fit ``budget`` bytes of float64 accumulators."""
    cells = min(n_steps, 366 * MAX_HOURS)
    return cells * int(np.prod(field_shape)) * 8 <= budget


class ClimatologyAccumulator:
    """Per (day of year, hour of day) sums of training fields, for :meth:`smoothed` (picklable: worker processes
    each fill one and :meth:`merge` them).

    Args:
        calendar: the CF calendar of the times (cftime's name).
    """

    def __init__(self, calendar: str):
        self.calendar = calendar
        self.days = days_in_year(calendar)
        self.sums: dict[tuple[int, float], np.ndarray] = {}  # (day index 0.., hour) -> float64 (C, H, W)
        self.counts: dict[tuple[int, float], int] = {}
        self.total: np.ndarray | None = None  # sum over every step, for cells no window reaches
        self.n_steps = 0
        self.years: set[int] = set()

    def update(self, block: np.ndarray, times: Sequence) -> None:
        """Add time steps ``block`` ``(n, C, H, W)`` (physical units) valid at ``times`` (n cftime datetimes).

        Raises:
            LayoutError: ``times`` is not n datetimes of the accumulator's calendar.
        """
        if len(times) != block.shape[0] or any(getattr(t, "calendar", None) != self.calendar for t in times):
            raise LayoutError(f"the climatology needs one {self.calendar} datetime per time step; files without "
                              "start_time have none: re-create them with the data tools")
        import cftime
        for field, t in zip(block, times):
            field = field.astype(np.float64)
            self.total = field.copy() if self.total is None else self.total + field
            self.n_steps += 1
            self.years.add(t.year)
            day, hour = t.dayofyr - 1, hour_of_day(t)
            cells = [(day, hour)]
            if self.days == 366 and day == 364 and not cftime.is_leap_year(t.year, self.calendar):
                cells.append((365, hour))  # WeatherBench 2 fills day 366 of a 365-day year with its day 365
            for cell in cells:
                self._add(cell, field, 1)

    def _add(self, cell, field: np.ndarray, count: int) -> None:
        if cell in self.sums:
            self.sums[cell] += field
            self.counts[cell] += count
        else:
            self.sums[cell] = field.copy()
            self.counts[cell] = count

    def merge(self, other: "ClimatologyAccumulator") -> None:
        """Add the steps ``other`` saw (the same calendar and grid)."""
        for cell, field in other.sums.items():
            self._add(cell, field, other.counts[cell])
        if other.total is not None:
            self.total = other.total.copy() if self.total is None else self.total + other.total
        self.n_steps += other.n_steps
        self.years |= other.years

    def smoothed(self, window: int = WINDOW_DAYS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(climatology (D, K, C, H, W) float32, hours (K,) float64, counts (D, K) int64)``: the windowed mean
        of the module docstring; cells the window reaches no data for hold the mean of all steps.

        Raises:
            LayoutError: no steps were added.
        """
        if not self.n_steps:
            raise LayoutError("no training data to compute the climatology from; the training split is empty")
        hours = np.array(sorted({h for _, h in self.sums}), dtype=np.float64)
        weights = window_weights(window)
        half = window // 2
        fallback = self.total / self.n_steps
        out = np.empty((self.days, hours.size, *fallback.shape), dtype=np.float32)
        counts = np.zeros((self.days, hours.size), dtype=np.int64)
        for k, hour in enumerate(hours):
            days = sorted(d for d, h in self.sums if h == hour)
            for d in days:
                counts[d, k] = self.counts[(d, hour)]
            for d in range(self.days):
                num, den = np.zeros_like(fallback), 0.0
                for j, w in enumerate(weights):
                    cell = ((d + j - half) % self.days, hour)
                    if w and cell in self.sums:
                        num += w * self.sums[cell]
                        den += w * self.counts[cell]
                out[d, k] = num / den if den else fallback
        return out, hours, counts

    def save(self, path: Path, channel_names: Sequence[str], window: int = WINDOW_DAYS) -> Path:
        """Write :meth:`smoothed` to ``path`` (see :func:`write_climatology`)."""
        values, hours, counts = self.smoothed(window)
        return write_climatology(path, values, hours, counts, self.calendar, channel_names, sorted(self.years),
                                 window)


def write_climatology(path: Path, values: np.ndarray, hours: np.ndarray, counts: np.ndarray, calendar: str,
                      channel_names: Sequence[str], years: Sequence[int], window: int = WINDOW_DAYS) -> Path:
    """Write the climatology file (module docstring) through ``<path>.part``, renamed once complete.

    Raises:
        LayoutError: the file cannot be written (no space, no permission).
    """
    def fill(f: h5py.File) -> None:
        _create(f, values.shape, hours, counts, calendar, channel_names, years, window)[...] = values
    return _write(Path(path), fill)


def _create(f: h5py.File, shape, hours, counts, calendar, channel_names, years, window) -> h5py.Dataset:
    """The datasets and attributes of a climatology file; returns the (unfilled) ``climatology`` dataset."""
    ds = f.create_dataset("climatology", shape=shape, dtype=np.float32, chunks=(1, 1, 1, *shape[3:]))
    f.create_dataset("dayofyear", data=np.arange(1, shape[0] + 1, dtype=np.int32))
    f.create_dataset("hour", data=np.asarray(hours, dtype=np.float64))
    f.create_dataset("count", data=np.asarray(counts, dtype=np.int64))
    ds.attrs.update(calendar=calendar, window_days=int(window), channel_names=[str(n) for n in channel_names],
                    years=np.asarray(years, dtype=np.int64))
    return ds


def _write(path: Path, fill) -> Path:
    """Run ``fill(h5py.File)`` on ``<path>.part`` and rename it to ``path``; LayoutError when writing fails."""
    tmp = path.with_name(path.name + ".part")
    try:
        check_replaceable(path)  # never over a link, FIFO or device
        tmp.unlink(missing_ok=True)  # a leftover, or a planted link: the link itself goes, never its target
        with h5py.File(tmp, "x") as f:
            fill(f)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LayoutError(f"cannot write the climatology {path} ({one_line(exc)}); free disk space or pass "
                          "another --out") from None
    return path


def make_climatology(data_path: str | Path, budget: int = ACCUMULATOR_BYTES, window: int = WINDOW_DAYS,
                     verbose: bool = False) -> Path:
    """Compute the climatology of an existing dataset's training split and write ``<data_path>/stats/climatology.h5``
    (``python -m tools.make_climatology``). Channels are accumulated in groups whose float64 sums fit
    ``budget`` bytes, reading the training files once per group. Returns the file written.

    Raises:
        InputNotFoundError: no training files. LayoutError: files of different grids or calendars, files without
        ``start_time``, or the file cannot be written. UserError: a file cannot be read.
    """
    files = split_files(data_path, TRAIN)
    if not files:
        raise InputNotFoundError(f"no training files {Path(data_path) / TRAIN}/*.h5; pass a data folder of the "
                                 "layout (train/, valid/, stats/)")
    shapes = [_shape(p) for p in files]
    if len({s[1:] for s in shapes}) > 1:
        raise LayoutError(f"the training files have different grids or channels ({sorted({s[1:] for s in shapes})}); "
                          "re-create the dataset with the data tools")
    c, h, w = shapes[0][1:]
    axes = [read_time_axis(p, w) for p in files]
    if any(a.start is None for a in axes) or len({a.calendar for a in axes}) > 1:
        raise LayoutError(f"the training files of {data_path} need a start_time and one calendar for a climatology "
                          "by day of year; re-create them with python -m tools.convert_era5")
    names, _ = read_metadata(files[0], c, h)
    n_steps = sum(s[0] for s in shapes)
    group = max(1, budget // (min(n_steps, 366 * MAX_HOURS) * h * w * 8))
    path = Path(data_path) / STATS / CLIMATOLOGY

    def fill(f: h5py.File) -> None:
        ds = None
        for c0 in range(0, c, group):
            acc = ClimatologyAccumulator(axes[0].calendar)
            for p, shape, axis in zip(files, shapes, axes):
                _accumulate(acc, p, shape[0], axis, slice(c0, min(c, c0 + group)))
            values, hours, counts = acc.smoothed(window)
            if ds is None:
                ds = _create(f, (values.shape[0], hours.size, c, h, w), hours, counts, acc.calendar, names,
                             sorted(acc.years), window)
            ds[:, :, c0:c0 + values.shape[2]] = values
            if verbose:
                print(f"  channels {', '.join(names[c0:c0 + values.shape[2]])}: {acc.n_steps} steps", flush=True)
    return _write(path, fill)


def _shape(path: Path) -> tuple[int, ...]:
    try:
        with h5py.File(path, "r") as f:
            return tuple(f[FIELDS].shape)
    except (OSError, KeyError) as exc:
        raise UserError(f"cannot read {path} ({one_line(exc)}); re-create it with the data tools") from None


def _accumulate(acc: ClimatologyAccumulator, path: Path, n: int, axis, channels: slice, block: int = 64) -> None:
    """Add the ``channels`` of every time step of ``path`` to ``acc``, ``block`` steps at a time."""
    for start in range(0, n, block):
        stop = min(n, start + block)
        try:
            with h5py.File(path, "r") as f:
                data = f[FIELDS][start:stop, channels]
        except OSError as exc:
            raise UserError(f"cannot read time steps {start}..{stop - 1} of {path} ({one_line(exc)}); the file is "
                            "damaged: re-create it with the data tools") from None
        acc.update(data, [axis.time(t) for t in range(start, stop)])


class Climatology:
    """A climatology file opened for lookups by valid time (module docstring).

    Args:
        path: the ``stats/climatology.h5`` file.
        n_channels: C the data have.
        img_size: (H, W) crop the lookups return (the north-west corner, as the loaders crop).

    Raises:
        UserError: the file cannot be read as HDF5, lacks a dataset or attribute, has inconsistent shapes, a
            calendar it cannot hold, or another channel count or a smaller grid; names the file and the fix.
    """

    def __init__(self, path: Path, n_channels: int, img_size: Sequence[int]):
        self.path, self.img_size = Path(path), tuple(img_size)
        try:
            with h5py.File(self.path, "r") as f:
                self._check(f, n_channels)
        except UserError:
            raise
        except (OSError, KeyError, TypeError, ValueError) as exc:  # not HDF5, or attributes of another type
            raise UserError(f"cannot read {self.path} as a climatology ({one_line(exc)}); {FIX}") from None
        self._table: np.ndarray | None = None  # the whole climatology, when it fits TABLE_CACHE_BYTES
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()  # else the recently read cells

    def _check(self, f: h5py.File, n_channels: int) -> None:
        def bad(problem: str) -> UserError:
            return UserError(f"{self.path}: {problem}; {FIX}")
        missing = [n for n in ("climatology", "hour") if not isinstance(f.get(n), h5py.Dataset)]
        if missing:
            raise bad(f"no dataset {', '.join(missing)}")
        ds = f["climatology"]
        calendar = ds.attrs.get("calendar")
        self.calendar = calendar.decode() if isinstance(calendar, bytes) else calendar
        if not isinstance(self.calendar, str):
            raise bad("no 'calendar' attribute")
        self.hours = np.asarray(f["hour"][()], dtype=np.float64)
        self.window = int(ds.attrs.get("window_days", WINDOW_DAYS))
        years = np.atleast_1d(ds.attrs.get("years", []))
        self.years = (int(years.min()), int(years.max())) if years.size else None
        d, h, w = days_in_year(self.calendar), *self.img_size
        if ds.dtype.kind != "f" or ds.ndim != 5 or ds.shape[:2] != (d, self.hours.size) or ds.shape[2] != n_channels:
            raise bad(f"'climatology' is {ds.dtype} of shape {ds.shape}, expected floats of shape ({d}, "
                      f"{self.hours.size}, {n_channels}, H, W) for the {self.calendar} calendar, {self.hours.size} "
                      f"hours of day and {n_channels} channels")
        if ds.shape[3] < h or ds.shape[4] < w:
            raise bad(f"its {ds.shape[3]}x{ds.shape[4]} grid is smaller than img_size {[h, w]}")
        if self.hours.ndim != 1 or not self.hours.size or not np.all(np.isfinite(self.hours)):
            raise bad(f"'hour' holds {self.hours!r}, not hours of day")
        self.shape = ds.shape

    @classmethod
    def find(cls, stats_dir: Path, n_channels: int, img_size) -> "Climatology | None":
        """The climatology of a data folder's ``stats/``, or None when it has none."""
        path = Path(stats_dir) / CLIMATOLOGY
        return cls(path, n_channels, img_size) if path.exists() else None

    def describe(self) -> str:
        """One line: what the climatology is (for scorecards and logs)."""
        years = f" {self.years[0]}-{self.years[1]}" if self.years else ""
        return (f"{self.path.name}: mean by day of year and hour of day over the training years{years}, "
                f"{self.calendar} calendar, smoothed over a {self.window}-day window (WeatherBench 2)")

    def cells(self, times: Sequence) -> np.ndarray:
        """Flat cell indices ``day * K + hour`` of ``times`` (cftime datetimes of the file's calendar): the day of
        year, and the nearest hour of day the file holds (circularly).

        Raises:
            UserError: a time of another calendar, or no datetime (files without ``start_time``).
        """
        days, hours = [], []
        for t in times:
            if getattr(t, "calendar", None) != self.calendar:
                raise UserError(f"{self.path} is in the {self.calendar} calendar but a sample is valid at {t!r} "
                                f"({getattr(t, 'calendar', 'no calendar')}); {FIX}")
            days.append(t.dayofyr - 1)
            hours.append(hour_of_day(t))
        gap = np.abs(np.asarray(hours)[:, None] - self.hours[None, :])
        nearest = np.minimum(gap, 24.0 - gap).argmin(axis=1)
        return np.asarray(days) * self.hours.size + nearest

    def read(self, cells: np.ndarray) -> np.ndarray:
        """The climatology of flat ``cells`` as float32 ``(n, C, H, W)`` (the img_size crop), physical units. A
        climatology of up to ``TABLE_CACHE_BYTES`` is read whole once; a larger one cell by cell, keeping that
        many bytes of the most recently used cells (consecutive batches share most of their valid times).

        Raises:
            UserError: the file cannot be read, or a cell holds NaN/Inf.
        """
        h, w = self.img_size
        d, k = self.shape[:2]
        try:
            if self._table is None and np.prod(self.shape) * 4 <= TABLE_CACHE_BYTES:
                with h5py.File(self.path, "r") as f:
                    self._table = f["climatology"][:, :, :, :h, :w].reshape(d * k, -1, h, w).astype(np.float32)
                self._check_finite(self._table)
            if self._table is not None:
                return self._table[cells]
            unique, inverse = np.unique(cells, return_inverse=True)
            missing = [int(c) for c in unique if int(c) not in self._cache]
            if missing:
                with h5py.File(self.path, "r") as f:
                    ds = f["climatology"]
                    for c in missing:
                        field = ds[c // k, c % k, :, :h, :w].astype(np.float32)
                        self._check_finite(field)
                        self._cache[c] = field
        except OSError as exc:
            raise UserError(f"cannot read {self.path} ({one_line(exc)}); the file is damaged: {FIX}") from None
        fields = np.stack([self._cache[int(c)] for c in unique])
        for c in unique:  # most recently used last; the oldest cells go beyond the cache's size
            self._cache.move_to_end(int(c))
        while len(self._cache) > max(len(unique), TABLE_CACHE_BYTES // fields[0].nbytes):
            self._cache.popitem(last=False)
        return fields[inverse]

    def _check_finite(self, values: np.ndarray) -> None:
        if not np.isfinite(values).all():
            raise UserError(f"{self.path} holds NaN/Inf values; {FIX} ({STATS_HINT})")
