"""Forcings (utils/data/forcings.py): the sun's position against pvlib's independent one (NREL's solar position
algorithm), local time, day of year and grid encodings, calendars, and the names."""

from __future__ import annotations

import cftime
import numpy as np
import pytest
import torch

from utils.core.errors import UserError
from utils.data.forcings import (FORCINGS, calendar_clock, check_forcing_names, cos_solar_zenith, forcing_fields,
                                 solar_declination)

# Spencer's series against NREL's SPA: ~0.0006 rad of declination and ~35 s of equation of time, plus the year
# fraction taken at the hour rather than at the day's noon, give at most 0.0057 (measured); a wrong sign or an hour's
# offset gives 0.2 and more
PVLIB_TOLERANCE = 0.007


def cf(*args, calendar="standard"):
    return cftime.datetime(*args, calendar=calendar)


def test_cos_zenith_agrees_with_pvlib_over_a_leap_year_and_the_globe():
    pd = pytest.importorskip("pandas")
    pvlib = pytest.importorskip("pvlib")
    times = pd.date_range("2020-01-01", "2020-12-31 23:00", freq="7h", tz="UTC")  # every hour of the day, every season
    lats = np.array([-80.0, -45.0, -10.0, 0.0, 23.4, 51.5, 80.0])
    lons = np.array([-180.0, -120.0, -10.0, 0.0, 2.0, 95.0, 179.75, 359.75])  # 359.75 east is 0.25 west
    clock = torch.from_numpy(calendar_clock([cf(t.year, t.month, t.day, t.hour) for t in times]))
    ours = cos_solar_zenith(clock, torch.from_numpy(lats), torch.from_numpy(lons)).numpy()
    for i, lat in enumerate(lats):
        for j, lon in enumerate(lons):
            sun = pvlib.solarposition.get_solarposition(times, lat, (lon + 180) % 360 - 180, method="nrel_numpy")
            want = np.cos(np.deg2rad(sun["zenith"].to_numpy()))  # geometric zenith: no refraction
            np.testing.assert_allclose(ours[:, i, j], want, rtol=0, atol=PVLIB_TOLERANCE, err_msg=f"{lat} {lon}")


def test_local_time_follows_longitude_east_of_greenwich():
    clock = torch.from_numpy(calendar_clock([cf(2019, 3, 1, 12)]))
    lon = torch.tensor([0.0, 90.0, -90.0, 180.0], dtype=torch.float64)
    f = forcing_fields(["sin_local_time", "cos_local_time"], clock, torch.zeros(1, dtype=torch.float64), lon)[0, :, 0]
    # noon at 0 E, 18 h at 90 E, 6 h at 90 W, midnight at 180
    torch.testing.assert_close(f[0], torch.tensor([0.0, -1.0, 1.0, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(f[1], torch.tensor([-1.0, 0.0, 0.0, 1.0]), atol=1e-6, rtol=0)


def test_the_sun_is_up_at_noon_and_down_at_midnight_in_london_in_march():
    clock = torch.from_numpy(calendar_clock([cf(2019, 3, 20, 12), cf(2019, 3, 20, 0), cf(2019, 6, 21, 12)]))
    cos = cos_solar_zenith(clock, torch.tensor([51.5], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    noon, midnight, summer = cos[:, 0, 0].tolist()
    assert noon == pytest.approx(np.cos(np.deg2rad(51.5)), abs=0.01)  # the equinox: the sun over the equator
    assert midnight == pytest.approx(-np.cos(np.deg2rad(51.5)), abs=0.01)
    assert summer == pytest.approx(np.cos(np.deg2rad(51.5 - 23.44)), abs=0.01)


@pytest.mark.parametrize("time,fraction,hour", [
    (cf(2019, 3, 1, 6), (31 + 28 + 0.25) / 365, 6.0),
    (cf(2020, 3, 1, 6), (31 + 29 + 0.25) / 366, 6.0),  # a leap year
    (cf(2020, 3, 1, 6, calendar="noleap"), (31 + 28 + 0.25) / 365, 6.0),
    (cf(2019, 12, 31, 18, 30, calendar="all_leap"), (365 + 18.5 / 24) / 366, 18.5),
    (cf(2001, 7, 1, 0, calendar="360_day"), 0.5, 0.0),  # day 181 of 360: mid-year
    (cf(2001, 2, 30, 12, calendar="360_day"), (59 + 0.5) / 360, 12.0),
])
def test_calendar_clock_counts_the_year_in_its_own_calendar(time, fraction, hour):
    np.testing.assert_allclose(calendar_clock([time])[0], [fraction, hour], rtol=1e-12)


def test_a_360_day_year_has_the_suns_declination_of_the_same_year_fraction():
    mid_360 = torch.from_numpy(calendar_clock([cf(2001, 7, 1, calendar="360_day")]))[:, 0]
    assert solar_declination(mid_360).item() == pytest.approx(solar_declination(torch.tensor([0.5])).item())
    assert np.rad2deg(solar_declination(mid_360).item()) == pytest.approx(23.1, abs=0.3)  # early July


def test_fields_have_the_names_order_shape_dtype_and_device():
    clock = torch.from_numpy(calendar_clock([cf(2019, 3, 1, 0), cf(2019, 9, 1, 0)]))
    lat = torch.tensor([58.0, 54.0, 50.0], dtype=torch.float64)
    lon = torch.tensor([-10.0, -5.0, 0.0, 2.0], dtype=torch.float64)
    f = forcing_fields(FORCINGS, clock, lat, lon)
    assert f.shape == (2, len(FORCINGS), 3, 4) and f.dtype == torch.float32 and f.device == clock.device
    by_name = dict(zip(FORCINGS, f.unbind(1)))
    torch.testing.assert_close(by_name["sin_latitude"][1, :, 2], torch.sin(torch.deg2rad(lat)).float())
    torch.testing.assert_close(by_name["cos_longitude"][0, 1], torch.cos(torch.deg2rad(lon)).float())
    torch.testing.assert_close(by_name["cos_julian_day"][:, 0, 0], torch.cos(2 * np.pi * clock[:, 0]).float())
    assert torch.equal(forcing_fields(["cos_longitude", "sin_latitude"], clock, lat, lon),
                       torch.stack([by_name["cos_longitude"], by_name["sin_latitude"]], 1))


@pytest.mark.parametrize("names,message", [
    (["cos_zenith"], "unknown forcing 'cos_zenith'; did you mean cos_solar_zenith_angle?"),
    (["local_time"], "did you mean"),
    (["sin_local_time", "sin_local_time"], "forcing sin_local_time is listed twice"),
])
def test_bad_names_are_one_line_with_the_nearest(names, message):
    with pytest.raises(UserError, match=message) as info:
        check_forcing_names(names)
    assert "\n" not in str(info.value)
