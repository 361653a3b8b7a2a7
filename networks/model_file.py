"""The model as one self-contained file (``model.pt``, a "model package", as makani saves one): the weights in
the single-GPU layout and names, and :func:`package_meta`: the config section by section, normalization
statistics, channel names and units, grid, time step and calendar, and the climatology when small (else a note).
All plain data, so ``torch.load(weights_only=True)`` (``utils/core/safe_load.py``) reads it and
``training.evaluation.forecast.Forecaster.from_file`` forecasts with nothing else (docs/python-api.md). Writing
one from a parallel run (gathering the shards) is ``distributed/checkpoint/export.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from utils.config.schema import SECTIONS, Config
from utils.config.types import plain
from utils.core.errors import UserError
from utils.core.safe_load import load_plain
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
    H, W)``, ``hour``, ``calendar``, ``window_days``, ``description``; or ``note`` saying why not), ``static``
    (float32 ``(S, H, W)``: the normalized static fields of ``data.static_fields``, ``S`` 0 without; the forcings
    are named in ``config["data"]`` and computed from the valid time).

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
            "climatology": _climatology(stats.climatology),
            "static": _static(cfg, data, lat, axis)}


def _static(cfg: Config, data, lat, axis) -> torch.Tensor:
    """The normalized static fields the model was trained with, float32 ``(S, H, W)`` (``S`` 0 without)."""
    h, w = cfg.data.img_size
    forcings = getattr(data, "train_forcings", None)
    if forcings is not None and forcings.static is not None:
        return forcings.static.detach().cpu().clone()
    if not cfg.data.static_fields:
        return torch.zeros(0, h, w)
    from utils.data.forcing_source import static_path
    from utils.data.static import read_static
    lon = axis.longitude if axis is not None else np.linspace(0, 360, w, endpoint=False)
    return torch.from_numpy(read_static(static_path(cfg.data), cfg.data.static_fields, np.asarray(lat)[:h], lon))


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
