"""Forcings and static fields end to end: a run trained with them, scored by ``evaluate.py`` as its validation
scored it, forecast by the ``Forecaster`` (from the run and from the self-contained model file) as ``evaluate.py
--save_forecasts`` saved, and the bad inputs: an unknown forcing, a static file of another grid, a state without
a time for a model that needs one."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from tests.dist_utils import launch_entry
from tests.jobs import run_job
from tests.multiprocess.test_forcings_training import write_static

ROOT = Path(__file__).resolve().parents[2]
FORCINGS = ["cos_solar_zenith_angle", "sin_local_time", "cos_local_time", "sin_julian_day", "cos_julian_day"]
LEADS = 3


def args(static: Path) -> list[str]:
    return ["--num_iters", "16", "--limit_nsamples_val", "null", "--valid_rollout_steps", str(LEADS),
            "--forcings", f"[{','.join(FORCINGS)}]", "--static_fields", "[lsm,z]", "--static_path", str(static),
            "--residual", "true", "--key_channels", "[u10m,t2m]"]


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("forcings")
    write_static(work / "static.h5", tiny_data)
    (status, out, err), = run_job(work, tiny_data, args(work / "static.h5"), 1)
    assert status == 0, err[-3000:]
    (run_dir,) = (work / "runs" / "tiny").glob("1*/00")
    return run_dir


@pytest.fixture(scope="module")
def evaluated(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluated")
    (proc,) = launch_entry(ROOT / "evaluate.py", ["--run_dir", str(run), "--lead_steps", str(LEADS),
                                                  "--save_forecasts", "--out", str(out)], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_training_names_the_roles_and_evaluate_scores_as_validation_did(run, evaluated):
    out, stdout = evaluated
    roles = f"inputs: 4 prognostic, forcings {', '.join(FORCINGS)}, static lsm, z"
    assert roles in (run / "out.log").read_text() and roles in stdout
    card = json.loads((out / "scorecard.json").read_text())
    assert card["inputs"] == roles
    want = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["scorecard"]
    assert card["initial_times"] == want["initial_times"]
    for ch in ("u10m", "t2m"):  # the same forcings for the same valid times: the same scores
        np.testing.assert_allclose(card["scores"]["model"]["rmse"][ch], want["scores"]["model"]["rmse"][ch],
                                   rtol=1e-5)
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["forcings"] == FORCINGS and config["static_fields"] == ["lsm", "z"]


def test_forecaster_computes_the_forcings_of_each_valid_time(run, evaluated, tiny_data):
    from training.evaluation.forecast import Forecaster
    out, _ = evaluated
    with xr.open_dataarray(out / "forecasts.nc", decode_times=xr.coders.CFDatetimeCoder(use_cftime=True)) as da:
        saved = da.load()
    (path,) = sorted((tiny_data / "valid").glob("*.h5"))
    for forecaster in (Forecaster.from_run(run), Forecaster.from_file(run / "checkpoints" / "model.pt")):
        state = Forecaster.read_state(path, 5)
        assert state.time.item() == saved.init_time.values[5]
        forecast = forecaster.forecast(state, LEADS)
        for ch in ("u10m", "t2m"):
            want = saved.isel(init_time=5).sel(channel=ch).values
            got = forecast[ch].transpose("lead_time", "latitude", "longitude").values
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
        # the same state dated 6 hours later: other forcings, another forecast
        later = forecaster.forecast(state.assign_coords(time=state.time.item() + timedelta(hours=6)), 1)
        assert not np.allclose(later["t2m"].values, forecast["t2m"].isel(lead_time=0).values)


def test_the_model_file_carries_the_static_fields_and_needs_a_time(run, tiny_data):
    from training.evaluation.forecast import Forecaster
    from utils.core.errors import UserError
    from utils.data.static import read_static
    package = torch.load(run / "checkpoints" / "model.pt", map_location="cpu", weights_only=True)
    lat, lon = package["grid"]["latitude"].numpy(), package["grid"]["longitude"].numpy()
    want = read_static(run.parents[3] / "static.h5", ["lsm", "z"], lat, lon)
    assert torch.equal(package["static"], torch.from_numpy(want))
    state = Forecaster.read_state(sorted((tiny_data / "valid").glob("*.h5"))[0], 0).drop_vars("time")
    with pytest.raises(UserError, match="trained with the forcings cos_solar_zenith_angle.*needs a time coordinate"):
        Forecaster.from_file(run / "checkpoints" / "model.pt").forecast(state, 1)


@pytest.mark.parametrize("bad,message", [
    (["--forcings", "[cos_zenith]"], "unknown forcing 'cos_zenith'; did you mean cos_solar_zenith_angle"),
    (["--static_fields", "[lsm]"], "another grid"),
], ids=["unknown forcing", "static file of another grid"])
def test_bad_inputs_are_one_line_before_anything_is_written(tiny_data, tmp_path, bad, message):
    import h5py
    other = tmp_path / "static.h5"
    with h5py.File(other, "w") as f:  # a 1-degree grid, not the tiny data's
        f["latitude"], f["longitude"] = np.linspace(90, 59, 32), np.arange(64.0)
        f["lsm"] = np.zeros((32, 64), np.float32)
        f["lsm"].attrs.update(mean=0.0, std=1.0, units="1")
    (status, out, err), = run_job(tmp_path, tiny_data, [*bad, "--static_path", str(other)], 1)
    assert status == 2 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()
