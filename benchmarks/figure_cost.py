"""What the validation's TensorBoard figures cost a run's wall clock (docs/speed.md, round 5v).

    python benchmarks/figure_cost.py --runs 2 --out benchmarks/results/h200_figure_cost.json -- --config short_opt \\
        --data_path /tmp/full --data_loader_config synthetic --amp_mode bf16 --num_iters 512 \\
        --local_batch_size 16 --limit_nsamples 1024 --valid_every 1

Each run is ``train.py`` in a process of its own, ``--runs`` times with ``--figure_every 0`` (no figures) and
``1`` (figures at every validation), alternating. Rank 0 draws the figures on a thread beside the training
(``training/monitor/drawing.py``); what they cost shows on the wall clock, and in the epochs that train while they
are drawn. Per run, from ``metrics.jsonl``: the epochs; the wall clock per epoch from the first epoch's end
(which compiles) to the last's (``elapsed_s``); epoch 2's time, which holds the first drawing's one-off costs
(matplotlib's import and fonts); the median time and samples/s of the epochs from 3 on. The summary gives each
setting's mean wall clock per epoch and the figures' cost: ``1``'s less ``0``'s. Needs 3 epochs or more, and a
validation every epoch for a figure every epoch (``--valid_every 1``).
With ``--gpus`` N above 1 each run is N ranks under torchrun (the clocks are rank 0's: every rank waits for the
slowest at its next gradient all-reduce). Arguments after ``--`` go to the runs as ``train.py`` options.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, parse_runs, run_variant, runs_parser, succeeded_row, table  # noqa: E402
from benchmarks.multi_gpu import ranks_launch  # noqa: E402
from utils.core.errors import UserError, run_cli  # noqa: E402

COLUMNS = [("figure_every", "figure_every", "d"), ("run", "run", "d"), ("epochs", "epochs", "d"),
           ("wall s per epoch", "wall_s_per_epoch", ".3f"), ("epoch 2 s", "epoch_2_s", ".3f"),
           ("epochs 3+ s median", "epoch_s_median", ".3f"), ("samples/s median", "samples_per_s_median", ".1f")]


def clocks(curve: list[dict]) -> dict:
    """One run's clocks from its epochs' records (``elapsed_s``, ``epoch_time_s``, ``samples_per_s``; 3 or more).

    Raises:
        UserError: fewer than 3 epochs.
    """
    if len(curve) < 3:
        raise UserError(f"the run trained {len(curve)} epoch(s); give --num_iters for 3 or more epochs")
    later = curve[2:]
    return {"epochs": len(curve),
            "wall_s_per_epoch": (curve[-1]["elapsed_s"] - curve[0]["elapsed_s"]) / (len(curve) - 1),
            "epoch_2_s": curve[1]["epoch_time_s"],
            "epoch_s_median": statistics.median(e["epoch_time_s"] for e in later),
            "samples_per_s_median": statistics.median(e["samples_per_s"] for e in later)}


def cost(rows: list[dict]) -> dict:
    """Each setting's mean wall clock per epoch, and the figures' cost per epoch (s; with figures less without)."""
    mean = {every: statistics.fmean(r["wall_s_per_epoch"] for r in rows if r["figure_every"] == every)
            for every in (0, 1)}
    return {"wall_s_per_epoch_without": mean[0], "wall_s_per_epoch_with": mean[1],
            "figures_s_per_epoch": mean[1] - mean[0]}


def one_run(args, train_args: list[str], every: int, index: int) -> dict:
    """A ``train.py`` run with ``--figure_every every``; its row."""
    name = f"figure_every_{every}_{index}"
    row = succeeded_row(run_variant(name, [*train_args, "--figure_every", str(every)], Path(args.expdir).absolute(),
                                    **ranks_launch(args.gpus)), name)
    return {"figure_every": every, "run": index, **clocks(row["curve"]), "curve": row["curve"]}


def main(argv: list[str]) -> int:
    args, train_args = parse_runs(runs_parser(__doc__, "figure_cost"), argv)
    from utils.config.command_line import cli_config
    cli_config(train_args, "tiny", "benchmarks/figure_cost.py")  # bad options: before any run
    results = Results(Path(args.out), train_args=train_args, gpus=args.gpus)
    for index in range(args.runs):
        for every in (0, 1):
            results.append(one_run(args, train_args, every, index))
    results.meta["summary"] = cost(results)
    results.save()
    print(table(results, COLUMNS))
    summary = results.meta["summary"]
    print(f"wall clock per epoch: {summary['wall_s_per_epoch_without']:.3f} s without figures, "
          f"{summary['wall_s_per_epoch_with']:.3f} s with; the figures cost {summary['figures_s_per_epoch']:.3f} s "
          "an epoch")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
