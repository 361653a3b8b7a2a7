"""Forecast skill: autoregressive rollouts scored the WeatherBench 2 way, against persistence and climatology.

Used by the trainer after every ``valid_every``-th epoch (:class:`Evaluator`) and by ``evaluate.py``
(:func:`score_rollouts`). A rollout feeds the model its own forecast ``K`` times; at each lead time
``j * dt`` three forecasts are scored against the data:

* ``model``: the ``j``-th autoregressive forecast;
* ``persistence``: the initial state, unchanged;
* ``climatology``: the time-mean climatology (``stats/time_means.npy``).

Scores, per forecast, lead and channel (``utils/metrics.py``, after Rasp et al. 2024, WeatherBench 2):
latitude-weighted RMSE in the channel's physical units, the MSE averaged over initial times before the
square root; and ACC of the anomalies from the climatology, averaged over initial times (0 for the
climatology itself, whose anomaly is zero). Every data-parallel rank scores its shard of initial times;
the sums are all-reduced, so every rank returns the same scorecard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator

import torch
from torch import nn

from distributed.world import World, all_reduce
from utils.data.stats import Stats
from utils.evaluation.metrics import relative_l2_loss, rmse_from_mse, weighted_acc_channels, weighted_mse_channels
from utils.monitor.profiling import nvtx_range


FORECASTS = ("model", "persistence", "climatology")


METRICS = ("rmse", "acc")


# one-step record keys of the model, then of the baselines (the climatology's ACC is 0 by definition)
FIRST_LEAD_KEYS = (("model", "rmse", "rmse"), ("model", "acc", "acc"), ("persistence", "rmse", "rmse_persistence"),
                   ("persistence", "acc", "acc_persistence"), ("climatology", "rmse", "rmse_climatology"))


def rollout(model: nn.Module, inp: torch.Tensor, steps: int,
            autocast: Callable[[], ContextManager]) -> Iterator[torch.Tensor]:
    """Yield the model's forecasts at leads 1..``steps``, each fed back as the next input.

    ``inp``: normalized float32 ``(B, C, H, W)``; yields float32 ``(B, C, H, W)`` (the model runs
    under ``autocast()``; its output is cast back so every step starts from the same precision).
    """
    x = inp
    for _ in range(steps):
        with autocast():
            x = model(x)
        x = x.float()
        yield x


def lead_hours(dt: int, step_hours: float, steps: int) -> list[float]:
    """Lead times in hours of ``steps`` rollout steps of ``dt`` file steps, ``step_hours`` apart."""
    return [j * dt * step_hours for j in range(1, steps + 1)]


def lead_label(hours: float) -> str:
    """Record-key label of a lead time: ``006h``, ``120h``, ``1.5h``."""
    return f"{int(hours):03d}h" if float(hours).is_integer() else f"{hours:g}h"


@dataclass
class Scorecard:
    """Skill by forecast, metric, channel and lead time.

    ``scores[forecast][metric][channel]`` lists one value per entry of ``lead_hours``: RMSE in the
    channel's physical units, ACC in [-1, 1]. ``initial_times`` counts the forecasts averaged.
    """

    lead_hours: list[float]
    channels: list[str]
    scores: dict[str, dict[str, dict[str, list[float]]]]
    initial_times: int

    def to_json(self) -> dict:
        """``{"lead_hours", "channels", "initial_times", "scores"}``: the layout of ``scorecard.json``."""
        return {"lead_hours": self.lead_hours, "channels": self.channels, "initial_times": self.initial_times,
                "scores": self.scores}

    def lead_record(self, channels: Iterable[str]) -> dict[str, float]:
        """The model's scores by lead for ``channels``: ``rmse_by_lead/<channel>/<lead>`` and
        ``acc_by_lead/<channel>/<lead>`` (one TensorBoard curve per lead time)."""
        return {f"{metric}_by_lead/{ch}/{lead_label(h)}": self.scores["model"][metric][ch][j]
                for metric in METRICS for ch in channels for j, h in enumerate(self.lead_hours)}

    def first_lead_record(self) -> dict[str, float]:
        """The first lead's scores as the epoch record keys ``rmse/<ch>``, ``acc_persistence/<ch>``, ..."""
        return {f"{prefix}/{ch}": self.scores[forecast][metric][ch][0]
                for forecast, metric, prefix in FIRST_LEAD_KEYS for ch in self.channels}


def beats_until(card: Scorecard, channel: str, baseline: str) -> float | None:
    """The longest lead (hours) up to which the model's RMSE of ``channel`` is below ``baseline``'s at every
    lead, or None when it is not below at the first lead."""
    model, other = card.scores["model"]["rmse"][channel], card.scores[baseline]["rmse"][channel]
    last = None
    for hours, m, o in zip(card.lead_hours, model, other):
        if not m < o:
            break
        last = hours
    return last


def format_scorecard(card: Scorecard, channels: list[str], max_rows: int = 12) -> str:
    """A table per channel of RMSE (model, persistence, climatology) and ACC (model, persistence) by lead,
    at most ``max_rows`` leads (evenly spread, the last included), and up to which lead the model
    beats each baseline."""
    n = len(card.lead_hours)
    shown = min(n, max_rows)
    rows = sorted({round(i * (n - 1) / max(1, shown - 1)) for i in range(shown)})
    lines = [f"skill over {card.initial_times} initial times (RMSE in channel units; ACC vs climatology)"]
    for ch in channels:
        r, a = ({f: card.scores[f][m][ch] for f in FORECASTS} for m in METRICS)
        lines += ["", f"{ch:>10}  {'RMSE model':>11} {'persistence':>11} {'climatology':>11}  "
                      f"{'ACC model':>9} {'persistence':>11}"]
        lines += [f"{lead_label(card.lead_hours[j]):>10}  {r['model'][j]:>11.4g} {r['persistence'][j]:>11.4g} "
                  f"{r['climatology'][j]:>11.4g}  {a['model'][j]:>9.3f} {a['persistence'][j]:>11.3f}" for j in rows]
        for baseline in FORECASTS[1:]:
            until = beats_until(card, ch, baseline)
            lines.append(f"{'':>10}  model RMSE below {baseline}: " + (
                "not at the first lead" if until is None else
                "at every lead" if until == card.lead_hours[-1] else f"up to {lead_label(until)}"))
    return "\n".join(lines)


class SkillSums:
    """Running sums over initial times, on the device, for a :class:`Scorecard`.

    Per forecast, lead and channel: the latitude-weighted MSE (normalized units) and the ACC, summed
    over initial times; the relative L2 loss of the first lead summed over samples.
    """

    def __init__(self, n_leads: int, n_channels: int, device: torch.device):
        self.mse = torch.zeros(len(FORECASTS), n_leads, n_channels, device=device)
        self.acc = torch.zeros_like(self.mse)
        self.loss = torch.zeros((), device=device)
        self.count = torch.zeros((), device=device)

    def add(self, inp: torch.Tensor, forecasts: Iterable[torch.Tensor], tar: torch.Tensor, stats: Stats,
            weights: torch.Tensor, baselines: bool = True) -> torch.Tensor:
        """Score one batch: ``inp`` ``(B, C, H, W)``, the model's ``forecasts`` by lead (each ``(B, C, H, W)``),
        ``tar`` ``(B, K, C, H, W)``, all normalized; persistence and climatology too unless not
        ``baselines``. Returns a bool ``(B,)`` device tensor: whether each sample's scores are finite."""
        finite = torch.ones(inp.shape[0], dtype=torch.bool, device=inp.device)
        clim = stats.clim.expand_as(inp)
        for j, pred in enumerate(forecasts):
            target = tar[:, j]
            if j == 0:
                self.loss += relative_l2_loss(pred, target) * inp.shape[0]
            for f, forecast in enumerate((pred, inp, clim) if baselines else (pred,)):
                mse = weighted_mse_channels(forecast, target, weights)
                self.mse[f, j] += mse.sum(0)
                self.acc[f, j] += weighted_acc_channels(forecast, target, stats.clim, weights).sum(0)
                finite &= torch.isfinite(mse).all(1)
        self.count += inp.shape[0]
        return finite

    def reduce(self, world: World) -> None:
        """Sum over the data-parallel ranks (collective)."""
        packed = torch.cat([self.mse.flatten(), self.acc.flatten(), self.loss.view(1), self.count.view(1)])
        all_reduce(packed, world, "dp")
        n = self.mse.numel()
        self.mse.copy_(packed[:n].view_as(self.mse))
        self.acc.copy_(packed[n:2 * n].view_as(self.acc))
        self.loss.copy_(packed[-2])
        self.count.copy_(packed[-1])

    def scorecard(self, std: torch.Tensor, lead_hours: list[float], channels: list[str]) -> Scorecard:
        """RMSE in physical units (``std``: ``(1, C, 1, 1)``) and mean ACC, per forecast, metric and channel."""
        n = self.count.clamp_min(1)
        rmse = (rmse_from_mse(self.mse, n) * std.view(1, 1, -1)).tolist()
        acc = (self.acc / n).tolist()
        scores = {forecast: {"rmse": {ch: [lead[c] for lead in rmse[f]] for c, ch in enumerate(channels)},
                             "acc": {ch: [lead[c] for lead in acc[f]] for c, ch in enumerate(channels)}}
                  for f, forecast in enumerate(FORECASTS)}
        return Scorecard(list(lead_hours), list(channels), scores, int(self.count.item()))


def score_rollouts(model: nn.Module, batches: Iterable, stats: Stats, weights: torch.Tensor, steps: int,
                   autocast: Callable[[], ContextManager], on_batch: Callable | None = None,
                   baselines: bool = True) -> tuple[SkillSums, list]:
    """Roll ``model`` out ``steps`` times from every batch ``(inp (B, C, H, W), tar (B, K >= steps, C, H, W), idx)``
    and sum the scores (this rank's share; reduce with :meth:`SkillSums.reduce`).

    ``on_batch(inp, forecasts, tar, idx)``, if given, sees each batch with its list of ``steps`` forecasts
    (``evaluate.py --save_forecasts``; the figure of the first sample). Returns the sums and, per batch, ``(idx, finite)``: which
    samples scored finite (for naming NaN/Inf data). Without ``baselines`` only the model is scored.
    """
    model.eval()
    sums = SkillSums(steps, stats.std.shape[1], weights.device)
    checks = []
    with torch.no_grad():
        for inp, tar, idx in batches:
            with nvtx_range("validation"):
                forecasts = list(rollout(model, inp, steps, autocast))
            checks.append((idx, sums.add(inp, forecasts, tar, stats, weights, baselines)))
            if on_batch is not None:
                on_batch(inp, forecasts, tar, idx)
    return sums, checks
