"""Generate a synthetic ERA5-like dataset in the training layout (what it holds: ``utils/preprocess/synthetic_dataset.py``).

Usage::

    python -m tools.make_synthetic_data --out data/synthetic
    python -m tools.make_synthetic_data --out data/era5_like --channels 20 --img_size 360 720 \\
        --train_years 1 --steps_per_year 520 --valid_years 1
"""

from __future__ import annotations

import sys

from utils.core.errors import ArgumentParser, run_cli
from utils.core.files import output_path_type
from utils.preprocess.synthetic_dataset import make_synthetic_dataset


def build_parser() -> ArgumentParser:
    """The CLI's argument parser (flags mirror :func:`make_synthetic_dataset`; usage errors are one
    ``error:`` line)."""
    p = ArgumentParser(prog="python -m tools.make_synthetic_data",
                       description="Write a synthetic ERA5-like dataset (train/, valid/, stats/).")
    p.add_argument("--out", required=True, type=output_path_type("--out"), help="output dataset folder")
    p.add_argument("--channels", type=int, default=4, help="number of channels C (default 4)")
    p.add_argument("--img_size", type=int, nargs=2, default=(32, 64), metavar=("H", "W"),
                   help="grid size (default 32 64)")
    p.add_argument("--train_years", type=int, default=2, help="training files (default 2)")
    p.add_argument("--valid_years", type=int, default=1, help="validation files (default 1)")
    p.add_argument("--steps_per_year", type=int, default=64, help="time steps per file (default 64)")
    p.add_argument("--dt_hours", type=float, default=6.0, help="hours between steps (default 6)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    p.add_argument("--workers", type=int, default=1, help="files generated in parallel processes (default 1)")
    return p


def generate_from_args(argv: list[str]) -> None:
    """Parse ``argv`` and write the dataset."""
    args = build_parser().parse_args(argv)
    make_synthetic_dataset(args.out, args.channels, tuple(args.img_size), args.train_years, args.valid_years,
                           args.steps_per_year, args.dt_hours, args.seed, overwrite=args.overwrite, verbose=True,
                           workers=args.workers)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 with ``error: ...`` on stderr for bad input)."""
    return run_cli(generate_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
