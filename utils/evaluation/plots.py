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


def skill_figure(scorecard: dict, channels: list[str]):
    """RMSE (top row, physical units) and ACC (bottom row) against lead time in hours, one column per
    channel, for each forecast of ``scorecard`` (the layout of ``Scorecard.to_json``: ``lead_hours`` and
    ``scores[forecast][metric][channel]``). Returns a matplotlib Figure (the caller closes it)."""
    leads, scores = scorecard["lead_hours"], scorecard["scores"]
    fig, axes = plt.subplots(2, len(channels), figsize=(3.2 * len(channels), 5.2), squeeze=False,
                             constrained_layout=True)
    for col, ch in enumerate(channels):
        for row, metric in enumerate(("rmse", "acc")):
            ax = axes[row, col]
            for forecast, style in zip(scores, ("-o", "--", ":")):
                ax.plot(leads, scores[forecast][metric][ch], style, label=forecast, markersize=3)
            ax.set_title(f"{metric.upper()} {ch}")
            ax.set_xlabel("lead time (h)")
            ax.grid(alpha=0.3)
    axes[0, 0].legend()
    return fig
