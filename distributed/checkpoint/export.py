"""The model as one plain file: the single-GPU layout and names, whatever parallelism trained it.

* :func:`save_full_model`: gather the model (DDP/FSDP gathered, tensor/context-parallel slices
  reassembled) and write ``{"model": state_dict, **extra}`` with ``torch.save``, loadable with
  ``VisionTransformer.load_state_dict(torch.load(path)["model"])`` without torch.distributed;
* :func:`load_checkpoint_model`: the plain model of a run's config with the weights of one of its
  checkpoints (sharded or single-file), on the CPU, without torch.distributed;
* :func:`export_model`: a run's sharded checkpoint as one such file (``python -m tools.export_model``);
* what makes such a file self-contained (its "model package") is ``networks/model_file.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from distributed.checkpoint.folder import (DISK_FIX, describe_exception, folder_step, is_complete, load_candidates,
                                           save_file, step_folder, step_folders)
from distributed.checkpoint.storage import SafeReader, mismatched_file, read_manifest
from distributed.checkpoint.views import ViewLoadPlanner
from distributed.tensor_parallel import checkpoint_views
from networks.model_file import FINAL_MODEL, PACKAGE_FORMAT, config_sections, package_meta
from networks.vit import build_model
from utils.config.loading import load_run_config
from utils.config.schema import Config
from utils.core.errors import UserError
from utils.core.files import check_replaceable
from utils.core.safe_load import load_plain


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) CPU state dict in the plain model's names and shapes, on rank 0 (other ranks get an
    empty dict); collective: call on every rank. DTensors (FSDP, tensor parallel) are gathered by
    ``get_model_state_dict``; parameters held with head axes are reshaped to their plain shape."""
    views = checkpoint_views(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.reshape(views[k]) if k in views else v for k, v in state.items()}


def save_full_model(model: nn.Module, path: str | Path, extra: dict | None = None) -> None:
    """Gather the full model and write ``{"model": state_dict, **extra}`` to ``path`` on rank 0.

    Raises:
        UserError: the write failed (full disk, quota, I/O error); the previous file at ``path``
            is kept and the partial one removed.
    """
    state = full_model_state_dict(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    save_file({"model": state, **(extra or {})}, Path(path), DISK_FIX)


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
        state, n = _read_model_state(path, model)
        model.load_state_dict(state["model"])
    except UserError:
        raise
    except (Exception, CheckpointException) as exc:
        raise UserError(f"checkpoint {path} does not load into the model of {run_dir / 'config.yaml'} "
                        f"({describe_exception(exc)}); pick another with --step") from None
    return model, n


def _read_model_state(path: Path, model: nn.Module) -> tuple[dict, int]:
    """``({"model": state_dict}, step)`` of a sharded checkpoint folder (its files verified against their
    checksums, which a checkpoint marked as having them must have, its metadata and items read without running
    code) or of a single ``.pt`` file.

    Raises:
        UserError: a file that does not match its checksum, or that holds more than plain data.
    """
    if not path.is_dir():
        state = load_plain(path)
        return state, int(state.get("step", -1)) if isinstance(state, dict) else -1
    manifest = read_manifest(path)
    bad = None if manifest is None else mismatched_file(path, manifest)
    if bad is not None:
        raise UserError(f"checkpoint {bad}; pick another with --step")
    state = {"model": model.state_dict()}  # the key layout the manager saves: {"model": <plain state_dict>, ...}
    dcp.load(state, storage_reader=SafeReader(path).checked(), planner=ViewLoadPlanner({}), no_dist=True)
    return state, folder_step(path)


def export_model(run_dir: Path, step: int | None = None, out: Path | None = None,
                 overwrite: bool = False) -> tuple[Path, int]:
    """Write the model of ``run_dir``'s checkpoint at ``step`` (default: the latest) to ``out``
    (default ``<run_dir>/checkpoints/model_step_<N>.pt``) with :func:`package_meta` (read from the run's data
    folder); returns ``(out, N)``. An existing ``out`` is replaced only with ``overwrite``, and only a regular
    file (never a link, FIFO or device: ``utils.core.files.check_replaceable``).

    Raises:
        UserError: no run directory or config, no such checkpoint, a checkpoint that does not load
            into the config's model, unreadable data statistics, ``out`` exists (without ``overwrite``) or is
            not a regular file (checked before anything is read), or the write failed (full disk: the
            previous file is kept).
    """
    run_dir = Path(run_dir)
    if out is not None:
        check_replaceable(Path(out), overwrite)
    cfg = load_run_config(run_dir)
    model, n = load_checkpoint_model(run_dir, cfg, path=pick_checkpoint(run_dir / "checkpoints", step))
    out = Path(out) if out is not None else run_dir / "checkpoints" / f"model_step_{n}.pt"
    check_replaceable(out, overwrite)
    save_file({"model": model.state_dict(), "step": n, **_export_meta(run_dir, cfg)}, out,
              "free space or pass --out on a larger filesystem", overwrite)
    return out, n


def _export_meta(run_dir: Path, cfg: Config) -> dict:
    """The package metadata of an export: the run's own ``model.pt``'s when it is self-contained (the data it was
    trained on), else read from the data folder; without one, the config and a note saying what is missing."""
    final = run_dir / "checkpoints" / FINAL_MODEL
    if final.is_file():
        package = load_plain(final)
        if isinstance(package, dict) and package.get("format") == PACKAGE_FORMAT:
            return {k: v for k, v in package.items() if k not in ("model", "step")}
    try:
        return package_meta(cfg)
    except UserError as exc:
        return {"config": config_sections(cfg), "note": f"not self-contained: the data folder could not be read "
                                                        f"({exc}); Forecaster.from_run needs it"}

