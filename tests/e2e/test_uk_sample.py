"""The shipped hourly ERA5 sample (``samples/era5-2mt-2019-03-uk.grib``, source and licence in samples/README.md)
converts with ``make uk_sample``'s flags into what the ``era5_uk`` config expects, and reading it leaves
``samples/`` as it was (cfgrib writes no ``.idx`` index beside it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from utils.data import layout

pytest.importorskip("cfgrib")
pytest.importorskip("cftime")

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples"
SAMPLE = SAMPLES / "era5-2mt-2019-03-uk.grib"
MD5 = "eae4f0d198f4f6c16ba950975a217155"  # the file of pydata/xarray-data, as it is
MAKE_FLAGS = ["--variables", "t2m", "--valid_start", "2019-03-25", "--trim_to_multiple", "8", "--overwrite"]


def tree(folder: Path) -> dict[str, tuple[int, float]]:
    """Name -> (size, modification time) of everything under ``folder``: what a read must not change."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime) for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[dict, Path, dict, dict]:
    """(summary, output folder, samples/ before, samples/ after) of the conversion ``make uk_sample`` runs."""
    from tools.convert_era5 import build_parser
    from utils.preprocess.convert import convert

    out = tmp_path_factory.mktemp("uk") / "era5_uk"
    args = build_parser().parse_args(["--input", str(SAMPLE), "--out", str(out), *MAKE_FLAGS])
    before = tree(SAMPLES)
    summary = convert(args.input, args.out, args.variables, args.levels, valid_start=args.valid_start,
                      trim_to_multiple=args.trim_to_multiple, overwrite=args.overwrite, verbose=False)
    return summary, out, before, tree(SAMPLES)


def test_the_sample_is_the_published_file():
    assert hashlib.md5(SAMPLE.read_bytes()).hexdigest() == MD5


def test_nothing_is_written_into_samples(converted):
    _, _, before, after = converted
    assert after == before
    assert not list(SAMPLES.glob("*.idx"))


def test_split_counts_and_times(converted):
    summary, _, _, _ = converted
    assert summary["samples"] == {"train": 575, "valid": 167}  # 24 x 24 - 1 and 7 x 24 - 1 hourly pairs
    assert summary["time_step"] == "1 hours" and summary["dt_hours"] == 1.0
    assert summary["time_range"] == {"train": ("2019-03-01T00:00:00", "2019-03-24T23:00:00"),
                                     "valid": ("2019-03-25T00:00:00", "2019-03-31T23:00:00")}
    assert summary["files"] == {"train": [("2019.h5", 576)], "valid": [("2019.h5", 168)]}


def test_grid_in_degrees_east(converted):
    """The 33 x 49 grid of 58..50 N and 10 W..2 E, trimmed to 32 x 48: the southernmost row (50 N) and the
    easternmost column (2 E) go. Longitudes stay as the file has them, -10 .. 1.75 degrees east: what the
    forcings of solar time need."""
    summary, out, _, _ = converted
    latitude, longitude = 58.0 - 0.25 * np.arange(32), -10.0 + 0.25 * np.arange(48)
    assert summary["grid"] == (32, 48)
    for split in layout.SPLITS:
        with h5py.File(out / split / "2019.h5", "r") as f:
            np.testing.assert_allclose(f[layout.LATITUDE][:], latitude, atol=1e-9)
            np.testing.assert_allclose(f[layout.LONGITUDE][:], longitude, atol=1e-9)


def test_t2m_in_kelvin(converted):
    _, out, _, _ = converted
    for split, steps in ((layout.TRAIN, 576), (layout.VALID, 168)):
        with h5py.File(out / split / "2019.h5", "r") as f:
            fields = f[layout.FIELDS]
            assert fields.shape == (steps, 1, 32, 48) and fields.dtype == np.float32
            assert list(fields.attrs[layout.ATTR_CHANNEL_NAMES]) == ["t2m"]
            assert list(fields.attrs[layout.ATTR_CHANNEL_UNITS]) == ["K"]
            assert fields.attrs[layout.ATTR_START_TIME] == f"2019-03-{1 if split == layout.TRAIN else 25:02d}T00:00:00"
            values = fields[:]
            assert np.isfinite(values).all() and 260 < values.min() and values.max() < 295
    mean = float(np.load(out / layout.STATS / layout.GLOBAL_MEANS).squeeze())
    assert 275 < mean < 285  # March over the British Isles: a few degrees Celsius
