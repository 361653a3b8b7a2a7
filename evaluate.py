"""Score a trained run's forecasts by lead time, the WeatherBench 2 way, against persistence and climatology.

    python evaluate.py --run_dir runs/tiny/1GPU/00 --lead_steps 20
    torchrun --nproc_per_node 4 evaluate.py --run_dir RUN_DIR --lead_steps 40   # initial times split over ranks

What it reads, scores and writes: ``training/evaluation/evaluate_run.py`` and docs/evaluation.md.
"""

import sys

from utils.core.errors import run_cli
from training.evaluation.evaluate_run import main

if __name__ == "__main__":
    sys.exit(run_cli(main))
