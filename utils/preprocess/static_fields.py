"""The converter's static fields (``--static_variables``, e.g. ERA5's land-sea mask ``lsm`` and surface geopotential
``z``): read from the input on the grid of the prognostic fields, checked, and written to ``<out>/static.h5``
(layout: ``utils/data/layout.py``; the reader: ``utils/data/static.py``).

A static variable may have a time dimension (a CDS download of ``lsm`` has one): it must then be constant in
time, and its first time is taken. Fields are read whole, one (H, W) grid at a time, so this costs little memory
beside the prognostic fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from utils.core.errors import one_line
from utils.core.files import check_replaceable
from utils.data.layout import ATTR_MEAN, ATTR_STD, ATTR_UNITS, LATITUDE, LONGITUDE, STATIC, LayoutError
from utils.preprocess.convert_plan import LAT_NAMES, LON_NAMES, MEMBER_DIM, TIME_NAMES, Plan

BLOCK_BYTES = 256 * 2 ** 20  # bytes of float64 read per block when checking that a field is constant in time
CONSTANT_TOLERANCE = 1e-5  # relative to the field's largest magnitude: what packing (GRIB, netCDF) may round off


@dataclass
class StaticField:
    """One static field, ready to write: ``values`` (H, W) float32 on the output grid, its ``mean`` and ``std``
    (float64 over the grid, ddof=0; std 1 for a constant field) and ``units``."""

    name: str
    values: np.ndarray
    mean: float
    std: float
    units: str


def read_static_fields(ds, names: Sequence[str], plan: Plan) -> list[StaticField]:
    """The static variables ``names`` of the opened input ``ds``, on ``plan``'s grid (flipped, trimmed).

    Args:
        ds: the input, opened by ``utils.preprocess.formats.open_input``.
        names: its variables to write as static fields, e.g. ``["lsm", "z"]``.
        plan: the converter's plan of the prognostic fields (grid and time dimension).

    Returns:
        One :class:`StaticField` per name, in order.

    Raises:
        LayoutError: a name missing from the input, given twice or naming a coordinate; a variable without the
            grid's dimensions or with another dimension of more than one entry, one that changes in time (or across
            ensemble members), NaN/Inf values, or the input cannot be read.
    """
    twice = sorted({n for n in names if list(names).count(n) > 1})
    if twice:
        raise LayoutError(f"--static_variables lists {twice[0]} more than once; list each static variable once")
    clash = [n for n in names if n in (LATITUDE, LONGITUDE)]
    if clash:  # static.h5 holds the grid's coordinates under these names
        raise LayoutError(f"--static_variables {clash[0]}: a coordinate, not a static field; static.h5 holds the "
                          "grid's latitude and longitude anyway: drop it from --static_variables")
    missing = [n for n in names if n not in ds.data_vars]
    if missing:
        raise LayoutError(f"static variable(s) {', '.join(missing)} not in the input; it has: "
                          f"{', '.join(map(str, ds.data_vars))}; pass those of them that are static fields to "
                          "--static_variables")
    return [_read_one(ds, str(name), plan) for name in names]


def _read_one(ds, name: str, plan: Plan) -> StaticField:
    """Static variable ``name``: checked constant, on the plan's grid, with its statistics."""
    da = _on_grid(ds, name, plan)
    first = _read(ds, da.isel({d: 0 for d in da.dims[:-2]}), name)
    for dim in da.dims[:-2]:  # time (and ensemble members): every entry must equal the first
        _check_constant(ds, da, dim, first, name)
    values = first[plan.lat_index][:, plan.lon_index]
    bad = ~np.isfinite(values)
    if bad.any():
        raise LayoutError(f"static variable '{name}' has {int(bad.sum())} NaN/Inf value(s) on the grid; a static "
                          "field needs a value at every point: fill them (or re-download the file), or drop it "
                          "from --static_variables")
    mean, std = float(values.mean()), float(values.std())
    # a constant field (a mask of sea only, flat orography) carries no information but is valid: std 1 keeps
    # (x - mean) / std finite (all zeros) instead of dividing by zero
    std = std if std > 0 else 1.0
    return StaticField(name, values.astype(np.float32), mean, std, str(ds[name].attrs.get("units", "")))


def _on_grid(ds, name: str, plan: Plan):
    """``ds[name]`` with the dimensions to check for constancy first (time, then members), latitude and longitude
    last; any other dimension reduced to its ``--select`` entry or its only one."""
    da = ds[name]
    lat, lon = plan.dims["lat"], plan.dims["lon"]
    if lat not in da.dims or lon not in da.dims:
        raise LayoutError(f"static variable '{name}' has dimensions {tuple(da.dims)}, not the grid's "
                          f"'{lat}' and '{lon}' of --variables; pass a variable on the same grid")
    varying = (*TIME_NAMES, MEMBER_DIM)
    others = [d for d in da.dims if d not in (lat, lon, *LAT_NAMES, *LON_NAMES, *varying)]
    # an entry picked for the variables (--select expver=0) is picked for the static fields too
    chosen = {dim: index for picks in plan.select.values() for dim, index in picks.items()}
    wide = [d for d in others if da.sizes[d] > 1 and d not in chosen]
    if wide:
        raise LayoutError(f"static variable '{name}' has the dimension '{wide[0]}' of size {da.sizes[wide[0]]}; a "
                          "static field is one surface field: pass a single-level variable (e.g. the surface "
                          "geopotential z, not z on pressure levels)")
    da = da.isel({d: chosen.get(d, 0) for d in others})
    return da.transpose(*[d for d in varying if d in da.dims], lat, lon)


def _read(ds, da, name: str) -> np.ndarray:
    """The values of ``da`` as float64; a failed read is a LayoutError."""
    try:
        return np.asarray(da.values, dtype=np.float64)
    except OSError as exc:
        raise LayoutError(f"cannot read static variable '{name}' from {ds.encoding.get('source', 'the input')} "
                          f"({one_line(exc)}); the file is damaged or truncated: download it again") from None


def _check_constant(ds, da, dim: str, first: np.ndarray, name: str) -> None:
    """Raise a LayoutError when ``da`` differs from ``first`` (its entry 0 of every leading dimension) anywhere
    along ``dim``, in blocks of :data:`BLOCK_BYTES`."""
    rest = {d: 0 for d in da.dims[:-2] if d != dim}
    size = da.sizes[dim]
    block = max(1, BLOCK_BYTES // (first.size * 8))
    tolerance = CONSTANT_TOLERANCE * max(1.0, float(np.nanmax(np.abs(first))) if np.isfinite(first).any() else 1.0)
    for start in range(1, size, block):
        values = _read(ds, da.isel({**rest, dim: slice(start, min(start + block, size))}), name)
        worst = np.abs(values - first).reshape(values.shape[0], -1).max(axis=1)
        changed = np.flatnonzero(~(worst <= tolerance))  # NaN in some entries only: a change too
        if changed.size:
            at = start + int(changed[0])
            where = _coordinate(da, dim, at)
            raise LayoutError(f"static variable '{name}' is not constant along '{dim}': {where} differs from the "
                              f"first by up to {float(worst[changed[0]]):.4g} {da.attrs.get('units', '')}".rstrip()
                              + "; a static field must not change: pass a constant one (e.g. ERA5's lsm or "
                                "surface z), or drop it from --static_variables")


def _coordinate(da, dim: str, index: int) -> str:
    """``dim``'s entry ``index`` for a message: its time in ISO format, its value, or its position."""
    if dim not in da.coords:
        return f"entry {index}"
    value = da[dim].values[index]
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def write_static_file(out: Path, fields: Sequence[StaticField], latitude: np.ndarray, longitude: np.ndarray) -> Path:
    """Write ``<out>/static.h5`` (layout: ``utils/data/layout.py``), as ``static.h5.part`` renamed when complete
    so that a reader never sees half a file.

    Args:
        out: the dataset folder.
        fields: the static fields, each (H, W) on the grid of ``latitude`` (H,) and ``longitude`` (W,) degrees.

    Raises:
        LayoutError: the file cannot be written (the partial file is removed).
    """
    path = Path(out) / STATIC
    tmp = path.with_name(STATIC + ".part")
    try:
        check_replaceable(path)  # never over a link, FIFO or device
        tmp.unlink(missing_ok=True)
        with h5py.File(tmp, "x") as f:
            for field in fields:
                dataset = f.create_dataset(field.name, data=field.values.astype(np.float32))
                dataset.attrs[ATTR_MEAN] = np.float64(field.mean)
                dataset.attrs[ATTR_STD] = np.float64(field.std)
                dataset.attrs[ATTR_UNITS] = field.units
            f.create_dataset(LATITUDE, data=np.asarray(latitude, dtype=np.float64))
            f.create_dataset(LONGITUDE, data=np.asarray(longitude, dtype=np.float64))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LayoutError(f"cannot write {path} ({one_line(exc)}); free disk space or pass another --out") from None
    return path


def format_static(static: dict[str, tuple[float, float, str]]) -> str:
    """One line for the converter's summary of ``{name: (mean, std, units)}``, e.g. ``static fields (static.h5):
    lsm (mean 0.41, std 0.49 (0 - 1)), z (...)``."""
    shown = ", ".join(f"{name} (mean {mean:.6g}, std {std:.6g}{' ' + units if units else ''})"
                      for name, (mean, std, units) in static.items())
    return f"static fields ({STATIC}): {shown}"
