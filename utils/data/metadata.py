"""Reading a file's metadata: channel names and units, latitudes, longitudes, time step, start time and calendar."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from utils.core.errors import UserError, one_line
from utils.data.layout import (ATTR_CALENDAR, ATTR_CHANNEL_NAMES, ATTR_CHANNEL_UNITS, ATTR_DT_HOURS, ATTR_START_TIME,
                               ATTR_TIME_STEP, ATTR_TIME_UNIT, DEFAULT_STEP_HOURS, FIELDS, LATITUDE, LONGITUDE,
                               InputNotFoundError, LayoutError)
from utils.data.timestep import UNITS, TimeStep


def _decode(name) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def read_channel_names(h5_path: str | Path) -> list[str]:
    """Channel names (length C) stored in attribute ``channel_names`` of ``fields`` of a file.

    Raises:
        InputNotFoundError: the file does not exist.
        LayoutError: the file is not readable HDF5, or has no ``fields`` dataset or no
            ``channel_names`` attribute.
    """
    path = Path(h5_path)
    if not path.is_file():
        raise InputNotFoundError(f"{path} does not exist")
    fix = "write it with tools.convert_era5 or tools.make_synthetic_data"
    try:
        with h5py.File(path, "r") as f:
            if FIELDS not in f or ATTR_CHANNEL_NAMES not in f[FIELDS].attrs:
                raise LayoutError(f"{path} has no '{FIELDS}' dataset with a '{ATTR_CHANNEL_NAMES}' attribute; {fix}")
            return [_decode(n) for n in f[FIELDS].attrs[ATTR_CHANNEL_NAMES]]
    except OSError as exc:
        raise LayoutError(f"cannot read {path} as HDF5 ({one_line(exc)}); {fix}") from None


def equiangular_latitudes(h: int) -> np.ndarray:
    """Latitudes (degrees, north to south) of an ``h``-row grid spanning 90 to -90 inclusive."""
    return np.linspace(90.0, -90.0, h)


@dataclass
class TimeAxis:
    """A file's time coordinate: ``start`` (ISO 8601 time of step 0, or None when the file has none), its
    ``calendar`` (CF name) and ``step`` (:class:`~utils.data.timestep.TimeStep`, in its own unit);
    ``longitude`` ``(W,)`` degrees east (equiangular from 0 when the file has none)."""

    start: str | None
    calendar: str
    step: TimeStep
    longitude: np.ndarray

    @property
    def step_hours(self) -> float:
        """Hours per step: exact for hourly and daily data, the calendar's mean month or year for monthly and
        annual data (see :meth:`TimeStep.hours`)."""
        return self.step.hours(self.calendar)

    def time(self, t: int):
        """Time of step ``t``: a cftime datetime in the file's calendar, or hours since step 0 without a start."""
        if self.start is None:
            return t * self.step_hours
        import cftime
        return self.step.add(cftime.num2date(0, f"hours since {self.start}", calendar=self.calendar), t)


def _step(attrs, path: Path) -> TimeStep:
    """The file's time step from ``time_step``/``time_step_unit``, else ``dt_hours``, else 6 hours."""
    fix = "re-create the file with the data tools"
    if ATTR_TIME_UNIT in attrs:
        value, unit = attrs.get(ATTR_TIME_STEP), _text(attrs[ATTR_TIME_UNIT])
        try:
            return TimeStep(float(value), unit)
        except (TypeError, ValueError):
            raise UserError(f"{path}: attributes {ATTR_TIME_STEP}={value!r} {ATTR_TIME_UNIT}={unit!r} are not a "
                            f"positive time step in one of {', '.join(UNITS)}; {fix}") from None
    step = attrs.get(ATTR_DT_HOURS, DEFAULT_STEP_HOURS)
    try:
        hours = float(step)
    except (TypeError, ValueError):
        hours = math.nan
    if not hours > 0 or math.isinf(hours):
        raise UserError(f"{path}: attribute {ATTR_DT_HOURS}={step!r} is not a positive number of hours; {fix}")
    return TimeStep.from_hours(hours)


def _text(value) -> str | None:
    return value.decode() if isinstance(value, bytes) else None if value is None else str(value)


def read_time_axis(path: Path, w: int) -> TimeAxis:
    """The :class:`TimeAxis` of one file of the layout (``w``: longitudes wanted). Files without a time step
    attribute (older ones, the tutorial's 6-hourly ERA5) get :data:`DEFAULT_STEP_HOURS`.

    Raises:
        UserError: the file cannot be read, or its time step is not a positive number of a known unit.
    """
    try:
        with h5py.File(path, "r") as f:
            attrs = dict(f[FIELDS].attrs)
            lon = f[LONGITUDE][:w].astype(np.float64) if LONGITUDE in f else np.linspace(0, 360, w, endpoint=False)
    except (OSError, KeyError) as exc:
        raise UserError(f"cannot read the metadata of {path} ({one_line(exc)}); the file is damaged: "
                        "re-create it with the data tools") from None
    axis = TimeAxis(_text(attrs.get(ATTR_START_TIME)), _text(attrs.get(ATTR_CALENDAR, "standard")),
                    _step(attrs, path), lon)
    _check_time(axis, path)
    return axis


def _check_time(axis: TimeAxis, path: Path) -> None:
    """Decode the file's calendar and start time now, when the data are opened (training too), rather than when
    a forecast is first dated. Raises UserError naming the attribute."""
    import cftime
    try:
        cftime.num2date(0, "hours since 2000-01-01", calendar=axis.calendar)
    except ValueError:
        raise UserError(f"{path}: attribute {ATTR_CALENDAR}={axis.calendar!r} is not a CF calendar (standard, "
                        "proleptic_gregorian, noleap, 360_day, ...); re-create the file with the data tools") from None
    if axis.start is not None:
        try:
            axis.time(0)
        except (ValueError, TypeError):
            raise UserError(f"{path}: attribute {ATTR_START_TIME}={axis.start!r} is not an ISO 8601 time in the "
                            f"{axis.calendar} calendar; re-create the file with the data tools") from None


def read_channel_units(path: Path, n_channels: int) -> list[str]:
    """The ``channel_units`` attribute of a file's ``fields`` (``n_channels`` strings), ``""`` for each channel
    when it is missing, unreadable or of another length (units only label figures)."""
    try:
        with h5py.File(path, "r") as f:
            units = f[FIELDS].attrs.get(ATTR_CHANNEL_UNITS)
    except (OSError, KeyError, TypeError, ValueError):
        units = None
    if (not isinstance(units, np.ndarray) or units.ndim != 1 or len(units) != n_channels
            or units.dtype.kind not in "OSU"):
        return [""] * n_channels
    return [_text(u) for u in units]


def read_metadata(path: Path, n_channels: int, h: int) -> tuple[list[str], np.ndarray]:
    """Channel names and the first ``h`` latitudes of one file of the layout.

    Returns:
        ``n_channels`` names from attr ``channel_names`` of ``fields`` (``c0, c1, ...`` when it is
        missing, unreadable or of another length: names only label logs), and float64 ``(h,)``
        degrees from dataset ``latitude`` (equiangular, :func:`equiangular_latitudes`, without one).

    Raises:
        UserError: h5py cannot read the file, or ``latitude`` is not a 1-D numeric array of at least ``h``
            finite values in [-90, 90] running north to south (it weights the metrics); names the file.
    """
    try:
        with h5py.File(path, "r") as f:
            names = _channel_names(f[FIELDS], n_channels)
            lat = _latitudes(f[LATITUDE], path, h) if LATITUDE in f else equiangular_latitudes(h)
    except OSError as exc:
        raise UserError(f"cannot read the metadata of {path} ({one_line(exc)}); the file is damaged: "
                        "re-create it with the data tools") from None
    return names, lat


def _channel_names(fields: h5py.Dataset, n_channels: int) -> list[str]:
    try:
        names = fields.attrs.get(ATTR_CHANNEL_NAMES)
    except (OSError, TypeError, ValueError):  # an attribute type h5py cannot read
        names = None
    if (not isinstance(names, np.ndarray) or names.ndim != 1 or len(names) != n_channels
            or names.dtype.kind not in "OSU"):
        return [f"c{i}" for i in range(n_channels)]
    return [n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names]


def _latitudes(node: h5py.Dataset | h5py.Group, path: Path, h: int) -> np.ndarray:
    """The first ``h`` entries of the ``latitude`` dataset ``node``, checked (see :func:`read_metadata`)."""
    fix = "re-create the file with the data tools (python -m tools.convert_era5)"
    if not isinstance(node, h5py.Dataset):
        raise UserError(f"{path}: '{LATITUDE}' is not a dataset; {fix}")
    if node.dtype.kind not in "iuf" or node.ndim != 1 or node.shape[0] < h:
        raise UserError(f"{path}: '{LATITUDE}' must be a 1-D numeric array of at least {h} values (the "
                        f"img_size height), got {node.dtype} of shape {node.shape}; {fix}")
    lat = node[()].astype(np.float64)
    if not np.isfinite(lat).all():
        raise UserError(f"{path}: '{LATITUDE}' holds {int((~np.isfinite(lat)).sum())} NaN/Inf value(s); {fix}")
    if np.abs(lat).max() > 90:
        raise UserError(f"{path}: '{LATITUDE}' runs from {lat.min():g} to {lat.max():g}, outside [-90, 90] "
                        f"degrees; {fix}")
    if lat.size > 1 and not (np.diff(lat) < 0).all():  # the crop, the weights and the climatology assume it
        order = "south to north" if (np.diff(lat) > 0).all() else "in no single direction"
        raise UserError(f"{path}: '{LATITUDE}' runs {order} ({lat[0]:g}, {lat[1]:g}, ...); the layout stores rows "
                        f"north to south: {fix}, which flips it")
    return lat[:h]
