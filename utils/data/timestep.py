"""The time step of a dataset in its own unit: hours, days, months of the calendar, or years.

Sub-daily and daily data step by a fixed duration (``6 hours``, ``1 days``). Monthly and annual means step by
calendar months or years, whose length in hours varies (28 to 31 days, 365 or 366 days) and whose time stamps
may sit mid-month or mid-year; a fixed number of hours cannot describe them, so the step keeps its unit. Times
are cftime datetimes of the dataset's CF calendar (``utils/preprocess/convert_plan.py`` decodes them), so ``360_day``,
``noleap`` and the other calendars count as their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np

UNITS = ("hours", "days", "months", "years")


SUFFIXES = {"hours": "h", "days": "d", "months": "mo", "years": "y"}


# mean length of a year in days, by CF calendar (as cftime names it): nominal hours of monthly and annual steps
YEAR_DAYS = {"360_day": 360.0, "noleap": 365.0, "all_leap": 366.0, "julian": 365.25}


GREGORIAN_YEAR_DAYS = 365.2425  # standard, proleptic_gregorian


MAX_DAY_SPREAD = 3  # days of month a monthly series' stamps may wander (mid-month stamps of 28..31-day months)


@dataclass(frozen=True)
class TimeStep:
    """``value`` units between consecutive time steps: ``unit`` one of :data:`UNITS`; ``value`` > 0, a whole
    number for months and years."""

    value: float
    unit: str

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"time step unit must be one of {UNITS}, got {self.unit!r}")
        if not self.value > 0 or (self.calendar_based and float(self.value) != int(self.value)):
            raise ValueError(f"a time step of {self.value} {self.unit} is not a positive (whole, for months and "
                             "years) number")

    @classmethod
    def from_hours(cls, hours: float) -> "TimeStep":
        """A fixed step of ``hours``: in days when it is a whole number of days, else in hours."""
        days = hours / 24.0
        return cls(days, "days") if float(days).is_integer() else cls(float(hours), "hours")

    @property
    def calendar_based(self) -> bool:
        """Whether the step counts calendar months or years (of varying length) rather than hours."""
        return self.unit in ("months", "years")

    @property
    def months(self) -> int:
        """Calendar months per step (months and years only)."""
        return int(self.value) * (12 if self.unit == "years" else 1)

    def hours(self, calendar: str = "standard") -> float:
        """Hours per step: exact for hours and days, the calendar's mean month or year length for months and years
        (a nominal figure for plots and the trainer's lead hours; times themselves are counted in the calendar)."""
        if self.unit == "hours":
            return float(self.value)
        if self.unit == "days":
            return 24.0 * self.value
        return 24.0 * YEAR_DAYS.get(calendar, GREGORIAN_YEAR_DAYS) * self.months / 12.0

    def add(self, time, n: int):
        """``time`` (a cftime datetime) plus ``n`` steps, in its calendar. Calendar months keep the day of month
        where it exists and clip it to the month's last day where it does not (Jan 31 + 1 month: Feb 28)."""
        if not self.calendar_based:
            return time + timedelta(hours=self.hours() * n)
        import cftime
        year, month = divmod(time.year * 12 + time.month - 1 + self.months * n, 12)
        for day in range(time.day, 0, -1):
            try:
                return cftime.datetime(year, month + 1, day, time.hour, time.minute, time.second,
                                       calendar=time.calendar, has_year_zero=time.has_year_zero)
            except ValueError:  # no such day in that month
                continue
        raise ValueError(f"cannot add {n} x {self} to {time}")

    def steps_between(self, a, b) -> float:
        """Steps from time ``a`` to time ``b`` (cftime datetimes of one calendar): calendar months (by year and
        month, whatever the day) over months per step, or elapsed hours over hours per step."""
        if self.calendar_based:
            return (_month_index(b) - _month_index(a)) / self.months
        return (b - a) / timedelta(hours=self.hours())

    def __str__(self) -> str:
        return f"{self.value:g} {self.unit}"


def _month_index(t) -> int:
    return t.year * 12 + t.month - 1


def infer_time_step(times: np.ndarray) -> TimeStep:
    """The time step of a strictly increasing series of cftime datetimes (at least 2) in its own unit.

    * Calendar months (years when a multiple of 12) when consecutive stamps are a constant number of months
      apart and either sit at the same day and time of their month (``360_day`` monthly data, whose months
      are all 30 days) or wander by at most :data:`MAX_DAY_SPREAD` days (mid-month stamps of 28..31-day
      months, mid-year stamps of 365/366-day years). Gaps of whole multiples of that step are allowed.
    * Else the smallest difference as a fixed step, in days when a whole number of days, else in hours.
      Larger differences are gaps (the caller checks that each file's inner steps are one step).

    Raises:
        ValueError: fewer than 2 times.
    """
    if len(times) < 2:
        raise ValueError("a time step needs at least two times")
    months = np.diff([_month_index(t) for t in times])
    seconds = np.array([(b - a) / timedelta(seconds=1) for a, b in zip(times[:-1], times[1:])])
    regular = bool(np.all(seconds == seconds[0]))
    same_place = len({(t.day, t.hour, t.minute, t.second) for t in times}) == 1
    days = [t.day for t in times]
    n = int(months.min())
    if n >= 1 and np.all(months % n == 0) and (same_place or (not regular and max(days) - min(days) <= MAX_DAY_SPREAD)):
        return TimeStep(n // 12, "years") if n % 12 == 0 else TimeStep(n, "months")
    return TimeStep.from_hours(float(seconds.min()) / 3600.0)


def lead_label(value: float, unit: str = "hours") -> str:
    """Record-key label of a lead time: ``006h``, ``120h``, ``1.5h``, ``002d``, ``003mo``, ``010y``."""
    suffix = SUFFIXES[unit]
    return f"{int(value):03d}{suffix}" if float(value).is_integer() else f"{value:g}{suffix}"
