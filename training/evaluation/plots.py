"""Figures of forecasts and their skill (TensorBoard, ``evaluate.py``): titled with the run and step, axes labelled
with units, legends."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# Margins in inches around and between the panels of a figure: room for a title above each panel and the
# figure's title, tick labels and an axis label below and to the left, and (``colorbar``) a labelled colorbar
# to the right. Fixed, because matplotlib's constrained layout measures every text to place the panels: 0.2-0.7 s
# a figure on a CPU, where a `tiny` epoch trains in about 2 s and draws one figure at its validation.
MARGINS = {"left": 0.85, "right": 0.3, "top": 0.8, "bottom": 0.6, "between_columns": 1.05, "between_rows": 0.85}
COLORBAR = 0.6  # more room to the right of a panel with a labelled colorbar, inches

LEAD_AXIS = {"hours": "lead time (h)", "days": "lead time (days)", "months": "lead time (months)",
             "years": "lead time (years)"}


def title(run: str | None, step: int | None, what: str) -> str:
    """``"<what>: <run>, step <step>"``, leaving out what is unknown."""
    where = ", ".join(x for x in (run, None if step is None else f"step {step}") if x)
    return f"{what}: {where}" if where else what


def in_units(quantity: str, unit: str) -> str:
    """Axis label ``RMSE (K)``; ``RMSE (channel units)`` when the unit is unknown."""
    return f"{quantity} ({unit or 'channel units'})"


def panel_grid(rows: int, cols: int, panel: tuple[float, float], colorbar: bool = False):
    """A figure of ``rows x cols`` panels, each ``panel`` (width, height) inches, with :data:`MARGINS` (and
    :data:`COLORBAR` to the right of each panel with ``colorbar``). Returns ``(figure, axes)``, axes ``(rows,
    cols)``."""
    m = MARGINS
    right_of_panel = COLORBAR if colorbar else 0.0
    width = m["left"] + cols * (panel[0] + right_of_panel) + (cols - 1) * m["between_columns"] + m["right"]
    height = m["top"] + rows * panel[1] + (rows - 1) * m["between_rows"] + m["bottom"]
    # gridspec's wspace and hspace are fractions of the mean panel width and height
    spacing = dict(left=m["left"] / width, right=1 - m["right"] / width, bottom=m["bottom"] / height,
                   top=1 - m["top"] / height, hspace=m["between_rows"] / panel[1],
                   wspace=(m["between_columns"] + right_of_panel) / (panel[0] + right_of_panel))
    return plt.subplots(rows, cols, figsize=(width, height), squeeze=False, gridspec_kw=spacing)


def prediction_figure(pred: np.ndarray, target: np.ndarray, channel: str, units: str = "",
                      latitude: np.ndarray | None = None, longitude: np.ndarray | None = None, run: str | None = None,
                      step: int | None = None, lead: str = ""):
    """Side-by-side maps of one channel: prediction, target, and their difference, on latitude/longitude axes.

    ``pred``, ``target``: ``(H, W)`` arrays in physical units (north at the top); ``latitude`` ``(H,)`` and
    ``longitude`` ``(W,)`` in degrees (default: a global equiangular grid). ``lead`` labels the forecast
    (e.g. ``006h``). Returns a matplotlib Figure (the caller closes it).
    """
    h, w = pred.shape
    lat = np.linspace(90, -90, h) if latitude is None else np.asarray(latitude)
    lon = np.linspace(0, 360, w, endpoint=False) if longitude is None else np.asarray(longitude)
    extent = (lon[0], lon[-1], lat[-1], lat[0])
    fig, axes = panel_grid(1, 3, (2.9, 2.2), colorbar=True)
    vmin, vmax = float(np.min(target)), float(np.max(target))
    diff = pred - target
    lim = float(np.abs(diff).max()) or 1.0
    forecast = f"prediction {channel}" + (f" at {lead}" if lead else "")
    panels = ((pred, forecast, "viridis", vmin, vmax, channel),
              (target, f"target {channel}", "viridis", vmin, vmax, channel),
              (diff, "prediction - target", "RdBu_r", -lim, lim, "difference"))
    for ax, (data, name, cmap, lo, hi, quantity) in zip(axes[0], panels):
        im = ax.imshow(data, cmap=cmap, vmin=lo, vmax=hi, aspect="auto", extent=extent)
        ax.set_title(name)
        ax.set_xlabel("longitude (degrees east)")
        ax.set_ylabel("latitude (degrees north)")
        fig.colorbar(im, ax=ax, label=in_units(quantity, units))
    fig.suptitle(title(run, step, "forecast against the data"))
    return fig


def skill_figure(scorecard: dict, channels: list[str], units: dict[str, str] | None = None, run: str | None = None,
                 step: int | None = None):
    """RMSE (top row), ACC (middle) and bias (bottom) against lead time, one column per channel, for each forecast
    of ``scorecard`` (the layout of ``Scorecard.to_json``: ``lead_time``, ``lead_time_unit`` and
    ``scores[forecast][metric][channel]``); RMSE and bias in ``units[channel]``. Returns a matplotlib Figure (the
    caller closes it)."""
    leads, scores = scorecard["lead_time"], scorecard["scores"]
    unit = scorecard.get("lead_time_unit", "hours")
    metrics = [m for m in ("rmse", "acc", "bias") if m in scores["model"]]
    fig, axes = panel_grid(len(metrics), len(channels), (2.6, 1.9))
    for col, ch in enumerate(channels):
        u = (units or {}).get(ch, "")
        for row, metric in enumerate(metrics):
            ax = axes[row, col]
            for forecast, style in zip(scores, ("-o", "--", ":")):
                if metric == "acc" and forecast == "climatology":
                    continue  # 0 by definition
                ax.plot(leads, scores[forecast][metric][ch], style, label=forecast, markersize=3)
            if metric == "bias":
                ax.axhline(0.0, color="grey", linewidth=0.6)
            ax.set_title(f"{metric.upper() if metric != 'bias' else 'bias'} {ch}")
            ax.set_xlabel(LEAD_AXIS.get(unit, unit))
            ax.set_ylabel("ACC (1)" if metric == "acc" else in_units(metric.upper() if metric == "rmse" else "bias", u))
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(title(run, step, "skill by lead time"))
    return fig


def spectra_figure(scorecard: dict, channels: list[str], units: dict[str, str] | None = None, run: str | None = None,
                   step: int | None = None, leads: list[int] | None = None):
    """Zonal power spectra of the forecast (solid) against the truth (dashed) at a few leads (indices ``leads``,
    default the first, middle and last), log-log over the zonal wavenumbers ``1 .. M``, one panel per channel;
    the legend gives each lead's blurring figure. Needs ``scorecard["spectra"]``. Returns a matplotlib Figure."""
    spectra, labels = scorecard["spectra"], scorecard["lead_time"]
    unit = scorecard.get("lead_time_unit", "hours")
    picks = leads if leads is not None else sorted({0, len(labels) // 2, len(labels) - 1})
    k = np.asarray(spectra["wavenumber"])[1:]
    fig, axes = panel_grid(1, len(channels), (3.0, 2.4))
    for ax, ch in zip(axes[0], channels):
        u = (units or {}).get(ch, "")
        for n, j in enumerate(picks):
            color = f"C{n}"
            lead = f"{labels[j]:g} {'h' if unit == 'hours' else unit}"
            blur = scorecard.get("blurring", {}) or {}
            extra = f", blurring {blur[ch][j]:.2f}" if ch in blur else ""
            ax.loglog(k, np.asarray(spectra["model"][ch][j])[1:], "-", color=color, label=f"forecast {lead}{extra}")
            ax.loglog(k, np.asarray(spectra["truth"][ch][j])[1:], "--", color=color, label=f"truth {lead}")
        ax.set_title(f"zonal power spectrum {ch}")
        ax.set_xlabel("zonal wavenumber (cycles per latitude circle)")
        ax.set_ylabel(f"power (({u or 'channel units'})^2)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="x-small")
    fig.suptitle(title(run, step, "spectra at |latitude| <= 60 degrees"))
    return fig


def rank_histogram_figure(scorecard: dict, channels: list[str], run: str | None = None, step: int | None = None,
                          leads: list[int] | None = None):
    """Rank histograms of the truth among the ensemble members: the share of each rank ``0 .. N`` (bars) at a few leads
    (indices ``leads``, default the first, middle and last), one panel per channel, with the flat ``1 / (N + 1)`` of
    a calibrated ensemble (a U shape: too little spread; a dome: too much; a slope: a bias). Needs
    ``scorecard["ensemble"]["rank_histogram"]`` (area-weighted counts) and ``scorecard["members"]``. Returns a
    matplotlib Figure (the caller closes it)."""
    counts, n = scorecard["ensemble"]["rank_histogram"], scorecard["members"]
    labels, unit = scorecard["lead_time"], scorecard.get("lead_time_unit", "hours")
    picks = leads if leads is not None else sorted({0, len(labels) // 2, len(labels) - 1})
    width = 0.8 / len(picks)
    ranks = np.arange(n + 1)
    fig, axes = panel_grid(1, len(channels), (3.0, 2.2))
    for ax, ch in zip(axes[0], channels):
        for i, j in enumerate(picks):
            values = np.asarray(counts[ch][j], dtype=np.float64)
            share = values / max(values.sum(), np.finfo(np.float64).tiny)
            ax.bar(ranks + (i - (len(picks) - 1) / 2) * width, share, width,
                   label=f"{labels[j]:g} {'h' if unit == 'hours' else unit}")
        ax.axhline(1.0 / (n + 1), color="grey", linestyle="--", linewidth=0.8, label="flat (calibrated)")
        ax.set_title(f"rank histogram {ch}")
        ax.set_xlabel(f"rank of the truth among {n} members")
        ax.set_ylabel("share of grid points (area-weighted)")
        ax.set_xticks(ranks)
        ax.legend(fontsize="x-small")
    fig.suptitle(title(run, step, "rank histograms"))
    return fig
