"""The on-disk layout of a dataset: folder, file, dataset and attribute names, and the output folder.

Layout (written by ``utils/preprocess/writer.py`` for the data tools, read by the loaders)::

    <data_path>/train/<name>.h5, <data_path>/valid/<name>.h5   one file per year (or year+member)
    <data_path>/stats/global_means.npy   (1, C, 1, 1) float32, per-channel mean, training split only
    <data_path>/stats/global_stds.npy    (1, C, 1, 1) float32, per-channel std (ddof=0), training only
    <data_path>/stats/time_means.npy     (1, C, H, W) float32, mean over training time steps
    <data_path>/stats/climatology.h5     optional: mean by day of year and hour of day over the training
                                         years, smoothed over day of year (``utils/data/climatology.py``)
    <data_path>/static.h5                optional: static fields (land-sea mask, orography), written by
                                         ``tools.convert_era5 --static_variables``, read by ``utils/data/static.py``

Each ``.h5`` file holds ``fields`` (T, C, H, W) float32 chunked one time step per chunk with
attribute ``channel_names``, ``latitude`` (H,) float64 descending and ``longitude`` (W,) float64
ascending. The time step is stored in its own unit as ``time_step`` (a number) and ``time_step_unit``
(``hours``, ``days``, ``months`` or ``years``: calendar months and years, whose length varies), and, for
hours and days, also as ``dt_hours`` (files without ``time_step_unit`` are in ``dt_hours``; without either,
6-hourly). Optional attributes of ``fields``: ``start_time``, the ISO 8601-like time of step 0
(``2001-02-30T06:00:00`` is valid in a 360-day calendar), ``calendar``, the CF calendar that
``start_time`` and the step are counted in (``standard``, ``proleptic_gregorian``, ``noleap``,
``360_day``, ...; as cftime names it, so ``365_day`` is stored as ``noleap`` and ``gregorian`` as
``standard``), and ``channel_units`` (C strings, e.g. ``K``; empty where unknown). The converter always
writes them; a file without ``calendar`` is in the standard calendar.

``static.h5`` holds one float32 dataset (H, W) per static field, named as the input's variable (``lsm``, ``z``),
with attributes ``mean`` and ``std`` (float64, over the grid, ddof=0; a constant field stores std 1) and
``units``, next to ``latitude`` (H,) and ``longitude`` (W,) float64 equal to those of the split files; the
fields are on the grid of the split files, cropped and trimmed the same way.

Files of one split named ``<year><suffix>.h5`` with the same ``<suffix>`` (``""``, or ``_m03`` for
ensemble member 3) form one series: where a file starts one time step after the previous one of its
series ends, samples run on across the file boundary (``utils/data/dataset.py``), so monthly and annual
data, one or twelve steps per file, train like hourly data.
"""

from __future__ import annotations

from pathlib import Path

from utils.core.errors import UserError, one_line

# dataset and attribute names of one .h5 file
FIELDS = "fields"


LATITUDE = "latitude"


LONGITUDE = "longitude"


ATTR_CHANNEL_NAMES = "channel_names"


ATTR_DT_HOURS = "dt_hours"


ATTR_START_TIME = "start_time"  # optional, ISO 8601 time of fields[0]


ATTR_CALENDAR = "calendar"  # optional, CF calendar of start_time; absent means standard


ATTR_TIME_STEP = "time_step"  # the step in its own unit (a number), with ATTR_TIME_UNIT


ATTR_TIME_UNIT = "time_step_unit"  # hours, days, months or years (utils/data/timestep.py)


ATTR_CHANNEL_UNITS = "channel_units"  # optional, C unit strings


# folder and file names of the layout
TRAIN = "train"


VALID = "valid"


SPLITS = (TRAIN, VALID)


STATS = "stats"


GLOBAL_MEANS = "global_means.npy"


GLOBAL_STDS = "global_stds.npy"


TIME_MEANS = "time_means.npy"


STATS_FILES = (GLOBAL_MEANS, GLOBAL_STDS, TIME_MEANS)


CLIMATOLOGY = "climatology.h5"  # optional: by day of year and hour of day (utils/data/climatology.py)


STATIC = "static.h5"  # optional, in <data_path>: the static fields (utils/data/static.py)


ATTR_MEAN = "mean"  # of a static field: float64 over its grid


ATTR_STD = "std"  # of a static field: float64, ddof=0; 1 for a constant field


ATTR_UNITS = "units"  # of a static field, e.g. "m**2 s**-2"; empty where unknown


SUFFIX = ".h5"


PARTIAL_SUFFIX = ".h5.part"  # written first, renamed once complete: loaders never see half files


class LayoutError(UserError, ValueError):
    """Bad input or arguments for the data tools; the message names the problem and the fix."""


class InputNotFoundError(UserError, FileNotFoundError):
    """An input file or folder the data tools need does not exist."""


REPO = Path(__file__).resolve().parents[2]  # train.py runs here: relative data paths of configs start here


def resolve_data_path(data_path: str | Path) -> Path:
    """A config's ``data_path``: as it is when absolute or found from the current directory, else relative to the
    repository root (where ``train.py`` runs, so a relative path in a run's config names a folder there);
    unchanged when neither exists (the loader then says it is missing)."""
    path = Path(data_path)
    if path.is_absolute() or path.exists():
        return path
    beside_repo = REPO / path
    return beside_repo if beside_repo.exists() else path


def split_files(data_path: str | Path, split: str) -> list[Path]:
    """Sorted ``.h5`` files of one split (``"train"`` or ``"valid"``) of a layout folder.

    Returns an empty list when the split folder does not exist.
    """
    return sorted((Path(data_path) / split).glob("*" + SUFFIX))


def series_key(path: str | Path) -> str:
    """The series a file of a split belongs to: its name after the leading year (``2001_m03.h5`` -> ``_m03``,
    ``2001.h5`` -> ``""``). Files of one series may continue each other in time."""
    return Path(path).stem.lstrip("0123456789")


def prepare_output_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """Create ``out_dir/{train,valid,stats}``; refuse to mix with a previous dataset.

    A loader reads every ``*.h5`` of a split, so stale files from an earlier run would silently
    join the new dataset. With ``overwrite`` they (and old stats, static fields and partial files) are
    deleted: static fields of an earlier conversion may lie on another grid.

    Raises:
        LayoutError: ``out_dir`` already holds layout files and ``overwrite`` is False,
            ``out_dir`` exists and is not a folder, or the folders cannot be made (or old
            files deleted), e.g. no permission, a read-only file system or a file on the path.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LayoutError(f"output path {out} exists and is not a folder; pass another --out")
    old = [p for s in SPLITS for p in (out / s).glob("*.h5*")]
    old += [out / STATS / n for n in (*STATS_FILES, CLIMATOLOGY) if (out / STATS / n).exists()]
    old += sorted(out.glob(STATIC + "*")) if out.is_dir() else []  # static.h5 and its partial file belong to it
    if old and not overwrite:
        raise LayoutError(f"{out} already holds a dataset ({len(old)} files, e.g. {old[0]}); "
                          "pass --overwrite (overwrite=True) to replace it or choose another --out")
    try:
        for p in old:
            p.unlink()
        for sub in (*SPLITS, STATS):
            (out / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LayoutError(f"cannot write the output folder {out} ({one_line(exc)}); "
                          "pass a writable --out") from None
    return out


DEFAULT_STEP_HOURS = 6.0


STATS_HINT = "recompute the statistics with the data tools (python -m tools.convert_era5 or tools.make_synthetic_data)"
