"""The converter's plan: channels, grid, time axis, train/valid split and output files, decided from the
input's metadata before anything is written (``utils/preprocess/convert.py`` carries it out).

Times are decoded with cftime in the input's CF calendar (``standard``, ``proleptic_gregorian``,
``noleap``/``365_day``, ``all_leap``/``366_day``, ``360_day``, ``julian``), so the time step and the
``--valid_start`` split are computed in that calendar (``2001-02-30`` exists in ``360_day``). The step keeps
its own unit (``utils/data/timestep.py``): hours, days, calendar months (monthly means) or years (annual means).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import numpy as np

from utils.data import layout
from utils.data.layout import LayoutError
from utils.data.timestep import TimeStep, infer_time_step

LEVEL_DIMS = ("isobaricInhPa", "level", "pressure_level")


LAT_NAMES = ("latitude", "lat")


LON_NAMES = ("longitude", "lon")


TIME_NAMES = ("time", "valid_time")


MEMBER_DIM = "number"


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
    step: TimeStep  # in its own unit: hours, days, calendar months or years
    files: list[OutputFile]
    member_values: list[int] | None
    times: np.ndarray  # (T,) cftime datetimes of the whole input time axis
    calendar: str  # their CF calendar, as cftime names it
    notes: list[str] = field(default_factory=list)

    @property
    def dt_hours(self) -> float | None:
        """Hours per step for hourly and daily data; None for calendar months and years."""
        return None if self.step.calendar_based else self.step.hours()


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


def _time_step(times: np.ndarray, files: list[OutputFile]) -> TimeStep:
    """The time step in its own unit (:func:`infer_time_step`), checked to be the spacing of the steps inside
    every output file (gaps between files are allowed)."""
    step = infer_time_step(times)
    for f in files:
        for i in f.times[:-1]:  # f.times is contiguous: each of its times to the next
            if step.steps_between(times[i], times[i + 1]) != 1:
                a, b = times[i].isoformat(), times[i + 1].isoformat()
                raise LayoutError(f"time steps are not equally spaced in {f.split}/{f.name}: {a} -> {b} is not one "
                                  f"step of {step}; each output file needs consecutive equally spaced steps, so "
                                  "select a regular time range")
    return step


def _continuing(times: np.ndarray, files: list[OutputFile], step: TimeStep) -> set[int]:
    """Indices of the files that continue, or are continued by, the file before or after them in time (same
    split and member): their samples run across the file boundary."""
    linked: set[int] = set()
    for i, f in enumerate(files):
        for j in range(i + 1, len(files)):
            g = files[j]
            if g.split == f.split and g.member == f.member:
                if step.steps_between(times[f.times[-1]], times[g.times[0]]) == 1:
                    linked |= {i, j}
                break
    return linked


def run_lengths(plan: "Plan", split: str) -> list[int]:
    """Time steps of each run of files of ``split`` that continue each other (samples cross their boundaries)."""
    lengths: list[int] = []
    open_runs: dict = {}  # member -> (its newest file, the index of its run in lengths)
    for f in (f for f in plan.files if f.split == split):
        prev = open_runs.get(f.member)
        if prev is not None and plan.step.steps_between(plan.times[prev[0].times[-1]], plan.times[f.times[0]]) == 1:
            lengths[prev[1]] += f.times.size
            open_runs[f.member] = (f, prev[1])
        else:
            lengths.append(f.times.size)
            open_runs[f.member] = (f, len(lengths) - 1)
    return lengths


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
    step = _time_step(times, files)
    # a year holding one step that no neighbouring file continues gives no (t, t+1) sample: leave it out (annual
    # data, one step a year, keep their files: samples run on from one file into the next)
    linked = _continuing(times, files, step)
    notes += [f"skipped {f.split}/{f.name}: its year has a single time step ({times[f.times[0]].isoformat()}) "
              "in this split and no file continues it"
              for i, f in enumerate(files) if f.times.size < 2 and i not in linked]
    files = [f for i, f in enumerate(files) if f.times.size >= 2 or i in linked]
    plan = Plan(channels, dims, extra, lat_index, lon_index, lat, lon, step, files, member_values, times,
                times[0].calendar, notes)
    for split in layout.SPLITS:
        if max(run_lengths(plan, split), default=0) < 2:
            raise LayoutError(f"the {split} split has no two consecutive time steps (one {step} step apart), so it "
                              "gives no samples; choose another --valid_start or --valid_fraction")
    notes += few_times_note(plan)
    return plan


FEW_INITIAL_TIMES = 8  # fewer distinct initial times in training: say what a model can learn from them


def few_times_note(plan: "Plan") -> list[str]:
    """A note when the training split holds fewer than :data:`FEW_INITIAL_TIMES` distinct initial times (ensemble
    members share theirs): what a model trained on it can and cannot learn, so that its scores read right."""
    starts = sorted({int(t) for f in plan.files if f.split == "train" for t in f.times[:-1]})
    if not starts or len(starts) >= FEW_INITIAL_TIMES:
        return []
    shown = ", ".join(plan.times[t].isoformat() for t in starts)
    members = f" (the same for all {len(plan.member_values)} members)" if plan.member_values else ""
    return [f"training has {len(starts)} distinct initial time(s), {shown}{members}: a model learns the change "
            f"over one step ({plan.step}) from those times only, not the weather of other days (at most a daily "
            "cycle shared with validation times of the same hour); its validation scores test the pipeline, not a "
            "forecast, and persistence may well beat it on channels that the weather moves"]
