"""Reading the static fields (land-sea mask, orography) of ``<data_path>/static.h5`` for a training grid.

The file (``utils/data/layout.py``; written by ``python -m tools.convert_era5 --static_variables lsm z``) holds one
float32 dataset (H', W') per field with attributes ``mean`` and ``std`` (float64), and ``latitude`` (H',) and
``longitude`` (W',) in degrees. Training crops the north-west corner of the data's grid (``img_size``), so the
file may be larger than the training grid: its first H latitudes and W longitudes must then be the training
grid's, within :data:`GRID_TOLERANCE` degrees (the same first point and the same spacing). Each field is
normalized with its own mean and std, those of the file's whole grid, as the prognostic channels are with
statistics of the whole training split.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from utils.core.errors import UserError, one_line
from utils.data.layout import ATTR_MEAN, ATTR_STD, LATITUDE, LONGITUDE

GRID_TOLERANCE = 1e-6  # degrees: coordinates of one grid written twice agree far better than this


def read_static(path: Path, names: Sequence[str], latitude: np.ndarray, longitude: np.ndarray) -> np.ndarray:
    """The static fields ``names`` of ``path`` on the training grid, normalized.

    Args:
        path: the HDF5 file of static fields (``<data_path>/static.h5`` or ``--static_path``).
        names: the fields, in channel order, e.g. ``["lsm", "z"]`` (``data.static_fields``).
        latitude: (H,) degrees north of the training grid, north to south (the data's, cropped).
        longitude: (W,) degrees east of the training grid, ascending (the data's, cropped).

    Returns:
        float32 array (S, H, W), S = ``len(names)``: ``(field - mean) / std`` of each field, in the order of
        ``names``; the north-west (H, W) corner of the file's fields.

    Raises:
        UserError: one line naming the problem and the fix: the file is missing, not HDF5 or damaged; it lacks a
            field (the nearest name suggested) or its coordinates; a field of another shape than the file's grid,
            with NaN/Inf values, or without a finite mean and a positive std; the file is on another grid.
    """
    path = Path(path)
    latitude = np.asarray(latitude, dtype=np.float64)
    longitude = np.asarray(longitude, dtype=np.float64)
    if not path.is_file():
        raise UserError(f"static fields file {path} does not exist; run python -m tools.convert_era5 with "
                        f"--static_variables {' '.join(names)} (it writes <out>/static.h5), or set --static_path "
                        "to the file")
    try:
        with h5py.File(path, "r") as f:
            _check_grid(f, path, latitude, longitude, names)
            return np.stack([_read_field(f, path, name, latitude.size, longitude.size) for name in names]) \
                if len(names) else np.empty((0, latitude.size, longitude.size), dtype=np.float32)
    except (OSError, KeyError, RuntimeError) as exc:  # h5py's errors on a damaged or foreign file
        raise UserError(f"cannot read static fields file {path} as HDF5 ({one_line(exc)}); it is damaged or not "
                        "HDF5: write it again with python -m tools.convert_era5 --static_variables "
                        f"{' '.join(names)}") from None


def _fix(names: Sequence[str]) -> str:
    """How to write the file right: the end of every message."""
    return ("write it again from the input of these data with python -m tools.convert_era5 --static_variables "
            f"{' '.join(names)}").rstrip()


def _coordinate(f: h5py.File, path: Path, name: str, names: Sequence[str]) -> np.ndarray:
    """The file's ``latitude`` or ``longitude``: (N,) float64 degrees."""
    if name not in f or not isinstance(f[name], h5py.Dataset) or f[name].ndim != 1:
        raise UserError(f"static fields file {path} has no 1-D '{name}' dataset, so its grid is unknown; "
                        f"{_fix(names)}")
    values = f[name][:].astype(np.float64)
    if not np.isfinite(values).all():
        raise UserError(f"static fields file {path}: '{name}' holds NaN/Inf; {_fix(names)}")
    return values


def describe_grid(latitude: np.ndarray, longitude: np.ndarray) -> str:
    """``33 x 49 (latitude 58 .. 50 by 0.25, longitude -10 .. 2 by 0.25)`` for messages."""
    def axis(name: str, values: np.ndarray) -> str:
        if not values.size:
            return f"no {name}"
        step = f" by {abs(values[1] - values[0]):g}" if values.size > 1 else ""
        return f"{name} {values[0]:g} .. {values[-1]:g}{step}"
    return f"{latitude.size} x {longitude.size} ({axis('latitude', latitude)}, {axis('longitude', longitude)})"


def _check_grid(f: h5py.File, path: Path, latitude: np.ndarray, longitude: np.ndarray, names: Sequence[str]) -> None:
    """The training grid must be the north-west corner of the file's: same first point, same spacing."""
    file_lat, file_lon = _coordinate(f, path, LATITUDE, names), _coordinate(f, path, LONGITUDE, names)
    h, w = latitude.size, longitude.size
    fits = h <= file_lat.size and w <= file_lon.size
    same = fits and np.allclose(file_lat[:h], latitude, rtol=0, atol=GRID_TOLERANCE) and \
        np.allclose(file_lon[:w], longitude, rtol=0, atol=GRID_TOLERANCE)
    if not same:
        raise UserError(f"static fields file {path} is on another grid than the data: the file's is "
                        f"{describe_grid(file_lat, file_lon)}, the data's {describe_grid(latitude, longitude)}, "
                        f"which must be all of the file's or its north-west corner; {_fix(names)}, or set "
                        "--static_path to static fields of this grid")


def _read_field(f: h5py.File, path: Path, name: str, h: int, w: int) -> np.ndarray:
    """Field ``name``'s north-west (h, w) corner, normalized: (h, w) float32."""
    fields = [k for k in f.keys() if k not in (LATITUDE, LONGITUDE)]
    if name not in fields or not isinstance(f[name], h5py.Dataset):
        near = difflib.get_close_matches(name, fields, n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        raise UserError(f"static fields file {path} has no field '{name}'; {hint}it has: "
                        f"{', '.join(fields) or 'none'}; set --static_fields to fields it has, or {_fix([name])}")
    dataset = f[name]
    grid = (f[LATITUDE].shape[0], f[LONGITUDE].shape[0])
    if dataset.shape != grid:
        raise UserError(f"static field '{name}' of {path} has shape {dataset.shape}, not the file's grid {grid} "
                        f"(latitude x longitude); {_fix([name])}")
    values = dataset[:h, :w].astype(np.float64)
    bad = int((~np.isfinite(values)).sum())
    if bad:
        raise UserError(f"static field '{name}' of {path} has {bad} NaN/Inf value(s) on the training grid; fill them "
                        f"in the input and {_fix([name])}")
    mean, std = _statistic(dataset, ATTR_MEAN, path), _statistic(dataset, ATTR_STD, path)
    if not std > 0:
        raise UserError(f"static field '{name}' of {path} has std {std:g}, which cannot normalize it (a constant "
                        f"field is written with std 1); {_fix([name])}")
    return ((values - mean) / std).astype(np.float32)


def _statistic(dataset: h5py.Dataset, attribute: str, path: Path) -> float:
    """The finite float attribute ``mean`` or ``std`` of a field."""
    value = dataset.attrs.get(attribute)
    try:
        number = float(np.asarray(value).item())
    except (TypeError, ValueError):
        number = float("nan")
    if not np.isfinite(number):
        raise UserError(f"static field '{dataset.name.lstrip('/')}' of {path} has no finite '{attribute}' "
                        f"attribute (it has {value!r}); {_fix([dataset.name.lstrip('/')])}")
    return number
