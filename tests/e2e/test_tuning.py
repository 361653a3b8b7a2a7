"""The batch-size tuner on the real setup (training/tuner/tune.py, tools/tune_batch_size.py) and ``train.py
--local_batch_size auto``: real CPU runs of the tool with a memory budget (peak RSS standing in for
reserved memory), its arguments training, OOM recovery in one process, an OOM on one of two gloo ranks
stopping both and the rerun continuing from the journal, and a resumed auto run keeping its batch."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.dist_utils import subprocess_env
from tests.forked import run_forked
from tests.jobs import ROOT, run_job, run_path, run_record
from utils.config.command_line import cli_config
from utils.config.validate import Launch, validate
from utils.core.errors import EXIT_OUT_OF_MEMORY, UserError
from training.tuner.tune import (
    TUNE_FILE,
    accumulated_batches,
    journal_path,
    setting_args,
    setting_values,
    with_setting,
    without_tuner_keys,
)

TOOL = ["-m", "tools.tune_batch_size"]
# one warm-up and one timed step per trial: the tests check the search and the records, not the speed
QUICK = ["--tune_warmup_steps", "1", "--tune_steps", "1"]


def tool(tmp_path: Path, data: Path, args: list[str], ranks: int = 1, entry: list[str] = TOOL, **env: str):
    out = tmp_path / "tune.json"
    results = run_job(tmp_path, data, [*QUICK, "--out", str(out), *args], ranks, entry=entry, **env)
    return results, out


def verdicts(out: Path) -> list[tuple[int, str]]:
    return [(t["local_batch_size"], t["verdict"]) for t in json.loads(out.read_text())["trials"]]


def test_tool_keeps_to_the_memory_budget_and_its_arguments_train(tiny_data, tmp_path):
    [(code, stdout, stderr)], out = tool(tmp_path / "free", tiny_data, ["--tune_max_batch", "128", "--tune_below", "0"])
    assert code == 0, stderr
    peaks = {t["local_batch_size"]: t["peak_reserved_bytes"] for t in json.loads(out.read_text())["trials"]}
    assert list(peaks) == [8, 16, 32, 64, 128] and peaks[128] > peaks[16]  # peak RSS grows with the batch
    budget = round((peaks[16] + peaks[128]) / 2 / 2**30, 4)  # the value passed, so a peak cannot fall between

    [(code, stdout, stderr)], out = tool(tmp_path / "budget", tiny_data,
                                         ["--tune_max_batch", "128", "--memory_budget_gib", str(budget)])
    assert code == 0, stderr
    result = json.loads(out.read_text())
    for t in result["trials"]:  # the verdict follows the budget, and nothing else fails on CPU
        assert t["over_budget"] == (t["peak_reserved_bytes"] > budget * 2**30)
        assert t["clean"] == (not t["over_budget"]) and t["ooms"] == t["alloc_retries"] == 0
    clean = [t["local_batch_size"] for t in result["trials"] if t["clean"]]
    failed = [t["local_batch_size"] for t in result["trials"] if not t["clean"]]
    assert clean and failed and 8 in clean
    # the trials bisect down after 128: each measures its own peak, whatever ran before it, so peaks rise with the batch
    by_batch = sorted((t["local_batch_size"], t["peak_reserved_bytes"]) for t in result["trials"])
    assert all(a[1] < b[1] for a, b in zip(by_batch, by_batch[1:])), (by_batch, verdicts(out))
    assert min(failed) > max(clean), verdicts(out)
    assert min(f for f in failed if f > max(clean)) - max(clean) == 8  # bisected to --resolution
    choice = result["choice"]["max-throughput"]  # among those whose global batch fits tiny's 64 training samples
    assert choice["clean"] and choice["samples_per_s"] == max(t["samples_per_s"] for t in result["trials"]
                                                             if t["clean"] and t["global_batch_size"] <= 64)
    assert f"python train.py {' '.join(choice['args'])}" in stdout and "max-throughput: local batch" in stdout
    assert out.with_suffix(".png").stat().st_size > 0 and not journal_path(out).exists()
    # the printed arguments train: no tuner key among them, the chosen local batch and the scaled lr last
    args, batch = choice["args"], choice["local_batch_size"]
    assert "--memory_budget_gib" not in args and "--out" not in args
    base = cli_config(["--config", "tiny"], "tiny", "train.py").optim  # global batch 8
    scaled = ["--lr", f"{base.lr * (batch / 8) ** 0.5:.6g}", "--num_iters", str(max(1, round(24 * 8 / batch)))]
    tail = ["--local_batch_size", str(batch)] + ([] if batch == 8 else scaled)  # as many samples as 24 steps at 8
    assert args[-len(tail):] == tail
    train = run_forked([str(ROOT / "train.py"), *choice["args"], "--num_iters", "2", "--expdir", str(tmp_path / "runs")],
                       tmp_path, subprocess_env())
    assert train.returncode == 0, train.stderr
    assert f"local batch {choice['local_batch_size']}, global batch" in train.stdout


def test_tune_ac_blocks_keeps_the_global_batch_and_its_arguments_train(tiny_data, tmp_path):
    [(code, stdout, stderr)], out = tool(tmp_path, tiny_data, ["--tune", "ac_blocks", "--global_batch_size", "32"])
    assert code == 0, stderr
    result = json.loads(out.read_text())
    assert result["tune"] == "ac_blocks" and not out.with_suffix(".png").exists()
    # nothing fails on CPU without a budget: no checkpointing at the whole global batch per rank, then done
    [trial] = result["trials"]
    assert (trial["setting"], trial["local_batch_size"], trial["global_batch_size"]) == (0, 32, 32)
    args = result["choice"]["max-throughput"]["args"]
    assert args[-6:] == ["--local_batch_size", "32", "--activation_checkpointing", "none", "--grad_accum_steps", "1"]
    assert "max-throughput: local batch 32 (global 32), ac_blocks 0" in stdout
    train = run_forked([str(ROOT / "train.py"), *args, "--num_iters", "2", "--expdir", str(tmp_path / "runs")],
                       tmp_path, subprocess_env())
    assert train.returncode == 0, train.stderr


def test_settings_of_the_second_dimension():
    cfg = cli_config(["--config", "tiny", "--depth", "8"], "tiny", "train.py")
    assert setting_values(cfg, "ac_blocks") == [0, 2, 4, 6, 8]
    assert setting_args(cfg, "ac_blocks", 8) == ["--activation_checkpointing", "full"]
    assert setting_args(cfg, "ac_blocks", 2) == ["--activation_checkpointing", "selective", "--ac_blocks", "2"]
    half = with_setting(cfg, "ac_blocks", 4, 2)
    assert (half.precision.activation_checkpointing, half.precision.ac_blocks, half.optim.grad_accum_steps) == \
        ("selective", 4, 2)
    assert cfg.precision.activation_checkpointing == "none"  # a copy
    assert with_setting(cfg, "fsdp_prefetch", 3, 1).parallel.fsdp_prefetch == 3
    assert accumulated_batches(64, 2) == [32, 16, 8, 4, 2, 1] and accumulated_batches(48, 1) == [48, 24, 12, 6, 3]
    with pytest.raises(UserError, match="--tune fsdp_prefetch"):
        validate(cli_config(["--config", "tiny", "--tune", "fsdp_prefetch"], "tiny", "train.py"), Launch(1, False))


def test_oom_in_one_process_is_recovered_and_the_search_goes_on(tiny_data, tmp_path):
    [(code, stdout, stderr)], out = tool(tmp_path, tiny_data, ["--tune_max_batch", "128", "--tune_below", "1"],
                                         entry=[str(ROOT / "tests" / "oom_in_tuner.py")], OOM_FROM="40")
    assert code == 0, stderr
    assert verdicts(out) == [(8, "clean"), (16, "clean"), (32, "clean"), (64, "OOM"), (48, "OOM"), (40, "OOM"),
                             (24, "clean")]
    assert "local batch 64 ran out of memory" in stdout and "going on" in stdout
    assert json.loads(out.read_text())["choice"]["max-throughput"]["local_batch_size"] in (8, 16, 24, 32)


def test_oom_on_one_of_two_ranks_stops_both_and_the_rerun_continues(tiny_data, tmp_path):
    # 16 and 32 fit; 64 runs out of memory on rank 1 only, with no batch to bisect at resolution 32
    args = ["--tune_start", "16", "--resolution", "32", "--tune_max_batch", "64", "--tune_below", "0"]
    entry = [str(ROOT / "tests" / "oom_in_tuner.py")]
    results, out = tool(tmp_path, tiny_data, args, ranks=2, entry=entry, OOM_FROM="64", OOM_RANKS="1")
    assert [code for code, _, _ in results] == [EXIT_OUT_OF_MEMORY] * 2, results
    line = results[1][2].strip().splitlines()
    assert len(line) == 1 and line[0].startswith("error: rank 1 ran out of cpu memory at local batch 64")
    assert "Traceback" not in results[0][2] + results[1][2]
    journal = [json.loads(x) for x in journal_path(out).read_text().splitlines()]
    assert {"oom": 64, "rank": 1} in journal and [x["trial"]["local_batch_size"] for x in journal if "trial" in x] \
        == [16, 32]

    results, out = tool(tmp_path, tiny_data, args, ranks=2, entry=entry, OOM_FROM="64", OOM_RANKS="1")
    assert [code for code, _, _ in results] == [0, 0], results
    assert "taken from the journal" in results[0][1]
    assert verdicts(out) == [(16, "clean"), (32, "clean"), (64, "OOM")]
    assert not journal_path(out).exists()


def test_auto_batch_trains_with_the_choice_and_a_resumed_run_keeps_it(tiny_data, tmp_path):
    args = ["--local_batch_size", "auto", "--tune_max_batch", "32", "--num_iters", "4", *QUICK]
    [(code, stdout, stderr)] = run_job(tmp_path, tiny_data, args, 1)
    assert code == 0, stderr
    run = run_path(tmp_path, 1)
    choice = json.loads((run / TUNE_FILE).read_text())["choice"]["max-throughput"]
    assert "local batch auto: the tuner's max-throughput choice" in stdout
    assert f"local batch {choice['local_batch_size']}, global batch" in stdout
    assert run_record(run)["config"]["local_batch_size"] == "auto"  # the rerun's config matches: it continues

    [(code, stdout, stderr)] = run_job(tmp_path, tiny_data, [*args[:-len(QUICK) - 2], "--num_iters", "6", *QUICK], 1)
    assert code == 0, stderr
    assert "batch tuner:" not in stdout and "as tuned when this run started" in stdout
    assert f"local batch {choice['local_batch_size']}, global batch" in stdout and "resumed at iteration 4" in stdout


def test_without_tuner_keys_leaves_what_train_py_takes():
    argv = ["--config", "short", "--out", "t.json", "--memory_budget_gib=40", "--local_batch_size", "auto",
            "--fsdp", "zero3", "--tune_steps", "3", "--lr=1e-3"]
    assert without_tuner_keys(argv) == ["--config", "short", "--fsdp", "zero3", "--lr=1e-3"]


def test_local_batch_size_auto_parses_and_bad_values_say_so():
    assert cli_config(["--config", "tiny", "--local_batch_size", "auto"], "tiny", "train.py").optim.local_batch_size \
        == "auto"
    assert cli_config(["--config", "tiny", "--local_batch_size", "24"], "tiny", "train.py").optim.local_batch_size == 24
    with pytest.raises(UserError, match="--local_batch_size expects auto or an integer"):
        cli_config(["--config", "tiny", "--local_batch_size", "lots"], "tiny", "train.py")


def test_submit_script_runs_the_tuner_with_tune(tmp_path):
    shown = subprocess.run(["bash", str(ROOT / "submit_pm.sh"), "--tune", "--config=short"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "DRY_RUN": "1", "REPO_DIR": str(ROOT),
                                                        "DATA_DIR": "/d", "LOG_DIR": str(tmp_path)})
    assert shown.returncode == 0, shown.stderr
    assert "python -m tools.tune_batch_size --data_path /d" in shown.stdout and "--tune " not in shown.stdout
