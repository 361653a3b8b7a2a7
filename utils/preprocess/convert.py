"""Convert ERA5-style netCDF, GRIB or zarr (Copernicus CDS, WeatherBench 2, ARCO-ERA5) to the layout of
``utils/data/layout.py`` (the command line: ``tools/convert_era5.py``).

Channels are variable-major (``variables=["t", "z"], levels=[850, 500]`` -> t850, t500, z850, z500); a
variable without a pressure-level dimension (e.g. t2m) is one channel named after it. Time steps
are split by time into train/valid, one file per year (``<year>.h5``, or ``<year>_m<NN>.h5`` per
ensemble member when the input has a ``number`` dimension). Output latitude runs north to south.
Statistics, and the climatology by day of year and hour of day (``stats/climatology.h5``, when its accumulators
fit in memory; else ``python -m tools.make_climatology``), are computed over the training split only (all its
members). The time step is stored in its own unit (hours, days, calendar months, years), so monthly and annual
means convert as they are; files of one member continue each other in time. Data are streamed in
blocks of time steps, so inputs larger than memory convert too. Every file stores the calendar as
cftime names it in attribute ``calendar`` (also for standard calendars) next to the ISO 8601-like
``start_time``. Inputs: ``utils/preprocess/formats.py``; the plan: ``utils/preprocess/convert_plan.py``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Sequence

import numpy as np

from utils.core.errors import one_line
from utils.data import layout
from utils.data.layout import LayoutError
from utils.preprocess.climatology_builder import ClimatologyAccumulator, climatology_fits
from utils.preprocess.convert_plan import (MEMBER_DIM, Channel, OutputFile, Plan, make_plan, parse_select,  # noqa: F401
                                           run_lengths)
from utils.preprocess.formats import open_input
from utils.preprocess.static_fields import StaticField, format_static, read_static_fields, write_static_file
from utils.preprocess.writer import FieldFileWriter, StatsAccumulator, format_stats

BLOCK_BYTES = 256 * 2 ** 20  # bytes of float32 output read per block


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
                          f"({one_line(exc)}); the file is damaged or truncated: download it again") from None
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


def _write_files(ds, plan: Plan, out: Path, verbose: bool) -> tuple[dict[str, np.ndarray], bool]:
    """Stream every planned file to disk block by block; return the saved training statistics and whether the
    climatology (``stats/climatology.h5``) was written too (it is when its accumulators fit in memory)."""
    names = [c.name for c in plan.channels]
    units = [str(ds[c.variable].attrs.get("units", "")) for c in plan.channels]
    h, w = plan.latitude.size, plan.longitude.size
    stats = StatsAccumulator(names, (h, w))
    n_train = sum(f.times.size for f in plan.files if f.split == layout.TRAIN)
    clim = ClimatologyAccumulator(plan.calendar) if climatology_fits(n_train, (len(names), h, w)) else None
    block = max(1, BLOCK_BYTES // (len(names) * h * w * 4))
    for f in plan.files:
        path = out / f.split / f.name
        with FieldFileWriter(path, names, plan.latitude, plan.longitude, f.times.size, plan.dt_hours,
                             start_time=plan.times[f.times[0]].isoformat(), calendar=plan.calendar,
                             step=plan.step, channel_units=units) as writer:
            for start in range(0, f.times.size, block):
                stop = min(start + block, f.times.size)
                data = np.stack([_read_channel(ds, plan, c, f, start, stop) for c in plan.channels], axis=1)
                writer.write(start, data)
                if f.split == layout.TRAIN:
                    stats.update(data)
                    if clim is not None:
                        clim.update(data, plan.times[f.times[start:stop]])
        if verbose:
            print(f"  wrote {f.split}/{f.name}: {f.times.size} steps", flush=True)
    result = stats.save(out)
    if clim is not None:
        clim.save(out / layout.STATS / layout.CLIMATOLOGY, names)
    return result, clim is not None


def convert(input_path: str | Path, out_dir: str | Path, variables: Sequence[str],
            levels: Sequence[float] | None = None, *, valid_start: str | None = None,
            valid_fraction: float = 0.5, members: str = "all", trim_to_multiple: int = 1,
            select: dict[str, int] | None = None, static_variables: Sequence[str] = (), overwrite: bool = False,
            verbose: bool = True) -> dict:
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
        static_variables: variables written to ``<out_dir>/static.h5`` as static fields on the same grid
            (e.g. ``["lsm", "z"]``: land-sea mask, surface geopotential); one with a time dimension must be
            constant in time (``utils/preprocess/static_fields.py``).
        overwrite: replace an existing dataset in ``out_dir``.
        verbose: print progress and the summary.

    Returns:
        dict with ``channels`` (list[str]), ``grid`` ((H, W)), ``latitude``/``longitude`` arrays,
        ``time_step`` (e.g. ``"6 hours"``, ``"1 months"``), ``dt_hours`` (None for months and years) and
        ``calendar`` (the input's CF calendar name, which the step and the times are counted in),
        ``members`` (list[int] or None), ``files`` ({split: [(name, n_steps)]}), ``climatology``
        (whether it was written), ``samples`` ({split: number of (t, t+1) pairs, across files of a
        member that continue each other}), ``time_range`` ({split:
        (first, last) ISO times}), ``stats`` (float32 arrays), ``static`` ({name: (mean, std, units)} of the
        static fields, empty without), ``notes`` (list[str]: flips, trims, skipped files).

    Raises:
        InputNotFoundError: missing input. LayoutError: anything else wrong with the input or
        the arguments (unsupported format, missing optional package, missing variable/level,
        unknown dimension, NaN/Inf, bad split, a static variable missing or changing in time, ...).
        Validation happens before anything is written; if reading fails midway, the files
        written by this call are removed again.
    """
    ds = open_input(input_path)
    try:
        plan = make_plan(ds, variables, levels, valid_start=valid_start, valid_fraction=valid_fraction,
                         members=members, trim_to_multiple=trim_to_multiple, select=select)
        static = read_static_fields(ds, static_variables, plan)  # small, and checked before anything is written
        new_dirs = [d for d in (Path(out_dir), *(Path(out_dir) / s for s in (*layout.SPLITS, layout.STATS)))
                    if not d.exists()]
        out = layout.prepare_output_dir(out_dir, overwrite)
        try:
            stats, with_clim = _write_files(ds, plan, out, verbose)
            if static:
                write_static_file(out, static, plan.latitude, plan.longitude)
        except BaseException:
            # a half-written dataset without stats would mislead the loader: remove it, and the folders made for it
            layout.prepare_output_dir(out, overwrite=True)
            for d in reversed(new_dirs):
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
    finally:
        ds.close()
    summary = _summary(plan, stats, input_path, out, with_clim, static)
    if verbose:
        print(format_summary(summary))
    return summary


def _summary(plan: Plan, stats: dict, input_path, out: Path, with_clim: bool, static: list[StaticField]) -> dict:
    files = {s: [(f.name, int(f.times.size)) for f in plan.files if f.split == s] for s in layout.SPLITS}
    return {
        "input": str(input_path), "out": str(out),
        "channels": [c.name for c in plan.channels],
        "grid": (plan.latitude.size, plan.longitude.size),
        "latitude": plan.latitude, "longitude": plan.longitude,
        "time_step": str(plan.step), "dt_hours": plan.dt_hours, "calendar": plan.calendar,
        "members": plan.member_values, "files": files, "climatology": with_clim,
        "samples": {s: sum(n - 1 for n in run_lengths(plan, s)) for s in layout.SPLITS},
        "time_range": {s: (plan.times[min(f.times[0] for f in plan.files if f.split == s)].isoformat(),
                           plan.times[max(f.times[-1] for f in plan.files if f.split == s)].isoformat())
                       for s in layout.SPLITS},
        "stats": stats, "notes": plan.notes, "static": {f.name: (f.mean, f.std, f.units) for f in static},
    }


def _short(step: str) -> str:
    """``"6 hours"`` -> ``"6 h"``, ``"1 days"`` -> ``"1 d"``; months and years as they are."""
    value, unit = step.split()
    return f"{value} {dict(hours='h', days='d').get(unit, unit)}"


def format_summary(summary: dict) -> str:
    """Human-readable multi-line summary of a conversion (see :func:`convert`)."""
    lat, lon = summary["latitude"], summary["longitude"]
    lines = [f"converted {summary['input']} -> {summary['out']}"]
    lines += [f"  note: {n}" for n in summary["notes"]]
    lines += [f"channels ({len(summary['channels'])}): {', '.join(summary['channels'])}",
              f"grid: {summary['grid'][0]} x {summary['grid'][1]}, latitude {lat[0]:g} .. {lat[-1]:g}, "
              f"longitude {lon[0]:g} .. {lon[-1]:g}; dt {_short(summary['time_step'])} "
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
    lines.append(format_stats(summary["stats"], summary["channels"]))
    lines.append(f"climatology: {layout.STATS}/{layout.CLIMATOLOGY} (day of year and hour of day)"
                 if summary["climatology"] else "climatology: skipped (too large to accumulate in memory); run "
                                                f"python -m tools.make_climatology {summary['out']}")
    if summary.get("static"):
        lines.append(format_static(summary["static"]))
    return "\n".join(lines)
