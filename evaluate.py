"""Score a trained run's forecasts by lead time, the WeatherBench 2 way, against persistence and climatology.

    python evaluate.py --run_dir runs/tiny/1GPU/00 --lead_steps 20
    torchrun --nproc_per_node 4 evaluate.py --run_dir RUN_DIR --lead_steps 40   # initial times split over ranks

What it reads, scores and writes: ``training/evaluation/evaluate_run.py`` and docs/evaluation.md.
"""

import sys

from utils.core.errors import run_cli
from utils.core.signals import StopOnSignal


def main(argv: list[str]) -> None:
    """Evaluate (``training.evaluation.evaluate_run.main``), imported here so that a signal during the imports
    stops it in one line too."""
    from training.evaluation.evaluate_run import main as evaluate
    evaluate(argv)


if __name__ == "__main__":
    with StopOnSignal():  # SIGTERM, SIGUSR1, Ctrl-C: one line, exit 75, no half-written output
        sys.exit(run_cli(main))
