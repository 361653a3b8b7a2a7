"""Export a run's model from its sharded checkpoint as one file, on the CPU, without torch.distributed.

The training run's sharded checkpoints (``<run_dir>/checkpoints/step_*``, written by
``distributed/checkpoint/manager.py`` on any number of GPUs) hold the model in pieces, with
the optimizer. This tool reads just the model part of one (DCP reassembles the shards) into the
plain model of the run's ``config.yaml`` and writes ``{"model": state_dict, "step": N, "config": {...}}``,
the layout of the trainer's final ``checkpoints/model.pt``::

    python -m tools.export_model runs/tiny/4GPU/00                  # the latest complete checkpoint
    python -m tools.export_model runs/tiny/4GPU/00 --step 500 --out tiny_500.pt

    model = build_model(cfg.model, cfg.data)
    model.load_state_dict(torch.load("tiny_500.pt")["model"])
"""

from __future__ import annotations

import sys
from pathlib import Path

from distributed.checkpoint.export import export_model
from utils.core.errors import ArgumentParser, run_cli
from utils.core.files import output_path_type
from utils.core.signals import StopOnSignal


def build_parser() -> ArgumentParser:
    """The CLI's argument parser (usage errors are one ``error:`` line, exit status 2)."""
    p = ArgumentParser(prog="python -m tools.export_model",
                       description="Write a run's model from its sharded checkpoint as one plain torch.save file.")
    p.add_argument("run_dir", type=Path, help="run directory <expdir>/<config>/<N>GPU/<run_num>")
    p.add_argument("--step", type=int, default=None,
                   help="export the checkpoint of this optimizer step (default: the latest complete one)")
    p.add_argument("--out", type=output_path_type("--out"), default=None,
                   help="output file (default: <run_dir>/checkpoints/model_step_<N>.pt)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output file (never a link, FIFO or device)")
    return p



def export_from_args(argv: list[str]) -> None:
    """Parse ``argv``, export, and say what was written."""
    args = build_parser().parse_args(argv)
    out, step = export_model(args.run_dir, args.step, args.out, args.overwrite)
    print(f"wrote {out} (model at step {step})")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 with ``error: ...`` on stderr for bad input)."""
    with StopOnSignal():  # SIGTERM, SIGUSR1, Ctrl-C: one line, exit 75, no half-written output
        return run_cli(export_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
