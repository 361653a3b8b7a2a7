"""Normalization statistics and the climatologies of a dataset (time mean; by day of year and hour of day), checked as
they are read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from utils.core.errors import UserError, one_line
from utils.data.climatology import Climatology
from utils.data.layout import STATS_HINT


def load_stats_array(path: Path) -> np.ndarray:
    """One statistics file as a finite float32 array (any shape).

    Raises:
        UserError: ``path`` is not a ``.npy`` file of numbers (truncated, empty, ``.npz``,
            pickled objects, strings) or holds NaN/Inf; the message names the file.
    """
    try:
        with open(path, "rb") as f:
            arr = np.lib.format.read_array(f, allow_pickle=False)  # .npy only, no pickles: a data file runs no code
    except (OSError, ValueError, EOFError) as exc:
        raise UserError(f"cannot read {path} as a .npy array ({one_line(exc)}); {STATS_HINT}") from None
    if arr.dtype.kind not in "iuf":
        raise UserError(f"{path} holds {arr.dtype} values, not numbers; {STATS_HINT}")
    arr = arr.astype(np.float32)
    bad = ~np.isfinite(arr)
    if bad.any():
        # caught here, a NaN std would otherwise surface later as a diverging loss
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise UserError(f"{path} holds {int(bad.sum())} NaN/Inf value(s), first at index {first}; {STATS_HINT}")
    return arr


# a std this small next to its channel's mean is a constant field (or a broken statistic): normalizing divides by it
NEAR_ZERO_STD = 1e-6


def check_stds(stds: np.ndarray, means: np.ndarray, path: Path) -> None:
    """Raise UserError naming the first channel whose std is negative, zero or near zero (below
    :data:`NEAR_ZERO_STD` times the larger of its mean's magnitude and 1): dividing by it would blow the normalized
    fields up, and training would stop later on a NaN loss blamed on the learning rate."""
    stds, means = stds.reshape(-1), means.reshape(-1)
    for c, (std, mean) in enumerate(zip(stds, means)):
        if std <= 0:
            raise UserError(f"{path}: channel {c} has a {'zero' if std == 0 else 'negative'} standard deviation "
                            f"({std:g}); recompute the statistics")
        if std < NEAR_ZERO_STD * max(abs(mean), 1.0):
            raise UserError(f"{path}: channel {c} has a near-zero standard deviation ({std:g}, mean {mean:g}): a "
                            "constant field or a broken statistic, which normalization would divide by; recompute "
                            "the statistics or drop the channel")


TIME_MEANS_SOURCE = "time_means.npy: one time mean per grid point (no seasonal or daily cycle)"


@dataclass
class Stats:
    """Normalization statistics on the device: ``mean``/``std`` ``(1, C, 1, 1)``, ``clim`` ``(1, C, H, W)``
    (time-mean climatology, normalized), all float32; ``climatology``: the data's climatology by day of year
    and hour of day (``stats/climatology.h5``), None when the data folder has none."""

    mean: torch.Tensor
    std: torch.Tensor
    clim: torch.Tensor
    climatology: Climatology | None = None

    def sample_climatology(self, dataset) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A lookup ``idx (B,) -> (B, k, C, H, W)``: the normalized climatology at the valid time of each target of
        the samples ``idx`` of ``dataset`` (an ``ERA5Dataset``), on the statistics' device; None when there is
        no climatology file, no dataset, or files without ``start_time`` (then the time mean stands in).

        Raises:
            UserError: the dataset's calendar is not the climatology's.
        """
        clim = self.climatology
        if clim is None or dataset is None or any(f.axis.start is None for f in dataset.files):
            return None
        calendar = dataset.files[0].axis.calendar
        if calendar != clim.calendar:
            raise UserError(f"{clim.path} is in the {clim.calendar} calendar but {dataset.directory} in the {calendar} "
                            "calendar; recompute it with python -m tools.make_climatology DATA_PATH")

        def lookup(idx: torch.Tensor) -> torch.Tensor:
            times = [t for i in idx.tolist() for t in dataset.times(int(i))[1:]]
            fields = torch.from_numpy(clim.read(clim.cells(times))).to(self.mean.device)
            return ((fields - self.mean) / self.std).view(len(idx), -1, *fields.shape[1:])
        return lookup

    def climatology_source(self, dataset) -> str:
        """What ACC and the climatology baseline are scored against on ``dataset`` (see :meth:`sample_climatology`)."""
        if self.sample_climatology(dataset) is not None:
            return self.climatology.describe()
        return TIME_MEANS_SOURCE

    @classmethod
    def load(cls, stats_dir: Path, n_channels: int, img_size, device) -> "Stats":
        """Read ``global_means``, ``global_stds``, ``time_means`` ``.npy`` files of ``stats_dir``, and open its
        ``climatology.h5`` when there is one.

        Raises:
            UserError: a file is missing, is not a numeric ``.npy`` array (truncated, empty,
                pickled, ...), holds NaN/Inf, has the wrong shape, or a std is not positive; the
                climatology file cannot be read or does not fit the data (see :class:`Climatology`).
        """
        arrays = {}
        for name, want in (("global_means", (1, n_channels, 1, 1)), ("global_stds", (1, n_channels, 1, 1)),
                           ("time_means", None)):
            path = stats_dir / f"{name}.npy"
            if not path.is_file():
                raise UserError(f"missing {path}; the data folder needs stats/global_means.npy, "
                                "global_stds.npy and time_means.npy (written by the tools in tools/)")
            arr = load_stats_array(path)
            if want is not None and arr.shape != want:
                raise UserError(f"{path} has shape {arr.shape}, expected {want}")
            arrays[name] = arr
        h, w = img_size
        clim = arrays["time_means"]
        if clim.ndim != 4 or clim.shape[1] != n_channels or clim.shape[2] < h or clim.shape[3] < w:
            raise UserError(f"{stats_dir}/time_means.npy has shape {clim.shape}, expected (1, {n_channels}, >={h}, >={w})")
        check_stds(arrays["global_stds"], arrays["global_means"], stats_dir / "global_stds.npy")
        mean, std = (torch.from_numpy(arrays[k]).to(device) for k in ("global_means", "global_stds"))
        clim = (torch.from_numpy(np.ascontiguousarray(clim[:, :, :h, :w])).to(device) - mean) / std
        return cls(mean, std, clim, Climatology.find(stats_dir, n_channels, img_size))

    @classmethod
    def identity(cls, n_channels: int, img_size, device) -> "Stats":
        ones = torch.ones(1, n_channels, 1, 1, device=device)
        return cls(ones * 0, ones, torch.zeros(1, n_channels, *img_size, device=device))
