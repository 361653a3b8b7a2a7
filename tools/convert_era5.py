"""Convert ERA5-style netCDF, GRIB or zarr (Copernicus CDS, WeatherBench2, ARCO-ERA5) to the layout of
``tools/era5_layout.py``.

Usage::

    python -m tools.convert_era5 --input era5.nc --out data/era5 --variables t z --levels 850 500 \\
        [--valid_start 2017-01-02 | --valid_fraction 0.5] [--members all | 0 | 0,3] \\
        [--trim_to_multiple 4] [--select expver=0] [--overwrite]

Channels are variable-major (``--variables t z --levels 850 500`` -> t850, t500, z850, z500); a
variable without a pressure-level dimension (e.g. t2m) is one channel named after it. Time steps
are split by time into train/valid, one file per year (``<year>.h5``, or ``<year>_m<NN>.h5`` per
ensemble member when the input has a ``number`` dimension). Output latitude runs north to south.
Statistics are computed over the training split only (all its members). Data are streamed in
blocks of time steps, so inputs larger than memory convert too.

Inputs (``--input``), told apart by content, else by suffix (see :func:`detect_format`):

- netCDF 3 or 4 file (xarray with h5netcdf or netCDF4; the ``data`` extra).
- GRIB 1 or 2 file (cfgrib with ecCodes; ``pip install -e '.[grib]'``). The time axis is cfgrib's
  ``valid_time`` (start ``time`` + lead ``step``), so analyses and a single forecast's lead times
  both give valid times. A file with several start times *and* several lead times (``time`` x
  ``step``) is refused: split it into one lead time per file first. A file's only pressure level,
  which cfgrib keeps as a scalar coordinate, still names the channel (``t500``).
- zarr store folder, format 2 or 3 (``.zgroup``/``.zattrs`` or ``zarr.json`` in it), e.g. a local
  copy of WeatherBench 2 or ARCO-ERA5 (the ``zarr`` package of the ``data`` extra; format 3 needs
  zarr >= 3, which needs Python >= 3.11).

Times are decoded with cftime in the input's CF calendar (``standard``, ``proleptic_gregorian``,
``noleap``/``365_day``, ``all_leap``/``366_day``, ``360_day``, ``julian``), so the step ``dt_hours``
and the ``--valid_start`` split are computed in that calendar (``2001-02-30`` exists in
``360_day``). Every file stores the calendar as cftime names it in attribute ``calendar`` (also
for standard calendars) next to the ISO 8601-like ``start_time``.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import numpy as np

from tools import era5_layout as layout
from tools.era5_layout import InputNotFoundError, LayoutError
from utils.errors import ArgumentParser, exit_status

LEVEL_DIMS = ("isobaricInhPa", "level", "pressure_level")
LAT_NAMES = ("latitude", "lat")
LON_NAMES = ("longitude", "lon")
TIME_NAMES = ("time", "valid_time")
MEMBER_DIM = "number"
BLOCK_BYTES = 256 * 2 ** 20  # bytes of float32 output read per block
GRIB_SUFFIXES = (".grib", ".grb", ".grib1", ".grib2", ".grb1", ".grb2")
ZARR_MARKERS = (".zgroup", ".zattrs", "zarr.json")  # zarr format 2 group/attributes, format 3 metadata
ACCEPTED = "--input takes a netCDF file, a GRIB file or a zarr store folder"


@dataclass(frozen=True)
class Channel:
    """One output channel: ``variable`` at ``level`` (value of ``level_dim``, or of a scalar level
    coordinate when ``level_dim`` is None), or a single-level variable (``level`` None)."""

    name: str
    variable: str
    level_dim: str | None = None
    level: float | None = None


@dataclass
class OutputFile:
    """One output file: a contiguous run of time indices of one year (and one ensemble member)."""

    split: str
    name: str
    times: np.ndarray  # indices into the input time axis, increasing and contiguous
    member: int | None = None  # index along MEMBER_DIM, None without ensemble dimension
    member_value: int | None = None  # its value of the MEMBER_DIM coordinate (for names and messages)


@dataclass
class Plan:
    """Everything decided before any output is written."""

    channels: list[Channel]
    dims: dict[str, str]  # role ("time", "lat", "lon") -> dimension name in the input
    select: dict[str, dict[str, int]]  # variable -> {extra dim: index} to apply when reading
    lat_index: np.ndarray  # input latitude rows to keep, north to south
    lon_index: np.ndarray  # input longitude columns to keep, ascending
    latitude: np.ndarray
    longitude: np.ndarray
    dt_hours: float
    files: list[OutputFile]
    member_values: list[int] | None
    times: np.ndarray  # (T,) cftime datetimes of the whole input time axis
    calendar: str  # their CF calendar, as cftime names it
    notes: list[str] = field(default_factory=list)


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
        raise LayoutError(f"cannot open --input {path} ({layout.one_line(exc)}); check its permissions") from None
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
                          f"{layout.one_line(exc)}); install it with pip install -e '.[{extra}]'") from None


def open_input(path: str | Path):
    """Open a netCDF file, GRIB file or zarr store lazily with xarray, times decoded with cftime.

    Unrecognised files are offered to xarray as netCDF (see :func:`detect_format`). A GRIB file's
    time dimension is replaced by ``valid_time`` (see the module docstring).

    Raises:
        InputNotFoundError: ``path`` does not exist.
        LayoutError: a folder that is no zarr store, a missing optional package (xarray, cftime,
            zarr, cfgrib/ecCodes; the message names the pip extra), a GRIB file with both several
            start times and several lead times, or xarray cannot read the input.
    """
    path = Path(path)
    if not path.exists():
        raise InputNotFoundError(f"input {path} does not exist; pass a netCDF file, GRIB file or zarr store "
                                 "folder with --input")
    kind = detect_format(path)
    _require("xarray", "data", "any input")
    _require("cftime", "data", "any input")
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
        raise LayoutError(f"cannot read {path} as {what} ({type(exc).__name__}: {layout.one_line(exc)}); "
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


def _find_dim(dims: Sequence[str], names: Sequence[str], what: str, variable: str) -> str:
    for name in names:
        if name in dims:
            return name
    raise LayoutError(f"variable '{variable}' has no {what} dimension (looked for {', '.join(names)}); "
                      f"its dimensions are {tuple(dims)}")


def _level_name(level: float) -> str:
    return str(int(level)) if float(level).is_integer() else f"{level:g}"


def _level_coord(da) -> str | None:
    """Name of ``da``'s pressure-level dimension, else of a scalar level coordinate (cfgrib keeps a
    file's only level that way), else None (a single-level variable such as t2m)."""
    for name in LEVEL_DIMS:
        if name in da.dims:
            return name
    return next((name for name in LEVEL_DIMS if name in da.coords and da[name].ndim == 0), None)


def _resolve_channels(ds, variables: Sequence[str], levels: Sequence[float] | None) -> list[Channel]:
    """Channels in variable-major order; raises LayoutError for missing variables or levels."""
    if not variables:
        raise LayoutError(f"no variables given; pass --variables, e.g. one of: {', '.join(map(str, ds.data_vars))}")
    missing = [v for v in variables if v not in ds.data_vars]
    if missing:
        raise LayoutError(f"variable(s) {', '.join(missing)} not in the input; it has: "
                          f"{', '.join(map(str, ds.data_vars))}")
    channels, any_levels = [], False
    for var in variables:
        level_name = _level_coord(ds[var])
        if level_name is None:
            channels.append(Channel(str(var), str(var)))
            continue
        any_levels = True
        level_dim = level_name if level_name in ds[var].dims else None  # None: a scalar level
        available = np.atleast_1d(np.asarray(ds[var][level_name].values, dtype=np.float64))
        wanted = available if levels is None else np.asarray(levels, dtype=np.float64)
        for lev in wanted:
            if not np.isclose(available, lev, rtol=0, atol=1e-6 * max(1.0, abs(lev))).any():
                raise LayoutError(f"variable '{var}' has no level {_level_name(lev)} along '{level_name}'; "
                                  f"available levels: {', '.join(_level_name(a) for a in available)}")
            channels.append(Channel(f"{var}{_level_name(lev)}", str(var), level_dim, float(lev)))
    if levels is not None and not any_levels:
        raise LayoutError(f"--levels given but none of the variables {list(variables)} has a pressure-level "
                          f"dimension ({', '.join(LEVEL_DIMS)}); drop --levels")
    names = [c.name for c in channels]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise LayoutError(f"channels {dupes} are requested more than once; list each variable and level once")
    return channels


def _resolve_extra_dims(ds, channels: list[Channel], dims: dict[str, str], select: dict[str, int],
                        notes: list[str]) -> dict[str, dict[str, int]]:
    """Per variable, the index to take along every dimension that is not time/lat/lon/level/member."""
    known = set(dims.values()) | set(LEVEL_DIMS) | {MEMBER_DIM}
    out = {}
    for var in dict.fromkeys(c.variable for c in channels):
        chosen = {}
        for dim in ds[var].dims:
            if dim in known:
                continue
            size = ds.sizes[dim]
            if dim in select:
                if not -size <= select[dim] < size:
                    raise LayoutError(f"--select {dim}={select[dim]} is out of range; '{dim}' has {size} entries")
                chosen[dim] = select[dim]
            elif size == 1:
                chosen[dim] = 0
                notes.append(f"dropped size-1 dimension '{dim}' of '{var}'")
            else:
                values = np.asarray(ds[dim].values) if dim in ds.coords else np.arange(size)
                raise LayoutError(f"variable '{var}' has an unexpected dimension '{dim}' of size {size} "
                                  f"(values {', '.join(map(str, values[:5]))}{' ...' if size > 5 else ''}); "
                                  f"pick one entry with --select {dim}=INDEX, e.g. --select {dim}=0")
        out[var] = chosen
    unused = set(select) - {d for ch in out.values() for d in ch}
    if unused:
        raise LayoutError(f"--select names dimension(s) {sorted(unused)} that no selected variable has as an "
                          f"extra dimension (use --members for '{MEMBER_DIM}' and --levels for pressure levels)")
    return out


def _grid(ds, dims: dict[str, str], trim: int, notes: list[str]):
    """Row/column indices giving descending latitude and ascending longitude, trimmed to ``trim``."""
    coords = {}
    for role in ("lat", "lon"):
        name = dims[role]
        if name not in ds.coords:
            raise LayoutError(f"dimension '{name}' has no coordinate values; the input needs {role}itude values")
        coords[role] = np.asarray(ds[name].values, dtype=np.float64)
    lat, lon = coords["lat"], coords["lon"]
    lat_index, lon_index = np.arange(lat.size), np.arange(lon.size)
    if lat.size > 1 and np.all(np.diff(lat) > 0):
        lat_index = lat_index[::-1]  # the layout runs north to south
        notes.append("flipped latitude to run north to south")
    if lon.size > 1 and np.all(np.diff(lon) < 0):
        lon_index = lon_index[::-1]
        notes.append("flipped longitude to run west to east")
    if lat.size > 1 and not np.all(np.diff(lat[lat_index]) < 0):
        raise LayoutError(f"latitude '{dims['lat']}' is not strictly monotonic; sort the input by latitude")
    if lon.size > 1 and not np.all(np.diff(lon[lon_index]) > 0):
        raise LayoutError(f"longitude '{dims['lon']}' is not strictly monotonic; sort the input by longitude")
    if trim < 1:
        raise LayoutError(f"--trim_to_multiple must be >= 1, got {trim}")
    h, w = (lat.size // trim) * trim, (lon.size // trim) * trim
    if h == 0 or w == 0:
        raise LayoutError(f"--trim_to_multiple {trim} is larger than the {lat.size}x{lon.size} grid")
    if h < lat.size or w < lon.size:
        # dropping the southernmost rows and easternmost columns keeps the loader's north-west crop intact
        dropped = [f"{n} {what} [{', '.join(f'{v:g}' for v in values)}]"
                   for n, what, values in ((lat.size - h, "southernmost latitude row(s)", lat[lat_index[h:]]),
                                           (lon.size - w, "easternmost longitude column(s)", lon[lon_index[w:]]))
                   if n]
        notes.append(f"trimmed the {lat.size}x{lon.size} grid to {h}x{w} (multiples of {trim}): "
                     f"dropped {' and '.join(dropped)}")
    lat_index, lon_index = lat_index[:h], lon_index[:w]
    return lat_index, lon_index, lat[lat_index], lon[lon_index]


def _times(ds, time_dim: str) -> np.ndarray:
    """(T,) cftime datetimes of the time axis, strictly increasing, in the input's calendar."""
    import cftime

    times = np.asarray(ds[time_dim].values)
    if np.issubdtype(times.dtype, np.datetime64):  # stored as datetimes, no CF units: numpy's calendar
        seconds = times.astype("datetime64[s]").astype(np.int64)
        times = cftime.num2date(seconds, "seconds since 1970-01-01", calendar="proleptic_gregorian")
    if not (times.size and isinstance(times.flat[0], cftime.datetime)):
        raise LayoutError(f"time coordinate '{time_dim}' is not decoded to datetimes (dtype {times.dtype}); "
                          "the input needs CF time units such as 'hours since 1900-01-01' (and optionally a "
                          "CF calendar attribute)")
    if times.size > 1 and not np.all(np.diff(times) > timedelta(0)):
        raise LayoutError(f"time coordinate '{time_dim}' is not strictly increasing; sort the input by time "
                          f"and drop duplicates (e.g. ds.sortby('{time_dim}'))")
    return times


def _parse_time(text: str, calendar: str):
    """ISO 8601 ``text`` (e.g. ``2017-01-02T06:00``) as a cftime datetime of ``calendar``."""
    import xarray as xr

    try:  # xarray's parser, unlike numpy's, knows dates such as 2001-02-30 of a 360-day calendar
        return xr.date_range(text, periods=1, calendar=calendar, use_cftime=True)[0]
    except (ValueError, TypeError):
        raise LayoutError(f"--valid_start {text!r} is not an ISO 8601 time of the input's {calendar} calendar, "
                          "e.g. 2017-01-02T00:00") from None


def split_index(times: np.ndarray, valid_start: str | None = None, valid_fraction: float = 0.5) -> int:
    """Number of leading time steps that go to the training split; the rest go to validation.

    Args:
        times: (T,) cftime datetimes of one calendar, strictly increasing (as ``open_input`` decodes them).
        valid_start: ISO 8601 time in that calendar; steps at or after it are validation. Overrides
            ``valid_fraction``.
        valid_fraction: fraction of the last steps for validation (0 < F < 1), rounded to nearest.

    Raises:
        LayoutError: unparsable ``valid_start``, ``valid_fraction`` outside (0, 1), or a split
            with fewer than 2 time steps (a sample needs two).
    """
    n = times.size
    if valid_start is not None:
        start = _parse_time(valid_start, times[0].calendar)
        n_train = int(np.searchsorted(times, start, side="left"))
        how = f"--valid_start {valid_start}"
    else:
        if not 0 < valid_fraction < 1:
            raise LayoutError(f"--valid_fraction must be between 0 and 1, got {valid_fraction}")
        n_train = n - int(np.floor(n * valid_fraction + 0.5))
        how = f"--valid_fraction {valid_fraction}"
    for split, count in ((layout.TRAIN, n_train), (layout.VALID, n - n_train)):
        if count < 2:
            raise LayoutError(f"{how} leaves {count} time step(s) of {n} (from {times[0].isoformat()} to "
                              f"{times[-1].isoformat()}) for the {split} split, but each split needs at least 2; "
                              "choose another --valid_start or --valid_fraction")
    return n_train


def _members(ds, channels: list[Channel], spec: str) -> tuple[list[int] | None, list[int] | None]:
    """(indices, coordinate values) of the chosen ensemble members, or (None, None) without members."""
    has_members = any(MEMBER_DIM in ds[c.variable].dims for c in channels)
    if not has_members:
        if spec.strip() != "all":
            raise LayoutError(f"--members {spec} given but the input has no ensemble dimension '{MEMBER_DIM}'; "
                              "drop --members")
        return None, None
    values = (np.asarray(ds[MEMBER_DIM].values) if MEMBER_DIM in ds.coords
              else np.arange(ds.sizes[MEMBER_DIM])).astype(int).tolist()
    if spec.strip() == "all":
        return list(range(len(values))), values
    try:
        wanted = [int(s) for s in spec.split(",")]
    except ValueError:
        raise LayoutError(f"--members must be 'all' or comma-separated member numbers like 0,3; got {spec!r}") from None
    missing = [m for m in wanted if m not in values]
    if missing or len(set(wanted)) != len(wanted):
        raise LayoutError(f"--members {spec}: member(s) {missing or 'repeated'} not available; the input has "
                          f"'{MEMBER_DIM}' = {', '.join(map(str, values))}")
    return [values.index(m) for m in wanted], wanted


def _plan_files(times: np.ndarray, n_train: int, member_index, member_values) -> list[OutputFile]:
    years = np.array([t.year for t in times])
    files = []
    for split, idx in ((layout.TRAIN, np.arange(n_train)), (layout.VALID, np.arange(n_train, times.size))):
        for year in np.unique(years[idx]):
            run = idx[years[idx] == year]
            if member_index is None:
                files.append(OutputFile(split, f"{year}{layout.SUFFIX}", run))
            else:
                files += [OutputFile(split, f"{year}_m{v:02d}{layout.SUFFIX}", run, i, v)
                          for i, v in zip(member_index, member_values)]
    return files


def _dt_hours(times: np.ndarray, files: list[OutputFile]) -> float:
    """The common spacing of the steps inside every output file (gaps between files are allowed)."""
    seconds = (np.diff(times) / timedelta(seconds=1)).astype(np.float64)  # cftime: in the input's calendar
    dt = seconds.min()
    for f in files:
        inner = seconds[f.times[:-1]]  # f.times is contiguous: the steps from each of its times to the next
        bad = np.flatnonzero(inner != dt)
        if bad.size:
            a, b = times[f.times[bad[0]]].isoformat(), times[f.times[bad[0] + 1]].isoformat()
            raise LayoutError(f"time steps are not equally spaced in {f.split}/{f.name}: {a} -> {b} is "
                              f"{inner[bad[0]] / 3600:g} h, expected {dt / 3600:g} h; each output file needs "
                              "consecutive equally spaced steps, so select a regular time range")
    return float(dt) / 3600.0


def parse_select(items: Sequence[str] | None) -> dict[str, int]:
    """``["expver=0"]`` -> ``{"expver": 0}``; raises LayoutError for a malformed item."""
    out = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise LayoutError(f"--select expects DIM=INDEX (an integer position), got {item!r}")
    return out


def make_plan(ds, variables: Sequence[str], levels: Sequence[float] | None = None, *,
              valid_start: str | None = None, valid_fraction: float = 0.5, members: str = "all",
              trim_to_multiple: int = 1, select: dict[str, int] | None = None) -> Plan:
    """Validate the request against an opened dataset and decide channels, grid, split and files.

    Arguments as :func:`convert`. Raises LayoutError naming the problem and the fix.
    """
    notes: list[str] = []
    channels = _resolve_channels(ds, variables, levels)
    first = ds[channels[0].variable]
    dims = {"time": _find_dim(first.dims, TIME_NAMES, "time", channels[0].variable),
            "lat": _find_dim(first.dims, LAT_NAMES, "latitude", channels[0].variable),
            "lon": _find_dim(first.dims, LON_NAMES, "longitude", channels[0].variable)}
    for c in channels:
        lacking = [d for d in dims.values() if d not in ds[c.variable].dims]
        if lacking:
            raise LayoutError(f"variable '{c.variable}' lacks dimension(s) {lacking} that "
                              f"'{channels[0].variable}' has; convert them separately")
    extra = _resolve_extra_dims(ds, channels, dims, select or {}, notes)
    lat_index, lon_index, lat, lon = _grid(ds, dims, trim_to_multiple, notes)
    times = _times(ds, dims["time"])
    if times.size < 4:
        raise LayoutError(f"the input has {times.size} time step(s); train and valid need at least 2 each")
    n_train = split_index(times, valid_start, valid_fraction)
    member_index, member_values = _members(ds, channels, members)
    files = _plan_files(times, n_train, member_index, member_values)
    # a year holding one step gives no (t, t+1) sample and would fail the loader: leave it out
    notes += [f"skipped {f.split}/{f.name}: its year has a single time step ({times[f.times[0]].isoformat()}) "
              "in this split"
              for f in files if f.times.size < 2]
    files = [f for f in files if f.times.size >= 2]
    for split in layout.SPLITS:
        if not any(f.split == split for f in files):
            raise LayoutError(f"the {split} split has no year with two or more time steps, so it gives no "
                              "samples; choose another --valid_start or --valid_fraction")
    dt = _dt_hours(times, files)
    return Plan(channels, dims, extra, lat_index, lon_index, lat, lon, dt, files, member_values, times,
                times[0].calendar, notes)


def _read_channel(ds, plan: Plan, ch: Channel, f: OutputFile, start: int, stop: int) -> np.ndarray:
    """(stop - start, H, W) float32 of one channel, flipped and trimmed.

    Raises:
        LayoutError: NaN/Inf values, or the data cannot be read (a damaged or truncated input).
    """
    da = ds[ch.variable]
    index = dict(plan.select[ch.variable])
    if ch.level_dim is not None:
        values = np.asarray(ds[ch.level_dim].values, dtype=np.float64)
        index[ch.level_dim] = int(np.argmin(np.abs(values - ch.level)))
    if f.member is not None and MEMBER_DIM in da.dims:
        index[MEMBER_DIM] = f.member
    index[plan.dims["time"]] = slice(int(f.times[start]), int(f.times[stop - 1]) + 1)
    da = da.isel(index).transpose(plan.dims["time"], plan.dims["lat"], plan.dims["lon"])
    try:
        values = np.asarray(da.values)  # the read itself: the dataset is opened lazily
    except OSError as exc:
        first, last = plan.times[f.times[start]].isoformat(), plan.times[f.times[stop - 1]].isoformat()
        raise LayoutError(f"cannot read variable '{ch.variable}' at {first} .. {last} from "
                          f"{ds.encoding.get('source', 'the input')} "
                          f"({layout.one_line(exc)}); the file is damaged or truncated: download it again") from None
    block = values[:, plan.lat_index][:, :, plan.lon_index].astype(np.float32)
    bad = ~np.isfinite(block)
    if bad.any():
        t_bad = int(f.times[start + np.flatnonzero(bad.any(axis=(1, 2)))[0]])
        when = plan.times[t_bad].isoformat()
        member = "" if f.member is None else f", member {f.member_value}"
        raise LayoutError(f"variable '{ch.variable}' (channel {ch.name}) has {int(bad.sum())} NaN/Inf value(s), "
                          f"first at time {when}{member}; ERA5 has no missing values, so fill or drop them "
                          "(or re-download the file) before converting")
    return block


def _write_files(ds, plan: Plan, out: Path, verbose: bool) -> dict[str, np.ndarray]:
    """Stream every planned file to disk block by block; return the saved training statistics."""
    names = [c.name for c in plan.channels]
    h, w = plan.latitude.size, plan.longitude.size
    stats = layout.StatsAccumulator(names, (h, w))
    block = max(1, BLOCK_BYTES // (len(names) * h * w * 4))
    for f in plan.files:
        path = out / f.split / f.name
        with layout.FieldFileWriter(path, names, plan.latitude, plan.longitude, f.times.size, plan.dt_hours,
                                    start_time=plan.times[f.times[0]].isoformat(),
                                    calendar=plan.calendar) as writer:
            for start in range(0, f.times.size, block):
                stop = min(start + block, f.times.size)
                data = np.stack([_read_channel(ds, plan, c, f, start, stop) for c in plan.channels], axis=1)
                writer.write(start, data)
                if f.split == layout.TRAIN:
                    stats.update(data)
        if verbose:
            print(f"  wrote {f.split}/{f.name}: {f.times.size} steps", flush=True)
    return stats.save(out)


def convert(input_path: str | Path, out_dir: str | Path, variables: Sequence[str],
            levels: Sequence[float] | None = None, *, valid_start: str | None = None,
            valid_fraction: float = 0.5, members: str = "all", trim_to_multiple: int = 1,
            select: dict[str, int] | None = None, overwrite: bool = False, verbose: bool = True) -> dict:
    """Convert one ERA5-style netCDF file, GRIB file or zarr store to the layout in ``out_dir``.

    Args:
        input_path: netCDF/GRIB file or zarr store folder (see :func:`open_input`) with variables
            over (time|valid_time, [isobaricInhPa|level|pressure_level], latitude|lat,
            longitude|lon), optionally ``number`` (ensemble); times in any CF calendar.
        out_dir: output dataset folder (train/, valid/, stats/).
        variables: variable names; channel order is variable-major.
        levels: pressure levels (hPa, values of the level coordinate) for variables that have
            a level dimension; None = all levels of the file.
        valid_start: ISO time; steps at or after it form the validation split.
        valid_fraction: used without ``valid_start``: the last round(F*T) steps are validation.
        members: ``"all"`` or comma-separated values of the ``number`` coordinate, e.g. ``"0,3"``.
        trim_to_multiple: drop southernmost rows / easternmost columns so H, W are multiples of it.
        select: ``{dim: index}`` for any other dimension (e.g. ``{"expver": 0}``).
        overwrite: replace an existing dataset in ``out_dir``.
        verbose: print progress and the summary.

    Returns:
        dict with ``channels`` (list[str]), ``grid`` ((H, W)), ``latitude``/``longitude`` arrays,
        ``dt_hours`` and ``calendar`` (the input's CF calendar name, which ``dt_hours`` and the
        times are counted in), ``members`` (list[int] or None), ``files`` ({split: [(name,
        n_steps)]}), ``samples`` ({split: number of (t, t+1) pairs}), ``time_range`` ({split:
        (first, last) ISO times}), ``stats`` (float32 arrays), ``notes`` (list[str]: flips, trims,
        skipped files).

    Raises:
        InputNotFoundError: missing input. LayoutError: anything else wrong with the input or
        the arguments (unsupported format, missing optional package, missing variable/level,
        unknown dimension, NaN/Inf, bad split, ...).
        Validation happens before anything is written; if reading fails midway, the files
        written by this call are removed again.
    """
    ds = open_input(input_path)
    try:
        plan = make_plan(ds, variables, levels, valid_start=valid_start, valid_fraction=valid_fraction,
                         members=members, trim_to_multiple=trim_to_multiple, select=select)
        out = layout.prepare_output_dir(out_dir, overwrite)
        try:
            stats = _write_files(ds, plan, out, verbose)
        except BaseException:
            # a half-written dataset without stats would mislead the loader: remove it
            layout.prepare_output_dir(out, overwrite=True)
            raise
    finally:
        ds.close()
    summary = _summary(plan, stats, input_path, out)
    if verbose:
        print(format_summary(summary))
    return summary


def _summary(plan: Plan, stats: dict, input_path, out: Path) -> dict:
    files = {s: [(f.name, int(f.times.size)) for f in plan.files if f.split == s] for s in layout.SPLITS}
    return {
        "input": str(input_path), "out": str(out),
        "channels": [c.name for c in plan.channels],
        "grid": (plan.latitude.size, plan.longitude.size),
        "latitude": plan.latitude, "longitude": plan.longitude,
        "dt_hours": plan.dt_hours, "calendar": plan.calendar, "members": plan.member_values,
        "files": files,
        "samples": {s: sum(n - 1 for _, n in files[s]) for s in layout.SPLITS},
        "time_range": {s: (plan.times[min(f.times[0] for f in plan.files if f.split == s)].isoformat(),
                           plan.times[max(f.times[-1] for f in plan.files if f.split == s)].isoformat())
                       for s in layout.SPLITS},
        "stats": stats, "notes": plan.notes,
    }


def format_summary(summary: dict) -> str:
    """Human-readable multi-line summary of a conversion (see :func:`convert`)."""
    lat, lon = summary["latitude"], summary["longitude"]
    lines = [f"converted {summary['input']} -> {summary['out']}"]
    lines += [f"  note: {n}" for n in summary["notes"]]
    lines += [f"channels ({len(summary['channels'])}): {', '.join(summary['channels'])}",
              f"grid: {summary['grid'][0]} x {summary['grid'][1]}, latitude {lat[0]:g} .. {lat[-1]:g}, "
              f"longitude {lon[0]:g} .. {lon[-1]:g}; dt {summary['dt_hours']:g} h "
              f"({summary['calendar']} calendar)",
              f"members: {'none' if summary['members'] is None else ', '.join(map(str, summary['members']))}"]
    for split in layout.SPLITS:
        files = summary["files"][split]
        steps = sum(n for _, n in files)
        shown = ", ".join(f"{name} ({n})" for name, n in files[:4]) + (" ..." if len(files) > 4 else "")
        first, last = summary["time_range"][split]
        lines.append(f"{split}: {first} .. {last}, {len(files)} file(s), {steps} time steps, "
                     f"{summary['samples'][split]} samples (t -> t+1 pairs): {shown}")
    lines.append("training statistics (stats/global_means.npy, global_stds.npy):")
    lines.append(layout.format_stats(summary["stats"], summary["channels"]))
    return "\n".join(lines)


def build_parser() -> ArgumentParser:
    """The CLI's argument parser (flags mirror :func:`convert`; usage errors are one ``error:`` line)."""
    p = ArgumentParser(prog="python -m tools.convert_era5",
                       description="Convert ERA5-style netCDF, GRIB or zarr to train/, valid/, stats/ HDF5 "
                                   "layout.")
    p.add_argument("--input", required=True,
                   help="netCDF file, GRIB file (needs pip install -e '.[grib]') or zarr store folder")
    p.add_argument("--out", required=True, help="output dataset folder")
    p.add_argument("--variables", nargs="+", required=True, help="variables, e.g. t z t2m (channel order)")
    p.add_argument("--levels", nargs="+", type=float, default=None,
                   help="pressure levels for level variables, e.g. 850 500 (default: all in the file)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--valid_start", default=None,
                       help="ISO time in the input's calendar; steps at or after it are validation")
    split.add_argument("--valid_fraction", type=float, default=None,
                       help="fraction of the last time steps used for validation (default 0.5)")
    p.add_argument("--members", default="all", help="ensemble members: all (default) or numbers like 0 or 0,3")
    p.add_argument("--trim_to_multiple", type=int, default=1, metavar="P",
                   help="drop southern rows / eastern columns so H and W are multiples of P (default 1 = keep)")
    p.add_argument("--select", action="append", default=[], metavar="DIM=INDEX",
                   help="take one entry of an extra dimension, e.g. --select expver=0 (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 with ``error: ...`` on stderr for bad input)."""
    args = build_parser().parse_args(argv)
    return exit_status(lambda: convert(
        args.input, args.out, args.variables, args.levels, valid_start=args.valid_start,
        valid_fraction=0.5 if args.valid_fraction is None else args.valid_fraction,
        members=args.members, trim_to_multiple=args.trim_to_multiple,
        select=parse_select(args.select), overwrite=args.overwrite))


if __name__ == "__main__":
    sys.exit(main())
