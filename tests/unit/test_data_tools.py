"""Tests of the data tools: synthetic generator, ERA5 netCDF converter, shared layout helpers."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from tools import convert_era5, make_synthetic_data as synth
from utils.data import layout, metadata
from utils.preprocess import convert, formats, writer
from utils.preprocess import convert_plan as plan
from utils.preprocess import synthetic_dataset as generate
from utils.data.layout import LayoutError

xr = pytest.importorskip("xarray")

REPO = Path(__file__).resolve().parents[2]
REAL_SAMPLE = REPO / "samples" / "era5-levels-members.nc"  # shipped with the project


def read_fields(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[layout.FIELDS][:]


def load_stats(data_path: Path) -> dict[str, np.ndarray]:
    return {n[:-4]: np.load(data_path / layout.STATS / n) for n in layout.STATS_FILES}


def numpy_stats(arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Reference statistics: concatenate (T, C, H, W) arrays along time, plain NumPy in float64."""
    x = np.concatenate(arrays).astype(np.float64)
    return {"global_means": x.mean(axis=(0, 2, 3))[None, :, None, None],
            "global_stds": x.std(axis=(0, 2, 3))[None, :, None, None],
            "time_means": x.mean(axis=0)[None]}


def assert_stats_equal(got: dict, want: dict) -> None:
    for key, ref in want.items():
        assert got[key].dtype == np.float32 and got[key].shape == ref.shape, key
        np.testing.assert_allclose(got[key], ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max(), err_msg=key)


# ---------------------------------------------------------------- shared layout helpers

def test_layout_writer_and_stats(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.normal(5e4, 1e3, size=(n, 2, 3, 4)).astype(np.float32) for n in (5, 1, 7)]
    lat, lon = np.array([60.0, 0.0, -60.0]), np.arange(4) * 90.0
    path = writer.write_field_file(tmp_path / "a.h5", arrays[0], ["z500", "t850"], lat, lon, dt_hours=6)
    np.testing.assert_array_equal(read_fields(path), arrays[0])
    assert metadata.read_channel_names(path) == ["z500", "t850"] and not list(tmp_path.glob("*.part"))
    # streaming over blocks of any size gives the statistics of the concatenation
    stats = writer.compute_and_save_stats(tmp_path, arrays, ["z500", "t850"])
    assert_stats_equal(stats, numpy_stats(arrays))
    assert_stats_equal(load_stats(tmp_path), numpy_stats(arrays))
    with pytest.raises(LayoutError, match="descending"):
        writer.write_field_file(tmp_path / "b.h5", arrays[0], ["z500", "t850"], lat[::-1], lon, 6)
    with pytest.raises(LayoutError, match="never written"):
        with writer.FieldFileWriter(tmp_path / "c.h5", ["z500", "t850"], lat, lon, 3, 6) as out:
            out.write(0, arrays[1])
    with pytest.raises(LayoutError, match=r"\['t850'\] are constant"):
        writer.compute_and_save_stats(tmp_path, [np.stack([arrays[0][:, 0], np.ones((5, 3, 4))], 1)], ["z500", "t850"])
    assert sorted(p.name for p in tmp_path.glob("*.h5*")) == ["a.h5"]  # failed writes leave nothing
    with pytest.raises(FileNotFoundError):
        metadata.read_channel_names(tmp_path / "missing.h5")
    # unwritable destinations (a file where a folder should be) and unreadable files name the path
    with pytest.raises(LayoutError, match=r"cannot create .*a\.h5/b\.h5\.part .*pass a writable --out"):
        writer.write_field_file(path / "b.h5", arrays[0], ["z500", "t850"], lat, lon, dt_hours=6)
    with pytest.raises(LayoutError, match=r"cannot write the statistics to .*a\.h5/stats"):
        writer.save_stats(path, stats)
    (tmp_path / "notes.h5").write_text("not HDF5")
    with pytest.raises(LayoutError, match=r"cannot read .*notes\.h5 as HDF5"):
        metadata.read_channel_names(tmp_path / "notes.h5")


# ---------------------------------------------------------------- synthetic generator

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return generate.make_synthetic_dataset(tmp_path_factory.mktemp("synthetic"), seed=3)


def test_synthetic_layout_shapes_and_dtypes(synthetic):
    train, valid = layout.split_files(synthetic, "train"), layout.split_files(synthetic, "valid")
    assert [p.name for p in train] == ["2000.h5", "2001.h5"] and [p.name for p in valid] == ["2002.h5"]
    for path in train + valid:
        with h5py.File(path, "r") as f:
            ds = f[layout.FIELDS]
            assert ds.shape == (64, 4, 32, 64) and ds.dtype == np.float32
            assert ds.chunks == (1, 4, 32, 64) and ds.compression is None
            assert float(ds.attrs[layout.ATTR_DT_HOURS]) == 6.0
            lat, lon = f[layout.LATITUDE][:], f[layout.LONGITUDE][:]
        assert lat.dtype == lon.dtype == np.float64 and lat.shape == (32,) and lon.shape == (64,)
        assert lat[0] == 90.0 and np.all(np.diff(lat) < 0) and lat[-1] > -90
        assert lon[0] == 0.0 and np.all(np.diff(lon) > 0) and lon[-1] < 360
        assert metadata.read_channel_names(path) == ["u10m", "v10m", "t2m", "sp"]
    stats = load_stats(synthetic)
    assert stats["global_means"].shape == stats["global_stds"].shape == (1, 4, 1, 1)
    assert stats["time_means"].shape == (1, 4, 32, 64)
    # stats come from the training files only
    assert_stats_equal(stats, numpy_stats([read_fields(p) for p in train]))
    # physically plausible magnitudes: temperature in K, surface pressure in Pa
    means = stats["global_means"].ravel()
    assert 250 < means[2] < 300 and 9e4 < means[3] < 1.1e5


def test_synthetic_channel_names():
    assert generate.channel_names(20) == list(generate.BASE_CHANNELS)
    longer = generate.channel_names(30)
    assert longer[:20] == list(generate.BASE_CHANNELS) and len(set(longer)) == 30
    with pytest.raises(LayoutError, match="--channels"):
        generate.channel_names(0)


def test_synthetic_is_deterministic(synthetic, tmp_path):
    again = generate.make_synthetic_dataset(tmp_path / "again", seed=3)
    for path in sorted(synthetic.rglob("*.*")):
        assert path.read_bytes() == (again / path.relative_to(synthetic)).read_bytes(), path
    other = generate.make_synthetic_dataset(tmp_path / "other", seed=4)
    assert not np.array_equal(read_fields(other / "train" / "2000.h5"), read_fields(synthetic / "train" / "2000.h5"))


def _stencil(x: np.ndarray) -> np.ndarray:
    """(T, H, W) -> (T, H, W, 15): each point's 3 (lat) x 5 (lon, periodic) neighbourhood."""
    xp = np.pad(x, ((0, 0), (1, 1), (0, 0)), mode="edge")
    return np.stack([np.roll(xp[:, i:i + x.shape[1]], -j, axis=2) for i in range(3) for j in range(-2, 3)], -1)


def _pairs(arrays, c, steps_per_day):
    feats, targets, hours = [], [], []
    for a in arrays:
        x = a[:, c].astype(np.float64)
        feats.append(_stencil(x[:-1]))
        targets.append(x[1:])
        hours.append(np.arange(x.shape[0] - 1) % steps_per_day)  # every file starts at 00 UTC
    return np.concatenate(feats), np.concatenate(targets), np.concatenate(hours)


def test_synthetic_is_learnable(synthetic):
    """A linear stencil (shared per channel) plus a per-(hour, grid point) bias, fitted by least squares
    on the training years, must beat persistence clearly on the unseen validation year.

    The hour-of-day bias stands in for what a network reads off the input: the position of the
    diurnal heating bump tells the time of day.
    """
    train = [read_fields(p) for p in layout.split_files(synthetic, "train")]
    valid = [read_fields(p) for p in layout.split_files(synthetic, "valid")]
    steps_per_day = 4  # 24 h / 6 h
    for c in range(train[0].shape[1]):
        x, y, g = _pairs(train, c, steps_per_day)
        x_mean = np.stack([x[g == h].mean(0) for h in range(steps_per_day)])
        y_mean = np.stack([y[g == h].mean(0) for h in range(steps_per_day)])
        beta = np.linalg.lstsq((x - x_mean[g]).reshape(-1, x.shape[-1]), (y - y_mean[g]).ravel(), rcond=None)[0]
        bias = y_mean - x_mean @ beta
        xv, yv, gv = _pairs(valid, c, steps_per_day)
        model = np.sqrt(np.mean((xv @ beta + bias[gv] - yv) ** 2))
        persistence = np.sqrt(np.mean((xv[..., 7] - yv) ** 2))  # feature 7 is the point itself
        assert persistence > 0.01 * np.concatenate(train)[:, c].std(), f"channel {c} barely changes"
        assert model < 0.2 * persistence, f"channel {c}: model {model:.4g} vs persistence {persistence:.4g}"


def test_synthetic_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    assert synth.main(["--out", str(out), "--channels", "2", "--img_size", "8", "16", "--train_years", "1",
                       "--steps_per_year", "4", "--dt_hours", "12"]) == 0
    assert read_fields(out / "valid" / "2001.h5").shape == (4, 2, 8, 16)
    # a second run must not silently mix with the first one
    assert synth.main(["--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert synth.main(["--out", str(out), "--steps_per_year", "1", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


# ---------------------------------------------------------------- converter on a small file

TIMES = np.arange("2019-12-31T00", "2020-01-02T12", np.timedelta64(6, "h"), dtype="datetime64[ns]")  # 10 steps
LEVELS = np.array([1000.0, 850.0, 500.0])
LAT = np.linspace(-90.0, 90.0, 7)  # ascending, 7 rows: not a multiple of 4
LON = np.arange(10) * 36.0  # 10 columns: not a multiple of 4


def small_dataset(members: int = 3, seed: int = 0):
    """Ensemble netCDF-like dataset: t, z on levels, t2m single-level; ascending latitude."""
    rng = np.random.default_rng(seed)
    shape = (members, TIMES.size, LEVELS.size, LAT.size, LON.size)
    coords = {"number": np.arange(members), "time": TIMES, "isobaricInhPa": LEVELS,
              "latitude": LAT, "longitude": LON}
    level_dims = ("number", "time", "isobaricInhPa", "latitude", "longitude")
    return xr.Dataset({
        "t": (level_dims, 250.0 + 10.0 * rng.standard_normal(shape)),
        "z": (level_dims, 5e4 + 1e3 * rng.standard_normal(shape)),
        "t2m": (("number", "time", "latitude", "longitude"), 280.0 + 5.0 * rng.standard_normal(shape[:2] + shape[3:])),
    }, coords=coords)


def write_nc(ds, path: Path, **kwargs) -> Path:
    ds.to_netcdf(path, engine=kwargs.pop("engine", "h5netcdf"), **kwargs)
    return path


def expected_fields(ds, member, time_index, channels=(("t", 850), ("t", 500), ("z", 850), ("z", 500), ("t2m", None))):
    """Reference (T, C, 4, 8) fields: flip latitude to north-south, trim to multiples of 4."""
    parts = []
    for var, lev in channels:
        da = ds[var].isel(number=member, time=time_index)
        if lev is not None:
            da = da.sel(isobaricInhPa=lev)
        parts.append(da.values[:, ::-1][:, :4, :8])
    return np.stack(parts, axis=1)


CONVERT_ARGS = dict(variables=["t", "z", "t2m"], levels=[850, 500], valid_start="2020-01-01T12",
                    trim_to_multiple=4, verbose=False)


@pytest.fixture(scope="module")
def small_nc(tmp_path_factory) -> tuple[Path, object]:
    ds = small_dataset()
    return write_nc(ds, tmp_path_factory.mktemp("nc") / "small.nc"), ds


def test_convert_round_trip(small_nc, tmp_path):
    path, ds = small_nc
    summary = convert.convert(path, tmp_path, **CONVERT_ARGS)
    names = ["t850", "t500", "z850", "z500", "t2m"]
    assert summary["channels"] == names and summary["grid"] == (4, 8) and summary["dt_hours"] == 6.0
    # train: 2019-12-31 00..18 (4 steps) and 2020-01-01 00, 06 (2); valid: 2020-01-01 12 .. 2020-01-02 06 (4)
    train_idx = {2019: np.arange(4), 2020: np.arange(4, 6)}
    want_files = {"train": [f"{y}_m{m:02d}.h5" for y in (2019, 2020) for m in range(3)],
                  "valid": [f"2020_m{m:02d}.h5" for m in range(3)]}
    for split, files in want_files.items():
        assert [p.name for p in layout.split_files(tmp_path, split)] == files
    # samples run on across the new year: 6 consecutive training steps per member
    assert summary["samples"] == {"train": 3 * (6 - 1), "valid": 3 * 3}
    assert summary["time_range"]["valid"] == ("2020-01-01T12:00:00", "2020-01-02T06:00:00")
    for m in range(3):
        for year, idx in train_idx.items():
            np.testing.assert_array_equal(read_fields(tmp_path / "train" / f"{year}_m{m:02d}.h5"),
                                          expected_fields(ds, m, idx).astype(np.float32))
        np.testing.assert_array_equal(read_fields(tmp_path / "valid" / f"2020_m{m:02d}.h5"),
                                      expected_fields(ds, m, np.arange(6, 10)).astype(np.float32))
    out_file = tmp_path / "valid" / "2020_m01.h5"
    assert metadata.read_channel_names(out_file) == names
    with h5py.File(out_file, "r") as f:
        np.testing.assert_array_equal(f[layout.LATITUDE][:], [90.0, 60.0, 30.0, 0.0])
        np.testing.assert_array_equal(f[layout.LONGITUDE][:], LON[:8])
        assert f[layout.FIELDS].chunks == (1, 5, 4, 8)
        assert f[layout.FIELDS].attrs[layout.ATTR_START_TIME] == "2020-01-01T12:00:00"
    # statistics over the training times (all members) only
    reference = numpy_stats([expected_fields(ds, m, np.arange(6)).astype(np.float32) for m in range(3)])
    assert_stats_equal(load_stats(tmp_path), reference)


def test_convert_member_selection_and_fraction(small_nc, tmp_path):
    path, ds = small_nc
    args = dict(CONVERT_ARGS, valid_start=None, valid_fraction=0.3, members="0,2")
    summary = convert.convert(path, tmp_path, **args)
    assert summary["members"] == [0, 2]
    # 0.3 of 10 steps -> the last 3 are validation
    assert [p.name for p in layout.split_files(tmp_path, "valid")] == ["2020_m00.h5", "2020_m02.h5"]
    assert read_fields(tmp_path / "valid" / "2020_m02.h5").shape == (3, 5, 4, 8)
    reference = numpy_stats([expected_fields(ds, m, np.arange(7)).astype(np.float32) for m in (0, 2)])
    assert_stats_equal(load_stats(tmp_path), reference)


def test_convert_keeps_single_step_year_that_continues_the_previous(small_nc, tmp_path):
    path, ds = small_nc
    summary = convert.convert(path, tmp_path, **dict(CONVERT_ARGS, valid_start="2020-01-01T06"))
    # the training split ends with 2020-01-01T00 alone in its year: one step after 2019's last, so its file is
    # kept and the sample 2019-12-31T18 -> 2020-01-01T00 runs across the two files
    assert [p.name for p in layout.split_files(tmp_path, "train")] == [f"{y}_m{m:02d}.h5" for y in (2019, 2020)
                                                                       for m in range(3)]
    assert not any("skipped" in n for n in summary["notes"]) and summary["samples"]["train"] == 3 * 4
    reference = numpy_stats([expected_fields(ds, m, np.arange(5)).astype(np.float32) for m in range(3)])
    assert_stats_equal(load_stats(tmp_path), reference)


def test_convert_alternative_names_without_members(tmp_path):
    """WeatherBench2/new-CDS style names (valid_time, pressure_level, lat, lon), no ensemble, netCDF3."""
    ds = small_dataset(members=1).isel(number=0, drop=True).rename(
        time="valid_time", isobaricInhPa="pressure_level", latitude="lat", longitude="lon")
    path = write_nc(ds, tmp_path / "wb2.nc", engine="netcdf4", format="NETCDF3_CLASSIC")  # h5netcdf cannot read it
    summary = convert.convert(path, tmp_path / "out", ["z"], [500], valid_fraction=0.5, verbose=False)
    assert summary["channels"] == ["z500"] and summary["grid"] == (7, 10) and summary["members"] is None
    # 2020: 1 step, continuing 2019
    assert [p.name for p in layout.split_files(tmp_path / "out", "train")] == ["2019.h5", "2020.h5"]
    got = read_fields(tmp_path / "out" / "valid" / "2020.h5")
    np.testing.assert_array_equal(got[:, 0], ds["z"].sel(pressure_level=500).values[5:, ::-1].astype(np.float32))


def test_convert_extra_dimension(tmp_path):
    ds = small_dataset(members=1)
    ds["t"] = ds["t"].expand_dims(expver=[1, 5]).copy()
    path = write_nc(ds, tmp_path / "expver.nc")
    with pytest.raises(LayoutError, match=r"unexpected dimension 'expver'.*--select expver="):
        convert.convert(path, tmp_path / "a", ["t"], [850], verbose=False)
    summary = convert.convert(path, tmp_path / "b", ["t"], [850], select={"expver": 1}, verbose=False)
    assert summary["channels"] == ["t850"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(variables=["t", "q"]), r"variable\(s\) q not in the input; it has: t, z, t2m"),
    (dict(variables=["t"], levels=[700]), r"no level 700 .*available levels: 1000, 850, 500"),
    (dict(variables=["t2m"], levels=[850]), "none of the variables"),
    (dict(variables=["t"], members="7"), "number' = 0, 1, 2"),
    (dict(variables=["t"], valid_start="2020-01-02T06"), "leaves 1 time step"),
    (dict(variables=["t"], valid_fraction=0.9), "leaves 1 time step"),
    (dict(variables=["t"], select={"foo": 0}), "no selected variable has"),
    (dict(variables=["t"], trim_to_multiple=8), "larger than the 7x10 grid"),
])
def test_convert_errors(small_nc, tmp_path, kwargs, message):
    path, _ = small_nc
    with pytest.raises(LayoutError, match=message):
        convert.convert(path, tmp_path, verbose=False, **kwargs)
    assert not layout.split_files(tmp_path, "train")  # validation happens before writing


def test_convert_nan_names_variable_and_cleans_up(tmp_path):
    ds = small_dataset()
    values = ds["z"].values.copy()
    values[1, 8, 2, 5, 0] = np.nan  # member 1, a validation time, level 500, 60N: written last
    ds["z"] = (ds["z"].dims, values)
    path = write_nc(ds, tmp_path / "nan.nc")
    with pytest.raises(LayoutError, match=r"variable 'z' \(channel z500\) has 1 NaN/Inf.*member 1"):
        convert.convert(path, tmp_path / "out", **CONVERT_ARGS)
    assert not layout.split_files(tmp_path / "out", "train")  # no half-written dataset left behind


def test_convert_missing_input_and_cli(small_nc, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert.convert(tmp_path / "nope.nc", tmp_path / "out", ["t"])
    path, _ = small_nc
    argv = ["--input", str(path), "--out", str(tmp_path / "cli"), "--variables", "t", "t2m", "--levels", "500",
            "--members", "1", "--trim_to_multiple", "2"]
    assert convert_era5.main(argv) == 0
    out = capsys.readouterr().out
    assert "channels (2): t500, t2m" in out and "grid: 6 x 10" in out and "dropped 1 southernmost" in out
    assert convert_era5.main(argv) == 2  # refuses to mix with the existing dataset
    assert "already holds a dataset" in capsys.readouterr().err
    assert convert_era5.main(argv + ["--overwrite"]) == 0
    unknown = [a if a != "t2m" else "nope" for a in argv if a != "t"]  # --variables nope
    assert convert_era5.main(unknown + ["--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: variable(s) nope not in the input") and "Traceback" not in err


def damaged_copy(ds, path: Path) -> Path:
    """``ds`` as netCDF4 with checksummed chunks, one chunk of ``z`` overwritten (a bad download)."""
    write_nc(ds, path, encoding={"z": {"chunksizes": (1, 1, 1, LAT.size, LON.size), "fletcher32": True}})
    with h5py.File(path, "r") as f:
        offset = f["z"].id.get_chunk_info_by_coord((0, 2, 1, 0, 0)).byte_offset
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 16)
    return path


def test_convert_damaged_input_cleans_up(small_nc, tmp_path):
    path = damaged_copy(small_nc[1], tmp_path / "damaged.nc")
    with pytest.raises(LayoutError, match=r"cannot read variable 'z' at 2019-12-31T00:00:00 \.\. 2019-12-31T18:00:00 from .*damaged\.nc"):
        convert.convert(path, tmp_path / "out", **CONVERT_ARGS)
    assert not layout.split_files(tmp_path / "out", "train")


# (tool, arguments, text of the error line); {nc}: a small input, {tmp}: a fresh folder, {file}: a
# text file, {dataset}: a folder holding a dataset, {damaged}: an input with a damaged chunk
NC_ARGS = ["--input", "{nc}", "--out", "{tmp}/out", "--variables", "t", "z"]
CLI_ERRORS = [
    ("make_synthetic_data", ["--out", "{tmp}/o", "--img_size", "0", "64"], "--img_size must be at least 2 2, got 0 64"),
    ("make_synthetic_data", ["--out", "{tmp}/o", "--channels", "0"], "--channels must be between 1 and 65, got 0"),
    ("make_synthetic_data", ["--out", "{tmp}/o", "--valid_years", "-1"], "--valid_years must be >= 1"),
    ("make_synthetic_data", ["--out", "{tmp}/o", "--steps_per_year", "-4"], "--steps_per_year must be >= 2"),
    ("make_synthetic_data", ["--out", "{tmp}/o", "--seed", "-1"], "--seed must be >= 0, got -1"),
    ("make_synthetic_data", ["--out", "{tmp}/o", "--channels", "many"],
     "argument --channels: invalid int value: 'many'; see --help"),
    ("make_synthetic_data", ["--out", "{dataset}"], "already holds a dataset"),
    ("make_synthetic_data", ["--out", "{file}/o"], "cannot write the output folder"),
    ("convert_era5", ["--out", "{tmp}/o"], "the following arguments are required: --input, --variables; see --help"),
    ("convert_era5", ["--input", "{tmp}/missing.nc", "--out", "{tmp}/o", "--variables", "t"], "does not exist"),
    ("convert_era5", ["--input", "{file}", "--out", "{tmp}/o", "--variables", "t"], "as netCDF"),
    ("convert_era5", ["--input", "{tmp}", "--out", "{tmp}/o", "--variables", "t"], "is a folder"),
    ("convert_era5", [*NC_ARGS, "q"], "variable(s) q not in the input"),
    ("convert_era5", [*NC_ARGS, "--levels", "700"], "no level 700"),
    ("convert_era5", [*NC_ARGS, "--valid_fraction", "1.5"], "--valid_fraction must be between 0 and 1, got 1.5"),
    ("convert_era5", [*NC_ARGS, "--trim_to_multiple", "0"], "--trim_to_multiple must be >= 1, got 0"),
    ("convert_era5", [*NC_ARGS, "--valid_fraction", "0.5", "--valid_start", "2020-01-01"], "not allowed with"),
    ("convert_era5", ["--input", "{nc}", "--out", "{dataset}", "--variables", "t", "z"], "already holds a dataset"),
    ("convert_era5", ["--input", "{nc}", "--out", "{file}/o", "--variables", "t", "z"],
     "cannot write the output folder"),
    ("convert_era5", ["--input", "{damaged}", "--out", "{tmp}/out", "--variables", "t", "z"],
     "the file is damaged or truncated"),
]


@pytest.fixture(scope="module")
def cli_inputs(small_nc, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli_inputs")
    (root / "dataset" / layout.TRAIN).mkdir(parents=True)
    (root / "dataset" / layout.TRAIN / "2000.h5").touch()
    (root / "notes.txt").write_text("not a netCDF file\n")
    return {"nc": small_nc[0], "file": root / "notes.txt", "dataset": root / "dataset",
            "damaged": damaged_copy(small_nc[1], root / "damaged.nc")}


def test_unreadable_input_message_is_one_line(cli_inputs):
    """xarray's message spans lines; the LayoutError's must not (API callers print it too)."""
    with pytest.raises(LayoutError, match=r"cannot read .*notes\.txt as netCDF \(ValueError: [^\n]*\Z"):
        formats.open_input(cli_inputs["file"])


@pytest.mark.parametrize("tool,args,message", CLI_ERRORS, ids=[f"{t}:{m}" for t, _, m in CLI_ERRORS])
def test_cli_bad_input_is_one_error_line(cli_inputs, tmp_path, tool, args, message, forking_python):
    argv = [a.format(tmp=tmp_path, **cli_inputs) for a in args]
    run = forking_python.run(["-m", f"tools.{tool}", *argv], dict(os.environ), timeout=120)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.splitlines()) == 1 and run.stderr.startswith("error: "), run.stderr
    assert "Traceback" not in run.stderr and message in run.stderr, run.stderr


def test_parse_select():
    assert plan.parse_select(["expver=1", "step=0"]) == {"expver": 1, "step": 0}
    with pytest.raises(LayoutError, match="DIM=INDEX"):
        plan.parse_select(["expver"])


# ---------------------------------------------------------------- the real ERA5 sample

def test_convert_real_sample(tmp_path):
    summary = convert.convert(REAL_SAMPLE, tmp_path, ["t", "z"], [850, 500], trim_to_multiple=4,
                                   verbose=False)
    assert summary["channels"] == ["t850", "t500", "z850", "z500"]
    assert summary["samples"] == {"train": 10, "valid": 10}
    # one training day: the summary says what a model can learn from it (docs/data.md)
    assert any(n.startswith("training has 1 distinct initial time(s), 2017-01-01T00:00:00 (the same for all 10 "
                            "members): a model learns the change over one step (12 hours) from those times only")
               for n in summary["notes"]), summary["notes"]
    files = layout.split_files(tmp_path, "valid")
    assert len(files) == 10 and files[3].name == "2017_m03.h5"
    with h5py.File(files[3], "r") as f:
        fields, lat = f[layout.FIELDS][:], f[layout.LATITUDE][:]
    assert fields.shape == (2, 4, 60, 120) and lat[0] == 90.0 and np.all(np.diff(lat) < 0)
    with xr.open_dataset(REAL_SAMPLE) as ds:
        direct = ds["z"].sel(number=3, isobaricInhPa=500).isel(time=3).values  # last time: valid step 1
    np.testing.assert_array_equal(fields[1, 3], direct[:60].astype(np.float32))
    assert np.all(np.isfinite(np.load(tmp_path / "stats" / "global_stds.npy")))
