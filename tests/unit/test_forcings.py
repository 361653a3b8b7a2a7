"""Forcings (utils/data/forcings.py): the sun's position against pvlib's independent one (NREL's solar position
algorithm), local time, day of year and grid encodings, calendars, and the names."""

from __future__ import annotations

import datetime

import cftime
import numpy as np
import pandas as pd
import pvlib  # the dev extra: NREL's solar position algorithm, independent of Spencer's series
import pytest
import torch

from utils.core.errors import UserError
from utils.data.forcings import (FORCINGS, calendar_clock, check_forcing_names, cos_solar_zenith, forcing_fields,
                                 solar_declination)

# Spencer's series at the year fraction of the hour against NREL's SPA, hourly through 2019-2024 at every 10 degrees
# of latitude (-80..80) and 30 of longitude: at most 0.0060 (2021-03-15 00 UTC, 60 S 90 W; the declination is off by
# up to 0.0058 rad near the equinoxes over the leap cycle, the equation of time by 41 s; module docstring), which
# the days below include. A longitude off by 1 degree (4 minutes) gives 0.019, a wrong sign or an hour 0.2 and more.
PVLIB_TOLERANCE = 0.007

# hourly on each: perihelion, the leap day, equinoxes and solstices of the leap year 2020, aphelion of 2019, and the
# days of the leap cycle where Spencer's declination is furthest from the sun's
DAYS = ("2020-01-03", "2020-02-29", "2020-03-20", "2020-06-20", "2020-09-22", "2020-10-02", "2020-12-21",
        "2019-07-04", "2021-03-15", "2021-09-23", "2024-10-04")


def cf(*args, calendar="standard"):
    return cftime.datetime(*args, calendar=calendar)


def f64(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def pvlib_cos_zenith(times: pd.DatetimeIndex, lats: np.ndarray, lons: np.ndarray) -> np.ndarray:
    """``(T, H, W)`` cosine of pvlib's geometric zenith (no refraction), longitudes given to it in -180..180."""
    out = np.empty((len(times), len(lats), len(lons)))
    for i, lat in enumerate(lats):
        for j, lon in enumerate(lons):
            sun = pvlib.solarposition.get_solarposition(times, lat, (lon + 180) % 360 - 180, method="nrel_numpy")
            out[:, i, j] = np.cos(np.deg2rad(sun["zenith"].to_numpy()))
    return out


def test_cos_zenith_agrees_with_pvlib_through_a_leap_year_and_over_the_globe():
    times = pd.DatetimeIndex([t for day in DAYS for t in pd.date_range(day, periods=24, freq="1h", tz="UTC")])
    lats = np.arange(-80.0, 81.0, 20.0)
    lons = np.array([-180.0, -135.0, -90.0, -45.0, -0.25, 0.0, 45.0, 90.0, 135.0, 179.75])
    want = pvlib_cos_zenith(times, lats, lons)
    clock = torch.from_numpy(calendar_clock([cf(t.year, t.month, t.day, t.hour) for t in times]))
    for spelled in (lons, lons % 360):  # -180..180 and 0..360 east: the same places
        ours = cos_solar_zenith(clock, torch.from_numpy(lats), torch.from_numpy(spelled)).numpy()
        assert np.abs(ours - want).max() < PVLIB_TOLERANCE, np.abs(ours - want).max()
    assert (want < -0.5).any() and (want > 0.9).any()  # deep night and a high sun: unclipped, both compared
    one_degree_east = cos_solar_zenith(clock, torch.from_numpy(lats), torch.from_numpy(lons + 1)).numpy()
    assert np.abs(one_degree_east - want).max() > 2 * PVLIB_TOLERANCE  # the bound catches a 4-minute error


def test_the_sun_is_up_at_noon_and_below_the_horizon_at_midnight_in_london():
    clock = torch.from_numpy(calendar_clock([cf(2019, 3, 20, 12), cf(2019, 3, 20, 0), cf(2019, 6, 21, 12)]))
    noon, midnight, summer = cos_solar_zenith(clock, f64(51.5), f64(0.0))[:, 0, 0].tolist()
    assert noon == pytest.approx(np.cos(np.deg2rad(51.5)), abs=0.01)  # the equinox: the sun over the equator
    assert midnight == pytest.approx(-np.cos(np.deg2rad(51.5)), abs=0.01)  # not clipped at 0
    assert summer == pytest.approx(np.cos(np.deg2rad(51.5 - 23.44)), abs=0.01)


def test_local_time_is_utc_plus_an_hour_per_15_degrees_east():
    lon = f64(0.0, 90.0, -90.0, 180.0, -97.5)
    clock = torch.from_numpy(calendar_clock([cf(2019, 3, 1, 12), cf(2019, 3, 1, 6, 30)]))
    sin, cos = forcing_fields(["sin_local_time", "cos_local_time"], clock, f64(10.0, -60.0), lon).unbind(1)
    assert torch.equal(sin[:, 0], sin[:, 1]) and torch.equal(cos[:, 0], cos[:, 1])  # the same at every latitude
    local_hours = torch.tensor([[12.0, 18.0, 6.0, 0.0, 5.5], [6.5, 12.5, 0.5, 18.5, 0.0]], dtype=torch.float64)
    angle = local_hours * (2 * np.pi / 24)  # at UTC 12: noon at 0 E (cos -1), 18 h at 90 E, 6 h at 90 W
    torch.testing.assert_close(sin[:, 0], torch.sin(angle).float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(cos[:, 0], torch.cos(angle).float(), atol=1e-6, rtol=0)
    assert cos[0, 0, 0] == pytest.approx(-1) and cos[1, 0, 4] == pytest.approx(1)


@pytest.mark.parametrize("time,fraction,hour", [
    (cf(2019, 3, 1, 6), (31 + 28 + 0.25) / 365, 6.0),
    (cf(2020, 3, 1, 6), (31 + 29 + 0.25) / 366, 6.0),  # a leap year: one more day before, one more in the year
    (cf(2020, 3, 1, 6, calendar="noleap"), (31 + 28 + 0.25) / 365, 6.0),
    (cf(2020, 3, 1, 6, calendar="365_day"), (31 + 28 + 0.25) / 365, 6.0),
    (cf(2019, 12, 31, 18, 30, calendar="all_leap"), (365 + 18.5 / 24) / 366, 18.5),
    (cf(2019, 3, 1, 0, 0, 36, calendar="366_day"), (60 + 0.01 / 24) / 366, 0.01),  # 36 s after a Feb 29
    (cf(2001, 7, 1, 0, calendar="360_day"), 0.5, 0.0),  # day 181 of 360: mid-year
    (cf(2001, 2, 30, 12, calendar="360_day"), (59 + 0.5) / 360, 12.0),
    (cf(1900, 3, 1, calendar="julian"), 60 / 366, 0.0),  # 1900 leaps in the Julian calendar only
    (cf(1900, 3, 1, calendar="proleptic_gregorian"), 59 / 365, 0.0),
    (cf(1900, 3, 1, calendar="gregorian"), 59 / 365, 0.0),
    (cf(2019, 12, 31, 23, 59, 59), (364 + 86399 / 86400) / 365, 23 + 3599 / 3600),  # still < 1
])
def test_calendar_clock_counts_the_year_in_its_own_calendar(time, fraction, hour):
    clock = calendar_clock([time])
    assert clock.dtype == np.float64 and clock.shape == (1, 2)
    np.testing.assert_allclose(clock[0], [fraction, hour], rtol=1e-12)
    assert 0 <= clock[0, 0] < 1 and 0 <= clock[0, 1] < 24


def test_calendar_clock_takes_a_batch_and_refuses_mixed_or_undated_times():
    batch = calendar_clock([cf(2019, 1, 1), cf(2019, 7, 2, 12), cf(2019, 12, 31, 18)])
    np.testing.assert_allclose(batch, [[0, 0], [0.5, 12], [(364 + 0.75) / 365, 18]], rtol=1e-12)
    assert calendar_clock([]).shape == (0, 2)
    with pytest.raises(UserError, match="mix the calendars noleap, standard") as mixed:
        calendar_clock([cf(2019, 1, 1), cf(2019, 1, 1, calendar="noleap")])
    with pytest.raises(UserError, match="need cftime datetimes of a CF calendar.*use_cftime=True") as plain:
        calendar_clock([datetime.datetime(2019, 1, 1)])
    assert "\n" not in str(mixed.value) + str(plain.value)


def test_a_360_day_mid_year_has_the_standard_calendars_sun_of_the_same_year_fraction():
    mid_360 = torch.from_numpy(calendar_clock([cf(2001, 7, 1, calendar="360_day")]))
    mid_leap_year = torch.from_numpy(calendar_clock([cf(2020, 7, 2)]))  # day 184 of 366: (184 - 1) / 366 = 0.5
    assert torch.equal(mid_360, mid_leap_year)
    assert np.rad2deg(solar_declination(mid_360[:, 0]).item()) == pytest.approx(23.1, abs=0.3)  # early July
    lat, lon = f64(-60.0, 0.0, 45.0), f64(-30.0, 0.0, 120.0)
    assert torch.equal(forcing_fields(FORCINGS, mid_360, lat, lon), forcing_fields(FORCINGS, mid_leap_year, lat, lon))
    spring_360 = torch.from_numpy(calendar_clock([cf(2001, 4, 1, calendar="360_day")]))  # 0.25 of the year
    assert solar_declination(spring_360[:, 0]).item() == pytest.approx(solar_declination(f64(0.25)).item(), abs=1e-15)


def test_fields_have_the_names_order_shape_dtype_and_values():
    clock = torch.from_numpy(calendar_clock([cf(2019, 3, 1, 0), cf(2019, 9, 1, 7)]))
    lat, lon = f64(58.0, 54.0, 50.0), f64(-10.0, -5.0, 0.0, 2.0, 350.0)
    fields = forcing_fields(FORCINGS, clock, lat, lon)
    assert fields.shape == (2, len(FORCINGS), 3, 5) and fields.dtype == torch.float32
    by_name = dict(zip(FORCINGS, fields.unbind(1)))
    grid = (2, 3, 5)
    torch.testing.assert_close(by_name["cos_solar_zenith_angle"], cos_solar_zenith(clock, lat, lon).float())
    for trig in ("sin", "cos"):
        f = getattr(torch, trig)
        torch.testing.assert_close(by_name[f"{trig}_julian_day"], f(2 * np.pi * clock[:, 0, None, None]).float()
                                   .expand(grid))  # the same at every grid point
        torch.testing.assert_close(by_name[f"{trig}_latitude"], f(torch.deg2rad(lat))[None, :, None].float()
                                   .expand(grid))
        torch.testing.assert_close(by_name[f"{trig}_longitude"], f(torch.deg2rad(lon))[None, None, :].float()
                                   .expand(grid))
    torch.testing.assert_close(by_name["sin_longitude"][..., 0], by_name["sin_longitude"][..., 4])  # -10 is 350 east
    picked = forcing_fields(["cos_longitude", "sin_julian_day", "cos_solar_zenith_angle"], clock, lat, lon)
    assert torch.equal(picked, torch.stack([by_name[n] for n in ("cos_longitude", "sin_julian_day",
                                                                 "cos_solar_zenith_angle")], 1))
    assert forcing_fields([], clock, lat, lon).shape == (2, 0, 3, 5)


def reference(clock: torch.Tensor, lat: torch.Tensor, lon: torch.Tensor) -> dict[str, torch.Tensor]:
    """The grid and time forcings written out in ``clock``'s dtype, ``(B, H, W)`` each."""
    hour, fraction = clock[:, 1, None, None], clock[:, 0, None, None]
    local = 2 * np.pi * (hour + lon.to(clock.dtype) / 15) / 24
    phi, lam = torch.deg2rad(lat.to(clock.dtype))[:, None], torch.deg2rad(lon.to(clock.dtype))
    shape = (len(clock), len(lat), len(lon))
    return {"sin_local_time": torch.sin(local).expand(shape), "cos_local_time": torch.cos(local).expand(shape),
            "sin_julian_day": torch.sin(2 * np.pi * fraction).expand(shape),
            "sin_latitude": torch.sin(phi).expand(shape), "cos_longitude": torch.cos(lam).expand(shape)}


def test_fields_are_computed_in_float64_from_float32_coordinates():
    clock = torch.from_numpy(calendar_clock([cf(2020, 6, 20, 13, 17), cf(2020, 12, 31, 23)]))
    lat, lon = torch.linspace(-89.5, 89.5, 180), torch.arange(-180, 360, 0.25)  # float32
    names = ["cos_solar_zenith_angle", "sin_local_time", "cos_local_time", "sin_julian_day", "sin_latitude",
             "cos_longitude"]
    ours = dict(zip(names, forcing_fields(names, clock, lat, lon).unbind(1)))
    want = {"cos_solar_zenith_angle": cos_solar_zenith(clock, lat.double(), lon.double()),
            **reference(clock, lat, lon)}
    narrow = reference(clock.float(), lat, lon)  # the same formulas in float32, as a guard on the bound
    half_ulp = 2.0 ** -25  # float32 rounding of values in [-1, 1]
    for name in want:
        assert (ours[name].double() - want[name]).abs().max() <= half_ulp, name
    assert max((narrow[n].double() - want[n]).abs().max() for n in narrow) > 4 * half_ulp


DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_fields_lie_on_the_clocks_device(device):
    clock = torch.from_numpy(calendar_clock([cf(2019, 3, 1, 0), cf(2019, 9, 1, 7)])).to(device)
    fields = forcing_fields(FORCINGS, clock, f64(58.0, 54.0).to(device), f64(-10.0, 0.0, 2.0).to(device))
    assert fields.device == clock.device and fields.shape == (2, len(FORCINGS), 2, 3) and fields.dtype == torch.float32
    if device != "meta":
        cpu = forcing_fields(FORCINGS, clock.cpu(), f64(58.0, 54.0), f64(-10.0, 0.0, 2.0))
        torch.testing.assert_close(fields.cpu(), cpu, atol=1e-6, rtol=0)


@pytest.mark.parametrize("names,message", [
    (["cos_zenith"], "^unknown forcing 'cos_zenith'; did you mean cos_solar_zenith_angle\\? the forcings are: "
                     "cos_solar_zenith_angle, sin_local_time, .*, cos_longitude$"),
    (["sin_latitude", "cos_lattitude"], "^unknown forcing 'cos_lattitude'; did you mean cos_latitude\\? "),
    (["xyzzy"], "^unknown forcing 'xyzzy'; the forcings are: "),  # nothing near: no suggestion
    (["sin_local_time", "cos_local_time", "sin_local_time"], "^forcing sin_local_time is listed twice"),
])
def test_bad_names_are_one_line_with_the_nearest(names, message):
    with pytest.raises(UserError, match=message) as info:
        check_forcing_names(names)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=message):  # the fields check their names too
        forcing_fields(names, torch.zeros(1, 2, dtype=torch.float64), f64(0.0), f64(0.0))
    check_forcing_names(FORCINGS)
