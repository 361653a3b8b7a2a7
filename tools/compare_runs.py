"""Compare training runs: a table of what differs and how they did, plus loss/RMSE plots.

Usage::

    python -m tools.compare_runs runs/tiny/1GPU/00 runs/tiny/2GPU/00
    python -m tools.compare_runs --expdir runs --config 'tiny*'
    python -m tools.compare_runs --expdir runs --channels t2m,z500 --out plots/
    python -m tools.compare_runs --expdir runs --json | jq '.runs[].samples_per_s'

What the table and the plots hold: ``training/evaluation/run_comparison.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from utils.core.errors import ArgumentParser, UserError, run_cli
from utils.core.files import output_path_type
from utils.core.signals import StopOnSignal
from training.evaluation.run_comparison import (default_out, differing_keys, finite, format_table, key_channels, load_runs,
                                   run_row, write_plots)


def parse_args(argv: Optional[list[str]]):
    """The command-line options (see the module docstring)."""
    parser = ArgumentParser(prog="python -m tools.compare_runs",
                            description="Compare training runs: a table of differing config keys, throughput, "
                                        "memory and accuracy, plus loss/RMSE plots.")
    parser.add_argument("run_dirs", nargs="*", type=Path, metavar="RUN_DIR",
                        help="run directories <expdir>/<config>/<N>GPU/<run_num>")
    parser.add_argument("--expdir", type=Path, help="compare every run under this directory (with the RUN_DIRs)")
    parser.add_argument("--config", help="with --expdir: only configs whose name matches this glob")
    parser.add_argument("--out", type=output_path_type("--out"),
                        help="directory for the PNG plots (default: <expdir>/compare_runs, else compare_runs "
                             "beside the run directories)")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of the table")
    parser.add_argument("--channels", help="comma-separated key channels (default: the runs' key_channels, "
                                           "else the first 4 common to all runs)")
    args = parser.parse_args(argv)
    if args.channels is not None:
        args.channels = [c.strip() for c in args.channels.split(",") if c.strip()]
        if not args.channels:
            raise UserError("--channels is empty; pass channel names like --channels t2m,z500")
    return args


def compare(argv: Optional[list[str]] = None) -> None:
    """Load the runs, then print the table (or JSON) and write the plots."""
    args = parse_args(argv)
    runs = load_runs(args.run_dirs, args.expdir, args.config)
    keys = differing_keys(runs)
    channels = key_channels(runs, args.channels)
    rows = [run_row(run, keys, channels) for run in runs]
    plots, notes = write_plots(runs, channels, args.out or default_out([r.path for r in runs], args.expdir), keys)
    for note in notes:  # stderr, so that --json output stays a single document
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        doc = {"runs": rows, "differing_keys": keys, "channels": channels, "plots": [str(p) for p in plots]}
        # NaN/Inf are not JSON: a diverged loss becomes null
        print(json.dumps(finite(doc), indent=2))
        return
    print(format_table(rows, keys, channels))
    for path in plots:
        print(f"wrote {path}")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: exit status 0, or 2 with a one-line ``error: ...`` for bad input."""
    with StopOnSignal():  # SIGTERM, SIGUSR1, Ctrl-C: one line, exit 75, no half-written output
        return run_cli(compare, argv)


if __name__ == "__main__":
    sys.exit(main())
