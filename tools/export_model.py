"""Export a run's model from its sharded checkpoint as one file, on the CPU, without torch.distributed.

The training run's sharded checkpoints (``<run_dir>/checkpoints/step_*``, written by
``distributed.checkpoint.CheckpointManager`` on any number of GPUs) hold the model in pieces, with
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

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from distributed.checkpoint import (describe_exception, folder_step, is_complete, load_candidates, save_file,
                                    step_folder, step_folders)
from networks.vit import build_model
from utils.config import load_config, read_yaml
from utils.errors import ArgumentParser, UserError, exit_status
from utils.schema import Config

FINAL_MODEL = "model.pt"  # the trainer's single-file model at the end of a run
RUN_DIR_HINT = "pass a run directory written by train.py (<expdir>/<config>/<N>GPU/<run_num>)"


def read_run_config(run_dir: Path) -> Config:
    """The resolved config a run was trained with (its ``config.yaml``: one named config).

    Raises:
        UserError: no such directory or file, or not a file of one named config.
    """
    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} not found; {RUN_DIR_HINT}")
    if not path.is_file():
        raise UserError(f"{run_dir} has no config.yaml; {RUN_DIR_HINT}")
    names = list(read_yaml(path))
    if len(names) != 1:
        raise UserError(f"{path} holds {len(names)} configs ({', '.join(names)}); expected the one resolved config "
                        "that train.py writes: restore the run's file")
    return load_config(path, names[0])


def pick_checkpoint(directory: Path, step: int | None) -> Path:
    """The complete checkpoint folder of ``step``, or by default the latest one.

    Raises:
        UserError: there is none (naming the complete ones).
    """
    if step is None:
        candidates = load_candidates(directory)
        if not candidates:
            raise UserError(f"no complete checkpoint in {directory}; train with --save_checkpoint true "
                            "(it saves every --checkpoint_every_steps and at the end)")
        return candidates[0]
    folder = step_folder(directory, step)
    if not is_complete(folder):
        steps = ", ".join(str(folder_step(f)) for f in step_folders(directory) if is_complete(f)) or "none"
        raise UserError(f"no complete checkpoint {folder.name} in {directory} (complete steps: {steps}); "
                        "pass one of them with --step")
    return folder


def load_checkpoint_model(run_dir: Path, cfg: Config, step: int | None = None,
                          path: Path | None = None) -> tuple[nn.Module, int]:
    """The plain model of ``cfg`` (on the CPU) with the weights of one of ``run_dir``'s checkpoints, and
    its optimizer step.

    ``path``: a sharded checkpoint folder or a single file written by this tool or the trainer
    (``checkpoints/model.pt``); else the sharded checkpoint of ``step`` (default: the latest, or
    ``checkpoints/model.pt`` when the run kept no sharded one).

    Raises:
        UserError: no such checkpoint, or one that does not load into the config's model.
    """
    model = build_model(cfg.model, cfg.data)
    if path is None:
        final = run_dir / "checkpoints" / FINAL_MODEL
        use_final = step is None and not load_candidates(run_dir / "checkpoints") and final.is_file()
        path = final if use_final else pick_checkpoint(run_dir / "checkpoints", step)
    elif path.is_dir() and not is_complete(path):
        raise UserError(f"{path} is not a complete sharded checkpoint; pass a step_* folder with its .metadata, "
                        "or a .pt file written by python -m tools.export_model")
    try:
        if path.is_dir():  # the key layout CheckpointManager saved: {"model": <plain model state_dict>, ...}
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=path, no_dist=True)
            n = folder_step(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            n = int(state.get("step", -1))
        model.load_state_dict(state["model"])
    except (Exception, CheckpointException) as exc:
        raise UserError(f"checkpoint {path} does not load into the model of {run_dir / 'config.yaml'} "
                        f"({describe_exception(exc)}); pick another with --step") from None
    return model, n


def export_model(run_dir: Path, step: int | None = None, out: Path | None = None) -> tuple[Path, int]:
    """Write the model of ``run_dir``'s checkpoint at ``step`` (default: the latest) to ``out``
    (default ``<run_dir>/checkpoints/model_step_<N>.pt``); returns ``(out, N)``.

    Raises:
        UserError: no run directory or config, no such checkpoint, a checkpoint that does not load
            into the config's model, or the write failed (full disk: the previous file is kept).
    """
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    model, n = load_checkpoint_model(run_dir, cfg, path=pick_checkpoint(run_dir / "checkpoints", step))
    out = Path(out) if out is not None else run_dir / "checkpoints" / f"model_step_{n}.pt"
    save_file({"model": model.state_dict(), "step": n, "config": cfg.flat()}, out,
              "free space or pass --out on a larger filesystem")
    return out, n


def build_parser() -> ArgumentParser:
    """The CLI's argument parser (usage errors are one ``error:`` line, exit status 2)."""
    p = ArgumentParser(prog="python -m tools.export_model",
                       description="Write a run's model from its sharded checkpoint as one plain torch.save file.")
    p.add_argument("run_dir", type=Path, help="run directory <expdir>/<config>/<N>GPU/<run_num>")
    p.add_argument("--step", type=int, default=None,
                   help="export the checkpoint of this optimizer step (default: the latest complete one)")
    p.add_argument("--out", type=Path, default=None,
                   help="output file (default: <run_dir>/checkpoints/model_step_<N>.pt)")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 with ``error: ...`` on stderr for bad input)."""
    args = build_parser().parse_args(argv)

    def run() -> None:
        out, step = export_model(args.run_dir, args.step, args.out)
        print(f"wrote {out} (model at step {step})")

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
