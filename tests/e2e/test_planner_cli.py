"""Planning a large job from the command line (docs/planning.md): the CPU dry run of a 128-rank HSDP x tp=2
vit_2b job and its printed plan, the tuner's dry run of every distinct rank into its JSON, a simulated training
run and the planner's search (a GPU's paths, forced on the CPU) that say what they are, keep no checkpoint and go
on after an OOM, and bad inputs as one line."""

from __future__ import annotations

import json
import re

import pytest
import torch

from networks.vit import build_model
from tests.dist_utils import launch_entry, subprocess_env
from tests.forked import run_forked
from tests.jobs import ROOT, run_job, run_path, run_record
from utils.config.command_line import cli_config
from training.loop.step import count_parameters

# vit_2b's width at depth 8: the plan's arithmetic is that of any depth (a block's shards, its activations), and the
# dry run's fake-tensor step over all 24 blocks took 20 s of CPU
VIT_2B_128 = ["--config", "vit_2b", "--depth", "8", "--fsdp", "hsdp", "--hsdp_shard_size", "8", "--tensor_parallel",
              "2", "--simulate_world_size", "128", "--local_batch_size", "1"]


def row(text: str, name: str) -> list[str]:
    """The cells of the plan table's row ``name`` (one per planned rank)."""
    line = next(line for line in text.splitlines() if line.startswith(name))
    return line[len(name):].split()


def mib_row(text: str, name: str) -> list[float]:
    return [float(v) for v in row(text, name)]


def parameter_counts(cfg) -> dict[str, int]:
    """The model's parameter count by top-level module (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.data)
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        counts[name.split(".")[0]] = counts.get(name.split(".")[0], 0) + p.numel()
    return counts


def test_dry_run_of_a_128_rank_hsdp_tp2_vit_2b_job_prints_its_plan(tmp_path):
    [done] = launch_entry(ROOT / "train.py", [*VIT_2B_128, "--expdir", str(tmp_path / "runs")], tmp_path)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "DRY RUN (no GPU), 128 ranks: HSDP over dp 64 = replicate 8 x shard 8, tp 2, cp 1" in text
    assert row(text, "local batch (global)") == ["1", "(64)"]  # 1 per rank over dp 64
    parts = [mib_row(text, f"{part} MiB")[0] for part in
             ("parameters", "gradients", "optimizer state", "activations", "all-gather buffers", "other")]
    assert abs(sum(parts) - mib_row(text, "tensor peak MiB")[0]) < 0.5  # the parts split the peak (rounded)
    # rank 0 keeps 1/16 of the blocks' weights (tp 2 x HSDP shard 8), fp32, and Adam twice that; 1/8 of the
    # patch embedding, final norm and head, which tensor parallelism leaves whole; and pos_embed (1, 4050, 2560)
    # whole: FSDP splits its leading axis, of length 1
    cfg = cli_config(VIT_2B_128, "tiny")
    sizes = parameter_counts(cfg)
    outside = sizes["patch_embed"] + sizes["norm"] + sizes["head"]
    share = (sizes["blocks"] / 16 + outside / 8 + sizes["pos_embed"]) * 4 / 2**20
    assert sum(sizes.values()) == count_parameters(cfg)
    # to 0.1 %: the blocks' norms and row-parallel biases, also whole on each tp rank, are 0.03 % more
    assert mib_row(text, "parameters shard MiB (counted)")[0] == pytest.approx(share, rel=1e-3)
    assert mib_row(text, "optimizer state shard MiB (counted)")[0] == pytest.approx(2 * share, rel=1e-3)
    assert row(text, "peak reserved MiB") == ["-"]  # the allocator's peaks need the GPU
    assert "groups: world 128, dp 64, tp 2, dp_replicate 8, dp_shard 8" in text
    submit = text.split("submit: ")[1].strip()
    assert submit.startswith("sbatch -N 32 submit_pm.sh --config vit_2b --depth 8 --fsdp hsdp --hsdp_shard_size 8 "
                             "--tensor_parallel 2 ") and submit.endswith(" --local_batch_size 1")
    assert "simulate" not in submit  # the line launches the real job
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_tuner_dry_run_plans_every_distinct_rank_into_its_json(tmp_path):
    out = tmp_path / "plan.json"
    [done] = launch_entry(ROOT / "tools" / "tune_batch_size.py",
                          ["--config", "tiny", "--fsdp", "zero3", "--simulate_world_size", "4", "--simulate_rank",
                           "all-distinct", "--tune_start", "2", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads(out.read_text())["plan"]
    assert [r["rank"] for r in plan["ranks"]] == [0, 1] and plan["submit"].startswith("sbatch -N 1 submit_pm.sh")
    assert all(r["local_batch"] == 2 and r["shards"] == r["analytic"] for r in plan["ranks"])
    assert plan["ranks"][0]["shards"]["parameters"] > plan["ranks"][1]["shards"]["parameters"]  # rank 0's pos_embed
    assert "plan for rank" in done.stdout


# train.py as it runs on a GPU, where a simulation trains instead of a dry run
FORCED = ["-c", "import sys, distributed.simulate as s; s.dry_run_wanted = lambda parallel: False; "
                "import train; sys.exit(train.cli())"]


def test_simulated_run_says_what_it_is_and_writes_no_checkpoint(tiny_data, tmp_path):
    [(code, stdout, stderr)] = run_job(tmp_path, tiny_data, ["--fsdp", "zero3", "--simulate_world_size", "2",
                                                             "--simulate_rank", "1", "--num_iters", "4"], 1,
                                       entry=FORCED)
    assert code == 0, stderr
    run = run_path(tmp_path, 2)
    record = run_record(run)
    assert record["status"] == "completed" and record["launcher"] == "simulated" and record["world_size"] == 2
    assert "losses are meaningless and communication time is absent" in record["simulation"]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    log = (run / "out.log").read_text()
    assert "SIMULATED: rank 1 of a 2-rank job" in log and "memory:" in log  # and the usual memory line


# the tuner as it runs on a GPU (a search, not a dry run), with an OOM from local batch OOM_FROM on
SEARCH = ["-c", "import runpy, sys, distributed.simulate as s; s.dry_run_wanted = lambda parallel: False; "
                f"runpy.run_path('{ROOT / 'tests' / 'oom_in_tuner.py'}', run_name='__main__')"]


def test_planner_search_recovers_from_an_oom_in_its_one_process(tiny_data, tmp_path):
    out = tmp_path / "plan.json"
    [(code, stdout, stderr)] = run_job(
        tmp_path, tiny_data, ["--fsdp", "zero3", "--simulate_world_size", "4", "--simulate_rank", "1", "--tune_start",
                              "4", "--tune_max_batch", "8", "--resolution", "2", "--tune_below", "0",
                              "--tune_warmup_steps", "1", "--tune_steps", "1", "--out", str(out)], 1,
        entry=SEARCH, OOM_FROM="8")
    assert code == 0, stderr
    record = json.loads(out.read_text())
    assert [(t["local_batch_size"], t["verdict"]) for t in record["trials"]] == \
        [(4, "clean"), (8, "OOM"), (6, "clean")]  # no peer waits for it: the one process goes on
    [ranked] = record["plan"]["ranks"]
    assert ranked["rank"] == 1 and ranked["local_batch"] in (4, 6) and ranked["parts"]["activations"] > 0
    assert "PLAN, 4 ranks: ZeRO-3 over dp 4" in stdout and "submit: sbatch -N 1 submit_pm.sh --config tiny" in stdout
    assert not out.with_name("plan.journal.jsonl").exists()


@pytest.mark.parametrize("args, env, message", [
    (["--simulate_world_size", "4", "--simulate_rank", "4"], {}, "--simulate_rank 4 is outside the simulated world"),
    (["--simulate_world_size", "4"], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
     "--simulate_world_size runs one process as one rank of a simulated job, but this job has 2 processes"),
    (["--simulate_world_size", "4", "--amp_mode", "fp8"], {}, "the dry run (no GPU) cannot step --amp_mode fp8"),
])
def test_bad_simulation_inputs_are_one_line_errors(tmp_path, args, env, message):
    done = run_forked([str(ROOT / "train.py"), "--config", "tiny", "--expdir", str(tmp_path / "runs"), *args],
                      tmp_path, subprocess_env(**env))
    assert done.returncode == 2
    assert re.fullmatch(r"error: .*\n", done.stderr) and message in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()
