"""Computing the climatology by day of year and hour of day and writing ``stats/climatology.h5`` (the definition,
WeatherBench 2's, and the file's layout: ``utils/data/climatology.py``, which reads it).

Streaming form: per (day, hour) the sum ``S`` and count ``N`` of the fields; the smoothed climatology is
``sum_j w_j S[d + j] / sum_j w_j N[d + j]`` over the window ``j = -30 .. 30`` (:func:`window_weights`), the same
weighted mean over (window, year) as WeatherBench 2's.
"""


from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from utils.core.errors import UserError, one_line
from utils.core.files import check_replaceable
from utils.data.climatology import WINDOW_DAYS, days_in_year, hour_of_day
from utils.data.layout import CLIMATOLOGY, FIELDS, STATS, TRAIN, InputNotFoundError, LayoutError, split_files
from utils.data.metadata import read_metadata, read_time_axis

ACCUMULATOR_BYTES = 4 << 30  # the data tools build a climatology in one pass up to this size (climatology_bytes)


MAX_HOURS = 24  # hours of day a cell table may hold (hourly data)


def window_weights(size: int = WINDOW_DAYS) -> np.ndarray:
    """WeatherBench 2's window: weights rising linearly from 0 to 1 at the center and back to 0, ``size`` odd."""
    half = size // 2
    return np.concatenate([np.linspace(0.0, 1.0, half + 1), np.linspace(1.0, 0.0, half + 1)[1:]])


def climatology_bytes(n_steps: int, field_shape: Sequence[int]) -> int:
    """The most memory a climatology of ``n_steps`` training steps of ``(C, H, W)`` fields takes: its float64
    sums (at most one cell per step, at most 366 x 24 cells) and the smoothed float32 result (366 days x up to
    24 hours of day, at most one hour per step), which covers every day whatever the number of steps."""
    field = int(np.prod(field_shape))
    return (min(n_steps, 366 * MAX_HOURS) * 8 + 366 * min(n_steps, MAX_HOURS) * 4) * field


def climatology_fits(n_steps: int, field_shape: Sequence[int], budget: int = ACCUMULATOR_BYTES) -> bool:
    """Whether :func:`climatology_bytes` fits ``budget`` bytes (the data tools then build the climatology as they
    write the data; else ``python -m tools.make_climatology`` does, a group of channels at a time)."""
    return climatology_bytes(n_steps, field_shape) <= budget


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
    (``python -m tools.make_climatology``). Channels are accumulated in groups whose float64 sums and smoothed
    result fit ``budget`` bytes (:func:`climatology_bytes`; one channel at least), reading the training files
    once per group. Returns the file written.

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
    group = max(1, budget // climatology_bytes(n_steps, (1, h, w)))
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


