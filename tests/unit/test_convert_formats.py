"""Input formats of the ERA5 converter: netCDF in non-standard calendars, zarr stores, GRIB files,
format detection and the one-line errors for inputs it cannot read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from utils.data import layout
from utils.preprocess import convert, formats
from utils.preprocess import convert_plan as plan
from utils.data.layout import LayoutError

xr = pytest.importorskip("xarray")
cftime = pytest.importorskip("cftime")

LAT = np.array([-45.0, 0.0, 45.0])  # ascending: the converter writes it north to south
LON = np.arange(4) * 90.0
LEVELS = np.array([850.0, 500.0])


def read_file(path: Path) -> tuple[np.ndarray, dict]:
    """(fields, attributes of ``fields``) of one written layout file."""
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f[layout.LATITUDE][:], LAT[::-1])
        np.testing.assert_array_equal(f[layout.LONGITUDE][:], LON)
        return f[layout.FIELDS][:], dict(f[layout.FIELDS].attrs)


def weather(times, level_dim: str = "level", seed: int = 0) -> xr.Dataset:
    """``t`` (time, level, lat, lon) and ``t2m`` (time, lat, lon), float32, over ``times``."""
    rng = np.random.default_rng(seed)
    n = len(times)
    return xr.Dataset({
        "t": (("time", level_dim, "latitude", "longitude"),
              (250 + 10 * rng.standard_normal((n, LEVELS.size, LAT.size, LON.size))).astype(np.float32)),
        "t2m": (("time", "latitude", "longitude"),
                (280 + 5 * rng.standard_normal((n, LAT.size, LON.size))).astype(np.float32)),
    }, coords={"time": times, level_dim: LEVELS, "latitude": LAT, "longitude": LON})


def expected(ds, index, level_dim: str = "level") -> np.ndarray:
    """(T, 3, H, W) channels t850, t500, t2m at time positions ``index``, latitude flipped."""
    t = ds["t"].values[index]
    return np.stack([t[:, 0], t[:, 1], ds["t2m"].values[index]], axis=1)[:, :, ::-1]


@pytest.fixture
def run_cli(forking_python):
    """``run_cli(*args)``: ``python -m tools.convert_era5 args`` under the forking python (xarray imported)."""
    def run(*args) -> subprocess.CompletedProcess:
        return forking_python.run(["-m", "tools.convert_era5", *map(str, args)], dict(os.environ), timeout=120)
    return run


# ---------------------------------------------------------------- calendars

def test_360_day_calendar_through_cli(tmp_path, run_cli):
    """6-hourly steps over 2001-02-29 and 2001-02-30, dates that exist only in a 360-day year."""
    times = xr.date_range("2001-02-29T12", periods=8, freq="6h", calendar="360_day", use_cftime=True)
    ds = weather(times)
    ds.to_netcdf(tmp_path / "in.nc", engine="h5netcdf")
    out = tmp_path / "out"
    run = run_cli("--input", tmp_path / "in.nc", "--out", out, "--variables", "t", "t2m", "--levels", "850", "500",
                  "--valid_start", "2001-02-30T12")
    assert run.returncode == 0, run.stderr
    assert "dt 6 h (360_day calendar)" in run.stdout
    train, train_attrs = read_file(out / "train" / "2001.h5")
    valid, valid_attrs = read_file(out / "valid" / "2001.h5")
    np.testing.assert_array_equal(train, expected(ds, slice(0, 4)))
    np.testing.assert_array_equal(valid, expected(ds, slice(4, 8)))
    assert list(valid_attrs[layout.ATTR_CHANNEL_NAMES]) == ["t850", "t500", "t2m"]
    assert train_attrs[layout.ATTR_DT_HOURS] == valid_attrs[layout.ATTR_DT_HOURS] == 6.0
    assert train_attrs[layout.ATTR_START_TIME] == "2001-02-29T12:00:00"
    assert valid_attrs[layout.ATTR_START_TIME] == "2001-02-30T12:00:00"
    assert valid_attrs[layout.ATTR_CALENDAR] == "360_day"
    stats = np.load(out / layout.STATS / layout.GLOBAL_MEANS)
    np.testing.assert_allclose(stats.ravel(), train.mean(axis=(0, 2, 3)), rtol=1e-6)


# daily steps from 2001-02-27, stored as numbers with units and calendar attributes: the date of each
# step, and so the split at 2001-03-01, depends on the calendar
CALENDARS = [  # (calendar attribute, name cftime gives it, steps before 2001-03-01)
    ("standard", "standard", 2), ("gregorian", "standard", 2), ("proleptic_gregorian", "proleptic_gregorian", 2),
    ("julian", "julian", 2), ("noleap", "noleap", 2), ("365_day", "noleap", 2), ("all_leap", "all_leap", 3),
    ("366_day", "all_leap", 3), ("360_day", "360_day", 4),
]


@pytest.mark.parametrize("calendar,name,n_train", CALENDARS, ids=[c[0] for c in CALENDARS])
def test_calendar_split_and_step(tmp_path, calendar, name, n_train):
    ds = weather(np.arange(6) * 24)
    ds = ds.assign_coords(time=("time", ds["time"].values,
                                {"units": "hours since 2001-02-27 00:00:00", "calendar": calendar}))
    ds.to_netcdf(tmp_path / "in.nc", engine="h5netcdf")
    summary = convert.convert(tmp_path / "in.nc", tmp_path / "out", ["t", "t2m"], [850, 500],
                                   valid_start="2001-03-01", verbose=False)
    assert summary["dt_hours"] == 24.0 and summary["calendar"] == name
    valid, attrs = read_file(tmp_path / "out" / "valid" / "2001.h5")
    np.testing.assert_array_equal(valid, expected(ds, slice(n_train, 6)))
    assert attrs[layout.ATTR_START_TIME] == "2001-03-01T00:00:00" and attrs[layout.ATTR_CALENDAR] == name


def test_noleap_year_files_and_gap(tmp_path):
    """12-hourly noleap steps over a new year (train) and over 2004-02-28 .. 03-01 (valid, no Feb 29)."""
    times = xr.date_range("2003-12-31", "2004-01-01T12", freq="12h", calendar="noleap", use_cftime=True)
    times = times.append(xr.date_range("2004-02-28", "2004-03-01T12", freq="12h", calendar="noleap",
                                       use_cftime=True))
    ds = weather(times)
    ds.to_netcdf(tmp_path / "in.nc", engine="h5netcdf")
    summary = convert.convert(tmp_path / "in.nc", tmp_path / "out", ["t", "t2m"], [850, 500],
                                   valid_start="2004-02-28", verbose=False)
    assert summary["files"] == {"train": [("2003.h5", 2), ("2004.h5", 2)], "valid": [("2004.h5", 4)]}
    assert summary["dt_hours"] == 12.0  # Feb 28 12:00 -> Mar 1 00:00 is one step: no Feb 29 in noleap
    assert summary["time_range"]["valid"] == ("2004-02-28T00:00:00", "2004-03-01T12:00:00")
    np.testing.assert_array_equal(read_file(tmp_path / "out" / "train" / "2004.h5")[0], expected(ds, slice(2, 4)))
    np.testing.assert_array_equal(read_file(tmp_path / "out" / "valid" / "2004.h5")[0], expected(ds, slice(4, 8)))
    with pytest.raises(LayoutError, match="not an ISO 8601 time of the input's noleap calendar"):
        convert.convert(tmp_path / "in.nc", tmp_path / "bad", ["t2m"], valid_start="2004-02-29")


def test_native_datetimes_count_as_proleptic_gregorian():
    """A time coordinate stored as datetime64 without CF units (possible in zarr stores)."""
    ds = weather(np.arange("2000-12-31T00", "2001-01-02T00", np.timedelta64(6, "h"), dtype="datetime64[ns]"))
    made = plan.make_plan(ds, ["t2m"], valid_start="2001-01-01")
    assert made.calendar == "proleptic_gregorian" and made.dt_hours == 6.0
    assert [(f.split, f.name, f.times.size) for f in made.files] == [("train", "2000.h5", 4), ("valid", "2001.h5", 4)]


# ---------------------------------------------------------------- zarr

@pytest.mark.parametrize("zarr_format", [2, 3])
def test_zarr_store(tmp_path, zarr_format):
    """A WeatherBench 2-style store: long variable names, ``level``, ascending latitude, two years."""
    zarr = pytest.importorskip("zarr")
    if zarr_format == 3 and int(zarr.__version__.split(".")[0]) < 3:
        pytest.skip("zarr format 3 needs zarr >= 3")
    times = np.arange("2019-12-31T00", "2020-01-02T00", np.timedelta64(6, "h"), dtype="datetime64[ns]")
    ds = weather(times).rename(t="temperature", t2m="2m_temperature")
    store = tmp_path / "era5.zarr"
    ds.to_zarr(store, zarr_format=zarr_format, consolidated=zarr_format == 2)  # as WeatherBench 2 writes v2
    assert formats.detect_format(store) == "zarr"
    summary = convert.convert(store, tmp_path / "out", ["temperature", "2m_temperature"], [850, 500],
                                   valid_fraction=0.5, verbose=False)
    assert summary["channels"] == ["temperature850", "temperature500", "2m_temperature"]
    assert summary["calendar"] == "proleptic_gregorian" and summary["dt_hours"] == 6.0
    assert summary["files"] == {"train": [("2019.h5", 4)], "valid": [("2020.h5", 4)]}
    ds = ds.rename(temperature="t", **{"2m_temperature": "t2m"})
    for split, index in (("train", slice(0, 4)), ("valid", slice(4, 8))):
        fields, attrs = read_file(tmp_path / "out" / split / f"{2019 if split == 'train' else 2020}.h5")
        np.testing.assert_array_equal(fields, expected(ds, index))
    assert attrs[layout.ATTR_START_TIME] == "2020-01-01T00:00:00" and attrs[layout.ATTR_DT_HOURS] == 6.0


# ---------------------------------------------------------------- GRIB

GRIB_TIMES = [(20001231, 0), (20001231, 12), (20010101, 0), (20010101, 12), (20010102, 0), (20010102, 12)]


@pytest.fixture
def eccodes():
    pytest.importorskip("cfgrib")
    return pytest.importorskip("eccodes")


def write_grib(eccodes, path: Path, messages) -> Path:
    """GRIB2 on the 3 x 4 grid (south to north, as jScansPositively says), IEEE 32-bit values, so the
    decoded values equal the float32 input exactly. ``messages``: (date, hour, step h, name, level, (H, W))."""
    with open(path, "wb") as f:
        for date, hour, step, name, level, values in messages:
            h = eccodes.codes_grib_new_from_samples("regular_ll_pl_grib2")
            try:
                for key, value in dict(Ni=LON.size, Nj=LAT.size, jScansPositively=1,
                                       latitudeOfFirstGridPointInDegrees=LAT[0],
                                       latitudeOfLastGridPointInDegrees=LAT[-1],
                                       longitudeOfFirstGridPointInDegrees=LON[0],
                                       longitudeOfLastGridPointInDegrees=LON[-1], iDirectionIncrementInDegrees=90,
                                       jDirectionIncrementInDegrees=45, dataDate=date, dataTime=hour * 100,
                                       step=step, shortName=name, level=level, packingType="grid_ieee").items():
                    eccodes.codes_set(h, key, value)
                eccodes.codes_set_values(h, values.astype(np.float64).ravel())
                eccodes.codes_write(h, f)
            finally:
                eccodes.codes_release(h)
    return path


def test_grib_two_variables_two_levels(eccodes, tmp_path):
    """t and z on 850/500 hPa, 12-hourly forecasts 6 h ahead: the valid times are start + 6 h."""
    rng = np.random.default_rng(1)
    values = {(i, name, level): (rng.normal(size=(LAT.size, LON.size)) * 100 + 5e4).astype(np.float32)
              for i in range(len(GRIB_TIMES)) for name in ("t", "z") for level in (850, 500)}
    path = write_grib(eccodes, tmp_path / "era5.grib",
                      [(*GRIB_TIMES[i], 6, name, level, v) for (i, name, level), v in values.items()])
    summary = convert.convert(path, tmp_path / "out", ["t", "z"], [500, 850], valid_start="2001-01-02T06",
                                   verbose=False)
    assert summary["channels"] == ["t500", "t850", "z500", "z850"] and summary["dt_hours"] == 12.0
    assert summary["files"] == {"train": [("2000.h5", 2), ("2001.h5", 2)], "valid": [("2001.h5", 2)]}
    for split, year, steps in (("train", 2000, [0, 1]), ("train", 2001, [2, 3]), ("valid", 2001, [4, 5])):
        fields, attrs = read_file(tmp_path / "out" / split / f"{year}.h5")
        want = np.stack([np.stack([values[(i, n, lev)] for n in ("t", "z") for lev in (500, 850)]) for i in steps])
        np.testing.assert_array_equal(fields, want[:, :, ::-1])
    assert attrs[layout.ATTR_START_TIME] == "2001-01-02T06:00:00"
    assert attrs[layout.ATTR_CALENDAR] == "proleptic_gregorian"
    assert not list(tmp_path.glob("*.idx"))  # cfgrib leaves no index file next to the input


def test_grib_single_level_and_forecast_steps(eccodes, tmp_path):
    rng = np.random.default_rng(2)

    def field() -> np.ndarray:
        return rng.normal(size=(LAT.size, LON.size)).astype(np.float32)

    # one run's lead times 0..30 h at one level: 'step' is the time axis, the level a scalar coordinate
    one_run = [(20010101, 0, step, "t", 500, field()) for step in range(0, 36, 6)]
    path = write_grib(eccodes, tmp_path / "run.grb2", one_run)
    summary = convert.convert(path, tmp_path / "out", ["t"], [500], verbose=False)
    assert summary["channels"] == ["t500"] and summary["dt_hours"] == 6.0
    assert summary["time_range"]["valid"] == ("2001-01-01T18:00:00", "2001-01-02T06:00:00")
    fields, _ = read_file(tmp_path / "out" / "valid" / "2001.h5")
    np.testing.assert_array_equal(fields[:, 0], np.stack([m[-1] for m in one_run[3:]])[:, ::-1])
    with pytest.raises(LayoutError, match=r"no level 850 along 'isobaricInhPa'; available levels: 500"):
        convert.convert(path, tmp_path / "bad", ["t"], [850], verbose=False)
    # several start times, each with several lead times: no single time axis
    runs = [(*GRIB_TIMES[i], step, "t", 500, field()) for i in range(2) for step in (0, 6)]
    with pytest.raises(LayoutError, match=r"2 start times with 2 lead times each .*grib_copy -w step=6"):
        formats.open_input(write_grib(eccodes, tmp_path / "runs.grib", runs))


# ---------------------------------------------------------------- detection and bad input

def test_detect_format(tmp_path):
    (tmp_path / "a.nc").write_bytes(b"CDF\x01rest")
    (tmp_path / "b.h5").write_bytes(b"\x89HDF\r\n\x1a\n")
    (tmp_path / "c.bin").write_bytes(b"GRIB\x00\x00")
    (tmp_path / "d.grib").write_bytes(b"TTAA00 bulletin header")
    (tmp_path / "e.txt").write_text("hello")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "zarr.json").write_text("{}")
    got = {p.name: formats.detect_format(p) for p in sorted(tmp_path.iterdir())}
    assert got == {"a.nc": "netcdf", "b.h5": "netcdf", "c.bin": "grib", "d.grib": "grib", "e.txt": None,
                   "store": "zarr"}


@pytest.mark.parametrize("module,extra,name", [("cfgrib", "grib", "in.grib"), ("zarr", "data", "in.zarr")])
def test_missing_optional_package(tmp_path, monkeypatch, module, extra, name):
    if name.endswith(".zarr"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".zgroup").write_text('{"zarr_format": 2}')
    else:
        (tmp_path / name).write_bytes(b"GRIB")
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail as if not installed
    with pytest.raises(LayoutError, match=rf"needs the Python package '{module}' .*pip install -e '\.\[{extra}\]'"):
        formats.open_input(tmp_path / name)


ACCEPTED = "--input takes a netCDF file, a GRIB file or a zarr store folder"
BAD_INPUTS = [  # (file name, content or None for a folder, words of the error line)
    ("notes.txt", b"not weather data\n", ACCEPTED),
    ("map.png", b"\x89PNG\r\n\x1a\n" + bytes(64), ACCEPTED),
    ("folder", None, f"is a folder but not a zarr store (it holds none of .zgroup, .zattrs, zarr.json); {ACCEPTED}"),
    ("broken.grib", b"GRIB" + bytes(60), "as GRIB"),
]


@pytest.mark.parametrize("name,content,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_cli_unreadable_input_is_one_error_line(tmp_path, name, content, message, run_cli):
    if name.endswith(".grib"):
        pytest.importorskip("cfgrib")
    path = tmp_path / name
    if content is None:
        path.mkdir()
        (path / "era5.nc").write_bytes(b"CDF\x01")
    else:
        path.write_bytes(content)
    run = run_cli("--input", path, "--out", tmp_path / "out", "--variables", "t")
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.splitlines()) == 1 and run.stderr.startswith("error: "), run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()
