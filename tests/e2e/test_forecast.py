"""Forecasts from Python (training/evaluation/forecast.py) and the self-contained model file:

* ``Forecaster.from_run`` and ``Forecaster.from_file`` forecast what ``evaluate.py --save_forecasts`` saved;
* ``checkpoints/model.pt`` is plain data (``torch.load(weights_only=True)``) holding the config section by
  section, normalization, channels, grid, time step and calendar, and forecasts with its data folder gone;
* ``evaluate.py --run_dir <absolute path>`` from another directory; the notebook-style example of docs/ runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from tests.dist_utils import launch_entry, subprocess_env
from tests.forked import run_forked
from tests.jobs import reference_run

ROOT = Path(__file__).resolve().parents[2]
# the arguments of ROLLOUT_RUN in tests/e2e/test_evaluation.py: a session running both trains the run once
RUN = ["--num_iters", "16", "--limit_nsamples_val", "null", "--valid_rollout_steps", "3",
       "--key_channels", "[u10m,t2m]", "--figure_every", "2"]
LEADS = 4


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory, tiny_data, RUN, 1)()


@pytest.fixture(scope="module")
def saved(run, tmp_path_factory) -> xr.DataArray:
    """evaluate.py's forecasts of the run, evaluated from a directory that is neither the repository nor the run's."""
    out = tmp_path_factory.mktemp("saved")
    args = ["--run_dir", str(run), "--lead_steps", str(LEADS), "--init_every", "9", "--save_forecasts",
            "--out", str(out)]
    (proc,) = launch_entry(ROOT / "evaluate.py", args, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with xr.open_dataarray(out / "forecasts.nc", decode_times=xr.coders.CFDatetimeCoder(use_cftime=True)) as da:
        return da.load()


def valid_file(run: Path) -> Path:
    from utils.config.loading import load_run_config
    (path,) = sorted((Path(load_run_config(run).data.data_path) / "valid").glob("*.h5"))
    return path


def assert_same_forecast(forecast: xr.Dataset, saved: xr.DataArray, init: int) -> None:
    want = saved.isel(init_time=init)
    assert list(forecast.lead_time.values) == list(want.lead_time.values) == [6.0, 12.0, 18.0, 24.0]
    np.testing.assert_array_equal(forecast.latitude.values, want.latitude.values)
    for ch in want.channel.values:
        got = forecast[str(ch)].transpose("lead_time", "latitude", "longitude").values
        scale = float(np.abs(want.sel(channel=ch)).max())
        np.testing.assert_allclose(got, want.sel(channel=ch).values, rtol=1e-5, atol=1e-5 * scale, err_msg=str(ch))


def test_forecaster_equals_the_saved_forecasts(run, saved):
    from training.evaluation.forecast import Forecaster
    path = valid_file(run)
    for forecaster in (Forecaster.from_run(run), Forecaster.from_file(run / "checkpoints" / "model.pt")):
        assert forecaster.step == 16 and forecaster.channels == ["u10m", "v10m", "t2m", "sp"]
        for init in (0, 2):  # --init_every 9: initial times 0 and 18 of the validation file
            state = Forecaster.read_state(path, 9 * init)
            assert state.time.item() == saved.init_time.values[init]
            forecast = forecaster.forecast(state, LEADS)
            assert_same_forecast(forecast, saved, init)
            assert forecast["t2m"].attrs["units"] == "K" and forecast.lead_time.attrs["units"] == "hours"
            assert forecast.valid_time.values[-1] == state.time.item() + timedelta(hours=6 * LEADS)
    # several initial times at once, along a leading dimension of the input
    states = xr.concat([Forecaster.read_state(path, t) for t in (0, 9)], "time")
    both = forecaster.forecast(states, LEADS, batch_size=1)
    assert both["sp"].dims == ("time", "lead_time", "latitude", "longitude")
    assert_same_forecast(both.isel(time=1), saved, 1)


def test_model_file_is_self_contained_plain_data(run, tmp_path):
    package = torch.load(run / "checkpoints" / "model.pt", map_location="cpu", weights_only=True)
    assert package["format"] == "era5-vit model package 1" and package["step"] == 16
    assert set(package["config"]) >= {"name", "model", "data", "optim", "evaluation"}
    assert package["config"]["model"]["embed_dim"] == 64 and package["config"]["data"]["img_size"] == [32, 64]
    assert package["channels"] == ["u10m", "v10m", "t2m", "sp"] and package["channel_units"][2] == "K"
    assert package["normalization"]["mean"].shape == (4,) and package["grid"]["latitude"].shape == (32,)
    assert package["grid"]["longitude"][1].item() == 5.625
    assert package["time"] == {"step": 6.0, "unit": "hours", "dt": 1, "calendar": "standard", "step_hours": 6.0}
    assert "climatology.h5" in package["climatology"]["note"]  # 48 MiB: left out, and said so
    # no data folder and no run directory: the file alone forecasts (its config's data path points nowhere)
    package["config"]["data"]["data_path"] = str(tmp_path / "gone")
    torch.save(package, tmp_path / "model.pt")
    state = xr.Dataset({ch: (("latitude", "longitude"), np.full((32, 64), v, np.float32))
                        for ch, v in zip(package["channels"], (1.0, -1.0, 280.0, 1.0e5))},
                       coords={"latitude": package["grid"]["latitude"].numpy(),
                               "longitude": package["grid"]["longitude"].numpy()})
    state.to_netcdf(tmp_path / "state.nc")
    script = ("import sys, xarray as xr\n"
              f"sys.path.insert(0, {str(ROOT)!r})\n"
              "from training.evaluation.forecast import Forecaster\n"
              "f = Forecaster.from_file('model.pt')\n"
              "out = f.forecast(xr.open_dataset('state.nc'), 2)\n"
              "print('OK', out['t2m'].shape, float(out['t2m'].mean()))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK (2, 32, 64)" in proc.stdout


def test_an_old_model_file_is_a_clear_error(run, tmp_path):
    from utils.core.errors import UserError
    from training.evaluation.forecast import Forecaster
    package = torch.load(run / "checkpoints" / "model.pt", map_location="cpu", weights_only=True)
    torch.save({"model": package["model"], "step": 16, "config": {"lr": 1.0}}, tmp_path / "old.pt")
    with pytest.raises(UserError, match="not a self-contained model file .* python -m tools.export_model"):
        Forecaster.from_file(tmp_path / "old.pt")
    with pytest.raises(UserError, match="lacks channel.*t2m"):
        Forecaster.from_file(run / "checkpoints" / "model.pt").forecast(xr.Dataset(), 1)


def test_relative_data_path_resolves_against_the_repository(run, tmp_path, monkeypatch):
    """A run trained in the repository with ``data_path: data/...`` is evaluated with an absolute ``--run_dir`` from
    elsewhere: the relative path is resolved against the repository root."""
    from utils.data import layout
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "tiny").symlink_to(Path(json.loads((run / "run.json").read_text())["config"]["data_path"]))
    monkeypatch.setattr(layout, "REPO", repo)
    monkeypatch.chdir(tmp_path)
    assert layout.resolve_data_path("data/tiny") == repo / "data" / "tiny"
    assert layout.resolve_data_path("/abs/path") == Path("/abs/path")
    assert layout.resolve_data_path("nowhere") == Path("nowhere")


def test_the_python_example_runs_and_plots(run, tmp_path):
    proc = run_forked([str(ROOT / "docs" / "examples" / "forecast_from_python.py"), "--run_dir", str(run),
                       "--lead_steps", "3", "--channel", "t2m", "--out", str(tmp_path / "f.png")], tmp_path,
                      subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote" in proc.stdout and (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # without --out: beside the run, not in the directory it runs from (the repository root, as documented)
    import shutil
    own = shutil.copytree(run, tmp_path / "run")  # the module's run stays as trained
    proc = run_forked([str(ROOT / "docs" / "examples" / "forecast_from_python.py"), "--run_dir", str(own),
                       "--lead_steps", "1"], tmp_path, subprocess_env())
    assert proc.returncode == 0 and f"wrote {own / 'forecast.png'}" in proc.stdout, proc.stderr[-3000:]
    assert (own / "forecast.png").is_file() and not (tmp_path / "forecast.png").exists()


def test_the_device_defaults_to_what_is_there(run):
    from utils.core.errors import UserError
    from training.evaluation.forecast import Forecaster
    f = Forecaster.from_file(run / "checkpoints" / "model.pt")
    assert f.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():  # docs/python-api.md's device="cuda" on a CPU machine: one line, no assert
        with pytest.raises(UserError, match="^device 'cuda' asked for, but no CUDA GPU is visible; pass "
                                            "device='cpu'"):
            Forecaster.from_file(run / "checkpoints" / "model.pt", device="cuda")
