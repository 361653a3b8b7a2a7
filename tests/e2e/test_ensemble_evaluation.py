"""Scoring ensembles end to end: a tiny stochastic model (``--noise_channels 1``, the CRPS with 2 members) trained a
few steps, evaluated by ``evaluate.py --ensemble_members 3`` and forecast by ``Forecaster.forecast(members=3)``:

* the forecasts file has a member dimension, the members differ, and the scorecard's ensemble scores equal a
  recomputation from the saved forecasts and the truth with the ``scores`` library (the deterministic scores are
  the ensemble mean's);
* two ranks (torchrun's variables, gloo) score the same members: the same scorecard;
* a deterministic run evaluated as one member gets the CRPS, equal to its mean absolute error;
* bad input is one line: members asked of a deterministic model, fewer than one member.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import scores.probability as scores_probability  # the dev extra: an independent verification library
import xarray as xr

from tests.dist_utils import launch_entry
from tests.jobs import run_job
from training.evaluation.metrics import latitude_weights

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--num_iters", "4", "--limit_nsamples_val", "16", "--key_channels", "[u10m,t2m]"]
STOCHASTIC = ["--noise_channels", "1", "--loss", "crps", "--ensemble_members", "2"]
LEADS, INIT_EVERY, MEMBERS = 2, 6, 3


def train(tmp_path_factory, tiny_data, args: list[str]) -> Path:
    work = tmp_path_factory.mktemp("ensemble")
    (status, _, err), = run_job(work, tiny_data, [*TRAIN, *args], 1)
    assert status == 0, err[-3000:]
    (run_dir,) = (work / "runs" / "tiny").glob("1*/00")
    return run_dir


def evaluate(run: Path, out: Path, *args: str):
    (proc,) = launch_entry(ROOT / "evaluate.py", ["--run_dir", str(run), "--lead_steps", str(LEADS), "--init_every",
                                                  str(INIT_EVERY), "--out", str(out), *args], out.parent)
    return proc


@pytest.fixture(scope="module")
def stochastic(tiny_data, tmp_path_factory) -> Path:
    return train(tmp_path_factory, tiny_data, STOCHASTIC)


@pytest.fixture(scope="module")
def deterministic(tiny_data, tmp_path_factory) -> Path:
    return train(tmp_path_factory, tiny_data, [])


def evaluated(run: Path, out: Path, members: int) -> tuple[dict, xr.DataArray, str]:
    proc = evaluate(run, out, "--save_forecasts", "--ensemble_members", str(members))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with xr.open_dataarray(out / "forecasts.nc") as da:
        return json.loads((out / "scorecard.json").read_text()), da.load(), proc.stdout


@pytest.fixture(scope="module")
def ensemble(stochastic, tmp_path_factory) -> tuple[dict, xr.DataArray, str, Path]:
    """``evaluate.py --ensemble_members 3 --save_forecasts`` of the stochastic run: scorecard, forecasts, output,
    and the output folder."""
    out = tmp_path_factory.mktemp("evaluated") / "eval"
    return (*evaluated(stochastic, out, MEMBERS), out)


def truth(tiny_data: Path, forecasts: xr.DataArray) -> tuple[xr.DataArray, xr.DataArray]:
    """The valid split's fields at each forecast's valid time ``(init_time, lead_time, channel, latitude, longitude)``
    and the latitude weights, from the one validation file (initial time ``i`` is its step ``INIT_EVERY * i``)."""
    (path,) = sorted((tiny_data / "valid").glob("*.h5"))
    with h5py.File(path, "r") as f:
        fields = f["fields"][:]
    steps = [[INIT_EVERY * i + j for j in range(1, LEADS + 1)] for i in range(forecasts.sizes["init_time"])]
    dims = ("init_time", "lead_time", "channel", "latitude", "longitude")
    coords = {d: forecasts[d] for d in dims}
    weights = latitude_weights(forecasts.latitude.values).double().numpy()
    return (xr.DataArray(fields[np.asarray(steps)], dims=dims, coords=coords),
            xr.DataArray(weights, dims="latitude", coords={"latitude": forecasts.latitude}))


def test_members_are_scored_as_the_scores_library_scores_the_saved_forecasts(ensemble, tiny_data):
    card, forecasts, stdout, out = ensemble
    n = card["initial_times"]
    assert forecasts.dims == ("init_time", "member", "lead_time", "channel", "latitude", "longitude")
    assert forecasts.shape == (n, MEMBERS, LEADS, 4, 32, 64) and card["members"] == MEMBERS
    spread = forecasts.std("member")
    assert float(spread.min()) > 0  # every point: the members differ (their own noise at every lead)
    assert "model: the mean of 3 members" in stdout and "rank_histogram.png" in stdout
    assert (out / "rank_histogram.png").read_bytes()[:4] == b"\x89PNG"
    y, w = truth(tiny_data, forecasts)
    e = card["ensemble"]
    for ch in ("u10m", "t2m"):
        fc, obs = forecasts.sel(channel=ch), y.sel(channel=ch)
        crps = scores_probability.crps_for_ensemble(fc, obs, "member", method="fair", weights=w,
                                                    preserve_dims=["lead_time"])
        np.testing.assert_allclose(e["crps"][ch], crps.values, rtol=1e-4)
        mse = ((fc.mean("member") - obs) ** 2 * w).mean(["latitude", "longitude"]).mean("init_time")
        np.testing.assert_allclose(e["ensemble_mean_rmse"][ch], np.sqrt(mse.values), rtol=1e-4)
        np.testing.assert_allclose(card["scores"]["model"]["rmse"][ch], np.sqrt(mse.values), rtol=1e-4)
        variance = (fc.var("member", ddof=1) * w).mean(["latitude", "longitude"]).mean("init_time")
        np.testing.assert_allclose(e["spread"][ch], np.sqrt(variance.values), rtol=1e-4)
        ratio = np.sqrt((MEMBERS + 1) / MEMBERS) * np.sqrt(variance.values / mse.values)
        np.testing.assert_allclose(e["spread_skill"][ch], ratio, rtol=1e-4)
        ranks = scores_probability.rank_histogram(fc, obs, "member", preserve_dims=["lead_time"], weights=w)
        counts = np.asarray(e["rank_histogram"][ch])
        np.testing.assert_allclose(counts.sum(1), n * 32 * 64, rtol=1e-5)
        np.testing.assert_allclose(counts / counts.sum(1, keepdims=True), ranks.transpose("lead_time", "rank").values,
                                   atol=1e-5)
    with xr.open_dataset(out / "scorecard.nc") as ds:
        assert ds.attrs["members"] == MEMBERS and ds.rank_histogram.shape == (4, LEADS, MEMBERS + 1)
        np.testing.assert_allclose(ds.ensemble_skill.sel(ensemble_metric="crps", channel="t2m"), e["crps"]["t2m"])


def test_two_ranks_score_the_same_members(stochastic, ensemble, tmp_path):
    (tmp_path / "eval").mkdir()
    args = ["--run_dir", str(stochastic), "--lead_steps", str(LEADS), "--init_every", str(INIT_EVERY), "--out",
            str(tmp_path / "eval"), "--ensemble_members", str(MEMBERS), "--batch_size", "2"]
    procs = launch_entry(ROOT / "evaluate.py", args, tmp_path, ranks=2)
    assert all(p.returncode == 0 for p in procs), procs[0].stderr[-3000:] + procs[1].stderr[-3000:]
    got, want = json.loads((tmp_path / "eval" / "scorecard.json").read_text()), ensemble[0]
    assert got["initial_times"] == want["initial_times"] and got["members"] == MEMBERS
    for score, by_channel in want["ensemble"].items():
        for ch, values in by_channel.items():
            np.testing.assert_allclose(got["ensemble"][score][ch], values, rtol=1e-5, err_msg=f"{score} {ch}")


def test_the_forecaster_draws_members_and_the_same_ones_again(stochastic, tiny_data):
    from training.evaluation.forecast import Forecaster
    from utils.core.errors import UserError
    (path,) = sorted((tiny_data / "valid").glob("*.h5"))
    f = Forecaster.from_file(stochastic / "checkpoints" / "model.pt")
    state = Forecaster.read_state(path, 0)
    ensemble = f.forecast(state, LEADS, members=MEMBERS)
    assert ensemble["t2m"].dims == ("member", "lead_time", "latitude", "longitude")
    assert list(ensemble.member.values) == [0, 1, 2]
    assert float(ensemble["t2m"].std("member").min()) > 0
    again = f.forecast(xr.concat([state, state], "time"), LEADS, members=MEMBERS, batch_size=1)
    assert again["t2m"].dims == ("time", "member", "lead_time", "latitude", "longitude")
    np.testing.assert_array_equal(again["t2m"].isel(time=0).values, ensemble["t2m"].values)  # same key, same draw
    one = f.forecast(state, LEADS)  # members=1: one member, the deterministic layout
    assert one["t2m"].dims == ("lead_time", "latitude", "longitude")
    np.testing.assert_array_equal(one["t2m"].values, ensemble["t2m"].isel(member=0).values)
    with pytest.raises(UserError, match="^members must be at least 1, got 0$"):
        f.forecast(state, LEADS, members=0)


def test_a_deterministic_run_is_one_member_whose_crps_is_its_mean_absolute_error(deterministic, tiny_data, tmp_path):
    card, forecasts, stdout = evaluated(deterministic, tmp_path / "eval", 1)
    assert forecasts.dims == ("init_time", "lead_time", "channel", "latitude", "longitude")
    assert card["members"] == 1 and "CRPS model" in stdout and "one member: CRPS = mean absolute error" in stdout
    y, w = truth(tiny_data, forecasts)
    mae = (abs(forecasts - y) * w).mean(["latitude", "longitude"]).mean("init_time")
    for ch in ("u10m", "t2m"):
        np.testing.assert_allclose(card["ensemble"]["crps"][ch], mae.sel(channel=ch).values, rtol=1e-4)
        assert card["ensemble"]["spread"][ch] == [0.0] * LEADS
    assert not (tmp_path / "eval" / "rank_histogram.png").exists()


@pytest.mark.parametrize("members,message", [
    ("2", "error: 2 members asked of a deterministic model: it has no noise inputs (noise_channels 0), so its "
          "members would be identical; pass --ensemble_members 1, or train a stochastic model"),
    ("0", "error: --ensemble_members must be at least 1, got 0"),
], ids=["members of a deterministic model", "no member"])
def test_bad_member_counts_are_one_line(deterministic, tmp_path, members, message):
    proc = evaluate(deterministic, tmp_path / "eval", "--ensemble_members", members)
    assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "eval").exists()
    if members == "2":
        from training.evaluation.forecast import Forecaster
        from utils.core.errors import UserError
        with pytest.raises(UserError, match="2 members asked of a deterministic model"):
            Forecaster.from_run(deterministic).forecast(xr.Dataset(), 1, members=2)
