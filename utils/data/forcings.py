"""Forcings: input-only channels computed from the valid time and the grid point, with the field's names (anemoi's).

* ``cos_solar_zenith_angle``: ``cos(theta_z) = sin(phi) sin(delta) + cos(phi) cos(delta) cos(h)`` (the spherical
  astronomy of e.g. Iqbal 1983, "An Introduction to Solar Radiation", ch. 1), with the latitude ``phi``, the
  solar declination ``delta`` and the hour angle ``h``. It is not clipped at 0: at night it says how far below
  the horizon the sun is, which a model of 2 m temperature can use (the top-of-atmosphere insolation of
  GraphCast is its positive part times the solar constant).
* ``sin_local_time``, ``cos_local_time``: the local mean time ``UTC hour + longitude / 15`` (hours) on the 24 h
  circle: ``sin/cos(2 pi * local mean time / 24)``.
* ``sin_julian_day``, ``cos_julian_day``: ``sin/cos(2 pi * year fraction)``, the same at every grid point.
* ``sin_latitude``, ``cos_latitude``, ``sin_longitude``, ``cos_longitude``: of the grid point, the same at every time.

The sun's position: ``delta`` and the equation of time ``E`` are Spencer's Fourier series (J. W. Spencer 1971,
"Fourier series representation of the position of the sun", Search 2(5), 172; also quoted in Iqbal 1983, ch. 1)
in the day angle ``Gamma = 2 pi * year fraction``; the true solar time is ``UTC hour + longitude / 15 + E``
(hours) and ``h = 2 pi (true solar time - 12 h) / 24 h``. The series' stated accuracy, about 0.0006 rad in
``delta`` and 35 s in ``E``, holds near its epoch (measured against NREL's solar position algorithm, pvlib: 0.0005
rad in 1950). Later the calendar date slides against the sun over the four-year leap cycle and the decades, so at
the year fraction of the hour the series is off by up to 0.0058 rad in ``delta`` in 2019-2024 (near the
equinoxes, where ``delta`` moves fastest) and 41 s in ``E``: up to 0.006 in the cosine, the sun's position of a
minute and a half earlier or later, far below the hourly steps of the data (tests/unit/test_forcings.py).

Calendars: the year fraction is ``(day of year - 1 + hour / 24) / days in that year``, counted in the data's own
CF calendar (``standard``/``gregorian``, ``proleptic_gregorian`` and ``julian`` have 365 or 366 days by their
leap rules, ``noleap`` 365, ``all_leap`` 366, ``360_day`` 360). This is a definition: in every calendar the sun
makes exactly one annual cycle per calendar year, so day 181 of a 360-day year has the declination of mid-year,
as climate models of those calendars define their insolation.
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


# Spencer (1971): declination (radians) = sum over k = 0..3 of a_k cos(k Gamma) + b_k sin(k Gamma)
DECLINATION_COS = (0.006918, -0.399912, -0.006758, -0.002697)


DECLINATION_SIN = (0.0, 0.070257, 0.000907, 0.00148)


# Spencer (1971): equation of time (radians of the sun's hour angle; his 229.18 min/rad), k = 0..2
EQUATION_OF_TIME_COS = (0.000075, 0.001868, -0.014615)


EQUATION_OF_TIME_SIN = (0.0, -0.032077, -0.040849)


def check_forcing_names(names: Sequence[str]) -> None:
    """Stop on a forcing name that does not exist or on one given twice.

    Args:
        names: forcing names, meant to be of :data:`FORCINGS`.

    Raises:
        UserError: one line naming the unknown name, the nearest forcing (``difflib``) and all of them; or the
            name listed twice.
    """
    for name in names:
        if name not in FORCINGS:
            near = difflib.get_close_matches(name, FORCINGS, n=1, cutoff=0.3)
            hint = f"did you mean {near[0]}? " if near else ""
            raise UserError(f"unknown forcing {name!r}; {hint}the forcings are: {', '.join(FORCINGS)}")
    seen = set()
    for name in names:
        if name in seen:
            raise UserError(f"forcing {name} is listed twice in --forcings; list each once")
        seen.add(name)


@lru_cache(maxsize=4096)
def _days_in_year(year: int, calendar: str, has_year_zero: bool) -> int:
    """Days of ``year`` in ``calendar`` (cftime knows each calendar's leap rule and the 1582 switch of
    ``standard``)."""
    import cftime
    after = 1 if year == -1 and not has_year_zero else year + 1  # 1 BC is followed by AD 1 without a year 0
    start = cftime.datetime(year, 1, 1, calendar=calendar, has_year_zero=has_year_zero)
    return (cftime.datetime(after, 1, 1, calendar=calendar, has_year_zero=has_year_zero) - start).days


def _calendar_of(times: Sequence) -> str:
    """The one CF calendar of ``times``; UserError for another kind of time, no calendar or mixed calendars."""
    odd = next((t for t in times if not (hasattr(t, "dayofyr") and getattr(t, "calendar", ""))), None)
    if odd is not None:
        raise UserError(f"the forcings need cftime datetimes of a CF calendar, got {odd!r} ({type(odd).__name__}); "
                        "decode the times with cftime (xarray: use_cftime=True)")
    calendars = {t.calendar for t in times}
    if len(calendars) > 1:
        raise UserError(f"the times mix the calendars {', '.join(sorted(calendars))}; the forcings need one")
    return calendars.pop()


def calendar_clock(times: Sequence) -> np.ndarray:
    """The clock of ``times``: where in its calendar year and in its UTC day each time is.

    Args:
        times: ``N`` cftime datetimes of one CF calendar (``standard``/``gregorian``, ``proleptic_gregorian``,
            ``julian``, ``noleap``/``365_day``, ``all_leap``/``366_day``, ``360_day``).

    Returns:
        float64 ``(N, 2)``: column 0 the fraction of the calendar year elapsed, in ``[0, 1)``,
        ``(day of year - 1 + hour / 24) / days in that year of that calendar`` (module docstring); column 1 the
        UTC hour of day ``hour + minute / 60 + second / 3600``, in ``[0, 24)``.

    Raises:
        UserError: a time that is not a cftime datetime with a calendar, or times of several calendars.
    """
    out = np.empty((len(times), 2))
    if not len(times):
        return out
    calendar = _calendar_of(times)
    for i, t in enumerate(times):  # the times of a batch, a few numbers each: the grid is torch's (forcing_fields)
        hour = t.hour + t.minute / 60 + t.second / 3600
        out[i] = (t.dayofyr - 1 + hour / 24) / _days_in_year(t.year, calendar, t.has_year_zero), hour
    return out


def _fourier(angle: torch.Tensor, cos: Sequence[float], sin: Sequence[float]) -> torch.Tensor:
    """``sum_k cos[k] cos(k angle) + sin[k] sin(k angle)``, the shape of ``angle``."""
    return sum(a * torch.cos(k * angle) + b * torch.sin(k * angle) for k, (a, b) in enumerate(zip(cos, sin)))


def solar_declination(year_fraction: torch.Tensor) -> torch.Tensor:
    """The sun's declination, radians, of the year fraction (Spencer 1971, in ``Gamma = 2 pi * year_fraction``).

    Args:
        year_fraction: any shape (column 0 of :func:`calendar_clock`); float64 for float64 results.

    Returns:
        The declination, radians, ``year_fraction``'s shape and dtype.
    """
    return _fourier(2 * math.pi * year_fraction, DECLINATION_COS, DECLINATION_SIN)


def equation_of_time_hours(year_fraction: torch.Tensor) -> torch.Tensor:
    """The equation of time (true minus mean solar time), hours, of the year fraction (Spencer 1971, in
    ``Gamma = 2 pi * year_fraction``): ``year_fraction``'s shape and dtype, within about +-0.27 h."""
    return _fourier(2 * math.pi * year_fraction, EQUATION_OF_TIME_COS, EQUATION_OF_TIME_SIN) * (12 / math.pi)


def _clock_columns(clock: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Year fraction and UTC hour of ``clock`` ``(B, 2)`` as float64 ``(B, 1, 1)``, to broadcast over ``(H, W)``."""
    clock = clock.double()
    return clock[:, 0, None, None], clock[:, 1, None, None]


def _radians(degrees: torch.Tensor) -> torch.Tensor:
    return torch.deg2rad(degrees.double())


def cos_solar_zenith(clock: torch.Tensor, latitude: torch.Tensor, longitude: torch.Tensor) -> torch.Tensor:
    """Cosine of the solar zenith angle, not clipped (negative at night), float64 ``(B, H, W)``.

    ``sin(phi) sin(delta) + cos(phi) cos(delta) cos(h)`` (Iqbal 1983, ch. 1), ``delta`` and the equation of
    time of Spencer (1971), ``h = 2 pi (UTC hour + longitude / 15 + E - 12) / 24`` (module docstring).

    Args:
        clock: ``(B, 2)`` of :func:`calendar_clock`: year fraction and UTC hour.
        latitude: ``(H,)`` degrees north; longitude: ``(W,)`` degrees east, any range (-180..180, 0..360).
    """
    fraction, hour = _clock_columns(clock)
    solar_time = hour + longitude.double()[None, None, :] / 15 + equation_of_time_hours(fraction)
    hour_angle = (solar_time - 12) * (math.pi / 12)  # 0 at true solar noon; 15 degrees an hour
    phi, delta = _radians(latitude)[None, :, None], solar_declination(fraction)
    return torch.sin(phi) * torch.sin(delta) + torch.cos(phi) * torch.cos(delta) * torch.cos(hour_angle)


def _local_time_angle(clock: torch.Tensor, longitude: torch.Tensor) -> torch.Tensor:
    """The local mean time ``UTC hour + longitude / 15`` as an angle on the 24 h circle, radians, ``(B, 1, W)``:
    longitude 15 degrees east is an hour later."""
    _, hour = _clock_columns(clock)
    return (hour + longitude.double()[None, None, :] / 15) * (math.pi / 12)


def _year_angle(clock: torch.Tensor) -> torch.Tensor:
    """``2 pi * year fraction``, radians, ``(B, 1, 1)``."""
    return 2 * math.pi * _clock_columns(clock)[0]


# name -> float64 field broadcastable to (B, H, W), of (clock, latitude, longitude)
_FIELDS = {
    "cos_solar_zenith_angle": cos_solar_zenith,
    "sin_local_time": lambda c, lat, lon: torch.sin(_local_time_angle(c, lon)),
    "cos_local_time": lambda c, lat, lon: torch.cos(_local_time_angle(c, lon)),
    "sin_julian_day": lambda c, lat, lon: torch.sin(_year_angle(c)),
    "cos_julian_day": lambda c, lat, lon: torch.cos(_year_angle(c)),
    "sin_latitude": lambda c, lat, lon: torch.sin(_radians(lat))[None, :, None],
    "cos_latitude": lambda c, lat, lon: torch.cos(_radians(lat))[None, :, None],
    "sin_longitude": lambda c, lat, lon: torch.sin(_radians(lon))[None, None, :],
    "cos_longitude": lambda c, lat, lon: torch.cos(_radians(lon))[None, None, :],
}


def forcing_fields(names: Sequence[str], clock: torch.Tensor, latitude: torch.Tensor,
                   longitude: torch.Tensor) -> torch.Tensor:
    """The forcings ``names``, in that order, for each time of ``clock`` at each grid point.

    Args:
        names: ``F`` forcing names of :data:`FORCINGS` (formulas and sources: module docstring).
        clock: ``(B, 2)`` float64, :func:`calendar_clock` of each sample's valid time, on any device.
        latitude: ``(H,)`` degrees north; longitude: ``(W,)`` degrees east, any range (-10..2, 0..360); float64 or
            float32, on ``clock``'s device.

    Returns:
        float32 ``(B, F, H, W)`` on ``clock``'s device, computed in float64 and cast at the end.

    Raises:
        UserError: an unknown name or one given twice (:func:`check_forcing_names`).
    """
    check_forcing_names(names)
    shape = (clock.shape[0], latitude.shape[0], longitude.shape[0])
    fields = [_FIELDS[name](clock, latitude, longitude).expand(shape) for name in names]
    if not fields:
        return torch.empty((shape[0], 0, *shape[1:]), dtype=torch.float32, device=clock.device)
    return torch.stack(fields, 1).float()
