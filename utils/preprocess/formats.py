"""Opening a converter input: netCDF, GRIB or a zarr store, told apart by content, else by suffix.

- netCDF 3 or 4 file (xarray with h5netcdf or netCDF4; the ``data`` extra).
- GRIB 1 or 2 file (cfgrib with ecCodes; ``pip install -e '.[grib]'``). The time axis is cfgrib's
  ``valid_time`` (start ``time`` + lead ``step``), so analyses and a single forecast's lead times
  both give valid times. A file with several start times *and* several lead times (``time`` x
  ``step``) is refused: split it into one lead time per file first. A file's only pressure level,
  which cfgrib keeps as a scalar coordinate, still names the channel (``t500``).
- zarr store folder, format 2 or 3 (``.zgroup``/``.zattrs`` or ``zarr.json`` in it), e.g. a local
  copy of WeatherBench 2 or ARCO-ERA5 (the ``zarr`` package of the ``data`` extra; format 3 needs
  zarr >= 3, which needs Python >= 3.11).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from utils.core.errors import one_line
from utils.data.layout import InputNotFoundError, LayoutError

GRIB_SUFFIXES = (".grib", ".grb", ".grib1", ".grib2", ".grb1", ".grb2")


ZARR_MARKERS = (".zgroup", ".zattrs", "zarr.json")  # zarr format 2 group/attributes, format 3 metadata


ACCEPTED = "--input takes a netCDF file, a GRIB file or a zarr store folder"


def detect_format(path: Path) -> str | None:
    """``"netcdf"``, ``"grib"`` or ``"zarr"`` for an existing ``path``, None if unrecognised.

    Content decides first (signature bytes ``GRIB``, ``\\x89HDF`` (netCDF4), ``CDF`` (netCDF3), or a
    folder holding zarr metadata), then the suffix (a GRIB file may start with a bulletin header).

    Raises:
        LayoutError: ``path`` is a folder without zarr metadata, or a file that cannot be opened.
    """
    if path.is_dir():
        if any((path / name).is_file() for name in ZARR_MARKERS):
            return "zarr"
        raise LayoutError(f"--input {path} is a folder but not a zarr store (it holds none of "
                          f"{', '.join(ZARR_MARKERS)}); {ACCEPTED}")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise LayoutError(f"cannot open --input {path} ({one_line(exc)}); check its permissions") from None
    if head == b"GRIB":
        return "grib"
    if head == b"\x89HDF" or head[:3] == b"CDF":
        return "netcdf"
    return "grib" if path.suffix.lower() in GRIB_SUFFIXES else None


def _require(module: str, extra: str, what: str) -> None:
    """Import an optional dependency, or raise a LayoutError naming the extra that installs it."""
    try:
        importlib.import_module(module)
    except (ImportError, RuntimeError) as exc:  # eccodes raises RuntimeError when its library is missing
        raise LayoutError(f"reading {what} needs the Python package '{module}' ({type(exc).__name__}: "
                          f"{one_line(exc)}); install it with pip install -e '.[{extra}]'") from None


def open_input(path: str | Path):
    """Open a netCDF file, GRIB file or zarr store lazily with xarray, times decoded with cftime.

    Unrecognised files are offered to xarray as netCDF (see :func:`detect_format`). A GRIB file's
    time dimension is replaced by ``valid_time`` (see the module docstring).

    Raises:
        InputNotFoundError: ``path`` does not exist.
        LayoutError: a folder that is no zarr store, a missing optional package (xarray, zarr,
            cfgrib/ecCodes; the message names the pip extra), a GRIB file with both several
            start times and several lead times, or xarray cannot read the input.
    """
    path = Path(path)
    if not path.exists():
        raise InputNotFoundError(f"input {path} does not exist; pass a netCDF file, GRIB file or zarr store "
                                 "folder with --input")
    kind = detect_format(path)
    _require("xarray", "data", "any input")
    import xarray as xr  # optional dependencies (the data extra); only the converter needs them

    # cftime datetimes for every calendar: one way to count steps, in the input's own calendar
    decode = xr.coders.CFDatetimeCoder(use_cftime=True)
    if kind == "zarr":
        _require("zarr", "data", f"the zarr store {path}")
        # a local store reads each array's metadata cheaply; this also works (without xarray's
        # multi-line warning) for stores written without consolidated metadata
        return _open(path, "zarr store", "download or copy the store again", engine="zarr",
                     consolidated=False, decode_times=decode)
    if kind == "grib":
        _require("cfgrib", "grib", f"the GRIB file {path}")
        # indexpath "": no .idx file next to the input (its folder may be read-only or shared);
        # errors "raise": a corrupt message fails here instead of being logged and skipped
        ds = _open(path, "GRIB", "if it mixes level types or steps, split it into one file per kind "
                   "(e.g. grib_copy in.grib 'out_[typeOfLevel].grib'), else download it again",
                   engine="cfgrib", decode_times=decode, backend_kwargs={"indexpath": "", "errors": "raise"})
        return _grib_valid_time(ds, path)
    if kind == "netcdf":
        try:
            return xr.open_dataset(path, engine="h5netcdf", decode_times=decode)
        except Exception:  # e.g. netCDF3 classic, which h5netcdf cannot read
            pass
    fix = ("pass an ERA5 netCDF file with --input" if kind == "netcdf" else
           f"it is not netCDF, GRIB or a zarr store either: {ACCEPTED}")
    return _open(path, "netCDF", fix, decode_times=decode)


def _open(path: Path, what: str, fix: str, **kwargs):
    """``xr.open_dataset(path, **kwargs)``; a failure becomes a one-line LayoutError ending in ``fix``."""
    import xarray as xr

    try:
        return xr.open_dataset(path, **kwargs)
    except Exception as exc:
        raise LayoutError(f"cannot read {path} as {what} ({type(exc).__name__}: {one_line(exc)}); "
                          f"{fix}") from None


def _grib_valid_time(ds, path: Path):
    """Make cfgrib's ``valid_time`` the time dimension: the fields are valid at start ``time`` + ``step``."""
    valid = ds.coords.get("valid_time")
    if valid is None or valid.ndim == 0:
        return ds
    if valid.ndim > 1:
        raise LayoutError(f"{path} holds forecasts from {ds.sizes.get('time', '?')} start times with "
                          f"{ds.sizes.get('step', '?')} lead times each (dimensions {valid.dims}), but the "
                          "converter needs one time axis; split it into one lead time per file, e.g. "
                          "grib_copy -w step=6 in.grib out.grib")
    return ds.swap_dims({valid.dims[0]: "valid_time"})
