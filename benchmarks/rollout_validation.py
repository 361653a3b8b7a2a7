"""What rollout validation costs: an epoch of training plus its validation, by ``--valid_rollout_steps`` K
and ``--valid_init_every`` n, on the native loader (``pytorch``).

    python benchmarks/rollout_validation.py --data_path /data/full --config short_opt --variants 1x1,4x1,4x4 \
        --out benchmarks/results/h100_rollout_validation.json

Each variant ``KxN`` trains two epochs, validating after each, and reports the second: the training
epoch's seconds, the validation's seconds (``valid_time_s``), their sum, and what it adds to the first
variant's sum. Prints a table and saves JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, run_variant, table  # noqa: E402
from utils.core.errors import ArgumentParser, run_cli  # noqa: E402

COLUMNS = [("variant", "variant", "s"), ("train s", "epoch_time_s", ".2f"),
           ("valid s", "valid_time_s", ".2f"), ("epoch + valid s", "total_s", ".2f"), ("added", "added", ".1%"),
           ("samples/s", "samples_per_s", ".1f"), ("valid samples", "valid_samples", "d")]


def main(argv: list[str]) -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="short_opt")
    ap.add_argument("--data_path", required=True)
    ap.add_argument("--variants", default="1x1,4x1,4x4", help="comma list of K x n: rollout steps x init every")
    ap.add_argument("--extra", default="--data_loader_config pytorch --num_data_workers 8",
                    help="extra train.py arguments for both variants")
    ap.add_argument("--expdir", default="/tmp/rollout_runs")
    ap.add_argument("--out", default="benchmarks/results/rollout_validation.json")
    args = ap.parse_args(argv)

    from utils.config.loading import load_config
    cfg = load_config("config/ViT.yaml", args.config)
    steps = (cfg.data.limit_nsamples or 512) // cfg.optim.global_batch_size
    rows = Results(Path(args.out), config=args.config, extra=args.extra)
    for variant in args.variants.split(","):
        k, every = variant.split("x")
        common = ["--config", args.config, "--data_path", args.data_path, "--num_iters", str(2 * steps),
                  "--valid_every", "1", "--log_every", "1000", "--valid_rollout_steps", k, "--valid_init_every", every,
                  "--figure_every", "0", *args.extra.split()]  # figures drawn in epoch 2 would count in its time
        row = run_variant(f"rollout_{variant}", common, Path(args.expdir))
        if "valid_time_s" in row:
            row["total_s"] = row["epoch_time_s"] + row["valid_time_s"]
            row["added"] = row["total_s"] / rows[0]["total_s"] - 1 if rows and "total_s" in rows[0] else 0.0
        row.pop("scorecard", None)  # the skill of an untrained model: not what is measured here
        rows.append(row)
    print(table(rows, COLUMNS))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
