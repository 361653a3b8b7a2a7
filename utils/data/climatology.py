"""The climatology by day of year and hour of day (``stats/climatology.h5``): reading it (computing it: ``utils/preprocess/climatology_builder.py``).

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

from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from utils.core.errors import UserError, one_line
from utils.data.layout import CLIMATOLOGY, STATS_HINT

WINDOW_DAYS = 61  # WeatherBench 2's window_size


TABLE_CACHE_BYTES = 1 << 30  # a climatology up to this size is read into memory once


FIX = "recompute it with python -m tools.make_climatology DATA_PATH"


def days_in_year(calendar: str) -> int:
    """Days of the longest year of a CF calendar (cftime's names): 360, 365 (noleap) or 366."""
    return {"360_day": 360, "noleap": 365}.get(calendar, 366)


def hour_of_day(t) -> float:
    """Hours since midnight of a datetime (fractions for minutes and seconds)."""
    return t.hour + t.minute / 60.0 + t.second / 3600.0


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
