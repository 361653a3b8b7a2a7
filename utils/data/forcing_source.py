"""The input-only channels of a split: forcings for the valid time of each rollout step, then the static fields.

The model reads ``C + F + S`` channels and predicts ``C`` (``DataConfig.model_in_channels``): the prognostic
state, the ``F`` forcings of ``data.forcings`` (``utils/data/forcings.py``: the sun's position, local time, day
of year, latitude and longitude encodings) and the ``S`` static fields of ``data.static_fields``
(``utils/data/static.py``: land-sea mask, orography). A forcing describes the state being predicted: for the
application of the model that maps the state at ``t + j*dt`` to ``t + (j+1)*dt`` it is computed for the valid
time ``t + (j+1)*dt``, in training, rollout training (each of the K applications its own), validation,
``evaluate.py`` and the ``Forecaster``.

Every loader yields the global sample indices of a batch, so one :class:`InputForcings` serves the native, DALI
and synthetic loaders alike: the valid times come from the sample index on the host (two numbers a sample), the
fields are computed on the device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from utils.config.schema import DataConfig
from utils.core.errors import UserError
from utils.data.forcings import calendar_clock, check_forcing_names, forcing_fields
from utils.data.layout import STATIC, resolve_data_path
from utils.data.metadata import equiangular_latitudes
from utils.data.static import read_static
from utils.data.timestep import TimeStep

# forcings that depend on the valid time (the others depend on the grid only)
TIME_FORCINGS = ("cos_solar_zenith_angle", "sin_local_time", "cos_local_time", "sin_julian_day", "cos_julian_day")


NOMINAL_START = "2000-01-01T00:00:00"  # synthetic data: sample i's input is i steps after this time


class InputForcings:
    """The forcings and static fields of one split, as a callable ``(idx, step) -> (B, F + S, H, W)``.

    Args:
        names: the forcings (``data.forcings``), in channel order.
        latitude, longitude: ``(H,)`` / ``(W,)`` degrees of the training grid.
        static: ``(S, H, W)`` float32 normalized static fields, or None.
        valid_time: ``(sample index, step j) -> time``: the valid time of the ``j``-th (0-based) application's
            target, a cftime datetime; None when no forcing depends on time.
        device: where the fields are computed.
    """

    def __init__(self, names: Sequence[str], latitude: np.ndarray, longitude: np.ndarray,
                 static: np.ndarray | None, valid_time: Callable[[int, int], object] | None, device):
        self.names = tuple(names)
        self.latitude = torch.as_tensor(np.asarray(latitude, dtype=np.float64), device=device)
        self.longitude = torch.as_tensor(np.asarray(longitude, dtype=np.float64), device=device)
        self.static = None if static is None else torch.as_tensor(static, dtype=torch.float32, device=device)
        self.valid_time = valid_time
        self.timed = any(n in TIME_FORCINGS for n in self.names)

    def __call__(self, idx: torch.Tensor, step: int) -> torch.Tensor:
        """Float32 ``(B, F + S, H, W)`` on the device for the samples ``idx`` (``(B,)`` int64, any device) at
        rollout step ``step`` (0-based: the first application's target is ``step`` 0)."""
        indices = idx.tolist()
        times = [self.valid_time(i, step) for i in indices] if self.timed else None
        return self.fields(times, len(indices))

    def fields(self, times: Sequence | None, batch: int) -> torch.Tensor:
        """The channels for ``batch`` states valid at ``times`` (cftime datetimes; None when no forcing needs
        them): float32 ``(B, F + S, H, W)``."""
        clock = calendar_clock(times) if times is not None else np.zeros((batch, 2))
        parts = []
        if self.names:
            parts.append(forcing_fields(self.names, torch.as_tensor(clock, device=self.latitude.device),
                                        self.latitude, self.longitude))
        if self.static is not None:
            parts.append(self.static.expand(batch, -1, -1, -1))
        return torch.cat(parts, 1)


def append_forcings(x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """The model's input: the state ``(B, C, H, W)`` with the forcing channels ``(B, F + S, H, W)`` appended, in
    the state's dtype (unchanged without forcings)."""
    return x if extra is None else torch.cat([x, extra.to(x.dtype)], 1)


def check_inputs(cfg: DataConfig) -> None:
    """Stop on forcing names that do not exist or a name given twice among forcings and static fields.

    Raises:
        UserError: naming the nearest forcing and the full list.
    """
    check_forcing_names(cfg.forcings)
    twice = sorted({n for n in cfg.static_fields if list(cfg.static_fields).count(n) > 1})
    if twice:
        raise UserError(f"static field {twice[0]} is listed twice in --static_fields; list each once")


def static_path(cfg: DataConfig) -> Path:
    """The file of the static fields: ``static_path``, or ``<data_path>/static.h5`` (relative paths found as the
    data's are, ``resolve_data_path``)."""
    return resolve_data_path(cfg.static_path) if cfg.static_path else resolve_data_path(cfg.data_path) / STATIC


def input_roles(cfg: DataConfig) -> str:
    """The channel roles in one line, e.g. ``inputs: 1 prognostic, forcings cos_solar_zenith_angle, sin_local_time,
    static lsm``: what the run record, the scorecard and ``evaluate.py`` name."""
    forcings = ", ".join(cfg.forcings) or "none"
    static = ", ".join(cfg.static_fields) or "none"
    return f"inputs: {cfg.n_in_channels} prognostic, forcings {forcings}, static {static}"


def dataset_forcings(cfg: DataConfig, dataset, latitude: np.ndarray, device) -> InputForcings | None:
    """The input-only channels of ``dataset`` (an ``ERA5Dataset`` of ``cfg``'s data), None when ``cfg`` has none.

    Raises:
        UserError: a forcing that needs the time of files without ``start_time``; the static fields cannot be read
            or lie on another grid (``utils/data/static.py``).
    """
    if not cfg.forcings and not cfg.static_fields:
        return None
    check_inputs(cfg)
    longitude = dataset.files[0].axis.longitude
    if any(n in TIME_FORCINGS for n in cfg.forcings) and any(f.axis.start is None for f in dataset.files):
        raise UserError(f"the forcings {', '.join(n for n in cfg.forcings if n in TIME_FORCINGS)} need the time "
                        f"of each step, but the files of {dataset.directory} have no start_time; re-create them with "
                        "python -m tools.convert_era5, or drop those forcings")
    static = (read_static(static_path(cfg), cfg.static_fields, np.asarray(latitude), longitude)
              if cfg.static_fields else None)
    return InputForcings(cfg.forcings, latitude, longitude, static, lambda i, j: target_time(dataset, i, j), device)


def target_time(dataset, index: int, step: int):
    """The valid time of target ``step`` (0-based) of sample ``index`` of ``dataset``: ``(step + 1) * dt`` time steps
    after the sample's input, in the files' calendar."""
    run_no, p = dataset.position(index)
    file_no, t = dataset.file_time(run_no, p + (step + 1) * dataset.dt)
    return dataset.files[file_no].axis.time(t)


def nominal_forcings(cfg: DataConfig, step_hours: float, device, seed: int = 0) -> InputForcings | None:
    """The input-only channels of synthetic data (``data_loader_config: synthetic``, the planner's dry run): sample
    ``i``'s input is valid ``i`` steps of ``step_hours`` after 2000-01-01T00 (standard calendar), on an equiangular
    grid (90 to -90, 0 to 360 east); static fields are random like the synthetic state (seeded by ``seed``)."""
    if not cfg.forcings and not cfg.static_fields:
        return None
    check_inputs(cfg)
    (h, w), dt = cfg.img_size, cfg.dt
    static = None
    if cfg.static_fields:  # numpy's generator: the planner's dry run builds this under a fake-tensor mode
        static = np.random.default_rng(seed).standard_normal((len(cfg.static_fields), h, w), dtype=np.float32)
    return InputForcings(cfg.forcings, equiangular_latitudes(h), np.linspace(0, 360, w, endpoint=False), static,
                         _nominal_time(step_hours, dt) if any(n in TIME_FORCINGS for n in cfg.forcings) else None,
                         device)


def _nominal_time(step_hours: float, dt: int) -> Callable[[int, int], object]:
    """``(sample i, application j) -> valid time`` of synthetic data: ``i`` steps after ``NOMINAL_START``."""
    import cftime
    start = cftime.datetime.strptime(NOMINAL_START, "%Y-%m-%dT%H:%M:%S", calendar="standard")
    step = TimeStep.from_hours(step_hours)
    return lambda i, j: step.add(start, i + (j + 1) * dt)


def package_forcings(cfg: DataConfig, package: dict, latitude: np.ndarray, longitude: np.ndarray,
                     device) -> InputForcings | None:
    """The input-only channels of a model file (``networks/model_file.py``): its forcings, computed from the valid
    times the caller passes to :meth:`InputForcings.fields`, and the static fields it carries. None without.

    Raises:
        UserError: the file names static fields but does not carry them (it was written before they were).
    """
    if not cfg.forcings and not cfg.static_fields:
        return None
    static = package.get("static")
    if cfg.static_fields and (not torch.is_tensor(static) or static.shape[0] != len(cfg.static_fields)):
        raise UserError(f"the model was trained with the static fields {', '.join(cfg.static_fields)} but its file "
                        "does not carry them; export it again with python -m tools.export_model RUN_DIR")
    return InputForcings(cfg.forcings, latitude, longitude, static if cfg.static_fields else None, None, device)
