"""The climatology by day of year and hour of day (utils/data/climatology.py, stats/climatology.h5) and what is
scored against it:

* the file the synthetic generator writes and ``tools.make_climatology`` recomputes against an independent xarray
  reference: ``groupby`` day of year per hour of day, years stacked and smoothed WeatherBench 2's way;
* day 366, calendars, and every reader problem as a one-line error naming the file;
* ACC, RMSE and bias of rollouts against the climatology of each valid time, checked with the ``scores``
  verification library (Bureau of Meteorology) on the reference climatology; the fallback to the time mean.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import cftime
import h5py
import numpy as np
import pytest
import scores.continuous as scores_continuous  # the dev extra: an independent verification library
import torch
import xarray as xr

from utils.core.errors import UserError
from utils.data.climatology import Climatology
from utils.preprocess.climatology_builder import (ClimatologyAccumulator, climatology_bytes, climatology_fits,
                                                  window_weights)
from utils.data.dataset import ERA5Dataset
from utils.preprocess.synthetic_dataset import make_synthetic_dataset
from utils.data.layout import CLIMATOLOGY
from utils.data.loaders import split_batches
from utils.data.metadata import read_metadata
from utils.data.stats import TIME_MEANS_SOURCE, Stats
from training.evaluation.metrics import latitude_weights, spectrum_rows
from training.evaluation.scoring import score_rollouts
from utils.config.schema import DataConfig

REPO = Path(__file__).resolve().parents[2]
C, IMG, STEPS = 2, (8, 16), 40  # 40 six-hourly steps a year: 10 days from Jan 1


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_synthetic_dataset(tmp_path_factory.mktemp("clim") / "data", channels=C, img_size=IMG, train_years=3,
                                  valid_years=1, steps_per_year=STEPS, seed=3)


def open_split(root: Path, split: str) -> xr.DataArray:
    """Every file of a split as one DataArray (time, channel, lat, lon), times decoded with cftime."""
    parts = []
    for path in sorted((root / split).glob("*.h5")):
        with h5py.File(path, "r") as f:
            fields = f["fields"]
            start, hours = fields.attrs["start_time"], float(fields.attrs["dt_hours"])
            times = cftime.num2date(np.arange(fields.shape[0]) * hours, f"hours since {start}", "standard")
            parts.append(xr.DataArray(fields[()], dims=("time", "channel", "lat", "lon"), coords={"time": times}))
    return xr.concat(parts, "time")


def reference_climatology(train: xr.DataArray, window: int = 61) -> np.ndarray:
    """WeatherBench 2's method written with xarray: per hour of day, stack the years by day of year (``groupby``),
    fill day 366 of a common year with its day 365, pad circularly, weighted rolling mean over (window, year);
    where the window holds no data, the mean of all steps. Returns (366, hours, C, H, W)."""
    weights = xr.DataArray(window_weights(window), dims="window")
    out = []
    for hour in np.unique(train.time.dt.hour):
        at_hour = train.isel(time=train.time.dt.hour == hour)
        years = [g.groupby("time.dayofyear").mean().reindex(dayofyear=np.arange(1, 367))
                 for _, g in at_hour.groupby("time.year")]
        stacked = xr.concat(years, "year")
        stacked = stacked.fillna(stacked.sel(dayofyear=365))
        padded = stacked.pad(dayofyear=window // 2, mode="wrap")
        rolled = padded.rolling(dayofyear=window, center=True).construct("window")
        smooth = rolled.weighted(weights.where(weights > 0, 0)).mean(("window", "year"))
        out.append(smooth.isel(dayofyear=slice(window // 2, -(window // 2))).fillna(train.mean("time")))
    return np.stack([o.transpose("dayofyear", "channel", "lat", "lon").values for o in out], axis=1)


def read_file(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    with h5py.File(path, "r") as f:
        return f["climatology"][()], f["hour"][()], dict(f["climatology"].attrs)


def test_climatology_matches_an_xarray_groupby_reference(data):
    values, hours, attrs = read_file(data / "stats" / CLIMATOLOGY)
    train = open_split(data, "train")
    want = reference_climatology(train)
    assert values.shape == (366, 4, C, *IMG) and hours.tolist() == [0.0, 6.0, 12.0, 18.0]
    assert attrs["calendar"] == "standard" and int(attrs["window_days"]) == 61
    assert list(attrs["years"]) == [2000, 2001, 2002]
    np.testing.assert_allclose(values, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    # the smoothing matters: Jan 5 is not the plain mean of the Jan 5 fields, and the window wraps to late December
    jan5 = train.isel(time=(train.time.dt.dayofyear == 5) & (train.time.dt.hour == 12)).mean("time").values
    assert not np.allclose(values[4, 2], jan5, rtol=1e-4)
    assert not np.allclose(values[360, 0], train.mean("time").values, rtol=1e-6)  # reached from Jan 1..10
    time_mean = train.mean("time").values
    # no data within 30 days of day 201: the time mean
    np.testing.assert_allclose(values[200, 1], time_mean, rtol=1e-5, atol=1e-6 * np.abs(time_mean).max())


def test_the_data_tools_build_the_climatology_only_where_it_fits_memory():
    """The smoothed result (366 days x hours of day) counts, not only the sums: 64 steps of 20 fields at 0.5
    degrees need 28 GiB of float32 for it at their 4 hours of day, which the synthetic generator once allocated
    (a MemoryError)."""
    assert climatology_fits(96, (4, 32, 64))
    assert climatology_bytes(64, (20, 360, 720)) == (64 * 8 + 366 * 24 * 4) * 20 * 360 * 720
    assert not climatology_fits(64, (20, 360, 720))
    assert climatology_fits(64, (20, 360, 720), budget=climatology_bytes(64, (20, 360, 720)))


def test_make_climatology_tool_recomputes_the_same_file(data, tmp_path):
    before = read_file(data / "stats" / CLIMATOLOGY)[0]
    copy = tmp_path / "data"
    for split in ("train", "stats"):
        (copy / split).mkdir(parents=True)
        for f in (data / split).iterdir():
            if f.name != CLIMATOLOGY:
                (copy / split / f.name).write_bytes(f.read_bytes())
    proc = subprocess.run([sys.executable, "-m", "tools.make_climatology", str(copy), "--max_memory_gib", "1e-4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "channels u10m:" in proc.stdout and "channels v10m:" in proc.stdout  # one channel per pass at this budget
    np.testing.assert_array_equal(read_file(copy / "stats" / CLIMATOLOGY)[0], before)


def test_day_366_takes_day_365_of_a_common_year_and_calendars_set_the_days():
    acc = ClimatologyAccumulator("standard")
    field = np.full((1, 1, 2, 2), 7.0, np.float32)
    acc.update(field, [cftime.datetime(2001, 12, 31, calendar="standard")])  # day 365 of a common year
    acc.update(field * 3, [cftime.datetime(2004, 12, 31, calendar="standard")])  # day 366 of a leap year
    assert acc.counts == {(364, 0.0): 1, (365, 0.0): 2}
    assert acc.sums[(365, 0.0)][0, 0, 0] == 28.0
    for calendar, days in (("360_day", 360), ("noleap", 365), ("all_leap", 366), ("julian", 366)):
        assert ClimatologyAccumulator(calendar).days == days
    acc = ClimatologyAccumulator("360_day")
    acc.update(field, [cftime.datetime(1850, 2, 30, calendar="360_day")])
    assert list(acc.sums) == [(59, 0.0)]
    with pytest.raises(ValueError, match="360_day datetime per time step"):
        acc.update(field, [cftime.datetime(1850, 1, 1, calendar="noleap")])


def damage(path: Path, how: str) -> None:
    if how == "garbage":
        path.write_bytes(b"not hdf5 at all")
        return
    with h5py.File(path, "r+") as f:
        if how == "no hour":
            del f["hour"]
        elif how == "channels":
            values = f["climatology"][:, :, :1]
            del f["climatology"]
            f.create_dataset("climatology", data=values).attrs["calendar"] = "standard"
        elif how == "no calendar":
            del f["climatology"].attrs["calendar"]
        elif how == "nan":
            f["climatology"][3, 1, 0, 2, 2] = np.nan


@pytest.mark.parametrize("how,problem", [("garbage", "cannot read .* as a climatology"), ("no hour", "no dataset hour"),
                                         ("channels", r"expected floats of shape \(366, 4, 2, H, W\)"),
                                         ("no calendar", "no 'calendar' attribute"), ("nan", "NaN/Inf")])
def test_a_bad_climatology_file_is_a_one_line_error_naming_it(data, tmp_path, how, problem):
    stats = tmp_path / "stats"
    stats.mkdir()
    for f in (data / "stats").iterdir():
        (stats / f.name).write_bytes(f.read_bytes())
    damage(stats / CLIMATOLOGY, how)
    with pytest.raises(UserError, match=problem) as exc:
        Stats.load(stats, C, IMG, "cpu").climatology.read(np.arange(4))
    message = str(exc.value)
    assert "\n" not in message and str(stats / CLIMATOLOGY) in message and "tools.make_climatology" in message


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(C, C, 3, padding=1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))

    def forward(self, x):
        return x + self.conv(x)


def test_acc_rmse_and_bias_against_the_scores_library(data):
    """Rollouts of a toy model on the validation year, scored by ``score_rollouts`` with the climatology of each valid
    time, against the same scores computed with ``scores`` (weighted MSE and mean error; ACC from the
    weighted second moments of the anomalies) on the xarray reference climatology."""
    k, every = 3, 3
    cfg = DataConfig(data_path=str(data), img_size=IMG, n_in_channels=C, n_out_channels=C)
    stats = Stats.load(data / "stats", C, IMG, "cpu")
    batches, dataset = split_batches(cfg, "valid", 5, 0, 1, torch.device("cpu"), target_steps=k, init_every=every,
                                     stats=stats)
    _, lat = read_metadata(dataset.files[0].path, C, IMG[0])
    model = Toy().eval()
    sums, _ = score_rollouts(model, batches, stats, latitude_weights(lat), k, contextlib.nullcontext,
                             climatology=stats.sample_climatology(dataset), rows=torch.as_tensor(spectrum_rows(lat)))
    batches.close()
    card = sums.scorecard(stats.std, [6.0, 12.0, 18.0], ["u10m", "v10m"], climatology=stats.climatology_source(dataset))
    assert card.climatology.startswith("climatology.h5: mean by day of year")

    # the reference: states read with h5py, the model applied by hand, the xarray reference climatology
    clim = reference_climatology(open_split(data, "train"))
    valid = open_split(data, "valid")
    mean, std = stats.mean[0].numpy(), stats.std[0].numpy()
    inits = np.arange(0, valid.sizes["time"] - k, every)
    x = torch.from_numpy((valid.values[inits] - mean) / std).float()
    with torch.no_grad():
        preds = torch.stack([x := model(x) for _ in range(k)], 1).numpy() * std + mean  # (init, lead, C, H, W)
    valid_at = inits[:, None] + np.arange(1, k + 1)[None, :]
    times = valid.time.values[valid_at]
    dims = ("init", "lead", "channel", "lat", "lon")
    as_da = lambda v: xr.DataArray(np.asarray(v, np.float64), dims=dims)  # noqa: E731
    c = as_da([[clim[t.dayofyr - 1, t.hour // 6] for t in row] for row in times])
    fc, obs = as_da(preds), as_da(valid.values[valid_at])
    pers = as_da(np.repeat(valid.values[inits][:, None], k, 1))
    weights = xr.DataArray(latitude_weights(lat).numpy().astype(np.float64), dims="lat")
    mse = lambda u, v: scores_continuous.mse(u, v, reduce_dims=["lat", "lon"], weights=weights)  # noqa: E731

    def acc(forecast):  # <a, b> / |a| |b| from weighted mean squares: 2<a, b> = |a|^2 + |b|^2 - |a - b|^2
        a, b = forecast - c, obs - c
        zero = xr.zeros_like(a)
        return ((mse(a, zero) + mse(b, zero) - mse(a, b)) / (2 * np.sqrt(mse(a, zero) * mse(b, zero)))).mean("init")

    assert card.initial_times == inits.size == len(range(0, STEPS - k, every))
    table = lambda f, m: np.array([card.scores[f][m][ch] for ch in ("u10m", "v10m")]).T  # noqa: E731
    np.testing.assert_allclose(table("model", "acc"), acc(fc).values, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(table("persistence", "acc"), acc(pers).values, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(table("model", "rmse"), np.sqrt(mse(fc, obs).mean("init")).values, rtol=1e-4)
    np.testing.assert_allclose(table("climatology", "rmse"), np.sqrt(mse(c, obs).mean("init")).values, rtol=1e-4)
    bias = scores_continuous.mean_error(fc, obs, reduce_dims=["lat", "lon"], weights=weights).mean("init")
    np.testing.assert_allclose(table("model", "bias"), bias.values, rtol=1e-3, atol=1e-4 * std.max())


def test_without_the_file_the_time_mean_is_used_and_named(data, tmp_path):
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    for name in ("global_means.npy", "global_stds.npy", "time_means.npy"):
        (stats_dir / name).write_bytes((data / "stats" / name).read_bytes())
    stats = Stats.load(stats_dir, C, IMG, "cpu")
    dataset = ERA5Dataset(data / "valid", C, IMG, 1)
    assert stats.climatology is None and stats.sample_climatology(dataset) is None
    assert stats.climatology_source(dataset) == TIME_MEANS_SOURCE
    # with the file: the lookup returns the normalized climatology of each target's valid time
    full = Stats.load(data / "stats", C, IMG, "cpu")
    lookup = full.sample_climatology(ERA5Dataset(data / "valid", C, IMG, 1, target_steps=2))
    got = lookup(torch.tensor([0, 5]))
    assert got.shape == (2, 2, C, *IMG)
    values = read_file(data / "stats" / CLIMATOLOGY)[0]
    # sample 5 of 2003.h5: input 2003-01-02T06, targets 12:00 and 18:00 of day 2
    want = (values[1, 3] - full.mean[0].numpy()) / full.std[0].numpy()
    np.testing.assert_allclose(got[1, 1].numpy(), want, rtol=1e-5, atol=1e-5)
    clim = Climatology(data / "stats" / CLIMATOLOGY, C, IMG)
    assert clim.cells([cftime.datetime(2003, 1, 2, 17, calendar="standard")]).tolist() == [1 * 4 + 3]  # nearest hour
    with pytest.raises(UserError, match="in the standard calendar but a sample is valid at"):
        clim.cells([cftime.datetime(2003, 1, 2, calendar="360_day")])
