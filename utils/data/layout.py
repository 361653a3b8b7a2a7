"""The on-disk layout of a dataset: folder, file, dataset and attribute names, and the output folder.

Layout (written by ``utils/data/writer.py`` for the data tools, read by the loaders)::

    <data_path>/train/<name>.h5, <data_path>/valid/<name>.h5   one file per year (or year+member)
    <data_path>/stats/global_means.npy   (1, C, 1, 1) float32, per-channel mean, training split only
    <data_path>/stats/global_stds.npy    (1, C, 1, 1) float32, per-channel std (ddof=0), training only
    <data_path>/stats/time_means.npy     (1, C, H, W) float32, mean over training time steps

Each ``.h5`` file holds ``fields`` (T, C, H, W) float32 chunked one time step per chunk with
attributes ``channel_names`` and ``dt_hours``, ``latitude`` (H,) float64 descending and
``longitude`` (W,) float64 ascending. Optional attributes of ``fields``: ``start_time``, the
ISO 8601-like time of step 0 (``2001-02-30T06:00:00`` is valid in a 360-day calendar), and
``calendar``, the CF calendar that ``start_time`` and ``dt_hours`` are counted in (``standard``,
``proleptic_gregorian``, ``noleap``, ``360_day``, ...; as cftime names it, so ``365_day`` is stored
as ``noleap`` and ``gregorian`` as ``standard``). The converter always writes both; a file without
``calendar`` (e.g. synthetic data) is in the standard calendar.
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


# folder and file names of the layout
TRAIN = "train"


VALID = "valid"


SPLITS = (TRAIN, VALID)


STATS = "stats"


GLOBAL_MEANS = "global_means.npy"


GLOBAL_STDS = "global_stds.npy"


TIME_MEANS = "time_means.npy"


STATS_FILES = (GLOBAL_MEANS, GLOBAL_STDS, TIME_MEANS)


SUFFIX = ".h5"


PARTIAL_SUFFIX = ".h5.part"  # written first, renamed once complete: loaders never see half files


class LayoutError(UserError, ValueError):
    """Bad input or arguments for the data tools; the message names the problem and the fix."""


class InputNotFoundError(UserError, FileNotFoundError):
    """An input file or folder the data tools need does not exist."""


def split_files(data_path: str | Path, split: str) -> list[Path]:
    """Sorted ``.h5`` files of one split (``"train"`` or ``"valid"``) of a layout folder.

    Returns an empty list when the split folder does not exist.
    """
    return sorted((Path(data_path) / split).glob("*" + SUFFIX))


def prepare_output_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """Create ``out_dir/{train,valid,stats}``; refuse to mix with a previous dataset.

    A loader reads every ``*.h5`` of a split, so stale files from an earlier run would silently
    join the new dataset. With ``overwrite`` they (and old stats and partial files) are deleted.

    Raises:
        LayoutError: ``out_dir`` already holds layout files and ``overwrite`` is False,
            ``out_dir`` exists and is not a folder, or the folders cannot be made (or old
            files deleted), e.g. no permission, a read-only file system or a file on the path.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LayoutError(f"output path {out} exists and is not a folder; pass another --out")
    old = [p for s in SPLITS for p in (out / s).glob("*.h5*")]
    old += [out / STATS / n for n in STATS_FILES if (out / STATS / n).exists()]
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
