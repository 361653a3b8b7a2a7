"""The model as one plain file: the single-GPU layout and names, whatever parallelism trained it.

* :func:`save_full_model`: gather the model (DDP/FSDP gathered, tensor/context-parallel slices
  reassembled) and write ``{"model": state_dict, **extra}`` with ``torch.save``, loadable with
  ``VisionTransformer.load_state_dict(torch.load(path)["model"])`` without torch.distributed;
* :func:`load_checkpoint_model`: the plain model of a run's config with the weights of one of its
  checkpoints (sharded or single-file), on the CPU, without torch.distributed;
* :func:`export_model`: a run's sharded checkpoint as one such file (``python -m tools.export_model``);
* :func:`package_meta`: what makes such a file self-contained (a "model package", as makani saves one): the
  config section by section, normalization statistics, channel names and units, grid, time step and calendar,
  and the climatology when small (else a note). All plain data, so ``torch.load(weights_only=True)`` reads it and
  ``utils.evaluation.forecast.Forecaster.from_file`` forecasts with nothing else (docs/python-api.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from distributed.checkpoint.files import (DISK_FIX, describe_exception, folder_step, is_complete, load_candidates,
                                          read_checksums, save_file, step_folder, step_folders)
from distributed.checkpoint.storage import SafeReader, load_plain, mismatched_file
from distributed.checkpoint.views import ViewLoadPlanner
from distributed.tensor_parallel import checkpoint_views
from networks.vit import build_model
from utils.config.loading import load_run_config
from utils.config.schema import SECTIONS, Config
from utils.config.types import plain
from utils.core.errors import UserError
from utils.data.layout import DEFAULT_STEP_HOURS, resolve_data_path
from utils.data.metadata import equiangular_latitudes, read_channel_units
from utils.data.stats import Stats
from utils.data.timestep import TimeStep

FINAL_MODEL = "model.pt"  # the trainer's single-file model at the end of a run


PACKAGE_FORMAT = "era5-vit model package 1"


CLIMATOLOGY_MAX_BYTES = 16 << 20  # a climatology up to this size travels inside the model file


def config_sections(cfg: Config) -> dict:
    """``{"name": ..., "model": {key: value}, "data": {...}, ...}``: the config section by section, plain values."""
    return {"name": cfg.name, **{section: {k: plain(v) for k, v in dataclasses.asdict(getattr(cfg, section)).items()}
                                 for section in SECTIONS}}


def package_meta(cfg: Config, data=None) -> dict:
    """Everything a model file holds besides the weights, as plain data (tensors, numbers, strings, lists, dicts).

    ``data``: the run's ``utils.data.loaders.Data`` (the trainer passes it); without it the data folder of
    ``cfg.data.data_path`` is read (a relative path found as ``evaluate.py`` finds it). Keys: ``format``,
    ``config`` (:func:`config_sections`), ``channels``, ``channel_units``, ``normalization`` (``mean``/``std``
    float32 ``(C,)``), ``grid`` (``latitude`` ``(H,)``/``longitude`` ``(W,)`` float64 degrees), ``time``
    (``step``, ``unit``, ``dt``, ``calendar``, ``step_hours``), ``climatology`` (``values`` float32 ``(D, K, C,
    H, W)``, ``hour``, ``calendar``, ``window_days``, ``description``; or ``note`` saying why not).

    Raises:
        UserError: the data folder's statistics or files cannot be read.
    """
    c, (h, w) = cfg.data.n_in_channels, cfg.data.img_size
    if data is None and cfg.data.data_loader_config != "synthetic":
        data = _read_data(cfg)
    dataset = getattr(data, "train_dataset", None)
    stats = data.stats if data is not None else Stats.identity(c, (h, w), "cpu")
    names = list(data.channel_names) if data is not None else [f"c{i}" for i in range(c)]
    lat = data.latitude if data is not None else equiangular_latitudes(h)
    axis = dataset.files[0].axis if dataset is not None else None
    step = axis.step if axis is not None else TimeStep.from_hours(DEFAULT_STEP_HOURS)
    return {"format": PACKAGE_FORMAT, "config": config_sections(cfg), "channels": names,
            "channel_units": read_channel_units(dataset.files[0].path, c) if dataset is not None else [""] * c,
            "normalization": {"mean": stats.mean.detach().cpu().reshape(-1).clone(),
                              "std": stats.std.detach().cpu().reshape(-1).clone()},
            "grid": {"latitude": torch.as_tensor(np.asarray(lat, dtype=np.float64)[:h]),
                     "longitude": torch.as_tensor(axis.longitude if axis is not None
                                                  else np.linspace(0, 360, w, endpoint=False))},
            "time": {"step": float(step.value), "unit": step.unit, "dt": cfg.data.dt,
                     "calendar": axis.calendar if axis is not None else "standard",
                     "step_hours": step.hours(axis.calendar if axis is not None else "standard")},
            "climatology": _climatology(stats.climatology)}


def _read_data(cfg: Config):
    """The parts of the run's data a package needs, read from the data folder (no loader built)."""
    from types import SimpleNamespace

    from utils.data.dataset import ERA5Dataset
    from utils.data.metadata import read_metadata
    root = resolve_data_path(cfg.data.data_path)
    c, img = cfg.data.n_in_channels, tuple(cfg.data.img_size)
    dataset = ERA5Dataset(root / "train", c, img, cfg.data.dt)
    names, lat = read_metadata(dataset.files[0].path, c, img[0])
    return SimpleNamespace(stats=Stats.load(root / "stats", c, img, "cpu"), channel_names=names, latitude=lat,
                           train_dataset=dataset)


def _climatology(clim) -> dict:
    if clim is None:
        return {"note": "the data have no stats/climatology.h5: ACC and the climatology baseline use the time mean"}
    size = int(np.prod(clim.shape[:3])) * clim.img_size[0] * clim.img_size[1] * 4
    if size > CLIMATOLOGY_MAX_BYTES:
        return {"note": f"not included ({size / 2 ** 20:.0f} MiB, more than {CLIMATOLOGY_MAX_BYTES >> 20} MiB): it is "
                        f"{clim.path} of the training data (python -m tools.make_climatology makes it)"}
    cells = np.arange(clim.shape[0] * clim.shape[1])
    values = clim.read(cells).reshape(*clim.shape[:3], *clim.img_size)
    return {"values": torch.from_numpy(values), "hour": torch.as_tensor(clim.hours), "calendar": clim.calendar,
            "window_days": clim.window, "description": clim.describe()}


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
    checksums, its metadata and items read without running code) or of a single ``.pt`` file.

    Raises:
        UserError: a file that does not match its checksum, or that holds more than plain data.
    """
    if not path.is_dir():
        state = load_plain(path)
        return state, int(state.get("step", -1)) if isinstance(state, dict) else -1
    manifest = read_checksums(path)
    bad = None if manifest is None else mismatched_file(path, manifest)
    if bad is not None:
        raise UserError(f"checkpoint {bad}; pick another with --step")
    state = {"model": model.state_dict()}  # the key layout the manager saves: {"model": <plain state_dict>, ...}
    dcp.load(state, storage_reader=SafeReader(path).checked(), planner=ViewLoadPlanner({}), no_dist=True)
    return state, folder_step(path)


def export_model(run_dir: Path, step: int | None = None, out: Path | None = None) -> tuple[Path, int]:
    """Write the model of ``run_dir``'s checkpoint at ``step`` (default: the latest) to ``out``
    (default ``<run_dir>/checkpoints/model_step_<N>.pt``) with :func:`package_meta` (read from the run's data
    folder); returns ``(out, N)``.

    Raises:
        UserError: no run directory or config, no such checkpoint, a checkpoint that does not load
            into the config's model, unreadable data statistics, or the write failed (full disk: the
            previous file is kept).
    """
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    model, n = load_checkpoint_model(run_dir, cfg, path=pick_checkpoint(run_dir / "checkpoints", step))
    out = Path(out) if out is not None else run_dir / "checkpoints" / f"model_step_{n}.pt"
    save_file({"model": model.state_dict(), "step": n, **_export_meta(run_dir, cfg)}, out,
              "free space or pass --out on a larger filesystem")
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


def read_init_weights(source: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The weights ``--init_from source`` starts a fine-tune from: the plain ``state_dict`` in a finished run's
    ``checkpoints/model.pt`` (``source`` the run directory, its ``checkpoints`` folder or the file itself), read
    without running code and checked against ``expected`` (``{name: plain shape}`` of this config's model).

    Raises:
        UnsafeCheckpoint, UserError: no such file (an unfinished run), a damaged file, one that is not a model
            file of this framework, or tensors missing, extra or of another shape (naming the first).
    """
    source = Path(source)
    path = next((p for p in (source / "checkpoints" / FINAL_MODEL, source / FINAL_MODEL) if p.is_file()), source)
    if path.is_dir():
        raise UserError(f"--init_from {source}: no checkpoints/{FINAL_MODEL} there (the run has not finished); "
                        f"let it finish, or write one with python -m tools.export_model {source}")
    state = load_plain(path)
    weights = state.get("model") if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not all(torch.is_tensor(v) for v in weights.values()):
        raise UserError(f"--init_from {path} is not a model file of this framework (no 'model' state_dict of "
                        "tensors); pass a run directory or the checkpoints/model.pt a run or tools.export_model wrote")
    for name, shape in expected.items():
        if name not in weights:
            raise UserError(f"--init_from {path} has no parameter {name}: it holds another model; start from a run "
                            "of this model (embed_dim, depth, channels, img_size, patch_size)")
        if tuple(weights[name].shape) != shape:
            raise UserError(f"--init_from {path}: parameter {name} is {tuple(weights[name].shape)} there, {shape} "
                            "here; start from a run of the same model (embed_dim, depth, channels, img_size, "
                            "patch_size)")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise UserError(f"--init_from {path} has parameter {extra[0]} that this model lacks ({len(extra)} in all); "
                        "start from a run of the same model")
    return weights
