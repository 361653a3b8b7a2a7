"""The benchmark harness reports each run on its own, with the run's own epochs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import run_variant
from tests.dist_utils import free_port, subprocess_env


def test_run_variant_reports_only_its_own_epochs(tiny_data, tmp_path):
    args = ["--config", "tiny", "--data_path", str(tiny_data), "--num_iters", "8", "--valid_every", "1",
            "--limit_nsamples", "32", "--log_every", "1000"]
    first = run_variant("same_name", args, tmp_path, timeout=300)
    again = run_variant("same_name", args, tmp_path, timeout=300)
    for row in (first, again):
        assert row["returncode"] == 0, row.get("error")
        assert [e["iteration"] for e in row["curve"]] == [4, 8], row["curve"]  # 2 epochs of 4 steps
        assert row["samples_per_s"] > 0 and row["memory/peak_rss"] > 0
    assert first["command"] != again["command"]  # two runs, two run directories


def test_checkpoint_benchmark_measures_every_kind_of_save(tiny_data, tmp_path):
    out = tmp_path / "ckpt.json"
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "benchmarks/checkpoint.py", "--config", "tiny", "--fsdp", "zero3", "--data_path",
           str(tiny_data), "--dir", str(tmp_path / "ckpt"), "--steps", "2", "--async_steps", "2", "--out", str(out)]
    procs = [subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=subprocess_env(**launch, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:]
    rows = {r["what"]: r for r in json.loads(out.read_text())["results"]}
    assert len(rows) == 9 and all(r["seconds"] > 0 for r in rows.values())
    assert all(rows[f"host buffers of {kind} saves, allocated in the background"]["steps_during_write"] == 2
               for kind in ("sync", "async"))
    saves = [r for what, r in rows.items() if what.startswith("sharded save")]
    assert len(saves) == 4 and all(r["size_gb"] > 0 and r["stall_s"] >= 0 for r in saves)
    assert "sharded load" in outputs[0][0]  # the table, on rank 0


def parity_run(mode: str, seed: int, valid: float, rmse: dict, samples_per_s: float) -> dict:
    """A ``run_variant`` row of fp8_parity (two epochs of 4 steps), as the benchmark records it."""
    curve = [{"iteration": 4, "loss/train": 2 * valid, "loss/valid": valid + 0.1},
             {"iteration": 8, "loss/train": valid, "loss/valid": valid}]
    return {"mode": mode, "seed": seed, "returncode": 0, "curve": curve, "loss/train": valid, "loss/valid": valid,
            **{f"rmse/{c}": v for c, v in rmse.items()}, "rmse_persistence/t2m": 9.0, "samples_per_s": samples_per_s}


def test_fp8_parity_summary_places_each_metric_against_the_reference_range():
    from benchmarks.fp8_parity import summarize
    runs = [parity_run("bf16", 0, 0.50, {"t2m": 1.0, "z500": 10.0}, 100.0),
            parity_run("fp8", 0, 0.505, {"t2m": 1.3, "z500": 8.0}, 150.0),
            parity_run("bf16", 1, 0.52, {"t2m": 1.2, "z500": 12.0}, 110.0),
            parity_run("fp8", 1, 0.515, {"t2m": 1.5, "z500": 9.0}, 160.0),
            {"mode": "fp8", "seed": 2, "returncode": 2, "error": "boom"}]  # failed: reported, not counted
    summary = summarize(runs, "bf16")
    assert summary["metrics"] == ["loss/valid", "rmse/t2m", "rmse/z500"]  # no baselines' RMSE
    bf16, fp8 = summary["modes"]["bf16"], summary["modes"]["fp8"]
    assert (bf16["seeds"], bf16["failed_seeds"], fp8["seeds"], fp8["failed_seeds"]) == ([0, 1], [], [0, 1], [2])
    valid = bf16["final"]["loss/valid"]
    assert valid["values"] == [0.50, 0.52] and valid["mean"] == pytest.approx(0.51)
    assert valid["std"] == pytest.approx(0.02 / 2 ** 0.5) and valid["spread"] == pytest.approx(0.02)
    assert (valid["min"], valid["max"]) == (0.50, 0.52)
    # the curves: per iteration, over seeds
    assert [p["iteration"] for p in fp8["curves"]["loss/train"]] == [4, 8]
    assert fp8["curves"]["loss/valid"][0]["mean"] == pytest.approx(0.61)
    assert fp8["curves"]["loss/train"][0]["spread"] == pytest.approx(0.02)
    parity = summary["parity"]["fp8"]
    assert set(summary["parity"]) == {"fp8"} and set(parity) == {"loss/valid", "rmse/t2m", "rmse/z500"}
    # within: fp8's mean 0.51 inside bf16's [0.50, 0.52]
    inside = parity["loss/valid"]
    assert inside["within"] and inside["outside_by"] == 0.0 and inside["seeds_within"] == 2
    assert inside["rel_diff"] == pytest.approx(0.0, abs=1e-12) and inside["reference_range"] == [0.50, 0.52]
    # above: mean 1.4 against [1.0, 1.2] (mean 1.1)
    above = parity["rmse/t2m"]
    assert not above["within"] and above["seeds_within"] == 0
    assert above["outside_by"] == pytest.approx(0.2) and above["outside_rel"] == pytest.approx(0.2 / 1.1)
    assert above["rel_diff"] == pytest.approx(0.3 / 1.1)
    # below: mean 8.5 against [10, 12] (mean 11): signed negative
    below = parity["rmse/z500"]
    assert not below["within"] and below["outside_by"] == pytest.approx(-1.5)
    assert below["rel_diff"] == pytest.approx(-2.5 / 11)
    assert summary["speedup"]["fp8"] == pytest.approx(155 / 105)


def test_fp8_parity_rejects_bad_input_before_any_run(tiny_data, tmp_path):
    from benchmarks.fp8_parity import main
    from utils.core.errors import UserError
    common = ["--config", "tiny", "--data_path", str(tiny_data), "--out", str(tmp_path / "p.json")]
    for argv, words in [([*common, "--modes", "bf16", "fp9"], ["--amp_mode", "fp9"]),
                        ([*common, "--", "--seed", "3"], ["--seed", "set by the benchmark"]),
                        ([*common, "--", "--lrr", "1"], ["unknown config key --lrr"]),
                        ([*common, "--seeds", "0", "0"], ["each value once"]),
                        ([*common, "--modes", "none", "bf16", "--", "--fp8_recipe", "rowwise"], ["fp8 runs only"]),
                        (["--data_path", str(tmp_path / "nope")], ["not a folder"])]:
        with pytest.raises(UserError) as err:
            main(argv)
        assert all(w in str(err.value) for w in words), (argv, str(err.value))
    assert not (tmp_path / "p.json").exists()


def test_fp8_parity_passes_fp8_keys_to_fp8_runs_only():
    from benchmarks.fp8_parity import mode_args
    overrides = {"lr": "1e-3", "fp8_recipe": "rowwise", "enable_jit": "true"}
    assert mode_args("bf16", overrides) == ["--lr", "1e-3", "--enable_jit", "true"]  # bf16 refuses fp8 keys
    assert mode_args("fp8", overrides) == ["--lr", "1e-3", "--fp8_recipe", "rowwise", "--enable_jit", "true"]


def test_fp8_parity_end_to_end_on_cpu(tiny_data, tmp_path):
    # amp modes that run on CPU stand for bf16 and fp8; the speed settings are switched off after --
    out = tmp_path / "parity.json"
    cmd = [sys.executable, "benchmarks/fp8_parity.py", "--config", "tiny", "--data_path", str(tiny_data),
           "--modes", "none", "bf16", "--seeds", "0", "1", "--expdir", str(tmp_path / "runs"), "--out", str(out),
           "--", "--attention_backend", "auto", "--enable_jit", "false", "--num_data_workers", "0",
           "--num_iters", "2", "--limit_nsamples", "8", "--limit_nsamples_val", "8"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and saved["torch"] and saved["modes"] == ["none", "bf16"]
    runs = saved["results"]
    assert [(r["mode"], r["seed"]) for r in runs] == [("none", 0), ("bf16", 0), ("none", 1), ("bf16", 1)]
    for run in runs:
        assert run["returncode"] == 0 and f"--amp_mode {run['mode']}" in run["command"]
        assert [p["iteration"] for p in run["curve"]] == [1, 2]  # 2 epochs of 1 step, both validated
    assert runs[0]["loss/valid"] != runs[2]["loss/valid"]  # the seed reaches the run
    summary = saved["summary"]
    channels = ["u10m", "v10m", "t2m", "sp"]
    assert summary["reference"] == "none" and summary["metrics"] == ["loss/valid", *[f"rmse/{c}" for c in channels]]
    for mode in ("none", "bf16"):
        assert summary["modes"][mode]["seeds"] == [0, 1]
        assert len(summary["modes"][mode]["final"]["rmse/sp"]["values"]) == 2
        assert [p["iteration"] for p in summary["modes"][mode]["curves"]["loss/valid"]] == [1, 2]
    assert set(summary["parity"]) == {"bf16"} and set(summary["parity"]["bf16"]) == set(summary["metrics"])
    assert all(isinstance(p["within"], bool) for p in summary["parity"]["bf16"].values())
    assert "bf16 vs none" in proc.stdout and "RMSE sp" in proc.stdout
