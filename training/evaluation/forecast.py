"""Forecasts from Python: a trained model, its normalization and grid, in one object (docs/python-api.md).

    from training.evaluation.forecast import Forecaster

    f = Forecaster.from_run("runs/tiny/1CPU/00")                 # or Forecaster.from_file("model.pt")
    state = Forecaster.read_state("data/tiny/valid/2004.h5", 0)   # or any xarray.Dataset of the channels
    forecast = f.forecast(state, lead_steps=20)                   # xarray.Dataset, physical units
    ensemble = f.forecast(state, lead_steps=20, members=8)        # a stochastic model's members (member dim)

The model file ``checkpoints/model.pt`` (``distributed/checkpoint/export.py``: :func:`package_meta`) holds the
weights with the config section by section, the normalization statistics, channel names and units, the grid,
the time step and calendar: :meth:`Forecaster.from_file` needs nothing else, no run directory and no data folder,
and reads it with ``torch.load(weights_only=True)`` (no code runs).
"""

from __future__ import annotations

import contextlib
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch

from distributed.checkpoint.export import load_checkpoint_model
from networks.model_file import FINAL_MODEL, PACKAGE_FORMAT, package_meta
from networks.vit import build_model
from training.evaluation.ensemble_scoring import Ensemble, check_members
from training.evaluation.scoring import member_rollout
from utils.config.loading import load_run_config
from utils.config.schema import KEYS, Config
from utils.config.types import coerce
from utils.core.errors import UserError
from utils.core.safe_load import load_plain
from utils.data.forcing_source import package_forcings
from utils.data.layout import FIELDS
from utils.data.metadata import read_metadata, read_time_axis
from utils.data.timestep import TimeStep
from utils.precision.amp import AMP_DTYPES

LAT_NAMES, LON_NAMES = ("latitude", "lat"), ("longitude", "lon")


def config_from_sections(sections: dict, source: Path) -> Config:
    """A :class:`Config` from a model file's ``config`` (section by section); keys the schema no longer has are
    skipped.

    Raises:
        UserError: a value does not fit its key's type, naming ``source``.
    """
    cfg = Config(name=str(sections.get("name", "custom")))
    for section, values in sections.items():
        for name, value in (values.items() if isinstance(values, dict) else ()):
            if name in KEYS:
                try:
                    cfg.set(name, coerce(value, KEYS[name].type))
                except ValueError as exc:
                    raise UserError(f"{source}: config key {section}.{name} = {value!r} ({exc}); the file is "
                                    "damaged: export the model again") from None
    return cfg


def resolve_device(device=None) -> torch.device:
    """The device a :class:`Forecaster` runs on: ``device`` (a name or a ``torch.device``) when it is there; None:
    ``cuda`` when a CUDA GPU is visible, else ``cpu``.

    Raises:
        UserError: not a device name, or a CUDA device that is not there (no GPU visible, or too few).
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device {device!r} is not a device name; pass 'cpu', 'cuda' or 'cuda:N', or leave device "
                        "out for the GPU when one is visible, else the CPU") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        seen = f"{torch.cuda.device_count()} CUDA GPUs are visible" if torch.cuda.is_available() else \
            "no CUDA GPU is visible"
        raise UserError(f"device {str(dev)!r} asked for, but {seen}; pass device='cpu', or leave device out for the "
                        "GPU when one is visible, else the CPU")
    return dev


class Forecaster:
    """A trained model with everything it needs to forecast in physical units.

    Args:
        model: the plain network (``networks.vit.build_model``) with its weights.
        package: the model file's metadata (:func:`networks.model_file.package_meta`).
        device: where to run (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``); None (the default): the
            first CUDA GPU when one is visible, else the CPU (:func:`resolve_device`).
        step: the optimizer step of the weights (None when unknown).

    Attributes: ``config`` (:class:`Config`), ``channels``, ``channel_units``, ``latitude`` ``(H,)`` and
    ``longitude`` ``(W,)`` (degrees), ``time_step`` (of one model step: ``dt`` file steps, in the data's unit),
    ``calendar``.
    """

    def __init__(self, model: torch.nn.Module, package: dict, device=None, step: int | None = None):
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.package, self.step = package, step
        self.config = config_from_sections(package["config"], Path("the model package"))
        self.channels, self.channel_units = list(package["channels"]), list(package["channel_units"])
        norm = package["normalization"]
        self.mean = norm["mean"].float().view(1, -1, 1, 1).to(self.device)
        self.std = norm["std"].float().view(1, -1, 1, 1).to(self.device)
        self.latitude = np.asarray(package["grid"]["latitude"], dtype=np.float64)
        self.longitude = np.asarray(package["grid"]["longitude"], dtype=np.float64)
        time = package["time"]
        self.time_step = TimeStep(float(time["step"]) * int(time["dt"]), time["unit"])
        self.calendar = time["calendar"]
        dtype = AMP_DTYPES[self.config.precision.amp_mode] if self.device.type == "cuda" else None
        self.autocast = (lambda: torch.autocast("cuda", dtype=dtype)) if dtype else contextlib.nullcontext
        self.inputs = package_forcings(self.config.data, package, self.latitude, self.longitude, self.device)

    @classmethod
    def from_file(cls, model_pt: str | Path, device=None) -> "Forecaster":
        """The model of a self-contained model file (``checkpoints/model.pt``, ``python -m tools.export_model``).

        Raises:
            UserError: the file is missing, unreadable, holds more than plain data, was written before model
                files were self-contained, or its weights do not fit its config.
        """
        path = Path(model_pt)
        if not path.is_file():
            raise UserError(f"model file {path} not found; pass checkpoints/model.pt of a run or a file written by "
                            "python -m tools.export_model")
        state = load_plain(path)
        if not isinstance(state, dict) or state.get("format") != PACKAGE_FORMAT:
            raise UserError(f"{path} is not a self-contained model file ({PACKAGE_FORMAT!r}); it was written before "
                            "they were: use Forecaster.from_run(run_dir), or re-export it with python -m "
                            "tools.export_model RUN_DIR")
        cfg = config_from_sections(state["config"], path)
        model = build_model(cfg.model, cfg.data)
        try:
            model.load_state_dict(state["model"])
        except (RuntimeError, KeyError) as exc:
            raise UserError(f"the weights of {path} do not fit the model of its config ({str(exc)[:200]}); export "
                            "the model again") from None
        return cls(model, state, device, state.get("step"))

    @classmethod
    def from_run(cls, run_dir: str | Path, step: int | None = None, device=None) -> "Forecaster":
        """The model of a run directory: the checkpoint of ``step`` (default: the latest, or ``checkpoints/model.pt``
        when the run kept no sharded one). The metadata come from the run's ``model.pt`` when it is self-contained,
        else from the run's data folder.

        Raises:
            UserError: no such run, checkpoint or data folder (see ``evaluate.py``).
        """
        run_dir = Path(run_dir)
        cfg = load_run_config(run_dir)
        final = run_dir / "checkpoints" / FINAL_MODEL
        package = load_plain(final) if final.is_file() else None
        if not isinstance(package, dict) or package.get("format") != PACKAGE_FORMAT:
            package = package_meta(cfg)
        with warnings.catch_warnings():  # DCP's note that it reads in one process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            model, n = load_checkpoint_model(run_dir, cfg, step)
        return cls(model, package, device, n)

    @staticmethod
    def read_state(h5_path: str | Path, t: int, img_size=None):
        """Time step ``t`` of a file of the layout as an ``xarray.Dataset``: one variable per channel over
        (latitude, longitude), physical units, with a scalar ``time`` coordinate (when the file has a start time).

        Raises:
            UserError: the file cannot be read, or ``t`` is out of range.
        """
        import h5py
        import xarray as xr
        path = Path(h5_path)
        try:
            with h5py.File(path, "r") as f:
                fields = f[FIELDS]
                if not 0 <= t < fields.shape[0]:
                    raise UserError(f"{path} has {fields.shape[0]} time steps; t={t} is out of range")
                h, w = img_size or fields.shape[2:]
                state = fields[t, :, :h, :w]
        except (OSError, KeyError) as exc:
            raise UserError(f"cannot read time {t} of {path} ({exc}); pass a file of the layout") from None
        names, lat = read_metadata(path, state.shape[0], h)
        axis = read_time_axis(path, w)
        coords = {"latitude": lat, "longitude": axis.longitude}
        if axis.start is not None:
            coords["time"] = axis.time(t)
        return xr.Dataset({n: (("latitude", "longitude"), state[i]) for i, n in enumerate(names)}, coords=coords)

    def forecast(self, initial_state, lead_steps: int, batch_size: int = 8, members: int = 1):
        """Roll the model out ``lead_steps`` times from ``initial_state``, ``members`` times for a stochastic model.

        Args:
            initial_state: an ``xarray.Dataset`` with a variable for each of :attr:`channels` (physical units)
                over ``latitude``/``lat`` and ``longitude``/``lon`` holding the model's grid (a larger grid is
                cut to it), optionally with one more leading dimension of initial times (e.g. ``time``).
            lead_steps: model steps, >= 1.
            batch_size: initial times per model call (each ``members`` times).
            members: forecasts per initial state, >= 1. A model trained with noise inputs (``noise_channels`` > 0)
                draws each member with its own noise, keyed by the run's seed, the state's position in
                ``initial_state``, the member and the lead (``utils/data/noise.py``): the same call gives the same
                members; ``members=1`` draws one member. A deterministic model forecasts one.

        Returns:
            An ``xarray.Dataset``: per channel ``([init dim,] [member,] lead_time, latitude, longitude)`` float32 in
            the channel's units (attribute ``units``), the ``member`` dimension (``0 .. members - 1``) only when
            ``members`` > 1; ``lead_time`` in the data's time-step unit (attribute ``units``); ``valid_time`` where
            the initial times are datetimes.

        Raises:
            UserError: a channel is missing, the grid does not hold the model's, ``lead_steps`` < 1, ``members`` < 1,
                or ``members`` > 1 of a deterministic model (its members would be identical).
        """
        import xarray as xr
        if lead_steps < 1:
            raise UserError(f"lead_steps must be at least 1, got {lead_steps}")
        noise_channels = self.config.model.noise_channels
        check_members(members, noise_channels, "members")
        ensemble = Ensemble(members, noise_channels, self.config.optim.seed)
        x, init_dim, init = self._stack(initial_state)
        valid = self._valid_times(init, lead_steps) if init is not None else None
        times = self._forcing_times(valid, len(x), lead_steps)
        out = []
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                inp = (torch.from_numpy(x[start:start + batch_size]).to(self.device) - self.mean) / self.std
                forcing = self.inputs and partial(self._forcing, times, start, len(inp))
                samples = list(range(start, start + len(inp)))
                steps = [(y * self.std + self.mean).cpu() for y in member_rollout(
                    self.model, inp, samples, lead_steps, self.autocast, ensemble, forcing)]
                out.append(torch.stack(steps, 2))
        values = torch.cat(out).numpy()  # (N, M, L, C, H, W)
        if members == 1:
            values = values[:, 0]
        leads = [j * float(self.time_step.value) for j in range(1, lead_steps + 1)]
        dims = (*((init_dim,) if init_dim else ()), *(("member",) if members > 1 else ()), "lead_time", "latitude",
                "longitude")
        data = {ch: xr.Variable(dims, values[..., c, :, :] if init_dim else values[0, ..., c, :, :],
                                {"units": self.channel_units[c]}) for c, ch in enumerate(self.channels)}
        coords = {"lead_time": xr.Variable("lead_time", leads, {"units": self.time_step.unit}),
                  "latitude": self.latitude, "longitude": self.longitude}
        if members > 1:
            coords["member"] = np.arange(members)
        if init is not None:
            coords[init_dim or "time"] = init
            if valid is not None:
                coords["valid_time"] = (("lead_time",) if init_dim is None else (init_dim, "lead_time"), valid)
        return xr.Dataset(data, coords=coords, attrs={"model_step": -1 if self.step is None else int(self.step)})

    def _forcing_times(self, valid, n: int, lead_steps: int) -> np.ndarray | None:
        """The valid times ``(N, L)`` of each forecast step as cftime datetimes, for the forcings; None when the model
        has no forcing that depends on time.

        Raises:
            UserError: the model was trained with such forcings and the initial state has no time to date them.
        """
        if self.inputs is None or not self.inputs.timed:
            return None
        if valid is None:
            raise UserError(f"this model was trained with the forcings {', '.join(self.inputs.names)}, computed for "
                            "each step's valid time: the initial state needs a time coordinate (datetime64 or "
                            "cftime), e.g. from Forecaster.read_state")
        flat = np.asarray(valid).reshape(n, lead_steps)
        if np.issubdtype(flat.dtype, np.datetime64):
            import cftime
            seconds = flat.astype("datetime64[s]").astype(np.int64)
            flat = cftime.num2date(seconds, "seconds since 1970-01-01", calendar="standard")
        return flat

    def _forcing(self, times: np.ndarray | None, start: int, n: int, step: int) -> torch.Tensor:
        """The input-only channels of lead ``step + 1`` for the ``n`` initial states from number ``start`` on
        (``times``: :meth:`_forcing_times`)."""
        return self.inputs.fields(None if times is None else list(times[start:start + n, step]), n)

    def _stack(self, ds) -> tuple[np.ndarray, str | None, object]:
        """``(N, C, H, W)`` float32 of the channels on the model grid, the leading dimension's name (None for one
        state) and the initial times (None without a time coordinate)."""
        missing = [ch for ch in self.channels if ch not in ds.data_vars]
        if missing:
            raise UserError(f"the initial state lacks channel(s) {', '.join(missing)}; the model needs "
                            f"{', '.join(self.channels)}")
        lat = next((n for n in LAT_NAMES if n in ds.coords), None)
        lon = next((n for n in LON_NAMES if n in ds.coords), None)
        if lat is None or lon is None:
            raise UserError("the initial state needs latitude and longitude coordinates (latitude/lat, longitude/lon)")
        try:
            ds = ds[self.channels].sel({lat: self.latitude, lon: self.longitude}, method="nearest", tolerance=1e-3)
        except KeyError:
            raise UserError(f"the initial state's grid does not hold the model's {self.latitude.size} x "
                            f"{self.longitude.size} grid (latitude {self.latitude[0]:g} .. {self.latitude[-1]:g}, "
                            f"longitude {self.longitude[0]:g} .. {self.longitude[-1]:g})") from None
        extra = [d for d in ds[self.channels[0]].dims if d not in (lat, lon)]
        if len(extra) > 1:
            raise UserError(f"the initial state has dimensions {extra} besides the grid; at most one (initial times)")
        init_dim = extra[0] if extra else None
        arr = np.stack([ds[ch].transpose(*extra, lat, lon).values for ch in self.channels], axis=-3)
        arr = arr.astype(np.float32).reshape(-1, len(self.channels), self.latitude.size, self.longitude.size)
        time_name = init_dim or "time"
        init = ds[time_name].values if time_name in ds.coords else None
        return arr, init_dim, init

    def _valid_times(self, init, lead_steps: int):
        """Valid times ``([N,] L)`` of initial times ``init`` (cftime or datetime64), or None when they are neither."""
        flat = np.atleast_1d(init)
        if np.issubdtype(flat.dtype, np.datetime64) and not self.time_step.calendar_based:
            delta = np.timedelta64(int(round(self.time_step.hours() * 3600)), "s")
            valid = flat[:, None] + delta * np.arange(1, lead_steps + 1)[None, :]
        elif flat.dtype == object and all(hasattr(t, "calendar") for t in flat):
            valid = np.array([[self.time_step.add(t, j) for j in range(1, lead_steps + 1)] for t in flat])
        else:
            return None
        return valid if np.ndim(init) else valid[0]
