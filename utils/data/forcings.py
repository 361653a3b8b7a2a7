"""Forcings: input-only channels computed from the valid time and the grid point, with the field's names (anemoi's).

* ``cos_solar_zenith_angle``: ``cos(theta_z) = sin(phi) sin(delta) + cos(phi) cos(delta) cos(h)`` (the spherical
  astronomy of e.g. Iqbal 1983, "An Introduction to Solar Radiation", ch. 1), with the latitude ``phi``, the
  solar declination ``delta`` and the hour angle ``h``. It is not clipped at 0: at night it says how far below
  the horizon the sun is, which a model of 2 m temperature can use (the top-of-atmosphere insolation of
  GraphCast is its positive part times the solar constant).
* ``sin_local_time``, ``cos_local_time``: the local mean time ``UTC hour + longitude / 15`` on the 24 h circle.
* ``sin_julian_day``, ``cos_julian_day``: the fraction of the calendar year elapsed, on the annual circle.
* ``sin_latitude``, ``cos_latitude``, ``sin_longitude``, ``cos_longitude``: of the grid point.

The sun's position: ``delta`` and the equation of time ``E`` are Spencer's Fourier series (J. W. Spencer 1971,
"Fourier series representation of the position of the sun", Search 2(5), 172) in the day angle
``Gamma = 2 pi * year fraction``; the true solar time is ``UTC hour + longitude / 15 + E`` and ``h = 2 pi (true
solar time - 12 h) / 24 h``. Spencer's series is fitted to the Gregorian year; its error (about 0.0006 rad in
``delta``, 35 s in ``E``) is far below what a model on a 0.25 degree grid resolves.

Calendars: the year fraction is ``(day of year - 1 + hour / 24) / days in that year``, counted in the data's own
CF calendar. In a calendar without leap years (``noleap``), with only leap years (``all_leap``) or of twelve
30-day months (``360_day``) the sun thus makes exactly one annual cycle per calendar year: day 181 of a 360-day
year has the declination of mid-year, as climate models of those calendars define their insolation.
"""

from __future__ import annotations

import difflib
import math
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from utils.core.errors import UserError

FORCINGS = ("cos_solar_zenith_angle", "sin_local_time", "cos_local_time", "sin_julian_day", "cos_julian_day",
            "sin_latitude", "cos_latitude", "sin_longitude", "cos_longitude")


# Spencer (1971): declination (radians) = sum of a_k cos(k Gamma) + b_k sin(k Gamma), k = 0..3
DECLINATION_COS = (0.006918, -0.399912, -0.006758, -0.002697)


DECLINATION_SIN = (0.0, 0.070257, 0.000907, 0.00148)


# Spencer (1971): equation of time (radians of the sun's hour angle), k = 0..2
EQUATION_OF_TIME_COS = (0.000075, 0.001868, -0.014615)


EQUATION_OF_TIME_SIN = (0.0, -0.032077, -0.040849)


def check_forcing_names(names: Sequence[str]) -> None:
    """Stop on a forcing name that does not exist or one given twice.

    Raises:
        UserError: one line naming the nearest forcing and listing them all.
    """
    for name in names:
        if name not in FORCINGS:
            near = difflib.get_close_matches(name, FORCINGS, n=1, cutoff=0.3)
            hint = f"did you mean {near[0]}? " if near else ""
            raise UserError(f"unknown forcing {name!r}; {hint}the forcings are: {', '.join(FORCINGS)}")
    twice = sorted({n for n in names if list(names).count(n) > 1})
    if twice:
        raise UserError(f"forcing {twice[0]} is listed twice in --forcings; list each once")


@lru_cache(maxsize=4096)
def _days_in_year(year: int, calendar: str) -> int:
    import cftime
    return (cftime.datetime(year + 1, 1, 1, calendar=calendar) - cftime.datetime(year, 1, 1, calendar=calendar)).days


def calendar_clock(times: Sequence) -> np.ndarray:
    """The clock of ``times`` (cftime datetimes of any CF calendar): float64 ``(N, 2)``, column 0 the fraction of the
    calendar year elapsed in ``[0, 1)`` (module docstring), column 1 the UTC hour of day in ``[0, 24)``."""
    out = np.empty((len(times), 2))
    for i, t in enumerate(times):
        hour = t.hour + t.minute / 60 + t.second / 3600
        out[i] = (t.dayofyr - 1 + hour / 24) / _days_in_year(t.year, t.calendar), hour
    return out


def _series(angle: torch.Tensor, cos: Sequence[float], sin: Sequence[float]) -> torch.Tensor:
    return sum(a * torch.cos(k * angle) + b * torch.sin(k * angle) for k, (a, b) in enumerate(zip(cos, sin)))


def solar_declination(year_fraction: torch.Tensor) -> torch.Tensor:
    """Spencer's (1971) declination of the sun, radians, of the year fraction (any shape, float64)."""
    return _series(2 * math.pi * year_fraction, DECLINATION_COS, DECLINATION_SIN)


def equation_of_time_hours(year_fraction: torch.Tensor) -> torch.Tensor:
    """Spencer's (1971) equation of time (true minus mean solar time), hours, of the year fraction."""
    return _series(2 * math.pi * year_fraction, EQUATION_OF_TIME_COS, EQUATION_OF_TIME_SIN) * 12 / math.pi


def cos_solar_zenith(clock: torch.Tensor, latitude: torch.Tensor, longitude: torch.Tensor) -> torch.Tensor:
    """Cosine of the solar zenith angle, float64 ``(B, H, W)``, for ``clock`` ``(B, 2)`` (:func:`calendar_clock`) at
    ``latitude`` ``(H,)`` and ``longitude`` ``(W,)`` in degrees (module docstring for the formula)."""
    fraction, hour = clock[:, 0, None, None], clock[:, 1, None, None]
    solar_time = hour + longitude.double()[None, None, :] / 15 + equation_of_time_hours(fraction)
    hour_angle = (solar_time - 12) * (math.pi / 12)
    phi, delta = torch.deg2rad(latitude.double())[None, :, None], solar_declination(fraction)
    return torch.sin(phi) * torch.sin(delta) + torch.cos(phi) * torch.cos(delta) * torch.cos(hour_angle)


def _local_time_angle(clock: torch.Tensor, longitude: torch.Tensor) -> torch.Tensor:
    """The local mean time as an angle (radians), ``(B, 1, W)``."""
    return (clock[:, 1, None, None] + longitude.double()[None, None, :] / 15) * (math.pi / 12)


def _field(name: str, clock: torch.Tensor, latitude: torch.Tensor, longitude: torch.Tensor) -> torch.Tensor:
    """Forcing ``name`` as float64, broadcastable to ``(B, H, W)``."""
    if name == "cos_solar_zenith_angle":
        return cos_solar_zenith(clock, latitude, longitude)
    trig = torch.sin if name.startswith("sin_") else torch.cos
    what = name.split("_", 1)[1]
    if what == "local_time":
        return trig(_local_time_angle(clock, longitude))
    if what == "julian_day":
        return trig(2 * math.pi * clock[:, 0, None, None])
    if what == "latitude":
        return trig(torch.deg2rad(latitude.double()))[None, :, None]
    return trig(torch.deg2rad(longitude.double()))[None, None, :]


def forcing_fields(names: Sequence[str], clock: torch.Tensor, latitude: torch.Tensor,
                   longitude: torch.Tensor) -> torch.Tensor:
    """The forcings ``names`` (in that order) as float32 ``(B, F, H, W)`` on ``clock``'s device.

    Args:
        names: forcing names of :data:`FORCINGS`.
        clock: ``(B, 2)`` float64, :func:`calendar_clock` of each sample's valid time.
        latitude, longitude: ``(H,)`` degrees north and ``(W,)`` degrees east (any range: -10..2 or 350..362), on
            ``clock``'s device.

    Computed in float64, cast at the end.
    """
    b, h, w = clock.shape[0], latitude.shape[0], longitude.shape[0]
    clock = clock.double()
    return torch.stack([_field(n, clock, latitude, longitude).expand(b, h, w) for n in names], 1).float()
