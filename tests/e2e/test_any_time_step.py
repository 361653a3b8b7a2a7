"""Any time step, end to end: monthly means in a 360_day calendar and annual means in the standard calendar, written
as netCDF here, convert (``tools.convert_era5``), train with ``--config tiny`` plus the flags docs/evaluation.md
names for one's own data, and evaluate with lead times in months and years; the DALI loader reads the same
samples across the file boundaries as the native one."""

from __future__ import annotations

import json
from pathlib import Path

import cftime
import h5py
import numpy as np
import pytest
import torch
import xarray as xr

from tests.dist_utils import launch_entry, subprocess_env
from tests.forked import run_forked

ROOT = Path(__file__).resolve().parents[2]
GRID = (16, 32)
VARIABLES = ("tas", "pr", "psl", "ua")
CASES = {  # name: (calendar, times, --valid_start, unit, steps a file)
    "monthly": ("360_day", [cftime.datetime(1850 + m // 12, m % 12 + 1, 16, calendar="360_day") for m in range(96)],
                "1856-01-01", "months", 12),
    # annual means stamped mid-year: 12 hours earlier in leap years (the mid-point of 366 days)
    "annual": ("standard", [cftime.datetime(1850 + y, 7, 2, 0 if (1850 + y) % 4 == 0 else 12, calendar="standard")
                            for y in range(48)], "1886-01-01", "years", 1),
}


def climate_model_output(times, calendar: str) -> xr.Dataset:
    """Four smooth fields with a seasonal cycle, a travelling wave, a trend and weather noise."""
    lat = np.linspace(-84.375, 84.375, GRID[0])  # south to north, as climate models write it
    lon = np.arange(GRID[1]) * 360.0 / GRID[1]
    n = len(times)
    rng = np.random.default_rng(1)
    phi, lam, t = np.deg2rad(lat)[None, :, None], np.deg2rad(lon)[None, None, :], np.arange(n)[:, None, None]
    season = np.array([np.sin(2 * np.pi * (d.month - 1) / 12) for d in times])[:, None, None]
    data = {}
    for i, (name, units) in enumerate(zip(VARIABLES, ("K", "mm day-1", "hPa", "m s-1"))):
        field = (280 + 10 * i) * np.cos(phi) + 5 * season * np.sin(phi) + 3 * np.cos(2 * lam - 0.3 * t + i) \
            + 0.02 * t + rng.standard_normal((n, *GRID))
        data[name] = (("time", "lat", "lon"), field.astype(np.float32), {"units": units})
    units = "days since 1850-01-01"
    time = xr.Variable("time", cftime.date2num(times, units, calendar), {"units": units, "calendar": calendar})
    return xr.Dataset(data, coords={"time": time, "lat": lat, "lon": lon})


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    calendar, times, valid_start, _, _ = CASES[name]
    work = tmp_path_factory.mktemp(name)
    climate_model_output(times, calendar).to_netcdf(work / f"{name}.nc")
    proc = run_forked(["-m", "tools.convert_era5", "--input", str(work / f"{name}.nc"), "--out", str(work / "data"),
                       "--variables", *VARIABLES, "--valid_start", valid_start, "--trim_to_multiple", "4"], ROOT,
                      subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return name, work / "data"


def test_conversion_keeps_the_step_in_its_unit(converted):
    name, data = converted
    calendar, times, _, unit, per_file = CASES[name]
    files = sorted((data / "train").glob("*.h5"))
    assert len(files) == 6 if name == "monthly" else len(files) == 36
    with h5py.File(files[0], "r") as f:
        attrs = f["fields"].attrs
        assert f["fields"].shape == (per_file, 4, *GRID) and attrs["time_step_unit"] == unit
        assert float(attrs["time_step"]) == 1.0 and "dt_hours" not in attrs and attrs["calendar"] == calendar
        assert list(attrs["channel_units"]) == ["K", "mm day-1", "hPa", "m s-1"]
    with h5py.File(data / "stats" / "climatology.h5", "r") as f:
        assert f["climatology"].shape[0] == (360 if calendar == "360_day" else 366)


# the flags docs/evaluation.md names for one's own data (with this data's sizes, and few iterations)
def own_data_flags(data: Path) -> list[str]:
    return ["--config", "tiny", "--data_path", str(data), "--n_in_channels", "4", "--n_out_channels", "4",
            "--img_size", f"[{GRID[0]},{GRID[1]}]", "--num_iters", "12", "--valid_every", "2",
            "--valid_rollout_steps", "3", "--key_channels", "[tas,pr]"]


def test_trains_and_evaluates_with_leads_in_its_unit(converted, tmp_path):
    name, data = converted
    unit = CASES[name][3]
    (train,) = launch_entry(ROOT / "train.py", [*own_data_flags(data), "--expdir", str(tmp_path / "runs")], tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    run = tmp_path / "runs" / "tiny" / "1CPU" / "00"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    card = records[-1]["scorecard"]
    assert card["lead_time"] == [1.0, 2.0, 3.0] and card["lead_time_unit"] == unit and card["lead_hours"] is None
    assert card["climatology"].startswith("climatology.h5")
    label = {"months": "mo", "years": "y"}[unit]
    assert f"rmse_by_lead/tas/003{label}" in records[-1] and f"bias_by_lead/pr/001{label}" in records[-1]
    assert all(np.isfinite(card["scores"]["model"]["rmse"]["tas"]))
    (ev,) = launch_entry(ROOT / "evaluate.py", ["--run_dir", str(run), "--lead_steps", "4"], tmp_path)
    assert ev.returncode == 0, ev.stderr[-3000:]
    scorecard = json.loads((run / "evaluation" / "scorecard.json").read_text())
    assert scorecard["lead_time"] == [1.0, 2.0, 3.0, 4.0] and scorecard["lead_time_unit"] == unit
    assert f"004{label}" in ev.stdout and "summary:" in ev.stdout


def test_dali_reads_the_native_samples_across_files(converted):
    pytest.importorskip("nvidia.dali")
    from utils.config.loading import load_config
    from utils.data.loaders import build_data
    name, data = converted
    if name != "monthly":
        pytest.skip("one calendar is enough for the loaders")
    made = []
    for loader in ("dali", "pytorch"):
        overrides = {"data_path": str(data), "data_loader_config": loader, "img_size": f"[{GRID[0]},{GRID[1]}]",
                     "num_data_workers": "2" if loader == "dali" else "0"}
        cfg = load_config(ROOT / "config" / "ViT.yaml", "tiny", overrides)
        made.append(build_data(cfg.data, 8, 0, 1, torch.device("cpu"), seed=0, valid_target_steps=13))
    try:
        dali, native = made
        assert dali.train_dataset.runs[0].files == list(range(6))  # one run over the six years
        for split in ("train", "valid"):
            got, want = list(getattr(dali, split)), list(getattr(native, split))
            assert len(got) == len(want) > 0
            for (a, b, i), (c, d, j) in zip(got, want):
                assert torch.equal(i, j) and torch.equal(a, c) and torch.equal(b, d)
        # 13 targets from the first validation month: they run into the second validation year
        assert native.valid_dataset.describe(0) == "valid/1856.h5 time 0 -> 1..11, 1857.h5 time 0..1"
    finally:
        for d in made:
            d.close()
