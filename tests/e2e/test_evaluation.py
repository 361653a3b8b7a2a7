"""Rollout evaluation (training/evaluation/, evaluate.py, the trainer's --valid_rollout_steps).

* rollouts feed the model its own forecasts (also inside :func:`score_rollouts`);
* :class:`SkillSums` / :class:`Scorecard` against an independent xarray reference with WeatherBench 2
  cell-area latitude weights (RMSE in physical units, MSE averaged over initial times before the root,
  ACC averaged over initial times; persistence and climatology baselines);
* training with ``--valid_rollout_steps 3``: metrics.jsonl and TensorBoard;
* ``evaluate.py`` end to end on two tiny trained runs (shared by the module, trained concurrently):
  scorecard files, lead-1 scores equal to the training run's validation, every way of naming a
  checkpoint, saved forecasts against the model applied by hand, ``--init_every``, two ranks.

The bad-input cases of evaluate.py are in tests/e2e/test_bad_inputs.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import xarray as xr
from torch import nn

from tests.dist_utils import launch_entry, subprocess_env
from tests.forked import run_forked
from tests.jobs import reference_run
from utils.data.stats import Stats
from training.evaluation.scoring import (FORECASTS, Scorecard, SkillSums, format_scorecard, lead_hours, lead_label, rollout, score_rollouts)
from training.evaluation.metrics import latitude_weights

ROOT = Path(__file__).resolve().parents[2]

# Two tiny runs (tests/jobs.py RUN: 64 training samples, 8 steps per epoch, checkpoints every 10 steps, the last 2
# kept) of 2 epochs, validating on the whole valid split (limit_nsamples_val null) after each: one scoring 3 rollout
# steps (drawing its TensorBoard figures at the second epoch only: --figure_every 2), one the default single step
# (no figures: RUN's --figure_every 0). Their checkpoints: steps 10 and 16.
# tests/e2e/test_bad_inputs.py asks for ROLLOUT_RUN too; reference_run trains it once per session.
ROLLOUT_RUN = ["--num_iters", "16", "--limit_nsamples_val", "null", "--valid_rollout_steps", "3",
               "--key_channels", "[u10m,t2m]", "--figure_every", "2"]
ONE_STEP_RUN = ["--num_iters", "16", "--limit_nsamples_val", "null"]
CHANNELS = ["u10m", "v10m", "t2m", "sp"]  # the tiny data's 4 channels


# ---------------------------------------------------------------- rollouts
class Toy(nn.Module):
    """A small deterministic (in eval mode) field-to-field model; dropout makes train mode differ."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))

    def forward(self, x):
        y = self.conv(x)  # bfloat16 under CPU autocast
        return self.drop(y + torch.tanh(y))


def successive(model, x, steps, autocast=contextlib.nullcontext):
    out = []
    with torch.no_grad():
        for _ in range(steps):
            with autocast():
                x = model(x)
            x = x.float()
            out.append(x)
    return out


def test_rollout_equals_successive_model_calls():
    model = Toy(3).eval()
    x = torch.randn(2, 3, 8, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = list(rollout(model, x, 4, contextlib.nullcontext))
    want = successive(model, x, 4)
    assert len(got) == 4
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # each lead is another model step (not the first forecast repeated, not the input)
    assert not torch.allclose(got[0], x) and not torch.allclose(got[1], got[0])
    with torch.no_grad():
        torch.testing.assert_close(got[2], model(model(model(x))), rtol=0, atol=0)


def test_rollout_under_autocast_feeds_back_fp32():
    model = Toy(3).eval()
    x = torch.randn(2, 3, 8, 16, generator=torch.Generator().manual_seed(2))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    with torch.no_grad(), bf16():
        assert model(x).dtype == torch.bfloat16  # so the cast back is what the test sees
    with torch.no_grad():
        got = list(rollout(model, x, 3, bf16))
    for g, w in zip(got, successive(model, x, 3, bf16)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def random_stats(c: int, h: int, w: int, seed: int = 3) -> Stats:
    g = torch.Generator().manual_seed(seed)
    return Stats(mean=torch.randn(1, c, 1, 1, generator=g) * 10, std=torch.rand(1, c, 1, 1, generator=g) + 0.5,
                 clim=0.5 * torch.randn(1, c, h, w, generator=g))


def test_score_rollouts_forecasts_are_the_rollout_and_scores_match_skill_sums():
    c, h, w, k = 3, 6, 8, 3
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(b, c, h, w, generator=g), torch.randn(b, k, c, h, w, generator=g),
                torch.arange(start, start + b)) for start, b in ((0, 3), (3, 2))]
    stats = random_stats(c, h, w)
    weights = latitude_weights(np.linspace(75, -75, h))
    model = Toy(c).train()  # score_rollouts must switch dropout off
    seen = []
    sums, checks = score_rollouts(model, batches, stats, weights, k, contextlib.nullcontext,
                                  lambda inp, forecasts, tar, idx: seen.append((idx.clone(), [f.clone() for f in forecasts])))
    assert not model.training
    want_sums = SkillSums(k, c, torch.device("cpu"), w // 2 + 1)
    assert [idx.tolist() for idx, _ in seen] == [[0, 1, 2], [3, 4]]
    for (inp, tar, _), (_, forecasts) in zip(batches, seen):
        want = successive(model, inp, k)
        assert len(forecasts) == k
        for f, wf in zip(forecasts, want):
            torch.testing.assert_close(f, wf, rtol=0, atol=0)
        want_sums.add(inp, want, tar, stats, weights)
    torch.testing.assert_close(sums.mse, want_sums.mse)
    torch.testing.assert_close(sums.acc, want_sums.acc)
    torch.testing.assert_close(sums.bias, want_sums.bias)
    torch.testing.assert_close(sums.spectra, want_sums.spectra)
    assert sums.count.item() == 5
    assert all(bool(ok.all()) for _, ok in checks)

    # a NaN in one sample's last target marks exactly that sample as not finite
    inp, tar, idx = batches[1]
    tar = tar.clone()
    tar[1, k - 1, 0, 2, 3] = float("nan")
    _, checks = score_rollouts(model, [(inp, tar, idx)], stats, weights, k, contextlib.nullcontext)
    assert checks[0][1].tolist() == [True, False]


# ---------------------------------------------------------------- scores against an xarray reference
def wb2_cell_area_weights(lat_deg: np.ndarray) -> np.ndarray:
    """WeatherBench 2's ``get_lat_weights`` (weatherbench2/metrics.py): cell bounds half-way between rows and
    at the poles, area ``sin(upper) - sin(lower)``, normalized to mean 1 (latitudes ascending)."""
    lat = np.deg2rad(lat_deg[::-1])
    bounds = np.concatenate([[-np.pi / 2], (lat[:-1] + lat[1:]) / 2, [np.pi / 2]])
    area = np.sin(bounds[1:]) - np.sin(bounds[:-1])
    return (area / area.mean())[::-1]


def test_skill_sums_scorecard_matches_xarray_reference():
    n_init, k, c, w = 7, 3, 3, 10
    lat = np.array([75.0, 45.0, 15.0, -15.0, -45.0, -75.0])  # a 30-degree global grid: bounds reach the poles
    h = len(lat)
    names = ["a", "b", "c"]
    rng = np.random.default_rng(5)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    mean = np.array([280.0, -2.0, 1.0e5], np.float32).reshape(1, c, 1, 1)
    std = np.array([15.0, 0.5, 900.0], np.float32).reshape(1, c, 1, 1)
    clim = (0.6 * f32(1, c, h, w)).astype(np.float32)  # normalized, as Stats holds it
    inp = f32(n_init, c, h, w)
    tar = np.stack([0.8 ** (j + 1) * inp + 0.5 * (j + 1) * f32(n_init, c, h, w) for j in range(k)], 1).astype(np.float32)
    model = (tar + 0.7 * f32(n_init, k, c, h, w)).astype(np.float32)  # forecasts correlated with the targets

    stats = Stats(torch.from_numpy(mean), torch.from_numpy(std), torch.from_numpy(clim))
    weights = latitude_weights(lat)
    np.testing.assert_allclose(weights.numpy(), wb2_cell_area_weights(lat), rtol=1e-6)
    sums = SkillSums(k, c, torch.device("cpu"), w // 2 + 1)
    for sl in (slice(0, 4), slice(4, 7)):  # two batches
        sums.add(torch.from_numpy(inp[sl]), [torch.from_numpy(model[sl, j]) for j in range(k)],
                 torch.from_numpy(tar[sl]), stats, weights)
    leads = lead_hours(1, 6.0, k)
    card = sums.scorecard(stats.std, leads, names)

    # the reference: float64, physical units, xarray's weighted mean over the grid
    phys = lambda x: x.astype(np.float64) * std.astype(np.float64) + mean  # noqa: E731
    dims = ("init", "lead", "channel", "lat", "lon")
    coords = {"channel": names, "lat": lat}
    target = xr.DataArray(phys(tar), dims=dims, coords=coords)
    clim_p = xr.DataArray(phys(clim)[0], dims=("channel", "lat", "lon"), coords=coords)
    forecasts = {"model": xr.DataArray(phys(model), dims=dims, coords=coords),
                 "persistence": xr.DataArray(np.repeat(phys(inp)[:, None], k, 1), dims=dims, coords=coords),
                 "climatology": clim_p.expand_dims(init=n_init, lead=k).transpose(*dims)}
    wts = xr.DataArray(wb2_cell_area_weights(lat), dims="lat", coords={"lat": lat})
    space = lambda x: x.weighted(wts).mean(("lat", "lon"))  # noqa: E731

    assert card.initial_times == n_init and card.lead_hours == [6.0, 12.0, 18.0] and card.channels == names
    for name, fc in forecasts.items():
        mse = space((fc - target) ** 2)  # (init, lead, channel)
        rmse = np.sqrt(mse.mean("init"))
        got_rmse = np.array([card.scores[name]["rmse"][ch] for ch in names]).T  # (lead, channel)
        np.testing.assert_allclose(got_rmse, rmse.values, rtol=1e-5, err_msg=name)
        a, b = fc - clim_p, target - clim_p
        got_acc = np.array([card.scores[name]["acc"][ch] for ch in names]).T
        if name == "climatology":  # its anomaly is zero: ACC exactly 0, not NaN
            assert np.all(got_acc == 0.0)
            continue
        acc = space(a * b) / np.sqrt(space(a * a) * space(b * b))
        np.testing.assert_allclose(got_acc, acc.mean("init").values, rtol=1e-5, atol=1e-6, err_msg=name)
        # the example tells the WB2 conventions apart from the usual mistakes
        assert not np.allclose(got_rmse, np.sqrt(mse).mean("init").values, rtol=1e-3)  # root before the mean
        unweighted = np.sqrt(((fc - target) ** 2).mean(("lat", "lon")).mean("init")).values
        assert not np.allclose(got_rmse, unweighted, rtol=1e-3)  # no latitude weights
        pooled = (a * b * wts).sum(("init", "lat", "lon")) / np.sqrt(
            (a * a * wts).sum(("init", "lat", "lon")) * (b * b * wts).sum(("init", "lat", "lon")))
        assert not np.allclose(got_acc, pooled.values, rtol=1e-3)  # ACC of pooled anomalies
        got_bias = np.array([card.scores[name]["bias"][ch] for ch in names]).T
        np.testing.assert_allclose(got_bias, space(fc - target).mean("init").values, rtol=1e-4,
                                   atol=1e-4 * std.max(), err_msg=name)
    # persistence is the initial state at every lead: its error grows with the lead here
    pers = np.array(card.scores["persistence"]["rmse"]["a"])
    assert pers[0] < pers[1] < pers[2]

    # the record views of the card
    first = card.first_lead_record()
    assert first["rmse/b"] == card.scores["model"]["rmse"]["b"][0]
    assert first["acc_persistence/c"] == card.scores["persistence"]["acc"]["c"][0]
    assert first["rmse_climatology/a"] == card.scores["climatology"]["rmse"]["a"][0]
    assert first["bias_persistence/a"] == card.scores["persistence"]["bias"]["a"][0]
    assert first["blurring/c"] == card.blurring["c"][0]
    assert "acc_climatology/a" not in first
    by_lead = card.lead_record(["b"])
    assert set(by_lead) == {f"{m}_by_lead/b/{lbl}" for m in ("rmse", "acc", "bias", "blurring")
                            for lbl in ("006h", "012h", "018h")}
    assert by_lead["rmse_by_lead/b/012h"] == card.scores["model"]["rmse"]["b"][1]
    assert by_lead["bias_by_lead/b/018h"] == card.scores["model"]["bias"]["b"][2]
    assert json.loads(json.dumps(card.to_json()))["scores"] == card.scores


def test_lead_hours_and_labels():
    assert lead_hours(1, 6.0, 3) == [6.0, 12.0, 18.0]
    assert lead_hours(2, 6.0, 3) == [12.0, 24.0, 36.0]
    assert lead_hours(3, 0.5, 2) == [1.5, 3.0]
    assert [lead_label(x) for x in (6.0, 12, 120.0, 1.5)] == ["006h", "012h", "120h", "1.5h"]


@pytest.mark.parametrize("n", [2, 3, 4, 12, 20])
def test_format_scorecard_shows_every_lead_up_to_max_rows_and_the_last(n):
    card = SkillSums(n, 1, torch.device("cpu"))
    card.count += 1
    text = format_scorecard(card.scorecard(torch.ones(1, 1, 1, 1), lead_hours(1, 6.0, n), ["x"]), ["x"])
    rows = [line.split()[0] for line in text.splitlines() if re.match(r"\s+\d{3}h\s", line)]
    assert rows[0] == "006h" and rows[-1] == lead_label(6.0 * n)
    assert len(rows) == min(n, 12)


@pytest.mark.parametrize("model,text", [([1, 1, 1], "at every lead"), ([1, 3, 1], "up to 006h"),
                                        ([3, 3, 3], "at no lead"), ([3, 1, 1], "at 2 later leads")])
def test_the_summary_says_up_to_which_lead_the_model_beats_a_baseline(model, text):
    """Persistence's RMSE is 2 at every lead: "not at the first lead" read as "at every lead but the first"."""
    scores = {f: {m: {"x": [2.0] * 3} for m in ("rmse", "acc", "bias")} for f in FORECASTS}
    scores["model"]["rmse"]["x"] = [float(v) for v in model]
    card = Scorecard([6.0, 12.0, 18.0], ["x"], scores, 100)
    lines = format_scorecard(card, ["x"]).splitlines()
    assert f"{'':>10}  model RMSE below persistence: {text}" in lines
    assert lines[-3] == ("summary: up to which lead the model's RMSE stays below persistence and below climatology; "
                         "its bias and blurring at 006h, 018h")
    assert lines[-1].split()[0] == "x" and text in lines[-1]


# ---------------------------------------------------------------- the runs and their evaluations
@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """The two training runs (started together: they share the 2 cores)."""
    waits = {name: reference_run(tmp_path_factory, tiny_data, args, 1)
             for name, args in (("rollout", ROLLOUT_RUN), ("one_step", ONE_STEP_RUN))}
    return {name: wait() for name, wait in waits.items()}


@pytest.fixture(scope="module")
def evals(runs, tmp_path_factory) -> dict[str, tuple[Path, list[subprocess.CompletedProcess]]]:
    """Every evaluation the tests below read, run two at a time: name -> (output folder, processes)."""
    base = tmp_path_factory.mktemp("evaluations")
    a, b = runs["rollout"], runs["one_step"]
    jobs = {  # name: (run, arguments, ranks); --out base/name unless the arguments say otherwise
        "rollout3": (a, ["--lead_steps", "3", "--batch_size", "8"], 1),
        "lead1": (b, ["--lead_steps", "1"], 1),  # default checkpoint, batch size and --out
        "lead1_pt": (b, ["--lead_steps", "1", "--checkpoint", str(b / "checkpoints" / "model.pt"),
                         "--batch_size", "16"], 1),
        "lead1_dcp": (b, ["--lead_steps", "1", "--checkpoint", str(b / "checkpoints" / "step_00000016"),
                          "--batch_size", "5"], 1),
        "lead1_step10": (b, ["--lead_steps", "1", "--step", "10", "--batch_size", "16"], 1),
        "lead4": (a, ["--lead_steps", "4", "--batch_size", "8", "--save_forecasts", "--channels", "u10m,v10m"], 1),
        "every2": (a, ["--lead_steps", "4", "--init_every", "2", "--batch_size", "8"], 1),
        "ranks2": (a, ["--lead_steps", "4", "--batch_size", "4", "--save_forecasts"], 2),
    }

    def one(name):
        run, args, ranks = jobs[name]
        out = run / "evaluation" if name == "lead1" else base / name
        extra = [] if name == "lead1" else ["--out", str(out)]
        return out, launch_entry(ROOT / "evaluate.py", ["--run_dir", str(run), *args, *extra], base, ranks)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(jobs, pool.map(one, jobs)))


def finished(evals, name: str) -> Path:
    out, procs = evals[name]
    for p in procs:
        assert p.returncode == 0, f"{name}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return out


def scorecard(out: Path) -> dict:
    return json.loads((out / "scorecard.json").read_text())


def last_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def valid_file(run_dir: Path) -> Path:
    cfg = (run_dir / "config.yaml").read_text()
    data = Path(re.search(r'data_path: "([^"]+)"', cfg).group(1))
    (path,) = sorted((data / "valid").glob("*.h5"))  # the tiny data has one validation year
    return path


def valid_steps(run_dir: Path) -> int:
    with h5py.File(valid_file(run_dir), "r") as f:
        return f["fields"].shape[0]


def assert_cards_close(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert got["lead_hours"] == want["lead_hours"] and got["channels"] == want["channels"]
    assert got["initial_times"] == want["initial_times"]
    for f in FORECASTS:
        for m in ("rmse", "acc", "bias"):
            for ch in want["channels"]:
                np.testing.assert_allclose(got["scores"][f][m][ch], want["scores"][f][m][ch], rtol=rtol, atol=atol,
                                           err_msg=f"{f} {m} {ch}")


# ---------------------------------------------------------------- training with rollout validation
def test_training_records_the_rollout_scorecard(runs):
    run = runs["rollout"]
    cfg = (run / "config.yaml").read_text()
    assert re.search(r"^\s*dt: 1$", cfg, re.M)
    with h5py.File(valid_file(run), "r") as f:
        assert float(f["fields"].attrs["dt_hours"]) == 6.0  # 6-hourly files, dt 1: leads 6, 12, 18 h
    rec = last_record(run)
    card = rec["scorecard"]
    assert card["lead_hours"] == [6.0, 12.0, 18.0]
    assert card["channels"] == CHANNELS
    assert card["initial_times"] == rec["valid_samples"] == valid_steps(run) - 3
    labels = ["006h", "012h", "018h"]
    for ch in CHANNELS:
        for m in ("rmse", "acc"):
            assert card["scores"]["model"][m][ch][0] == rec[f"{m}/{ch}"]
            assert len(card["scores"]["model"][m][ch]) == 3
        assert card["scores"]["persistence"]["rmse"][ch][0] == rec[f"rmse_persistence/{ch}"]
        assert card["scores"]["persistence"]["acc"][ch][0] == rec[f"acc_persistence/{ch}"]
        assert card["scores"]["climatology"]["rmse"][ch][0] == rec[f"rmse_climatology/{ch}"]
        assert card["scores"]["climatology"]["acc"][ch] == [0.0, 0.0, 0.0]
        assert all(math.isfinite(v) for f in FORECASTS for v in card["scores"][f]["rmse"][ch])
    # by-lead keys for the key channels only (--key_channels [u10m,t2m])
    for ch in ("u10m", "t2m"):
        assert rec[f"rmse_by_lead/{ch}/006h"] == rec[f"rmse/{ch}"]
        for j, lbl in enumerate(labels):
            assert rec[f"rmse_by_lead/{ch}/{lbl}"] == card["scores"]["model"]["rmse"][ch][j]
            assert rec[f"acc_by_lead/{ch}/{lbl}"] == card["scores"]["model"]["acc"][ch][j]
    assert not [k for k in rec if k.startswith(("rmse_by_lead/v10m", "rmse_by_lead/sp", "acc_by_lead/sp"))]
    # later leads are other forecasts: the scores differ from the first lead's
    assert card["scores"]["model"]["rmse"]["u10m"][2] != card["scores"]["model"]["rmse"]["u10m"][0]


@pytest.mark.parametrize("name", ["rollout", "one_step"])
def test_each_validation_scores_the_new_model_against_the_same_baselines(runs, name):
    """Two validations (2 epochs): the model's scores change, persistence and climatology (scored once by
    the trainer and reused) do not."""
    records = [r for r in map(json.loads, (runs[name] / "metrics.jsonl").read_text().splitlines()) if "rmse/u10m" in r]
    assert [r["iteration"] for r in records] == [8, 16]
    first, last = records
    for ch in CHANNELS:
        assert first[f"rmse/{ch}"] != last[f"rmse/{ch}"] and first[f"acc/{ch}"] != last[f"acc/{ch}"]
        for key in ("rmse_persistence", "acc_persistence", "rmse_climatology"):
            assert first[f"{key}/{ch}"] == last[f"{key}/{ch}"], key
    if name == "rollout":
        for f in FORECASTS[1:]:
            assert first["scorecard"]["scores"][f] == last["scorecard"]["scores"][f]
        assert first["scorecard"]["scores"]["model"] != last["scorecard"]["scores"]["model"]


def test_tensorboard_holds_the_rollout_scores(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = runs["rollout"]
    rec = last_record(run)
    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    want = [f"{m}_by_lead/{ch}/{lbl}" for m in ("rmse", "acc") for ch in ("u10m", "t2m")
            for lbl in ("006h", "012h", "018h")]
    assert set(want) <= set(tags["scalars"]), sorted(tags["scalars"])
    for tag in want:
        last = events.Scalars(tag)[-1]
        assert last.step == rec["iteration"] == 16
        assert last.value == pytest.approx(rec[tag], rel=1e-6, abs=1e-7)
    assert "skill_by_lead/valid" in tags["images"] and "spectra/valid" in tags["images"]
    for tag in ("prediction(u10m)/valid", "skill_by_lead/valid", "spectra/valid"):  # --figure_every 2, 2 epochs
        assert [image.step for image in events.Images(tag)] == [16], tag
    assert EventAccumulator(str(runs["one_step"])).Reload().Tags()["images"] == []  # --figure_every 0
    for tag in [f"{m}_by_lead/{ch}/{lbl}" for m in ("bias", "blurring") for ch in ("u10m", "t2m")
                for lbl in ("006h", "012h", "018h")]:
        assert events.Scalars(tag)[-1].value == pytest.approx(rec[tag], rel=1e-6, abs=1e-7)


# ---------------------------------------------------------------- evaluate.py
def test_evaluate_reproduces_the_training_scorecard(runs, evals):
    """--lead_steps 3 on the run validated with 3 rollout steps: the same model (the final checkpoint),
    the same initial times: the same whole scorecard."""
    out = finished(evals, "rollout3")
    got = scorecard(out)
    assert got["checkpoint_step"] == 16 and got["split"] == "valid" and got["init_every"] == 1
    assert_cards_close(got, last_record(runs["rollout"])["scorecard"])
    # the table lists the run's key channels (u10m, t2m) by default
    stdout = evals["rollout3"][1][0].stdout
    assert re.search(r"^\s+u10m\s+RMSE model", stdout, re.M) and re.search(r"^\s+t2m\s+RMSE model", stdout, re.M)
    assert not re.search(r"^\s+v10m\s+RMSE model", stdout, re.M)


@pytest.mark.parametrize("name", ["lead1", "lead1_pt", "lead1_dcp"])
def test_evaluate_lead1_equals_training_validation(runs, evals, name):
    """The run validated every valid sample (limit_nsamples_val null) one step ahead with its final model;
    evaluate.py --lead_steps 1 scores the same samples with the same weights, from the latest sharded
    checkpoint (default), the single-file export, or the sharded folder named with --checkpoint."""
    out = finished(evals, name)
    run = runs["one_step"]
    if name == "lead1":
        assert out == run / "evaluation"  # the default --out
    rec = last_record(run)
    card = scorecard(out)
    assert card["lead_hours"] == [6.0] and card["checkpoint_step"] == 16
    assert card["initial_times"] == rec["valid_samples"] == valid_steps(run) - 1
    assert "scorecard" not in rec  # one-step validation records no table
    for ch in CHANNELS:
        for f, m, key in (("model", "rmse", "rmse"), ("model", "acc", "acc"), ("persistence", "rmse", "rmse_persistence"),
                          ("persistence", "acc", "acc_persistence"), ("climatology", "rmse", "rmse_climatology")):
            assert card["scores"][f][m][ch][0] == pytest.approx(rec[f"{key}/{ch}"], rel=1e-5, abs=1e-6), (f, m, ch)


def test_evaluate_step_picks_that_checkpoint(runs, evals):
    card = scorecard(finished(evals, "lead1_step10"))
    final = last_record(runs["one_step"])
    assert card["checkpoint_step"] == 10
    # another model: other model scores, the same baselines
    assert card["scores"]["model"]["rmse"]["u10m"][0] != pytest.approx(final["rmse/u10m"], rel=1e-4)
    assert card["scores"]["persistence"]["rmse"]["u10m"][0] == pytest.approx(final["rmse_persistence/u10m"], rel=1e-5)


def test_evaluate_writes_consistent_scorecard_files(runs, evals):
    out = finished(evals, "lead4")
    card = scorecard(out)
    n = valid_steps(runs["rollout"]) - 4
    assert card["lead_hours"] == [6.0, 12.0, 18.0, 24.0] and card["channels"] == CHANNELS
    assert card["initial_times"] == n == 44
    with xr.open_dataset(out / "scorecard.nc") as ds:
        ds = ds.load()
    skill = ds["skill"]
    assert skill.dims == ("metric", "forecast", "channel", "lead_time")
    assert list(skill.metric.values) == ["rmse", "acc", "bias"] and list(skill.forecast.values) == list(FORECASTS)
    assert ds["spectrum"].dims == ("source", "channel", "lead_time", "wavenumber") and ds.sizes["wavenumber"] == 33
    np.testing.assert_allclose(ds["spectrum"].sel(source="truth", channel="t2m").values,
                               card["spectra"]["truth"]["t2m"], rtol=1e-12)
    np.testing.assert_allclose(ds["blurring"].sel(channel="sp").values, card["blurring"]["sp"], rtol=1e-12)
    assert card["lead_time"] == card["lead_hours"] and card["lead_time_unit"] == "hours"
    assert card["climatology"].startswith("climatology.h5: mean by day of year and hour of day")
    assert list(skill.channel.values) == CHANNELS
    assert list(skill.lead_time.values) == card["lead_hours"] and skill.lead_time.attrs["units"] == "hours"
    assert int(ds.attrs["initial_times"]) == n
    for f in FORECASTS:
        for m in ("rmse", "acc", "bias"):
            for ch in CHANNELS:
                np.testing.assert_allclose(skill.sel(metric=m, forecast=f, channel=ch).values,
                                           card["scores"][f][m][ch], rtol=1e-12)
    assert (skill.sel(metric="acc", forecast="climatology").values == 0).all()
    for figure in ("scorecard.png", "spectra.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --channels picks the table's channels
    stdout = evals["lead4"][1][0].stdout
    assert re.search(r"^\s+v10m\s+RMSE model", stdout, re.M) and not re.search(r"^\s+t2m\s+RMSE", stdout, re.M)
    assert f"skill over {n} initial times" in stdout


def test_saved_forecasts_are_the_model_applied_to_the_normalized_input(runs, evals):
    from networks.vit import build_model
    from utils.config.loading import load_run_config
    run = runs["rollout"]
    out = finished(evals, "lead4")
    with xr.open_dataarray(out / "forecasts.nc") as da:
        da = da.load()
    n = valid_steps(run) - 4
    assert da.dims == ("init_time", "lead_time", "channel", "latitude", "longitude")
    assert da.shape == (n, 4, 4, 32, 64) and da.dtype == np.float32
    assert list(da.lead_time.values) == [6.0, 12.0, 18.0, 24.0] and da.lead_time.attrs["units"] == "hours"
    assert list(da.channel.values) == CHANNELS
    path = valid_file(run)
    with h5py.File(path, "r") as f:
        fields = f["fields"]
        start, hours = fields.attrs["start_time"], float(fields.attrs["dt_hours"])
        start = start.decode() if isinstance(start, bytes) else str(start)
        np.testing.assert_array_equal(da.latitude.values, f["latitude"][:32])
        np.testing.assert_array_equal(da.longitude.values, f["longitude"][:64])
        picks = [0, 17, n - 1]
        states = np.stack([fields[t, :, :32, :64] for t in picks])
    want_times = np.datetime64(start) + (np.arange(n) * hours * 3600).astype("timedelta64[s]")
    np.testing.assert_array_equal(da.init_time.values, want_times.astype("datetime64[ns]"))
    assert str(da.init_time.values[1]).startswith(str(np.datetime64(start) + np.timedelta64(6, "h")))

    stats_dir = Path(re.search(r'data_path: "([^"]+)"', (run / "config.yaml").read_text()).group(1)) / "stats"
    mean, std = np.load(stats_dir / "global_means.npy"), np.load(stats_dir / "global_stds.npy")
    cfg = load_run_config(run)
    model = build_model(cfg.model, cfg.data)
    model.load_state_dict(torch.load(run / "checkpoints" / "model.pt", map_location="cpu")["model"])
    model.eval()
    with torch.no_grad():
        x = torch.from_numpy((states - mean) / std).float()
        lead1 = model(x)
        lead2 = model(lead1)
    tol = dict(rtol=1e-5, atol=1e-5 * float(std.max()))
    for lead, pred in ((0, lead1), (1, lead2)):
        np.testing.assert_allclose(da.values[picks, lead], pred.numpy() * std + mean, **tol)
    # the forecast is not the input (a model step happened)
    assert not np.allclose(da.values[picks, 0], states, rtol=1e-3)


def test_init_every_halves_the_initial_times(runs, evals):
    out = finished(evals, "every2")
    card = scorecard(out)
    n = valid_steps(runs["rollout"]) - 4
    assert card["initial_times"] == math.ceil(n / 2) == 22 and card["init_every"] == 2
    assert card["lead_hours"] == [6.0, 12.0, 18.0, 24.0]
    full = scorecard(finished(evals, "lead4"))
    assert card["scores"]["model"]["rmse"]["u10m"] != full["scores"]["model"]["rmse"]["u10m"]


def test_two_ranks_give_the_one_rank_scorecard(runs, evals):
    """44 initial times split over 2 ranks (22 each, nothing dropped): the all-reduced scorecard is the
    single-process one; each rank writes its own forecasts, together the single-process file."""
    out = finished(evals, "ranks2")
    one = finished(evals, "lead4")
    got, want = scorecard(out), scorecard(one)
    assert got["initial_times"] == want["initial_times"] == 44
    assert_cards_close(got, want)
    procs = evals["ranks2"][1]
    assert "wrote" in procs[0].stdout and "skill over 44 initial times" in procs[0].stdout
    assert "skill over" not in procs[1].stdout  # rank 0 alone prints and writes the table
    assert not (out / "forecasts.nc").exists()
    parts = []
    for r in range(2):
        with xr.open_dataarray(out / f"forecasts_rank{r}.nc") as da:
            parts.append(da.load())
    assert [p.sizes["init_time"] for p in parts] == [22, 22]
    merged = xr.concat(parts, "init_time").sortby("init_time")
    with xr.open_dataarray(one / "forecasts.nc") as ref:
        ref = ref.load()
    np.testing.assert_array_equal(merged.init_time.values, ref.init_time.values)
    np.testing.assert_allclose(merged.values, ref.values, rtol=1e-5, atol=1e-3)


def test_default_batch_size_is_the_runs_local_batch(runs, tmp_path):
    probe = ("import sys, utils.data.loaders as dl\n"
             "def stop(cfg, split, batch_size, *a, **k):\n"
             "    print('BATCH', batch_size); sys.exit(0)\n"
             "dl.split_batches = stop\n"
             "from training.evaluation.evaluate_run import main\n"
             f"main(['--run_dir', {str(runs['one_step'])!r}, '--lead_steps', '1'])\n")
    proc = run_forked(["-c", probe], tmp_path, subprocess_env(), timeout=120)  # torch already imported
    assert proc.returncode == 0, proc.stderr[-3000:]
    batch = re.search(r"BATCH (\d+)", proc.stdout)
    assert batch and batch.group(1) == "8", proc.stdout[-3000:]
