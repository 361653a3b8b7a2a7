"""Normalization statistics and the climatology of a dataset, checked as they are read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from utils.core.errors import UserError, one_line
from utils.data.layout import STATS_HINT


def load_stats_array(path: Path) -> np.ndarray:
    """One statistics file as a finite float32 array (any shape).

    Raises:
        UserError: ``path`` is not a ``.npy`` file of numbers (truncated, empty, ``.npz``,
            pickled objects, strings) or holds NaN/Inf; the message names the file.
    """
    try:
        with open(path, "rb") as f:
            arr = np.lib.format.read_array(f)  # .npy only and no pickles: a data file never runs code
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


@dataclass
class Stats:
    """Normalization statistics on the device: ``mean``/``std`` ``(1, C, 1, 1)``, ``clim`` ``(1, C, H, W)``
    (time-mean climatology, normalized), all float32."""

    mean: torch.Tensor
    std: torch.Tensor
    clim: torch.Tensor

    @classmethod
    def load(cls, stats_dir: Path, n_channels: int, img_size, device) -> "Stats":
        """Read ``global_means``, ``global_stds``, ``time_means`` ``.npy`` files of ``stats_dir``.

        Raises:
            UserError: a file is missing, is not a numeric ``.npy`` array (truncated, empty,
                pickled, ...), holds NaN/Inf, has the wrong shape, or a std is not positive.
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
        if (arrays["global_stds"] <= 0).any():
            raise UserError(f"{stats_dir}/global_stds.npy has non-positive entries; recompute the statistics")
        mean, std = (torch.from_numpy(arrays[k]).to(device) for k in ("global_means", "global_stds"))
        clim = (torch.from_numpy(np.ascontiguousarray(clim[:, :, :h, :w])).to(device) - mean) / std
        return cls(mean, std, clim)

    @classmethod
    def identity(cls, n_channels: int, img_size, device) -> "Stats":
        ones = torch.ones(1, n_channels, 1, 1, device=device)
        return cls(ones * 0, ones, torch.zeros(1, n_channels, *img_size, device=device))
