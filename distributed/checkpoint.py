"""Saving and loading models however they are parallelized.

* :func:`save_full_model`: one plain ``torch.save`` file with the single-GPU layout and names
  (DDP/FSDP gathered, tensor/context-parallel slices reassembled), loadable with
  ``VisionTransformer.load_state_dict(torch.load(path)["model"])`` without torch.distributed.
* :func:`save_sharded` / :func:`load_sharded`: ``torch.distributed.checkpoint`` (DCP) folders
  where every rank writes and reads only its own shards (model and optimizer).

Files are written to a temporary name and renamed, so an interrupted save never replaces a
good checkpoint with a truncated one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from utils.errors import UserError


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict with the plain model's keys; collective: call on every rank."""
    from distributed.parallelize import is_tensor_context_parallel, unwrap
    if is_tensor_context_parallel(model):
        from distributed.tensor_parallel import full_state_dict
        return full_state_dict(unwrap(model))
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_full_model(model: nn.Module, path: str | Path, extra: dict | None = None) -> None:
    """Gather the full model and write ``{"model": state_dict, **extra}`` to ``path`` on rank 0.

    Raises:
        UserError: the write failed (full disk, quota, I/O error); the previous file at ``path``
            is kept and the partial one removed.
    """
    state = full_model_state_dict(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # through a Python file, so a full disk raises OSError(ENOSPC) (behind the zip writer's
        # "unexpected pos" RuntimeError) instead of a bare RuntimeError
        with open(tmp, "wb") as f:
            torch.save({"model": state, **(extra or {})}, f)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        cause = _os_error(exc)
        if cause is None:
            raise
        tmp.unlink(missing_ok=True)
        raise UserError(f"writing checkpoint {path} failed: {cause.strerror or cause} ({_free_space(path.parent)}); "
                        "any previous checkpoint is kept: free space or pass --expdir on a larger filesystem "
                        "(or --save_checkpoint false)") from None


def _os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc`` (itself, or the one it was raised while handling), if any."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def _free_space(directory: Path) -> str:
    try:
        return f"{shutil.disk_usage(directory).free / 2**30:.2f} GiB free there"
    except OSError:
        return "free space unknown"


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Write model and optimizer shards with DCP into ``directory`` (collective)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Load shards written by :func:`save_sharded` into an identically parallelized model (collective)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
