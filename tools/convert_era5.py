"""Convert ERA5-style netCDF (Copernicus CDS, WeatherBench2) to the layout of ``tools/era5_layout.py``.

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
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Channel:
    """One output channel: ``variable`` at ``level`` (value of ``level_dim``), or a single-level variable."""

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
    times: np.ndarray  # (T,) datetime64[s] of the whole input time axis
    notes: list[str] = field(default_factory=list)


def open_input(path: str | Path):
    """Open a netCDF file lazily with xarray (engine ``h5netcdf``, else xarray's default).

    Raises:
        InputNotFoundError: the file does not exist.
        LayoutError: ``path`` is a folder, or xarray cannot read it.
    """
    path = Path(path)
    if path.is_dir():
        raise LayoutError(f"--input {path} is a folder; pass one netCDF file with --input")
    if not path.is_file():
        raise InputNotFoundError(f"input file {path} does not exist; pass the netCDF file with --input")
    import xarray as xr  # optional dependency (pip install .[data]); only the converter needs it

    try:
        return xr.open_dataset(path, engine="h5netcdf")
    except Exception:  # e.g. netCDF3 classic, which h5netcdf cannot read
        pass
    try:
        return xr.open_dataset(path)
    except Exception as exc:
        raise LayoutError(f"cannot read {path} as netCDF ({type(exc).__name__}: {layout.one_line(exc)}); "
                          "pass an ERA5 netCDF file with --input") from None


def _find_dim(dims: Sequence[str], names: Sequence[str], what: str, variable: str) -> str:
    for name in names:
        if name in dims:
            return name
    raise LayoutError(f"variable '{variable}' has no {what} dimension (looked for {', '.join(names)}); "
                      f"its dimensions are {tuple(dims)}")


def _level_name(level: float) -> str:
    return str(int(level)) if float(level).is_integer() else f"{level:g}"


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
        level_dim = next((d for d in LEVEL_DIMS if d in ds[var].dims), None)
        if level_dim is None:
            channels.append(Channel(str(var), str(var)))
            continue
        any_levels = True
        available = np.asarray(ds[level_dim].values, dtype=np.float64)
        wanted = available if levels is None else np.asarray(levels, dtype=np.float64)
        for lev in wanted:
            if not np.isclose(available, lev, rtol=0, atol=1e-6 * max(1.0, abs(lev))).any():
                raise LayoutError(f"variable '{var}' has no level {_level_name(lev)} along '{level_dim}'; "
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
    times = np.asarray(ds[time_dim].values)
    if not np.issubdtype(times.dtype, np.datetime64):
        raise LayoutError(f"time coordinate '{time_dim}' is not decoded to datetimes (dtype {times.dtype}); "
                          "the input needs CF time units (standard calendar)")
    times = times.astype("datetime64[s]")
    if times.size > 1 and not np.all(np.diff(times) > np.timedelta64(0, "s")):
        raise LayoutError(f"time coordinate '{time_dim}' is not strictly increasing; sort the input by time "
                          f"and drop duplicates (e.g. ds.sortby('{time_dim}'))")
    return times


def split_index(times: np.ndarray, valid_start: str | None = None, valid_fraction: float = 0.5) -> int:
    """Number of leading time steps that go to the training split; the rest go to validation.

    Args:
        times: (T,) datetime64, strictly increasing.
        valid_start: ISO 8601 time; steps at or after it are validation. Overrides ``valid_fraction``.
        valid_fraction: fraction of the last steps for validation (0 < F < 1), rounded to nearest.

    Raises:
        LayoutError: unparsable ``valid_start``, ``valid_fraction`` outside (0, 1), or a split
            with fewer than 2 time steps (a sample needs two).
    """
    n = times.size
    if valid_start is not None:
        try:
            start = np.datetime64(valid_start, "s")
        except ValueError:
            raise LayoutError(f"--valid_start {valid_start!r} is not an ISO 8601 time, e.g. 2017-01-02T00:00") from None
        n_train = int(np.searchsorted(times, start, side="left"))
        how = f"--valid_start {valid_start}"
    else:
        if not 0 < valid_fraction < 1:
            raise LayoutError(f"--valid_fraction must be between 0 and 1, got {valid_fraction}")
        n_train = n - int(np.floor(n * valid_fraction + 0.5))
        how = f"--valid_fraction {valid_fraction}"
    for split, count in ((layout.TRAIN, n_train), (layout.VALID, n - n_train)):
        if count < 2:
            raise LayoutError(f"{how} leaves {count} time step(s) of {n} (from {times[0]} to {times[-1]}) for the "
                              f"{split} split, but each split needs at least 2; choose another --valid_start "
                              "or --valid_fraction")
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
    years = times.astype("datetime64[Y]").astype(int) + 1970
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
    diffs = np.diff(times).astype(np.int64)
    dt = int(diffs.min())
    for f in files:
        inner = np.diff(times[f.times]).astype(np.int64)
        bad = np.flatnonzero(inner != dt)
        if bad.size:
            a, b = times[f.times[bad[0]]], times[f.times[bad[0] + 1]]
            raise LayoutError(f"time steps are not equally spaced in {f.split}/{f.name}: {a} -> {b} is "
                              f"{inner[bad[0]] / 3600:g} h, expected {dt / 3600:g} h; each output file needs "
                              "consecutive equally spaced steps, so select a regular time range")
    return dt / 3600.0


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
    notes += [f"skipped {f.split}/{f.name}: its year has a single time step ({times[f.times[0]]}) in this split"
              for f in files if f.times.size < 2]
    files = [f for f in files if f.times.size >= 2]
    for split in layout.SPLITS:
        if not any(f.split == split for f in files):
            raise LayoutError(f"the {split} split has no year with two or more time steps, so it gives no "
                              "samples; choose another --valid_start or --valid_fraction")
    dt = _dt_hours(times, files)
    return Plan(channels, dims, extra, lat_index, lon_index, lat, lon, dt, files, member_values, times, notes)


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
        raise LayoutError(f"cannot read variable '{ch.variable}' at {plan.times[f.times[start]]} .. "
                          f"{plan.times[f.times[stop - 1]]} from {ds.encoding.get('source', 'the input')} "
                          f"({layout.one_line(exc)}); the file is damaged or truncated: download it again") from None
    block = values[:, plan.lat_index][:, :, plan.lon_index].astype(np.float32)
    bad = ~np.isfinite(block)
    if bad.any():
        t_bad = int(f.times[start + np.flatnonzero(bad.any(axis=(1, 2)))[0]])
        when = plan.times[t_bad]
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
                                    start_time=str(plan.times[f.times[0]])) as writer:
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
    """Convert one ERA5-style netCDF file to the layout in ``out_dir``; return a summary.

    Args:
        input_path: netCDF file with variables over (time|valid_time, [isobaricInhPa|level|
            pressure_level], latitude|lat, longitude|lon), optionally ``number`` (ensemble).
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
        ``dt_hours``, ``members`` (list[int] or None), ``files`` ({split: [(name, n_steps)]}),
        ``samples`` ({split: number of (t, t+1) pairs}), ``time_range`` ({split: (first, last) ISO
        times}), ``stats`` (float32 arrays), ``notes`` (list[str]: flips, trims, skipped files).

    Raises:
        InputNotFoundError: missing input. LayoutError: anything else wrong with the input or
        the arguments (missing variable/level, unknown dimension, NaN/Inf, bad split, ...).
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
        "dt_hours": plan.dt_hours, "members": plan.member_values,
        "files": files,
        "samples": {s: sum(n - 1 for _, n in files[s]) for s in layout.SPLITS},
        "time_range": {s: (str(plan.times[min(f.times[0] for f in plan.files if f.split == s)]),
                           str(plan.times[max(f.times[-1] for f in plan.files if f.split == s)]))
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
              f"longitude {lon[0]:g} .. {lon[-1]:g}; dt {summary['dt_hours']:g} h",
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
                       description="Convert ERA5-style netCDF to train/, valid/, stats/ HDF5 layout.")
    p.add_argument("--input", required=True, help="netCDF file (CDS or WeatherBench2 style)")
    p.add_argument("--out", required=True, help="output dataset folder")
    p.add_argument("--variables", nargs="+", required=True, help="variables, e.g. t z t2m (channel order)")
    p.add_argument("--levels", nargs="+", type=float, default=None,
                   help="pressure levels for level variables, e.g. 850 500 (default: all in the file)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--valid_start", default=None, help="ISO time; steps at or after it are validation")
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
