"""The files ``evaluate.py`` writes: the scorecard (JSON, netCDF, PNG figures) and the forecasts (netCDF)."""

from __future__ import annotations

import json
from pathlib import Path

from training.evaluation.ensemble_scoring import ENSEMBLE_SCORES
from training.evaluation.plots import rank_histogram_figure, skill_figure, spectra_figure
from training.evaluation.scoring import FORECASTS, METRICS, SPECTRA
from utils.core.errors import UserError
from utils.core.files import write_atomic, write_atomic_by_name, write_text_atomic


def scorecard_dataset(card):
    """The scorecard as an xarray Dataset: ``skill(metric, forecast, channel, lead_time)`` (RMSE and bias in
    channel units, ACC), ``spectrum(source, channel, lead_time, wavenumber)`` (``source`` model or truth, squared
    channel units) and ``blurring(channel, lead_time)``; ``lead_time`` in the card's unit (attribute ``units``). With
    ensemble scores also ``ensemble_skill(ensemble_metric, channel, lead_time)`` (CRPS, ensemble-mean RMSE and
    spread in channel units, spread/skill) and ``rank_histogram(channel, lead_time, rank)`` (area-weighted counts),
    and the attribute ``members``."""
    import xarray as xr  # the data extra: only evaluate.py needs it
    values = [[[card.scores[f][m][ch] for ch in card.channels] for f in FORECASTS] for m in METRICS]
    leads = xr.Variable("lead_time", card.leads, {"units": card.lead_unit})
    skill = xr.DataArray(values, dims=("metric", "forecast", "channel", "lead_time"),
                         attrs={"description": "RMSE and bias (channel units) and ACC by lead time, WeatherBench 2 "
                                               "conventions (Rasp et al. 2024)"})
    spectrum = xr.DataArray([[card.spectra[s][ch] for ch in card.channels] for s in SPECTRA],
                            dims=("source", "channel", "lead_time", "wavenumber"),
                            attrs={"description": "zonal power spectrum, mean over the rows within +-60 degrees "
                                                  "(squared channel units)"})
    blurring = xr.DataArray([card.blurring[ch] for ch in card.channels], dims=("channel", "lead_time"),
                            attrs={"description": "forecast over truth power in the smallest resolved third of the "
                                                  "zonal wavenumbers (1: sharp, toward 0: blurred)"})
    ds = xr.Dataset({"skill": skill, "spectrum": spectrum, "blurring": blurring},
                    coords={"metric": list(METRICS), "forecast": list(FORECASTS), "channel": card.channels,
                            "lead_time": leads, "source": list(SPECTRA), "wavenumber": card.spectra["wavenumber"]},
                    attrs={"initial_times": card.initial_times, "climatology": card.climatology})
    return ds if card.ensemble is None else ds.merge(ensemble_dataset(card)).assign_attrs(members=card.members)


def ensemble_dataset(card):
    """The ensemble scores of ``card`` as ``ensemble_skill(ensemble_metric, channel, lead_time)`` and
    ``rank_histogram(channel, lead_time, rank)`` (see :func:`scorecard_dataset`)."""
    import xarray as xr
    e = card.ensemble
    skill = xr.DataArray([[e[m][ch] for ch in card.channels] for m in ENSEMBLE_SCORES],
                         dims=("ensemble_metric", "channel", "lead_time"),
                         attrs={"description": "fair CRPS, ensemble-mean RMSE and spread (channel units), spread/skill "
                                               "ratio with the finite-ensemble correction (docs/ensembles.md)"})
    ranks = xr.DataArray([e["rank_histogram"][ch] for ch in card.channels], dims=("channel", "lead_time", "rank"),
                         attrs={"description": "area-weighted counts of the truth's rank among the members (ties "
                                               "shared); each initial time adds as many as the grid has points"})
    return xr.Dataset({"ensemble_skill": skill, "rank_histogram": ranks},
                      coords={"ensemble_metric": list(ENSEMBLE_SCORES), "rank": list(range(card.members + 1))})


def write_scorecard(card, out: Path, channels: list[str], extra: dict, units: dict[str, str] | None = None,
                    run: str | None = None, step: int | None = None) -> None:
    """``scorecard.json``, ``scorecard.nc``, ``scorecard.png`` (RMSE, ACC and bias against lead) and ``spectra.png``
    (``channels``' spectra at a few leads against the truth) in ``out``; figures titled with ``run`` and ``step``,
    RMSE and bias labelled in ``units[channel]``.

    Raises:
        UserError: ``out`` cannot be created or written.
    """
    import matplotlib.pyplot as plt
    payload = {**card.to_json(), **extra}
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "scorecard.json", json.dumps(payload, indent=2) + "\n")
        write_atomic_by_name(out / "scorecard.nc", scorecard_dataset(card).to_netcdf)
        for name, draw in (("scorecard.png", skill_figure), ("spectra.png", spectra_figure)):
            fig = draw(payload, channels, units, run, step)
            write_atomic(out / name, lambda f: fig.savefig(f, dpi=100, format="png"))
            plt.close(fig)
    except OSError as exc:
        raise UserError(f"cannot write the scorecard to {out} ({exc.strerror or exc}); pass a writable --out") from None


class ForecastWriter:
    """Collects forecasts in physical units and writes them as netCDF (``--save_forecasts``).

    The file holds ``forecast(init_time, lead_time, channel, latitude, longitude)`` float32 (``forecast(init_time,
    member, lead_time, channel, latitude, longitude)`` for ensembles of more than one member), with
    ``init_time`` the initial time (from the files' ``start_time`` and time step, in their calendar;
    hours since the file's first step when it has no ``start_time``) and ``lead_time`` in ``lead_unit``.
    """

    def __init__(self, dataset, stats, names: list[str], latitude, leads: list[float], lead_unit: str = "hours"):
        self.dataset, self.stats, self.names, self.latitude = dataset, stats, names, latitude
        self.leads, self.lead_unit = leads, lead_unit
        self.blocks, self.times = [], []

    def add(self, inp, forecasts, tar, idx) -> None:
        """Keep a batch: ``forecasts`` by lead, each ``(B, C, H, W)`` or members ``(B, N, C, H, W)``, normalized."""
        import torch
        stacked = torch.stack(forecasts, -4)  # (B, [N,] L, C, H, W)
        if stacked.dim() == 6 and stacked.shape[1] == 1:
            stacked = stacked[:, 0]  # one member: the deterministic layout
        self.blocks.append((stacked * self.stats.std + self.stats.mean).cpu().numpy())
        for i in idx.tolist():
            file_no, t = self.dataset.locate(i)
            self.times.append(self.dataset.files[file_no].axis.time(t))

    def write(self, path: Path) -> None:
        """Write the collected forecasts to ``path`` (raises UserError when that fails)."""
        import numpy as np
        import xarray as xr
        h, w = self.dataset.img_size
        shape = (0, len(self.leads), len(self.names), h, w)
        data = np.concatenate(self.blocks) if self.blocks else np.zeros(shape, np.float32)
        dims = ("init_time", "member")[:data.ndim - 4] + ("lead_time", "channel", "latitude", "longitude")
        da = xr.DataArray(data, name="forecast", dims=dims,
                          coords={"init_time": self.times, "lead_time": self.leads, "channel": self.names,
                                  "latitude": np.asarray(self.latitude)[:h],
                                  "longitude": self.dataset.files[0].axis.longitude},
                          attrs={"units": "the physical units of each channel (those of the converted input)"})
        da.lead_time.attrs["units"] = self.lead_unit
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic_by_name(path, da.to_netcdf)  # a stopped write leaves no partial file under this name
        except OSError as exc:
            raise UserError(f"cannot write {path} ({exc.strerror or exc}); pass a writable --out") from None


def write_rank_histogram(card, out: Path, channels: list[str], run: str | None = None, step: int | None = None) -> None:
    """``rank_histogram.png`` in ``out``: the rank histograms of ``channels`` at a few leads
    (:func:`plots.rank_histogram_figure`).

    Raises:
        UserError: ``out`` cannot be written.
    """
    import matplotlib.pyplot as plt
    fig = rank_histogram_figure(card.to_json(spectra=False), channels, run, step)
    try:
        write_atomic(out / "rank_histogram.png", lambda f: fig.savefig(f, dpi=100, format="png"))
    except OSError as exc:
        raise UserError(f"cannot write the scorecard to {out} ({exc.strerror or exc}); pass a writable --out") from None
    finally:
        plt.close(fig)
