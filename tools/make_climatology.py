"""Compute the climatology by day of year and hour of day of an existing dataset: ``<DATA_PATH>/stats/climatology.h5``.

The data tools (``tools.convert_era5``, ``tools.make_synthetic_data``) write it themselves; this tool adds it to a
dataset made before they did, or one too large for their single pass (channels are accumulated in groups that
fit ``--max_memory_gib``). The method, WeatherBench 2's (Rasp et al. 2024): per hour of day, the mean over the
training years of each day of year, smoothed with a 61-day triangular window (``utils/data/climatology.py``)::

    python -m tools.make_climatology data/tiny
    python -m tools.make_climatology /scratch/era5 --max_memory_gib 64
"""

from __future__ import annotations

import sys
from pathlib import Path

from utils.core.errors import ArgumentParser, UserError, run_cli
from utils.data.climatology import WINDOW_DAYS
from utils.preprocess.climatology_builder import make_climatology


def build_parser() -> ArgumentParser:
    """The CLI's argument parser (usage errors are one ``error:`` line, exit status 2)."""
    p = ArgumentParser(prog="python -m tools.make_climatology", description=__doc__.splitlines()[0])
    p.add_argument("data_path", type=Path, help="dataset folder with train/, valid/ and stats/")
    p.add_argument("--max_memory_gib", type=float, default=4.0,
                   help="memory for the float64 sums and the smoothed result; more channels per pass over the "
                        "data (default 4)")
    p.add_argument("--window_days", type=int, default=WINDOW_DAYS,
                   help=f"smoothing window over day of year, odd (default {WINDOW_DAYS}, WeatherBench 2's)")
    return p


def make_from_args(argv: list[str]) -> None:
    """Parse ``argv``, compute the climatology and say where it went."""
    args = build_parser().parse_args(argv)
    if args.max_memory_gib <= 0 or args.window_days < 1 or args.window_days % 2 == 0:
        raise UserError("--max_memory_gib must be > 0 and --window_days an odd number >= 1")
    path = make_climatology(args.data_path, int(args.max_memory_gib * 2 ** 30), args.window_days, verbose=True)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 with ``error: ...`` on stderr for bad input)."""
    return run_cli(make_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
