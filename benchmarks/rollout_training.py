"""What rollout training costs: throughput and memory by ``--train_rollout_steps`` K, with and without
``--rollout_checkpointing`` (activation checkpointing per rollout step).

    python benchmarks/rollout_training.py --config tiny --variants 1,2,4,2c,4c --out benchmarks/results/cpu_rollout_training.json

A variant ``K`` trains at K rollout steps, ``Kc`` adds per-step checkpointing. Per variant:

* samples/s (initial states a second: a sample costs K forward and backward passes) of the training step on
  synthetic batches of the real shape, in this process: ``--rounds`` rounds that time ``--steps`` steps of every
  variant in turn, the best round kept (on a shared machine the other loads only ever slow a round down);
* the peak memory of a short ``train.py`` run (two epochs of ``--steps`` steps on the configured data; peak
  allocated on a GPU, peak RSS on the CPU, which is mostly the interpreter and libraries);
* the tensor peak of one step and its activations, measured by PyTorch's memory tracker on the planner's dry run
  (``--simulate_world_size 1``: fake tensors, exact bytes, nothing else in them).

Prints a table and saves JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, run_variant, table  # noqa: E402
from utils.core.errors import ArgumentParser, run_cli  # noqa: E402

COLUMNS = [("variant", "variant", "s"), ("K", "k", "d"), ("per-step AC", "checkpointed", "s"),
           ("samples/s", "samples_per_s", ".2f"), ("vs K=1", "relative_speed", ".2f"),
           ("peak GiB", "peak_gib", ".3f"), ("step tensors MiB", "tensor_peak_mib", ".1f"),
           ("activations MiB", "activations_mib", ".1f")]


def variant_args(variant: str) -> list[str]:
    """``4c`` -> ``--train_rollout_steps 4 --rollout_checkpointing true``."""
    k = variant.rstrip("c")
    return ["--train_rollout_steps", k] + (["--rollout_checkpointing", "true"] if variant.endswith("c") else [])


def tracked_step(common: list[str], config: str) -> dict:
    """Tensor peak and activations (MiB) of one step, from the planner's dry run on one simulated rank."""
    from distributed.launch import LaunchEnv
    from utils.config.command_line import cli_config
    from training.tuner.planner import dry_run
    plan = dry_run(cli_config([*common, "--simulate_world_size", "1"], config), LaunchEnv())[0]
    return {"tensor_peak_mib": plan.tensor_peak / 2**20, "activations_mib": plan.parts["activations"] / 2**20}


def step_seconds(variants: list[str], config: str, local_batch: int, steps: int, rounds: int) -> dict[str, float]:
    """Best seconds per optimizer step of each variant over ``rounds`` interleaved rounds of ``steps`` steps."""
    import itertools
    import time

    import torch

    from distributed.world import init_distributed
    from utils.config.command_line import cli_config
    from utils.data.synthetic_loader import SyntheticBatches
    from training.loop.rollout import max_rollout_steps
    from training.loop.step import build_training_step

    runs = {}
    for variant in variants:
        cfg = cli_config(["--config", config, "--local_batch_size", str(local_batch), *variant_args(variant)], config)
        world = init_distributed(cfg.parallel)
        step = build_training_step(cfg, world)
        batches = SyntheticBatches(1, local_batch, cfg.data.n_in_channels, cfg.data.img_size, world.device,
                                   target_steps=max_rollout_steps(cfg.optim))
        runs[variant] = (step, itertools.cycle(list(batches)))
        step(runs[variant][1])  # warm-up
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for variant, (step, batches) in runs.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step(batches)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best[variant] = min(best[variant], (time.perf_counter() - t0) / steps)
    return best


def main(argv: list[str]) -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--variants", default="1,2,4,2c,4c", help="comma list of K, with a c for per-step checkpointing")
    ap.add_argument("--local_batch_size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timed round, and per epoch of the runs")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds (the best kept)")
    ap.add_argument("--extra", default="", help="extra train.py arguments for every variant")
    ap.add_argument("--expdir", default="/tmp/rollout_training_runs")
    ap.add_argument("--out", default="benchmarks/results/rollout_training.json")
    args = ap.parse_args(argv)

    base = ["--config", args.config, "--local_batch_size", str(args.local_batch_size), "--log_every", "1000",
            "--limit_nsamples", str(args.steps * args.local_batch_size), "--num_iters", str(2 * args.steps),
            "--valid_every", "1000", *args.extra.split()]
    rows = Results(Path(args.out), config=args.config, local_batch_size=args.local_batch_size, extra=args.extra,
                   timing=f"best of {args.rounds} interleaved rounds of {args.steps} steps, synthetic batches")
    variants = args.variants.split(",")
    seconds = step_seconds(variants, args.config, args.local_batch_size, args.steps, args.rounds)
    for variant in variants:
        common = [*base, *variant_args(variant)]
        row = run_variant(f"rollout_{variant}", common, Path(args.expdir))
        row.pop("curve", None)
        row["samples_per_s"] = args.local_batch_size / seconds[variant]
        peak = row.get("memory/peak_allocated", row.get("memory/peak_rss"))
        row.update(k=int(variant.rstrip("c")), checkpointed="yes" if variant.endswith("c") else "no",
                   peak_gib=peak, **tracked_step(common, args.config))  # the record's memory is in GiB
        if rows and "samples_per_s" in row and "samples_per_s" in rows[0]:
            row["relative_speed"] = row["samples_per_s"] / rows[0]["samples_per_s"]
        rows.append(row)
    print(table(rows, COLUMNS))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
