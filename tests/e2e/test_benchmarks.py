"""The benchmark harness reports each run on its own, with the run's own epochs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.common import run_variant
from tests.dist_utils import free_port, subprocess_env
from tests.forked import Forked, run_forked


def test_run_variant_reports_only_its_own_epochs(tiny_data, tmp_path, forking_python):
    args = ["--config", "tiny", "--data_path", str(tiny_data), "--num_iters", "8", "--valid_every", "1",
            "--limit_nsamples", "32", "--log_every", "1000"]
    # under the forking python (tests/forked_python.py: torch already imported), as a launcher
    forked = dict(launcher=[forking_python.python], env=forking_python.env({"PATH": os.environ["PATH"]}), timeout=300)
    first = run_variant("same_name", args, tmp_path, **forked)
    again = run_variant("same_name", args, tmp_path, **forked)
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
    # the two ranks forked (tests/forked.py: torch already imported), each with torchrun's variables
    procs = [Forked(cmd[1:], Path(__file__).resolve().parents[2], subprocess_env(**launch, RANK=str(r),
                                                                                 LOCAL_RANK=str(r)))
             for r in range(2)]
    outputs = [(done.stdout, done.stderr) for done in (p.wait(300) for p in procs)]
    assert [p.process.exitcode for p in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    rows = {r["what"]: r for r in json.loads(out.read_text())["results"]}
    assert len(rows) == 12 and all(r["seconds"] > 0 for r in rows.values())
    assert all(rows[f"host buffers of {kind} saves, allocated in the background"]["steps_during_write"] == 2
               for kind in ("sync", "async"))
    saves = [r for what, r in rows.items() if what.startswith("sharded save")]
    assert len(saves) == 6 and all(r["size_gb"] > 0 and r["stall_s"] >= 0 for r in saves)
    # sync saves and loads with and without checksums: what the checksums cost
    assert {"sharded load, with checksums", "sharded load, without checksums"} <= set(rows)
    assert "sharded load, with checksums" in outputs[0][0]  # the table, on rank 0


@pytest.mark.parametrize("gpus", [1, 2])
def test_gc_pauses_times_full_collections_with_and_without_the_frozen_heap(tiny_data, tmp_path, capsys, gpus):
    from benchmarks.gc_pauses import main
    out = tmp_path / "gc.json"
    main(["--runs", "1", "--gpus", str(gpus), "--expdir", str(tmp_path / "runs"), "--out", str(out), "--",
          "--config", "tiny", "--data_path", str(tiny_data), "--num_iters", "4", "--limit_nsamples", "16",
          "--log_every", "1000"])
    rows = json.loads(out.read_text())["results"]
    assert [(row["gc_freeze"], row["rank"]) for row in rows] == [(s, r) for s in ("false", "true") for r in range(gpus)]
    for off, on in zip(rows[:gpus], rows[gpus:]):
        assert off["frozen_objects"] == 0 and on["frozen_objects"] > 100_000  # torch's modules and the model
        # with the frozen heap: a full collection at the start of epoch 2, outside any step (step 1's is a young one)
        assert on["collections_after_step_1"] >= on["collections_in_later_steps"] + 1
    for row in rows:
        assert row["samples_per_s"] > 0 and 0 < row["step_ms_median"] <= row["step_ms_longest"]
        assert 0 < row["epoch_s_median"] == row["epoch_s_longest"]  # epoch 2 of 2: the only one after the first
        assert row["garbage_objects"] >= 0 and row["garbage_gpu_mib"] == 0  # no CUDA here
        assert len(row["epoch_spans_s"]) == 2
    for on in rows[gpus:]:  # the freeze at epoch 2's start, before its first step
        assert 2 in [epoch for epoch, _ in on["collections_after_step_1_s"]]
    assert "in a later step" in capsys.readouterr().out


def test_figure_cost_times_runs_with_and_without_figures(tiny_data, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from benchmarks.figure_cost import main
    out, runs = tmp_path / "figures.json", tmp_path / "runs"
    main(["--runs", "1", "--expdir", str(runs), "--out", str(out), "--", "--config", "tiny", "--data_path",
          str(tiny_data), "--num_iters", "6", "--limit_nsamples", "16", "--valid_every", "1", "--log_every", "1000"])
    saved = json.loads(out.read_text())
    rows, summary = saved["results"], saved["summary"]
    assert [row["figure_every"] for row in rows] == [0, 1]
    for row in rows:
        assert row["epochs"] == 3 and row["wall_s_per_epoch"] > 0 and row["samples_per_s_median"] > 0
        elapsed = [epoch["elapsed_s"] for epoch in row["curve"]]
        assert row["wall_s_per_epoch"] == pytest.approx((elapsed[2] - elapsed[0]) / 2)
    assert summary["figures_s_per_epoch"] == pytest.approx(rows[1]["wall_s_per_epoch"] - rows[0]["wall_s_per_epoch"])
    images = {every: EventAccumulator(str(next(runs.glob(f"*/*/figure_every_{every}_0-*")))).Reload().Tags()["images"]
              for every in (0, 1)}
    assert images[0] == [] and any(tag.startswith("prediction(") for tag in images[1])  # the flag reached the run
    assert "the figures cost" in capsys.readouterr().out


def test_gc_pauses_reckons_each_epochs_span_from_its_steps():
    from benchmarks.gc_pauses import epoch_spans
    steps = [(1, 0.0, 5.0), (1, 5.5, 6.0), (2, 7.0, 7.5), (2, 9.0, 9.25), (3, 10.0, 10.5)]
    assert epoch_spans(steps) == [6.0, 2.25, 0.5]


class Cycle:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def test_garbage_held_frees_frozen_garbage_too():
    import gc
    import weakref

    from benchmarks.gc_pauses import garbage_held
    ref = weakref.ref(Cycle())  # garbage at once
    gc.freeze()  # out of every collection's sight until unfrozen
    try:
        assert garbage_held()["garbage_objects"] >= 1 and ref() is None
    finally:
        gc.unfreeze()


def parity_run(mode: str, seed: int, valid: float, rmse: dict, samples_per_s: float) -> dict:
    """A ``run_variant`` row of precision_parity (two epochs of 4 steps), as the benchmark records it."""
    curve = [{"iteration": 4, "loss/train": 2 * valid, "loss/valid": valid + 0.1},
             {"iteration": 8, "loss/train": valid, "loss/valid": valid}]
    return {"mode": mode, "seed": seed, "returncode": 0, "curve": curve, "loss/train": valid, "loss/valid": valid,
            **{f"rmse/{c}": v for c, v in rmse.items()}, "rmse_persistence/t2m": 9.0, "samples_per_s": samples_per_s}


def test_precision_parity_summary_places_each_metric_against_the_reference_range():
    from benchmarks.precision_parity import summarize
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


def test_precision_parity_rejects_bad_input_before_any_run(tiny_data, tmp_path):
    from benchmarks.precision_parity import main
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


def test_precision_parity_passes_fp8_keys_to_fp8_runs_only():
    from benchmarks.precision_parity import mode_args
    overrides = {"lr": "1e-3", "fp8_recipe": "rowwise", "enable_jit": "true"}
    assert mode_args("bf16", overrides) == ["--lr", "1e-3", "--enable_jit", "true"]  # bf16 refuses fp8 keys
    assert mode_args("fp8", overrides) == ["--lr", "1e-3", "--fp8_recipe", "rowwise", "--enable_jit", "true"]


def test_precision_parity_runs_draw_no_figures_into_their_timed_epochs():
    """Each run validates every epoch; figures would be drawn during the next epoch and count in its samples/s."""
    import argparse
    from benchmarks.precision_parity import train_args
    args = train_args(argparse.Namespace(config="tiny", data_path="/d"), "bf16", 0, {})
    assert args[args.index("--valid_every") + 1] == "1" and args[args.index("--figure_every") + 1] == "0"


def test_precision_parity_end_to_end_on_cpu(tiny_data, tmp_path, forking_python):
    # the CPU runs bf16 autocast and bf16_pure (fp8 needs a Hopper GPU); the speed settings are switched off after --
    out = tmp_path / "parity.json"
    # the forking python (tests/forked_python.py): its runs, started with sys.executable, fork as well
    proc = forking_python.run(
        ["benchmarks/precision_parity.py", "--config", "tiny", "--data_path", str(tiny_data), "--modes", "bf16",
         "bf16_pure", "--seeds", "0", "1", "--expdir", str(tmp_path / "runs"), "--out", str(out), "--",
         "--attention_backend", "auto", "--enable_jit", "false", "--num_data_workers", "0", "--num_iters", "2",
         "--limit_nsamples", "8", "--limit_nsamples_val", "8"], subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and saved["torch"] and saved["modes"] == ["bf16", "bf16_pure"]
    runs = saved["results"]
    assert [(r["mode"], r["seed"]) for r in runs] == [("bf16", 0), ("bf16_pure", 0), ("bf16", 1), ("bf16_pure", 1)]
    for run in runs:
        assert run["returncode"] == 0 and f"--amp_mode {run['mode']}" in run["command"]
        assert [p["iteration"] for p in run["curve"]] == [1, 2]  # 2 epochs of 1 step, both validated
    assert runs[0]["loss/valid"] != runs[2]["loss/valid"]  # the seed reaches the run
    summary = saved["summary"]
    channels = ["u10m", "v10m", "t2m", "sp"]
    assert summary["reference"] == "bf16" and summary["metrics"] == ["loss/valid", *[f"rmse/{c}" for c in channels]]
    for mode in ("bf16", "bf16_pure"):
        assert summary["modes"][mode]["seeds"] == [0, 1]
        assert len(summary["modes"][mode]["final"]["rmse/sp"]["values"]) == 2
        assert [p["iteration"] for p in summary["modes"][mode]["curves"]["loss/valid"]] == [1, 2]
    assert set(summary["parity"]) == {"bf16_pure"} and set(summary["parity"]["bf16_pure"]) == set(summary["metrics"])
    assert all(isinstance(p["within"], bool) for p in summary["parity"]["bf16_pure"].values())
    assert "bf16_pure vs bf16" in proc.stdout and "RMSE sp" in proc.stdout


BENCHMARKS = sorted(p.name for p in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py")
                    if p.name not in ("__init__.py", "common.py", "check_files.py"))


# ``python benchmarks/<script> --help`` of every script, one after the other in one interpreter (torch is imported
# once, not once per script: seconds of CPU each on 2 cores). Before each script, sys.path is what that command
# starts with (the script's folder first, not the project's root), so the script must put the root on it itself
# (``root_on_path``), and its module-level imports run: a name gone from the project fails them, cached module or
# not. The project's modules stay imported between scripts (re-importing kernels/ would register its custom ops
# twice).
HELP_ALL = r"""
import contextlib, io, json, runpy, sys, traceback
from pathlib import Path
root, scripts, out_path = Path.cwd(), sys.argv[2:], sys.argv[1]
base = [p for p in sys.path if p not in ("", ".", str(root))]
results = {}
for script in scripts:
    path = root / "benchmarks" / script
    sys.path[:] = [str(path.parent), *base]
    sys.argv = [str(path), "--help"]
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    results[script] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                       "root_on_path": str(root) in sys.path}
Path(out_path).write_text(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, dict]:
    """Each script's ``--help``: exit status, stdout, stderr, and whether it put the project's root on sys.path."""
    out = tmp_path_factory.mktemp("helps") / "helps.json"
    proc = subprocess.run([sys.executable, "-c", HELP_ALL, str(out), *BENCHMARKS],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("script", BENCHMARKS)
def test_every_benchmark_answers_help(script, helps):
    """Each script imports from the current layout and explains itself without a GPU."""
    proc = helps[script]
    assert proc["returncode"] == 0 and proc["stdout"].startswith("usage:"), \
        proc["stdout"][-2000:] + proc["stderr"][-2000:]
    assert proc["root_on_path"], f"{script} does not put the project's root on sys.path: run alone, it cannot import it"


def fake_check_runs(speeds: dict[str, float], stalls: tuple[float, float]):
    """``run`` and ``checkpoint`` measurements for ``benchmarks/check.py``, recording the train.py arguments."""
    calls = []

    def run(name, args, expdir, **launch):  # launch: multi_gpu.py's launcher (torchrun) and entry, for tp
        calls.append((name, args, *launch.values()))
        return {"variant": name, "returncode": 0, "samples_per_s": speeds[name], "loss/train": 1.0 + speeds[name] / 1e3,
                "command": " ".join(args)}

    def checkpoint(args, folder):
        calls.append(("checkpoint", args))
        return [{"what": "sharded save, sync, with checksums (again)", "stall_s": stalls[0]},
                {"what": "sharded save, async (again)", "stall_s": stalls[1]}, {"what": "sharded load", "seconds": 1.0}]
    return calls, run, checkpoint


def test_check_compares_with_the_reference_and_names_what_regressed(tiny_data, tmp_path, capsys):
    from benchmarks.check import main
    calls, run, checkpoint = fake_check_runs({"ceiling_bf16": 100.0, "ceiling_bf16_pure": 110.0,
                                              "e2e_bf16_pure": 105.0, "fp8": 90.0}, (0.5, 0.2))
    reference = tmp_path / "cpu_check.json"
    reference.write_text(json.dumps({"device": "cpu", "metrics": {
        "ceiling bf16 samples/s": 101.0, "ceiling bf16_pure samples/s": 120.0, "fp8 / best bf16 ceiling": 0.8,
        "sync save stall s": 0.2, "async save stall s": 0.08}}))
    out = tmp_path / "check.json"
    regressed = main(["--data_path", str(tiny_data), "--config", "tiny", "--reference", str(reference), "--out",
                      str(out), "--only", "ceiling", "e2e", "fp8", "checkpoint", "--", "--enable_jit", "false"],
                     run=run, checkpoint=checkpoint, gpus=1)
    assert regressed
    assert [name for name, _ in calls] == ["ceiling_bf16", "ceiling_bf16_pure", "e2e_bf16_pure", "fp8", "checkpoint"]
    for name, args in calls[:4]:  # two epochs of 64 steps (512 samples at global batch 8), the extra arguments last
        assert args[args.index("--num_iters") + 1] == "128" and args[-2:] == ["--enable_jit", "false"]
    assert "--data_loader_config pytorch --num_data_workers 8 --amp_mode bf16_pure" in " ".join(calls[2][1])
    saved = json.loads(out.read_text())
    verdicts = {r["metric"]: r["verdict"] for r in saved["comparison"]}
    assert verdicts == {"ceiling bf16 samples/s": "ok", "ceiling bf16_pure samples/s": "REGRESSED",
                        "end to end bf16_pure samples/s": "new", "end to end bf16_pure / ceiling": "new",
                        "fp8 samples/s": "new", "fp8 / best bf16 ceiling": "ok",
                        "sync save stall s": "REGRESSED", "async save stall s": "ok"}  # +0.12 s: within the slack
    assert saved["metrics"]["end to end bf16_pure / ceiling"] == pytest.approx(105 / 110)
    assert saved["metrics"]["fp8 / best bf16 ceiling"] == pytest.approx(90 / 110)
    assert saved["device"] == "cpu" and len(saved["results"]) == 4 + 3
    printed = capsys.readouterr().out
    assert "regressed (more than 5% worse than cpu_check.json): ceiling bf16_pure samples/s, sync save stall s" in printed
    assert "-8.3%" in printed


def test_check_without_a_reference_says_how_to_make_one(tiny_data, tmp_path, capsys):
    from benchmarks.check import main
    calls, run, checkpoint = fake_check_runs({"ceiling_bf16": 100.0}, (0.5, 0.1))
    out = tmp_path / "check.json"
    assert not main(["--data_path", str(tiny_data), "--config", "tiny", "--only", "ceiling", "--amp_modes", "bf16",
                     "--reference", str(tmp_path / "none.json"), "--out", str(out)], run=run, checkpoint=checkpoint)
    assert [name for name, _ in calls] == ["ceiling_bf16"]
    assert json.loads(out.read_text())["metrics"] == {"ceiling bf16 samples/s": 100.0}
    assert f"copy {out} there to make this run the reference" in capsys.readouterr().out


def test_check_rejects_bad_input_before_any_run(tiny_data, tmp_path, capsys):
    from benchmarks.check import main
    from utils.core.errors import UserError
    calls, run, checkpoint = fake_check_runs({}, (0, 0))
    other = tmp_path / "h100_check.json"
    other.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "metrics": {}}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    common = ["--data_path", str(tiny_data), "--config", "tiny"]
    for argv, words in [([*common, "--reference", str(other)], ["measured on NVIDIA H100", "this is cpu"]),
                        ([*common, "--reference", str(broken)], ["not a JSON written by benchmarks/check.py"]),
                        ([*common, "--", "--lrr", "1"], ["unknown config key --lrr"]),
                        (["--data_path", str(tmp_path / "nope")], ["not a folder"])]:
        with pytest.raises(UserError) as err:
            main(argv, run=run, checkpoint=checkpoint)
        assert all(w in str(err.value) for w in words), (argv, str(err.value))
    with pytest.raises(SystemExit) as exit_:  # argparse's own errors: one line, status 2
        main([*common, "--only", "speed"], run=run, checkpoint=checkpoint)
    assert exit_.value.code == 2 and "invalid choice: 'speed'" in capsys.readouterr().err
    assert calls == []


def test_profile_step_saves_each_mode_on_cpu(tmp_path):
    """The profiling script drives the trainer (one process) for each --amp_modes mode and saves its op table."""
    cmd = [sys.executable, "benchmarks/profile_step.py", "--config", "tiny", "--data_loader_config", "synthetic",
           "--amp_modes", "none", "bf16_pure", "--warmup_steps", "1", "--steps", "1", "--rows", "5",
           "--out", str(tmp_path), "--expdir", str(tmp_path / "runs")]
    proc = run_forked(cmd[1:], Path(__file__).resolve().parents[2], subprocess_env())  # torch already imported
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for mode in ("none", "bf16_pure"):
        saved = json.loads((tmp_path / f"profile_tiny_{mode}.json").read_text())
        assert saved["amp_mode"] == mode and saved["device"] == "cpu" and saved["step_ms"] > 0
        assert 0 < saved["memory"]["peak_rss"] < 64  # GiB, of the timed steps
        assert saved["frozen_objects"] > 100_000  # timed after the warm-up's garbage was frozen, as training does
        assert "gpu_time_ms" not in saved and "collectives" not in saved  # no GPU activity to split
        assert "GPU time a step" not in proc.stdout
        names = [op["name"] for op in saved["ops"]]
        assert "aten::addmm" in names and all(op["calls"] > 0 for op in saved["ops"])
        assert f"--amp_mode {mode}: step" in proc.stdout and "peak RSS" in proc.stdout


def test_profile_step_profiles_every_rank_of_a_context_parallel_run(tmp_path, forking_python):
    """Under the launcher each rank profiles its own steps and saves them; the key/value all-gather of cp 2 shows
    in each rank's ops; only rank 0 prints the table."""
    # launcher and workers under the forking python (tests/forked_python.py: torch already imported)
    proc = forking_python.run(
        ["-m", "tools.torchrun", "--standalone", "--nproc_per_node=2", "benchmarks/profile_step.py", "--config",
         "tiny", "--context_parallel", "2", "--data_loader_config", "synthetic", "--warmup_steps", "1", "--steps",
         "1", "--rows", "5", "--out", str(tmp_path), "--expdir", str(tmp_path / "runs")], subprocess_env(),
        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        saved = json.loads((tmp_path / f"profile_tiny_none_rank{rank}.json").read_text())
        assert "gloo:all_gather" in [op["name"] for op in saved["ops"]] and saved["memory"]["peak_rss"] > 0
        assert f"rank {rank}: tiny --amp_mode none: step" in proc.stdout
    assert proc.stdout.count("Self CPU time total") == 1 and not (tmp_path / "profile_tiny_none.json").exists()
    assert [p.name for p in (tmp_path / "runs" / "tiny" / "2CPU").iterdir()] == ["00"]  # one run, both ranks


def test_check_goes_on_after_a_failed_run_and_names_it(tiny_data, tmp_path):
    from benchmarks.check import main
    from utils.core.errors import UserError
    calls, run, checkpoint = fake_check_runs({"ceiling_bf16": 100.0, "e2e_bf16": 90.0}, (0.5, 0.1))

    def failing_fp8(name, args, expdir):
        return {"returncode": 2, "error": "error: --amp_mode fp8 needs torchao\n"} if name == "fp8" else \
            run(name, args, expdir)
    out = tmp_path / "check.json"
    with pytest.raises(UserError, match=r"1 measurement\(s\) failed: fp8 \(the fp8 run failed \(exit status 2;.*"
                                        r"needs torchao\)"):
        main(["--data_path", str(tiny_data), "--config", "tiny", "--amp_modes", "bf16", "--reference",
              str(tmp_path / "none.json"), "--out", str(out), "--only", "ceiling", "e2e", "fp8", "checkpoint"],
             run=failing_fp8, checkpoint=checkpoint, gpus=1)
    saved = json.loads(out.read_text())
    assert set(saved["metrics"]) == {"ceiling bf16 samples/s", "end to end bf16 samples/s", "end to end bf16 / ceiling",
                                     "sync save stall s", "async save stall s"}
    assert len(saved["failed"]) == 1 and calls[-1][0] == "checkpoint"


def test_check_tp_compares_tp2s_share_of_ddp_on_two_gpus(tmp_path, capsys):
    """--only tp runs multi_gpu.py's DDP and tp 2 variants of mp under torchrun on 2 GPUs (no data needed) and
    guards tp 2's share of DDP's per-GPU rate against the reference's; on one GPU it is skipped and says so."""
    from benchmarks.check import TP_METRICS, TP_SHARE, main
    reference = tmp_path / "cpu_check.json"
    reference.write_text(json.dumps({"device": "cpu", "metrics": {
        "mp DDP 2 GPUs samples/s": 140.0, "mp tp 2 samples/s": 112.0, "mp tp 2 / DDP per GPU": 0.8}}))
    common = ["--only", "tp", "--reference", str(reference), "--expdir", str(tmp_path / "runs")]
    calls, run, _ = fake_check_runs({"mp_tp1_cp1": 141.0, "mp_tp2_cp1": 105.0}, (0, 0))
    out = tmp_path / "tp.json"
    assert main([*common, "--out", str(out), "--", "--enable_jit", "false"], run=run, gpus=2)
    assert [call[0] for call in calls] == ["mp_tp1_cp1", "mp_tp2_cp1"]
    for (_, args, launcher, entry), tp in zip(calls, ("1", "2")):
        assert launcher[-2:] == ["--standalone", "--nproc_per_node=2"] and entry == "train.py"
        assert " ".join(args).startswith(f"--config mp --tensor_parallel {tp} --context_parallel 1 --local_batch_size 16")
        assert args[args.index("--num_iters") + 1] == "32" and args[-2:] == ["--enable_jit", "false"]
        assert "--data_path" not in args and "--data_loader_config synthetic" in " ".join(args)
    saved = json.loads(out.read_text())
    assert saved["metrics"][TP_SHARE] == pytest.approx(105 / 141)  # per GPU: both on 2 GPUs
    verdicts = {r["metric"]: r["verdict"] for r in saved["comparison"]}
    assert verdicts == {"mp DDP 2 GPUs samples/s": "ok", "mp tp 2 samples/s": "REGRESSED",
                        "mp tp 2 / DDP per GPU": "REGRESSED"}  # 0.745 is 6.9 % below 0.8
    assert [r["measurement"] for r in saved["results"]] == ["tp", "tp"] and saved["skipped"] == []
    # within a 10 % tolerance the same share passes
    calls.clear()
    assert not main([*common, "--out", str(out), "--tolerance", "0.1"], run=run, gpus=2)
    # one GPU: skipped, said, nothing run
    calls.clear()
    capsys.readouterr()
    assert not main([*common, "--out", str(out)], run=run, gpus=1)
    assert calls == [] and "[tp] skipped: it needs 2 GPUs, this machine has 1" in capsys.readouterr().out
    assert json.loads(out.read_text())["skipped"] == ["tp (it needs 2 GPUs, this machine has 1)"]
    # the stored H100 reference holds every tp metric, so a real run is compared, not only reported as new
    stored = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/h100_check.json").read_text())
    assert {*TP_METRICS.values(), TP_SHARE} <= set(stored["metrics"])
    rates = [stored["metrics"][TP_METRICS[v]] for v in ("mp_tp2_cp1", "mp_tp1_cp1")]
    assert stored["metrics"][TP_SHARE] == pytest.approx(rates[0] / rates[1])  # of one lease (round 5h: 73.0 %)


def test_check_modes_and_fp8_vit2b_give_each_cost_row(tiny_data, tmp_path):
    """--only modes: rollout, forcings and ensemble runs, compute only in the highest ceiling's precision, each
    with its share of that ceiling; a failed mode is named and the others still run. --only fp8_vit2b: vit_2b at
    local batch 4 in bf16_pure and in fp8 (default and rowwise recipes), each fp8 run's ratio to bf16_pure."""
    from benchmarks.check import MODES, VIT2B_FP8, compare, main
    from utils.core.errors import UserError
    speeds = {"ceiling_bf16": 100.0, "ceiling_bf16_pure": 120.0, "mode_rollout_K2": 60.0,
              "mode_forcings_3": 118.0, "mode_ensemble_crps_M2": 55.0,
              "fp8_vit2b_bf16_pure": 7.0, "fp8_vit2b_fp8": 8.4, "fp8_vit2b_fp8_rowwise": 9.1}
    calls, run, checkpoint = fake_check_runs(speeds, (0, 0))
    common = ["--data_path", str(tiny_data), "--config", "tiny", "--reference", str(tmp_path / "none.json")]
    out = tmp_path / "check.json"
    assert not main([*common, "--out", str(out), "--only", "ceiling", "modes", "fp8_vit2b"], run=run, gpus=1)
    assert [c[0] for c in calls] == list(speeds)  # in this order
    for name, args in calls[2:5]:  # the modes: synthetic, in bf16_pure (the highest ceiling), their own arguments
        label = name[len("mode_"):].replace("_", " ")
        assert " ".join(["--data_loader_config", "synthetic", "--amp_mode", "bf16_pure", *MODES[label]]) in " ".join(args)
    for name, args in calls[5:]:
        joined = " ".join(args)
        assert joined.startswith("--config vit_2b") and "--local_batch_size 4 --limit_nsamples 32" in joined
        assert args[args.index("--num_iters") + 1] == "16"
    assert "--fp8_recipe rowwise" in " ".join(calls[7][1]) and set(VIT2B_FP8) == {"fp8", "fp8 rowwise"}
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["rollout K2 / ceiling"] == pytest.approx(0.5)
    assert metrics["ensemble crps M2 / ceiling"] == pytest.approx(55 / 120)
    assert metrics["forcings 3 samples/s"] == 118.0
    assert metrics["vit_2b fp8 / bf16_pure"] == pytest.approx(1.2)
    assert metrics["vit_2b fp8 rowwise / bf16_pure"] == pytest.approx(1.3)
    assert metrics["vit_2b fp8 train loss"] == pytest.approx(1.0084)  # each run's loss, lower is better:
    assert [r["verdict"] for r in compare({"vit_2b fp8 train loss": 1.06, "x loss": 0.9}, {  # not a stall's slack
        "vit_2b fp8 train loss": 1.0, "x loss": 1.0}, 0.05)] == ["REGRESSED", "better"]
    # a failed mode: the others run, the failure is named
    calls.clear()

    def failing_rollout(name, args, expdir, **launch):
        return {"returncode": 1, "error": "boom"} if name == "mode_rollout_K2" else run(name, args, expdir, **launch)
    with pytest.raises(UserError, match=r"1 measurement\(s\) failed: modes \(the mode_rollout_K2 run failed"):
        main([*common, "--out", str(out), "--only", "modes", "--amp_modes", "bf16"], run=failing_rollout, gpus=1)
    assert [c[0] for c in calls] == ["mode_forcings_3", "mode_ensemble_crps_M2"]
    metrics = json.loads(out.read_text())["metrics"]
    assert "rollout K2 samples/s" not in metrics and "forcings 3 / ceiling" not in metrics  # no ceiling this time


def test_check_two_gpu_levers_share_one_ddp_run_and_scaling_uses_every_gpu(tiny_data, tmp_path, capsys):
    """--only tp tp_async cp: one DDP run of mp, then tp 2, async tp, bucketed sp gradients, tp 2 without sequence
    parallelism, cp 2 with
    the all-gather and with the ring, each with its share of DDP. --only scaling on 4 GPUs: the one-GPU ceiling,
    then DDP on 4 at the same local batch with 200 MiB buckets, and its share of 4 x the ceiling. --only fp8_zero3:
    vit_2b with ZeRO-3 on 2 GPUs in bf16_pure and fp8 with and without float8 all-gather; skipped on one GPU."""
    from benchmarks.check import TP_SHARE, main
    speeds = {"mp_tp1_cp1": 140.0, "mp_tp2_cp1": 110.0, "mp_tp2_cp1_async": 126.0, "mp_tp2_cp1_nosp": 112.0,
              "mp_tp2_cp1_buckets": 114.0,
              "mp_tp1_cp2": 125.0, "mp_tp1_cp2_ring": 133.0, "ceiling_bf16_pure": 180.0, "scaling_4gpu": 700.0,
              **{f"ceiling_bf16_pure_gpu{i}": 178.0 + i for i in range(4)}}
    calls, run, _ = fake_check_runs(speeds, (0, 0))
    out = tmp_path / "levers.json"
    common = ["--reference", str(tmp_path / "none.json"), "--expdir", str(tmp_path / "runs"), "--out", str(out)]
    assert not main([*common, "--only", "tp", "tp_async", "cp"], run=run, gpus=2)
    assert [c[0] for c in calls] == ["mp_tp1_cp1", "mp_tp2_cp1", "mp_tp2_cp1_async", "mp_tp2_cp1_buckets",
                                     "mp_tp2_cp1_nosp", "mp_tp1_cp2", "mp_tp1_cp2_ring"]
    assert "--async_tp true" in " ".join(calls[2][1]) and "--cp_attention ring" in " ".join(calls[6][1])
    assert "--sp_grad_bucketing true" in " ".join(calls[3][1])
    assert all(c[2][-1] == "--nproc_per_node=2" for c in calls)
    saved = json.loads(out.read_text())
    metrics = saved["metrics"]
    assert metrics[TP_SHARE] == pytest.approx(110 / 140)
    assert metrics["mp tp 2 async / DDP per GPU"] == pytest.approx(126 / 140)
    assert metrics["mp tp 2 without sp / DDP per GPU"] == pytest.approx(112 / 140)
    assert metrics["mp tp 2 sp grad buckets / DDP per GPU"] == pytest.approx(114 / 140)
    assert metrics["mp cp 2 / DDP per GPU"] == pytest.approx(125 / 140)
    assert metrics["mp cp 2 ring / DDP per GPU"] == pytest.approx(133 / 140)
    assert [r["measurement"] for r in saved["results"]] == ["tp", "tp", "tp_async", "tp_async", "tp_async", "cp",
                                                            "cp"]
    # one GPU: each two-GPU measurement skipped and said
    calls.clear()
    assert not main([*common, "--only", "tp_async", "cp"], run=run, gpus=1)
    assert calls == [] and json.loads(out.read_text())["skipped"] == [
        "tp_async (it needs 2 GPUs, this machine has 1)", "cp (it needs 2 GPUs, this machine has 1)"]
    # fp8 under ZeRO-3: vit_2b on 2 GPUs, bf16_pure then fp8 with and without float8 all-gather
    speeds.update({"fp8_zero3_bf16_pure": 14.0, "fp8_zero3_fp8": 16.8, "fp8_zero3_fp8_bf16_all-gather": 16.1})
    assert not main([*common, "--data_path", str(tiny_data), "--only", "fp8_zero3"], run=run, gpus=2)
    assert [c[0] for c in calls] == ["fp8_zero3_bf16_pure", "fp8_zero3_fp8", "fp8_zero3_fp8_bf16_all-gather"]
    for name, args, launcher in calls:
        joined = " ".join(args)
        assert launcher[-1] == "--nproc_per_node=2" and joined.startswith("--config vit_2b")
        assert "--fsdp zero3 --local_batch_size 4 --limit_nsamples 64" in joined
    assert "--amp_mode bf16_pure" in " ".join(calls[0][1]) and "--fp8_all_gather false" in " ".join(calls[2][1])
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["vit_2b ZeRO-3 fp8 / bf16_pure"] == pytest.approx(1.2)
    assert metrics["vit_2b ZeRO-3 fp8 bf16 all-gather / bf16_pure"] == pytest.approx(16.1 / 14)
    assert metrics["vit_2b ZeRO-3 fp8 train loss"] == pytest.approx(1.0168)
    calls.clear()
    assert not main([*common, "--data_path", str(tiny_data), "--only", "fp8_zero3"], run=run, gpus=1)
    assert calls == [] and "[fp8_zero3] skipped: it needs 2 GPUs" in capsys.readouterr().out
    # scaling over 4 GPUs of tiny (global batch 8, 64 steps per epoch)
    assert not main([*common, "--data_path", str(tiny_data), "--config", "tiny", "--only", "scaling",
                     "--amp_modes", "bf16_pure"], run=run, gpus=4)
    assert [c[0] for c in calls[:2]] == ["ceiling_bf16_pure", "scaling_4gpu"]
    name, args, launcher = calls[1]
    joined = " ".join(args)
    assert launcher[-1] == "--nproc_per_node=4" and "--bucket_cap_mb 200" in joined
    assert "--local_batch_size 8 --limit_nsamples 2048" in joined and args[args.index("--num_iters") + 1] == "128"
    # then the ceiling on each GPU at once, one process a GPU (threads: in any order)
    at_once = sorted(calls[2:], key=lambda c: c[0])
    assert [(c[0], c[2]) for c in at_once] == [(f"ceiling_bf16_pure_gpu{i}", {"CUDA_VISIBLE_DEVICES": str(i)})
                                               for i in range(4)]
    assert all(c[1] == calls[0][1] for c in at_once)  # the ceiling's own arguments
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["DDP 4 GPUs / 4 x ceiling"] == pytest.approx(700 / 720)
    assert metrics["4 one-GPU ceilings at once, slowest / fastest"] == pytest.approx(178 / 181)
    assert metrics["DDP 4 GPUs / sum of 4 one-GPU ceilings at once"] == pytest.approx(700 / 718)
    assert not main([*common, "--data_path", str(tiny_data), "--config", "tiny", "--only", "scaling"], run=run, gpus=1)
    assert "[scaling] skipped: it needs 2 GPUs, this machine has 1" in capsys.readouterr().out


def test_check_without_data_runs_only_tp(tmp_path):
    from benchmarks.check import main
    from utils.core.errors import UserError
    with pytest.raises(UserError, match="^ceiling, fp8, scaling need --data_path"):
        main(["--only", "ceiling", "fp8", "tp", "scaling", "--out", str(tmp_path / "x.json")], gpus=2)


def test_multi_gpu_suites_split_into_calls(tmp_path, capsys):
    """tp on 2 GPUs leaves out tp 4; --only picks variants by name (an unknown one is a one-line error before
    any run); vit2b's batch search splits by --batches and --fsdp_prefetches."""
    from benchmarks.multi_gpu import main
    calls, figures = [], {}

    def run(name, args, expdir, launcher, entry):  # batches up to 24 fit; 32 has cudaMalloc retries
        calls.append((name, launcher[-1]))
        figures[name] = args[args.index("--figure_every") + 1] if "--figure_every" in args else None
        bs = int(args[args.index("--local_batch_size") + 1])
        return {"variant": name, "returncode": 0, "samples_per_s": 10.0,
                "curve": [{"alloc_retries": int(bs > 24)}]}
    out = ["--out", str(tmp_path / "r.json"), "--gpus_max", "2"]
    assert main(["--suite", "tp", *out], runner=run) == 0
    assert calls == [("mp_tp1_cp1", "--nproc_per_node=2"), ("mp_tp2_cp1", "--nproc_per_node=2"),
                     ("mp_tp2_cp1_async", "--nproc_per_node=2"), ("mp_tp2_cp1_buckets", "--nproc_per_node=2"),
                     ("mp_tp2_cp1_async_buckets", "--nproc_per_node=2"), ("mp_tp2_cp1_nosp", "--nproc_per_node=2"),
                     ("mp_tp1_cp2", "--nproc_per_node=2"), ("mp_tp1_cp2_ring", "--nproc_per_node=2")]
    # tp validates after epoch 1: its figures, drawn during epoch 2, would count in the reported epoch
    assert set(figures.values()) == {"0"}
    calls.clear()
    assert main(["--suite", "fsdp", "--only", "mp_zero3_ac,mp_ddp", *out], runner=run) == 0
    assert [name for name, _ in calls] == ["mp_ddp", "mp_zero3_ac"]  # the suite's order
    assert figures["mp_ddp"] is None  # validated only after the reported epoch
    with pytest.raises(SystemExit) as exit_:
        main(["--suite", "tp", "--only", "mp_tp4_cp1", *out], runner=run)
    assert exit_.value.code == 2 and "--only mp_tp4_cp1: not a variant of --suite tp" in capsys.readouterr().err
    calls.clear()
    assert main(["--suite", "vit2b", "--batches", "8,16,24,32,48", *out], runner=run) == 0  # one call
    one_call = [name for name, _ in calls]
    assert one_call == ["vit2b_pf1_bs8", "vit2b_pf1_bs16", "vit2b_pf1_bs24", "vit2b_pf1_bs32",
                        "vit2b_pf0_bs24", "vit2b_pf2_bs24"]
    calls.clear()
    for batches, prefetches in (("8,16", "1"), ("24,32", "1"), ("24", "0,2")):  # three calls, the same runs
        main(["--suite", "vit2b", "--batches", batches, "--fsdp_prefetches", prefetches, *out], runner=run)
    assert [name for name, _ in calls] == one_call


STOPPED_CHECK = """
import sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks import check

def run(name, args, expdir, **launch):  # a train.py run of each measurement, the end-to-end one long
    if name.startswith("e2e"):
        print("e2e started", flush=True)
        time.sleep(60)
    return {"variant": name, "returncode": 0, "samples_per_s": 100.0, "command": " ".join(args)}

measure = check.main
check.main = lambda argv: measure(argv, run=run)
sys.exit(check.cli(sys.argv[2:]))
"""


def test_check_stopped_by_sigterm_keeps_what_it_measured(tiny_data, tmp_path):
    """A time limit's SIGTERM during the second measurement (a real signal to a real process): exit 75 at once,
    the first measurement saved in --out, the second named unfinished."""
    import signal
    script, out = tmp_path / "stopped_check.py", tmp_path / "check.json"
    script.write_text(STOPPED_CHECK)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(script), str(root), "--data_path", str(tiny_data), "--config", "tiny",
                             "--only", "ceiling", "e2e", "--amp_modes", "bf16", "--reference",
                             str(tmp_path / "none.json"), "--expdir", str(tmp_path / "runs"), "--out", str(out)],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        for line in proc.stdout:
            if line.startswith("e2e started"):
                proc.send_signal(signal.SIGTERM)
                break
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 75, stdout + stderr
    assert "stopped by SIGTERM" in stdout and "unfinished: e2e" in stdout, stdout + stderr
    saved = json.loads(out.read_text())
    assert saved["metrics"] == {"ceiling bf16 samples/s": 100.0} and saved["unfinished"] == ["e2e"]
    assert [r["measurement"] for r in saved["results"]] == ["ceiling_bf16"]


STOPPED_AT_ONCE = """
import sys
sys.path.insert(0, sys.argv[1])
from benchmarks import check, common

def run(name, args, expdir, **launch):  # the ceilings at once are real processes (a sleeper each), the rest instant
    if "_gpu" in name:
        return common.run_variant(name, [], expdir, entry=sys.argv[2], **launch)
    return {"variant": name, "returncode": 0, "samples_per_s": 100.0, "loss/train": 1.0, "command": ""}

measure = check.main
check.main = lambda argv: measure(argv, run=run, gpus=2)
sys.exit(check.cli(sys.argv[3:]))
"""
SLEEPER = """
import os, sys, time
expdir = sys.argv[sys.argv.index("--expdir") + 1]
with open(os.path.join(expdir, "pid" + os.environ["CUDA_VISIBLE_DEVICES"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


def test_check_stopped_during_the_ceilings_at_once_kills_every_one(tiny_data, tmp_path):
    """SIGTERM (a real signal to a real process) while the one-GPU ceilings run at once, one per visible GPU
    (CUDA_VISIBLE_DEVICES 5,7): exit 75, scaling unfinished, and both runs gone, not only the main thread's."""
    import signal
    script, sleeper = tmp_path / "check_at_once.py", tmp_path / "sleeper.py"
    out, runs = tmp_path / "c.json", tmp_path / "runs"
    script.write_text(STOPPED_AT_ONCE)
    sleeper.write_text(SLEEPER)
    runs.mkdir()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(sleeper), "--data_path", str(tiny_data),
                             "--config", "tiny", "--only", "scaling", "--amp_modes", "bf16", "--reference",
                             str(tmp_path / "none.json"), "--expdir", str(runs), "--out", str(out)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": "5,7"})
    pids = [runs / "pid5", runs / "pid7"]
    try:
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 75 and "unfinished: scaling" in stdout, stdout + stderr
    for pid in (int(p.read_text()) for p in pids):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_check_resume_runs_only_what_did_not_finish(tiny_data, tmp_path):
    """--resume an output that a stop cut short (during scaling, before the checkpoint stall, which runs last) and
    where a run failed (vit_2b fp8): only those run again; the finished runs are kept, marked, and give the metrics
    of one whole run. Resuming the finished output runs nothing and keeps the checkpoint rows too."""
    from benchmarks.check import main
    speeds = {"ceiling_bf16": 100.0, "ceiling_bf16_pure": 120.0, "fp8_vit2b_bf16_pure": 7.0, "fp8_vit2b_fp8": 8.4,
              "fp8_vit2b_fp8_rowwise": 9.1, "scaling_2gpu": 230.0, "ceiling_bf16_pure_gpu0": 119.0,
              "ceiling_bf16_pure_gpu1": 121.0}
    calls, run, checkpoint = fake_check_runs(speeds, (0.5, 0.1))
    argv = ["--data_path", str(tiny_data), "--config", "tiny", "--reference", str(tmp_path / "none.json"), "--only",
            "ceiling", "fp8_vit2b", "checkpoint", "scaling", "--", "--enable_jit", "false"]
    whole = tmp_path / "whole.json"
    main([*argv[:-3], "--out", str(whole), *argv[-3:]], run=run, checkpoint=checkpoint, gpus=2)
    assert calls[-1][0] == "checkpoint"  # after every train.py run: the next run after it was slow (round 5r)

    def cut_short(name, args, expdir, **launch):
        if name == "scaling_2gpu":
            raise KeyboardInterrupt  # as StopOnSignal stops a run in flight
        return {"returncode": 1, "error": "boom"} if name == "fp8_vit2b_fp8" else run(name, args, expdir, **launch)
    stopped, resumed = tmp_path / "stopped.json", tmp_path / "resumed.json"
    with pytest.raises(KeyboardInterrupt):
        main([*argv[:-3], "--out", str(stopped), *argv[-3:]], run=cut_short, checkpoint=checkpoint, gpus=2)
    assert json.loads(stopped.read_text())["unfinished"] == ["scaling", "checkpoint"]
    calls.clear()
    main([*argv[:-3], "--out", str(resumed), "--resume", str(stopped), *argv[-3:]], run=run, checkpoint=checkpoint,
         gpus=2)
    assert [c[0] for c in calls[:2]] == ["fp8_vit2b_fp8", "scaling_2gpu"]
    assert sorted(c[0] for c in calls[2:4]) == ["ceiling_bf16_pure_gpu0", "ceiling_bf16_pure_gpu1"]
    assert [c[0] for c in calls[4:]] == ["checkpoint"]
    saved = json.loads(resumed.read_text())
    assert saved["metrics"] == json.loads(whole.read_text())["metrics"]
    assert saved["metrics"]["vit_2b fp8 / bf16_pure"] == pytest.approx(1.2)
    assert saved["unfinished"] == [] and saved["failed"] == []
    kept = [r.get("variant", r.get("what")) for r in saved["results"] if r.get("kept_from") == str(stopped)]
    assert kept == ["ceiling_bf16", "ceiling_bf16_pure", "fp8_vit2b_bf16_pure", "fp8_vit2b_fp8_rowwise"]
    assert [r["measurement"] for r in saved["results"] if r.get("what")] == ["checkpoint"] * 3

    calls.clear()
    again = tmp_path / "again.json"
    main([*argv[:-3], "--out", str(again), "--resume", str(resumed), *argv[-3:]], run=run, checkpoint=checkpoint,
         gpus=2)
    assert calls == []
    saved_again = json.loads(again.read_text())
    assert saved_again["metrics"] == saved["metrics"]
    assert [r["what"] for r in saved_again["results"] if r.get("what") and r.get("kept_from") == str(resumed)] == [
        "sharded save, sync, with checksums (again)", "sharded save, async (again)", "sharded load"]


def test_check_resume_refuses_another_device_or_other_settings_before_any_run(tiny_data, tmp_path):
    from benchmarks.check import main
    from utils.core.errors import UserError
    calls, run, checkpoint = fake_check_runs({"ceiling_bf16": 100.0}, (0, 0))
    common = ["--data_path", str(tiny_data), "--config", "tiny", "--amp_modes", "bf16", "--only", "ceiling",
              "--reference", str(tmp_path / "none.json")]
    earlier = tmp_path / "earlier.json"
    main([*common, "--out", str(earlier), "--", "--enable_jit", "false"], run=run, checkpoint=checkpoint)
    calls.clear()
    saved = json.loads(earlier.read_text())
    files = {name: tmp_path / f"{name}.json" for name in ("h100", "old", "rows", "broken")}
    files["h100"].write_text(json.dumps({**saved, "device": "NVIDIA H100 80GB HBM3"}))
    files["old"].write_text(json.dumps({k: v for k, v in saved.items() if k != "train_args"}))
    files["rows"].write_text(json.dumps({**saved, "results": [1, 2]}))
    files["broken"].write_text("{")
    for resume, extra, words in [
            (earlier, ["--", "--enable_jit", "true"], ["other settings: train_args ['--enable_jit', 'false']",
                                                       "(here ['--enable_jit', 'true'])"]),
            (earlier, ["--config", "short", "--", "--enable_jit", "false"], ["other settings: config 'tiny'"]),
            (files["h100"], [], ["measured on NVIDIA H100", "this is cpu"]),
            (files["old"], [], ["not a JSON written by benchmarks/check.py (no train_args)"]),
            (files["rows"], [], ["its results are not rows"]),
            (files["broken"], [], ["--resume", "not a JSON written by benchmarks/check.py"]),
            (tmp_path / "none.json", [], ["--resume", "cannot be read (No such file or directory)"])]:
        with pytest.raises(UserError) as err:
            main([*common, "--out", str(tmp_path / "out.json"), "--resume", str(resume), *extra], run=run,
                 checkpoint=checkpoint)
        assert all(w in str(err.value) for w in words), (resume, str(err.value))
    assert calls == [] and not (tmp_path / "out.json").exists()


def test_run_variant_that_times_out_is_a_failed_variant(tmp_path):
    """A variant past run_variant's timeout is killed and reported as failed (no exception for the benchmark)."""
    entry = tmp_path / "slow.py"
    entry.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    row = run_variant("slow", [], tmp_path / "runs", timeout=3, entry=str(entry))
    assert row["returncode"] is None and "timed out after 3 s" in row["error"], row
