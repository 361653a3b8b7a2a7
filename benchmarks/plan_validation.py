"""Validate the planner (``--simulate_world_size``, docs/planning.md) on one GPU, in three parts:

(a) world of one: a real one-process training of ``--config`` and the same with ``--simulate_world_size 1``;
    their peaks of allocated and reserved memory must agree to the MiB;
(b) the planner for ``vit_2b`` ZeRO-3 on 256 ranks (``python -m tools.tune_batch_size --simulate_world_size 256``)
    under a time limit: its wall time, pick, predicted peaks and parts;
(c) ZeRO-3 shards of simulated worlds of 2 and 4: this rank's parameter, gradient and Adam bytes counted from its
    local shards, computed from the sharding rule (``training.tuner.planner.analytic_shard_bytes``), and seen by the
    CUDA allocator (which adds FSDP2's padding of every shard to the largest chunk, and its rounding).

(d) real ranks: each layout of ``--layouts`` (DDP, ZeRO-2, ZeRO-3, HSDP, tp 2 at ``mp``) trained for real on
    ``--gpus`` GPUs (torchrun), then simulated on one GPU as the rank that peaked (``--simulate_world_size``);
    the per-rank peaks of allocated and reserved memory and the simulated / real ratio.

    python benchmarks/plan_validation.py --out $OUT/plan.json
    python benchmarks/plan_validation.py --parts d --gpus 2 --out benchmarks/results/h100x2_plan_validation.json
    python benchmarks/plan_validation.py --parts a,c --out benchmarks/results/h100_plan_validation.json

About 8 minutes on an H100 (part b is bounded by ``--planner_minutes``). Prints a table per part; the JSON is
rewritten after each part, so a run stopped at a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, run_variant, save_json, table  # noqa: E402
from utils.core.errors import ArgumentParser, run_cli  # noqa: E402

MIB = 2**20
# part (a): a short bf16 run on synthetic batches (no data needed), two epochs of 16 steps
WORLD1 = ["--data_loader_config", "synthetic", "--amp_mode", "bf16", "--enable_fused", "true",
          "--limit_nsamples", "256", "--limit_nsamples_val", "32", "--global_batch_size", "16", "--num_iters", "32",
          "--valid_every", "2", "--log_every", "1000"]
# part (b): the acceptance command of issue 30, with short trials
PLANNER = ["--config", "vit_2b", "--fsdp", "zero3", "--simulate_world_size", "256", "--tune_warmup_steps", "2",
           "--tune_steps", "2"]


def world_of_one(config: str, expdir: Path) -> list[dict]:
    """Part (a): the real run and the simulated world of one; peaks in MiB and whether they agree."""
    rows = [run_variant(name, ["--config", config, *WORLD1, *extra], expdir)
            for name, extra in (("real", []), ("simulated_world_1", ["--simulate_world_size", "1"]))]
    for row in rows:
        for key in ("peak_allocated", "peak_reserved"):
            value = row.get(f"memory/{key}")
            row[f"{key}_mib"] = None if value is None else round(value * 1024)
    same = all(rows[0].get(k) is not None and rows[0][k] == rows[1][k] for k in ("peak_allocated_mib",
                                                                                 "peak_reserved_mib"))
    for row in rows:
        row["equal_to_the_mib"] = same
    return rows


# part (d): eager bf16 steps of mp on synthetic batches, local batch 16, 2 epochs of 4 steps
REAL = ["--config", "mp", "--data_loader_config", "synthetic", "--amp_mode", "bf16", "--enable_fused", "true",
        "--enable_jit", "false", "--local_batch_size", "16", "--limit_nsamples_val", "32", "--num_iters", "8",
        "--valid_every", "2", "--log_every", "1000"]
LAYOUTS = {"ddp": [], "zero2": ["--fsdp", "zero2"], "zero3": ["--fsdp", "zero3"],
           "hsdp": ["--fsdp", "hsdp", "--hsdp_shard_size", "1"], "tp2": ["--tensor_parallel", "2"]}


def real_ranks(layouts: list[str], gpus: int, expdir: Path, rows: list[dict], save) -> None:
    """Part (d): per layout the real run on ``gpus`` ranks (peaks: maximum over ranks) and the simulated rank
    that peaked; appends both rows (ratio = simulated / real on the simulated row) and saves after each."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    for name in layouts:
        dp = gpus // (2 if name == "tp2" else 1)
        args = REAL + LAYOUTS[name] + ["--limit_nsamples", str(16 * dp * 4)]
        real = run_variant(f"{name}_real", args, expdir, launcher=launcher)
        rank = real.get("memory/peak_allocated_rank", 0)
        sim = run_variant(f"{name}_simulated_rank{rank}", args + ["--simulate_world_size", str(gpus),
                                                                  "--simulate_rank", str(rank)], expdir)
        for row in (real, sim):
            for key in ("peak_allocated", "peak_reserved"):
                value = row.get(f"memory/{key}")
                row[f"{key}_mib"] = None if value is None else round(value * 1024)
        for key in ("peak_allocated", "peak_reserved"):
            if real.get(f"{key}_mib") and sim.get(f"{key}_mib") is not None:
                sim[f"{key}_ratio"] = sim[f"{key}_mib"] / real[f"{key}_mib"]
        rows += [real, sim]
        save()


def planner(minutes: float, out_dir: Path, extra: list[str]) -> dict:
    """Part (b): the planner's run, its wall time and its plan (the JSON's ``plan`` and choices)."""
    out = out_dir / "plan_vit_2b_zero3_256.json"
    cmd = [sys.executable, "-m", "tools.tune_batch_size", *PLANNER, "--max_minutes", str(minutes), *extra,
           "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          timeout=int(60 * minutes + 240))
    row = {"command": " ".join(cmd), "returncode": proc.returncode, "wall_minutes": (time.perf_counter() - start) / 60,
           "stdout": proc.stdout[-8000:], "stderr": proc.stderr[-3000:]}
    print(proc.stdout[-8000:], proc.stderr[-2000:], sep="\n", flush=True)
    if proc.returncode == 0 and out.exists():
        result = json.loads(out.read_text())
        [plan] = result["plan"]["ranks"]
        row.update(plan=result["plan"], trials=len(result.get("trials", [])),
                   pick=result.get("choice", {}).get("max-throughput"),
                   **{f"{k}_mib": None if plan[k] is None else plan[k] / MIB
                      for k in ("peak_allocated", "peak_reserved", "device_memory_bytes", "tensor_peak")})
    return row


def zero3_shards(config: str, sizes: tuple[int, ...]) -> list[dict]:
    """Part (c): for each world size and ranks 0 and 1 (rank 0 alone holds parameters whose first axis is shorter
    than the world), this rank's shard bytes counted, computed and seen by the allocator."""
    import torch

    from distributed.launch import LaunchEnv
    from distributed.world import init_distributed, shutdown
    from utils.config.command_line import cli_config
    from training.monitor.activations import gradient_bytes, optimizer_state_bytes, tensor_bytes
    from training.loop.step import build_training_step
    from training.tuner.estimates import analytic_shard_bytes

    rows = []
    for n, rank in itertools.product(sizes, (0, 1)):
        cfg = cli_config(["--config", config, "--fsdp", "zero3", "--enable_jit", "false", "--simulate_world_size",
                          str(n), "--simulate_rank", str(rank), "--local_batch_size", "1"], "tiny")
        world = init_distributed(cfg.parallel, LaunchEnv())
        try:
            gc.collect()  # the previous rank's step (held in a cycle by its optimizer hook) is freed now, not mid-build
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            step = build_training_step(cfg, world)
            built = torch.cuda.memory_allocated()
            seen = {}
            step.optimizer.register_step_pre_hook(lambda opt, a, k: seen.update(
                gradients=gradient_bytes(opt), allocated=torch.cuda.memory_allocated()))
            c, (h, w) = cfg.data.n_in_channels, cfg.data.img_size
            batch = (torch.randn(1, c, h, w, device=world.device), torch.randn(1, 1, c, h, w, device=world.device),
                     torch.arange(1))
            step(itertools.repeat(batch))
            torch.cuda.synchronize()
            counted = {"parameters": tensor_bytes(step.model.parameters()), "gradients": seen["gradients"],
                       "optimizer state": optimizer_state_bytes(step.optimizer)}
            allocator = {"parameters": built - base, "gradients": seen["allocated"] - built,
                         "optimizer state": torch.cuda.memory_allocated() - built}
            rows.append({"world_size": n, "rank": rank, "counted": counted,
                         "analytic": analytic_shard_bytes(cfg, world), "allocator": allocator,
                         "counted_equals_analytic": counted == analytic_shard_bytes(cfg, world)})
            del step
        finally:
            shutdown()
    return rows


def shards_in_child(config: str, folder: Path) -> list[dict]:
    """Part (c) in a child process, so that the CUDA memory it caches is not taken from part (b)'s budget."""
    child_out = folder / "plan_validation_shards.json"
    subprocess.run([sys.executable, __file__, "--parts", "c", "--shards_config", config, "--out", str(child_out)],
                   cwd=ROOT, check=True)
    rows = json.loads(child_out.read_text())["zero3_shards"]
    child_out.unlink()
    return rows


def main(argv: list[str]) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="a,b,c", help="which parts to run: a, b, c, d")
    ap.add_argument("--gpus", type=int, default=2, help="part (d): ranks of the real runs")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="part (d): comma list of " + ", ".join(LAYOUTS))
    ap.add_argument("--config", default="short", help="part (a)'s config (synthetic batches)")
    ap.add_argument("--shards_config", default="vit_2b", help="part (c)'s config")
    ap.add_argument("--planner_minutes", type=float, default=3.5, help="part (b): the tuner's --max_minutes")
    ap.add_argument("--planner_extra", default="", help="part (b): more tuner arguments")
    ap.add_argument("--expdir", default="/tmp/plan_validation_runs")
    ap.add_argument("--out", default="benchmarks/results/plan_validation.json")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        ap.error("needs a GPU: without one --simulate_world_size is a dry run, and part (c) reads the CUDA allocator")

    out = Path(args.out)
    payload = {"benchmark": "plan_validation", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__}
    parts = args.parts.split(",")
    if "a" in parts:
        payload["world_of_one"] = rows = world_of_one(args.config, Path(args.expdir))
        save_json(out, payload)
        print(table(rows, [("variant", "variant", "s"), ("peak alloc MiB", "peak_allocated_mib", "d"),
                           ("peak reserved MiB", "peak_reserved_mib", "d"), ("retries", "memory/alloc_retries", "d"),
                           ("equal", "equal_to_the_mib", "")]), flush=True)
    if "d" in parts:
        payload["real_ranks"] = rows = []
        real_ranks(args.layouts.split(","), args.gpus, Path(args.expdir), rows, lambda: save_json(out, payload))
        print(table(rows, [("variant", "variant", "s"), ("peak alloc MiB", "peak_allocated_mib", "d"),
                           ("sim/real alloc", "peak_allocated_ratio", ".3f"),
                           ("peak reserved MiB", "peak_reserved_mib", "d"),
                           ("sim/real reserved", "peak_reserved_ratio", ".3f"),
                           ("retries", "memory/alloc_retries", "d")]), flush=True)
    if "c" in parts:  # before (b): it is short, and (b) may meet its time limit
        payload["zero3_shards"] = rows = (zero3_shards(args.shards_config, (2, 4)) if parts == ["c"] else
                                          shards_in_child(args.shards_config, out.parent))
        save_json(out, payload)
        columns = [("world", "world_size", "d"), ("rank", "rank", "d")]
        for kind in ("parameters", "gradients", "optimizer state"):
            columns += [(f"{kind} {source} MiB", f"{source}.{kind}", ".2f") for source in
                        ("counted", "analytic", "allocator")]
        print(table([{**r, **{s: {k: v / MIB for k, v in r[s].items()} for s in ("counted", "analytic", "allocator")}}
                     for r in rows], columns + [("counted = analytic", "counted_equals_analytic", "")]), flush=True)
    if "b" in parts:
        payload["planner"] = row = planner(args.planner_minutes, out.parent, args.planner_extra.split())
        save_json(out, payload)
        print(table([row], [("wall min", "wall_minutes", ".1f"), ("trials", "trials", "d"),
                            ("pick", "pick.local_batch_size", "d"), ("samples/s", "pick.samples_per_s", ".1f"),
                            ("peak alloc MiB", "peak_allocated_mib", ".0f"),
                            ("peak reserved MiB", "peak_reserved_mib", ".0f"),
                            ("device memory MiB", "device_memory_bytes_mib", ".0f")]), flush=True)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
