"""Figures for TensorBoard."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def prediction_figure(pred: np.ndarray, target: np.ndarray, channel: str, units: str = ""):
    """Side-by-side maps of one channel: prediction, target, and their difference.

    ``pred``, ``target``: ``(H, W)`` arrays in physical units (north at the top).
    Returns a matplotlib Figure (the caller closes it).
    """
    fig, axes = plt.subplots(1, 3, figsize=(12, 2.6), constrained_layout=True)
    vmin, vmax = float(np.min(target)), float(np.max(target))
    diff = pred - target
    lim = float(np.abs(diff).max()) or 1.0
    panels = ((pred, f"prediction {channel}", "viridis", vmin, vmax),
              (target, f"target {channel}", "viridis", vmin, vmax),
              (diff, "prediction - target", "RdBu_r", -lim, lim))
    for ax, (data, title, cmap, lo, hi) in zip(axes, panels):
        im = ax.imshow(data, cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
        ax.set_title(title)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, label=units)
    return fig
