"""Static fields: ``tools.convert_era5 --static_variables`` writes ``static.h5`` on the grid of the prognostic fields
(flipped, trimmed), and ``utils.data.static.read_static`` returns them normalized for the whole grid or its
north-west corner; every bad input is one error line naming the fix."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from tools import convert_era5
from utils.core.errors import UserError
from utils.data import layout
from utils.data.layout import LayoutError
from utils.data.static import read_static
from utils.preprocess.convert import convert

xr = pytest.importorskip("xarray")
pytest.importorskip("cftime")

T, H, W = 8, 9, 13  # trimmed to 8 x 12 by --trim_to_multiple 4
LAT = np.linspace(-40.0, 40.0, H)  # ascending: the converter flips it, and the static fields with it
LON = np.arange(W) * 2.5 - 10.0  # degrees east, some negative


def fields(seed: int = 0) -> dict[str, np.ndarray]:
    """The input's values: ``t2m`` (T, H, W) changing in time, ``lsm`` and ``z`` (H, W)."""
    rng = np.random.default_rng(seed)
    return {"t2m": 280 + rng.standard_normal((T, H, W)).astype(np.float32),
            "lsm": (rng.random((H, W)) > 0.5).astype(np.float32),
            "z": (rng.random((H, W)) * 4000).astype(np.float32)}


def write_input(path: Path, z_in_time: bool = True, lsm_change: float = 0.0, **variables) -> Path:
    """A small ERA5-like netCDF: ``t2m`` over time, ``lsm`` repeated over time (its last time shifted by
    ``lsm_change``), ``z`` with or without a time dimension; ``variables`` replace or add (dims, values)."""
    import pandas as pd
    values = fields()
    lsm = np.repeat(values["lsm"][None], T, axis=0)
    lsm[-1] += lsm_change
    grid = ("latitude", "longitude")
    data = {"t2m": (("time", *grid), values["t2m"], {"units": "K"}),
            "lsm": (("time", *grid), lsm, {"units": "(0 - 1)"}),
            "z": ((("time", *grid), np.repeat(values["z"][None], T, axis=0)) if z_in_time else (grid, values["z"]))
            + ({"units": "m**2 s**-2"},)}
    data.update(variables)
    xr.Dataset(data, coords={"time": pd.date_range("2001-01-01", periods=T, freq="6h"), "latitude": LAT,
                             "longitude": LON}).to_netcdf(path)
    return path


def expected(name: str) -> np.ndarray:
    """``name`` on the output grid: north to south, trimmed to 8 x 12."""
    return fields()[name][::-1][:8, :12]


def run(input_path: Path, out: Path, static=("lsm", "z")) -> dict:
    return convert(input_path, out, ["t2m"], valid_fraction=0.5, trim_to_multiple=4, static_variables=list(static),
                   verbose=False)


@pytest.fixture(scope="module", params=[True, False], ids=["z in time", "z without time"])
def converted(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("static")
    run(write_input(folder / "in.nc", z_in_time=request.param), folder / "data")
    return folder / "data"


def grid_of(data: Path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(layout.split_files(data, layout.TRAIN)[0], "r") as f:
        return f[layout.LATITUDE][:], f[layout.LONGITUDE][:]


# ---------------------------------------------------------------- the converter
def test_static_file_values_attributes_and_grid(converted):
    latitude, longitude = grid_of(converted)
    assert latitude[0] == 40 and longitude[0] == -10 and (latitude.size, longitude.size) == (8, 12)
    with h5py.File(converted / layout.STATIC, "r") as f:
        assert sorted(f) == ["latitude", "longitude", "lsm", "z"]
        np.testing.assert_array_equal(f[layout.LATITUDE][:], latitude)
        np.testing.assert_array_equal(f[layout.LONGITUDE][:], longitude)
        assert f[layout.LATITUDE].dtype == f[layout.LONGITUDE].dtype == np.float64
        for name, units in (("lsm", "(0 - 1)"), ("z", "m**2 s**-2")):
            field, want = f[name], expected(name)
            assert field.shape == (8, 12) and field.dtype == np.float32
            np.testing.assert_array_equal(field[:], want)
            assert field.attrs[layout.ATTR_UNITS] == units
            assert isinstance(field.attrs[layout.ATTR_MEAN], np.float64)
            assert field.attrs[layout.ATTR_MEAN] == pytest.approx(want.astype(np.float64).mean(), rel=1e-12)
            assert field.attrs[layout.ATTR_STD] == pytest.approx(want.astype(np.float64).std(), rel=1e-12)
    assert not list(converted.glob("*.part"))


def test_read_static_full_grid_and_north_west_crop(converted):
    latitude, longitude = grid_of(converted)
    want = np.stack([(expected(n) - expected(n).astype(np.float64).mean()) / expected(n).astype(np.float64).std()
                     for n in ("z", "lsm")])
    full = read_static(converted / layout.STATIC, ["z", "lsm"], latitude, longitude)
    assert full.shape == (2, 8, 12) and full.dtype == np.float32
    np.testing.assert_allclose(full, want, rtol=1e-6, atol=1e-6)
    crop = read_static(converted / layout.STATIC, ["lsm"], latitude[:4], longitude[:8])  # statistics: whole grid
    np.testing.assert_allclose(crop, want[1:, :4, :8], rtol=1e-6, atol=1e-6)
    assert read_static(converted / layout.STATIC, [], latitude, longitude).shape == (0, 8, 12)


def test_constant_field_stores_std_one(tmp_path):
    source = write_input(tmp_path / "in.nc", sea=(("latitude", "longitude"), np.zeros((H, W), np.float32)))
    run(source, tmp_path / "data", static=["sea"])
    with h5py.File(tmp_path / "data" / layout.STATIC, "r") as f:
        assert f["sea"].attrs[layout.ATTR_STD] == 1.0 and f["sea"].attrs[layout.ATTR_MEAN] == 0.0
    latitude, longitude = grid_of(tmp_path / "data")
    assert not read_static(tmp_path / "data" / layout.STATIC, ["sea"], latitude, longitude).any()


def test_summary_names_the_static_fields(tmp_path, capsys):
    source = write_input(tmp_path / "in.nc")
    out = tmp_path / "data"
    assert convert_era5.main(["--input", str(source), "--out", str(out), "--variables", "t2m",
                              "--trim_to_multiple", "4", "--static_variables", "lsm", "z"]) == 0
    assert "static fields (static.h5): lsm (mean " in capsys.readouterr().out
    run(source, out.with_name("again"), static=())  # without --static_variables: no file
    assert not (out.with_name("again") / layout.STATIC).exists()


def test_overwrite_removes_an_old_static_file(tmp_path):
    source = write_input(tmp_path / "in.nc")
    run(source, tmp_path / "data")
    with pytest.raises(LayoutError, match="already holds a dataset"):
        run(source, tmp_path / "data", static=())
    convert(source, tmp_path / "data", ["t2m"], trim_to_multiple=4, overwrite=True, verbose=False)
    assert not (tmp_path / "data" / layout.STATIC).exists()  # it may have been of another grid


@pytest.mark.parametrize("variables,static,message", [
    ({}, ["lsn"], "static variable(s) lsn not in the input; it has: t2m, lsm, z"),
    ({}, ["lsm", "lsm"], "lists lsm more than once"),
    ({}, ["latitude"], "a coordinate, not a static field"),
    ({"lsm": (("time", "latitude", "longitude"), np.ones((T, H, W), np.float32) * np.arange(T)[:, None, None])},
     ["lsm"], "static variable 'lsm' is not constant along 'time': 2001-01-01T06:00:00 differs from the first by up "
              "to 1"),
    ({"zl": (("level", "latitude", "longitude"), np.zeros((2, H, W), np.float32))}, ["zl"],
     "has the dimension 'level' of size 2"),
    ({"nan": (("latitude", "longitude"), np.full((H, W), np.nan, np.float32))}, ["nan"],
     f"static variable 'nan' has {8 * 12} NaN/Inf value(s)"),
    ({"flat": (("x",), np.zeros(3, np.float32))}, ["flat"], "not the grid's 'latitude' and 'longitude'"),
])
def test_converter_errors_leave_nothing(tmp_path, variables, static, message):
    source = write_input(tmp_path / "in.nc", **variables)
    with pytest.raises(LayoutError) as info:
        run(source, tmp_path / "data", static=static)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "data").exists()  # checked before anything was written


def test_converter_tolerates_packing_noise_but_not_a_change(tmp_path):
    run(write_input(tmp_path / "in.nc", lsm_change=1e-7), tmp_path / "data")  # float32 rounding: constant
    with pytest.raises(LayoutError, match="'lsm' is not constant along 'time': 2001-01-02T18:00:00"):
        run(write_input(tmp_path / "in2.nc", lsm_change=0.01), tmp_path / "data2")


def test_cli_error_is_one_line(tmp_path, capsys):
    source = write_input(tmp_path / "in.nc")
    status = convert_era5.main(["--input", str(source), "--out", str(tmp_path / "data"), "--variables", "t2m",
                                "--static_variables", "orography"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: static variable(s) orography not in the input; it has: t2m, lsm, z")
    assert err.count("\n") == 1


# ---------------------------------------------------------------- the reader's errors
def spoil(data: Path, how) -> Path:
    """A copy of ``data``'s static.h5 changed by ``how(h5py file)``."""
    path = data.parent / f"spoiled_{data.name}.h5"
    path.write_bytes((data / layout.STATIC).read_bytes())
    with h5py.File(path, "r+") as f:
        how(f)
    return path


def replace(name: str, values) -> callable:
    def change(f):
        del f[name]
        f[name] = values
    return change


def set_attribute(name: str, attribute: str, value) -> callable:
    def change(f):
        f[name].attrs[attribute] = value
    return change


@pytest.mark.parametrize("how,names,crop,message", [
    (None, ["lsm"], None, "does not exist; run python -m tools.convert_era5 with --static_variables lsm"),
    ("garbage", ["lsm"], None, "as HDF5"),
    ("truncated", ["lsm"], None, "as HDF5"),
    (lambda f: None, ["lsn"], None, "has no field 'lsn'; did you mean lsm? it has: lsm, z; set --static_fields"),
    (replace("z", np.zeros((8, 11), np.float32)), ["z"], None, "has shape (8, 11), not the file's grid (8, 12)"),
    (replace("z", np.full((8, 12), np.inf, np.float32)), ["z"], None, "has 96 NaN/Inf value(s)"),
    (set_attribute("z", "std", 0.0), ["z"], None, "has std 0, which cannot normalize it"),
    (set_attribute("z", "std", -2.0), ["z"], None, "has std -2"),
    (set_attribute("z", "mean", "none"), ["z"], None, "has no finite 'mean' attribute"),
    (replace("longitude", np.arange(12.0)), ["z"], None,
     "is on another grid than the data: the file's is 8 x 12 (latitude 40 .. -30 by 10, longitude 0 .. 11 by 1), "
     "the data's 8 x 12 (latitude 40 .. -30 by 10, longitude -10 .. 17.5 by 2.5), which must be all of the file's or "
     "its north-west corner; write it again"),
    (lambda f: None, ["z"], (9, 12), "is on another grid"),  # larger than the file
    (lambda f: None, ["z"], "south", "is on another grid"),  # a corner that is not the north-west one
    (lambda f: f.__delitem__("latitude"), ["z"], None, "has no 1-D 'latitude' dataset"),
])
def test_reader_errors_name_the_fix(converted, how, names, crop, message):
    latitude, longitude = grid_of(converted)
    if how is None:
        path = converted / "absent.h5"
    elif how in ("garbage", "truncated"):
        path = converted.parent / f"{how}.h5"
        path.write_bytes(b"not HDF5 at all" if how == "garbage" else (converted / layout.STATIC).read_bytes()[:900])
    else:
        path = spoil(converted, how)
    if crop == "south":
        latitude = latitude[4:]
    elif crop:
        latitude = np.linspace(latitude[0], latitude[0] - 10 * (crop[0] - 1), crop[0])
    with pytest.raises(UserError) as info:
        read_static(path, names, latitude, longitude)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
