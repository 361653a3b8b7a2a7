"""The files ``evaluate.py`` writes: the scorecard (JSON, netCDF, PNG) and the forecasts (netCDF)."""

from __future__ import annotations

import json
from pathlib import Path

from utils.core.errors import UserError
from utils.data.metadata import read_time_axis
from utils.evaluation.plots import skill_figure
from utils.evaluation.scoring import FORECASTS, METRICS


def write_scorecard(card, out: Path, channels: list[str], extra: dict) -> None:
    """``scorecard.json``, ``scorecard.nc`` and ``scorecard.png`` in ``out``.

    Raises:
        UserError: ``out`` cannot be created or written.
    """
    import xarray as xr  # the data extra: only evaluate.py needs it
    payload = {**card.to_json(), **extra}
    values = [[[card.scores[f][m][ch] for ch in card.channels] for f in FORECASTS] for m in METRICS]
    skill = xr.DataArray(values, name="skill", dims=("metric", "forecast", "channel", "lead_time"),
                         coords={"metric": list(METRICS), "forecast": list(FORECASTS), "channel": card.channels,
                                 "lead_time": card.lead_hours},
                         attrs={"description": "RMSE (channel units) and ACC by lead time, WeatherBench 2 "
                                               "conventions (Rasp et al. 2024)", "initial_times": card.initial_times})
    skill.lead_time.attrs["units"] = "hours"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scorecard.json").write_text(json.dumps(payload, indent=2) + "\n")
        skill.to_netcdf(out / "scorecard.nc")
        skill_figure(payload, channels).savefig(out / "scorecard.png", dpi=100)
    except OSError as exc:
        raise UserError(f"cannot write the scorecard to {out} ({exc.strerror or exc}); pass a writable --out") from None


class ForecastWriter:
    """Collects forecasts in physical units and writes them as netCDF (``--save_forecasts``).

    The file holds ``forecast(init_time, lead_time, channel, latitude, longitude)`` float32, with
    ``init_time`` the initial time (from the files' ``start_time`` and ``dt_hours``, in their calendar;
    hours since the file's first step when it has no ``start_time``) and ``lead_time`` in hours.
    """

    def __init__(self, dataset, stats, names: list[str], latitude, leads: list[float]):
        self.dataset, self.stats, self.names, self.latitude, self.leads = dataset, stats, names, latitude, leads
        self.axes = [read_time_axis(f.path, dataset.img_size[1]) for f in dataset.files]
        self.blocks, self.times = [], []

    def add(self, inp, forecasts, tar, idx) -> None:
        import torch
        physical = torch.stack(forecasts, 1) * self.stats.std.unsqueeze(1) + self.stats.mean.unsqueeze(1)
        self.blocks.append(physical.cpu().numpy())
        for i in idx.tolist():
            file_no, t = self.dataset.locate(i)
            self.times.append(self.axes[file_no].time(t))

    def write(self, path: Path) -> None:
        """Write the collected forecasts to ``path`` (raises UserError when that fails)."""
        import numpy as np
        import xarray as xr
        h, w = self.dataset.img_size
        shape = (0, len(self.leads), len(self.names), h, w)
        data = np.concatenate(self.blocks) if self.blocks else np.zeros(shape, np.float32)
        da = xr.DataArray(data, name="forecast", dims=("init_time", "lead_time", "channel", "latitude", "longitude"),
                          coords={"init_time": self.times, "lead_time": self.leads, "channel": self.names,
                                  "latitude": np.asarray(self.latitude)[:h], "longitude": self.axes[0].longitude},
                          attrs={"units": "the physical units of each channel (those of the converted input)"})
        da.lead_time.attrs["units"] = "hours"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            da.to_netcdf(path)
        except OSError as exc:
            raise UserError(f"cannot write {path} ({exc.strerror or exc}); pass a writable --out") from None

