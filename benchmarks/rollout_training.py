"""What rollout training costs: throughput and memory by ``--train_rollout_steps`` K, with and without
``--rollout_checkpointing`` (activation checkpointing per rollout step).

    python benchmarks/rollout_training.py --config tiny --variants 1,2,4,2c,4c --out benchmarks/results/cpu_rollout_training.json

A variant ``K`` trains at K rollout steps, ``Kc`` adds per-step checkpointing. Each trains two short epochs and
reports the second: samples/s (initial states a second: a sample costs K forward and backward passes), the
process's peak memory (peak allocated on a GPU, peak RSS on the CPU: mostly the interpreter and libraries), and
the tensor peak of one step and its activations, measured by PyTorch's memory tracker on the planner's dry run
(``--simulate_world_size 1``: fake tensors, exact bytes, nothing else in them). Prints a table and saves JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, run_variant, table  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--variants", default="1,2,4,2c,4c", help="comma list of K, with a c for per-step checkpointing")
    ap.add_argument("--local_batch_size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per epoch (two epochs, the second timed)")
    ap.add_argument("--extra", default="", help="extra train.py arguments for every variant")
    ap.add_argument("--expdir", default="/tmp/rollout_training_runs")
    ap.add_argument("--out", default="benchmarks/results/rollout_training.json")
    args = ap.parse_args()

    base = ["--config", args.config, "--local_batch_size", str(args.local_batch_size), "--log_every", "1000",
            "--limit_nsamples", str(args.steps * args.local_batch_size), "--num_iters", str(2 * args.steps),
            "--valid_every", "1000", *args.extra.split()]
    rows = Results(Path(args.out), config=args.config, local_batch_size=args.local_batch_size, extra=args.extra)
    for variant in args.variants.split(","):
        common = [*base, *variant_args(variant)]
        row = run_variant(f"rollout_{variant}", common, Path(args.expdir))
        row.pop("curve", None)
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
    sys.exit(main())
