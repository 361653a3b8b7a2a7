"""The figures of ``training/evaluation/plots.py`` on their fixed margins: every panel with its title, tick
labels, axis labels, legend and colorbar stays inside the figure and clear of every other panel and of the
figure's title, for the longest tick labels the scores print (1e-14 powers, 100000 Pa)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from training.evaluation import plots

CHANNELS = ["u10m", "v10m", "t2m", "sp"]
UNITS = {"u10m": "m s-1", "v10m": "m s-1", "t2m": "K", "sp": "Pa"}
LEADS = [6.0 * (i + 1) for i in range(40)]


def scorecard() -> dict:
    """A scorecard with scores of every magnitude the figures meet: pressure in Pa, tiny spectra, a bias of
    both signs."""
    rng = np.random.default_rng(0)
    scale = {"u10m": 4.0, "v10m": 0.02, "t2m": 12.0, "sp": 100000.0}
    scores = {forecast: {metric: {ch: list(scale[ch] * (rng.random(len(LEADS)) - (metric == "bias") * 0.5))
                                  for ch in CHANNELS} for metric in ("rmse", "acc", "bias")}
              for forecast in ("model", "persistence", "climatology")}
    wavenumber = list(range(33))
    spectra = {"wavenumber": wavenumber,
               **{kind: {ch: [list(10.0 ** rng.uniform(-14, 5, len(wavenumber))) for _ in LEADS] for ch in CHANNELS}
                  for kind in ("model", "truth")}}
    ranks = {ch: [list(rng.random(9)) for _ in LEADS] for ch in CHANNELS}
    return {"lead_time": LEADS, "lead_time_unit": "hours", "scores": scores, "spectra": spectra, "members": 8,
            "blurring": {ch: list(rng.random(len(LEADS)) * 100) for ch in CHANNELS},
            "ensemble": {"rank_histogram": ranks}}


def prediction():
    field = 100000.0 + 2000.0 * np.random.default_rng(1).standard_normal((32, 64))
    return plots.prediction_figure(field + 50.0, field, "sp", "Pa", None, None, "tiny/1CPU/00", 800, "006h")


# name -> (the figure, its axes: panels and colorbars)
FIGURES = {
    "prediction": (prediction, 6),
    "skill": (lambda: plots.skill_figure(scorecard(), CHANNELS, UNITS, "tiny/1CPU/00", 800), 12),
    "spectra": (lambda: plots.spectra_figure(scorecard(), CHANNELS, UNITS, "tiny/1CPU/00", 800), 4),
    "rank histograms": (lambda: plots.rank_histogram_figure(scorecard(), CHANNELS, "tiny/1CPU/00", 800), 4),
}


@pytest.mark.parametrize("name", FIGURES)
def test_panels_stay_inside_the_figure_and_clear_of_each_other(name):
    draw, axes = FIGURES[name]
    fig = draw()
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        page = fig.bbox
        boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]  # ticks, labels, title, legend (colorbars too)
        assert len(boxes) == axes
        for box in boxes:
            assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, \
                (box, page)
        for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
            assert not a.overlaps(b), f"panels {i} and {j} overlap: {a} {b}"
        [heading] = [text.get_window_extent(renderer) for text in fig.texts]  # the figure's title
        assert page.y0 <= heading.y0 and heading.y1 <= page.y1
        assert not any(heading.overlaps(box) for box in boxes)
        assert fig.get_layout_engine() is None  # measured layouts cost 0.6 s a figure (plots.MARGINS)
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
