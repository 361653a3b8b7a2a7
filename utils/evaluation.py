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

import math
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator

import torch
from torch import nn

from distributed.env import World, all_reduce
from utils.data_loader import Data, Stats
from utils.errors import NonFiniteError, UserError
from utils.metrics import latitude_weights, relative_l2_loss, rmse_from_mse, weighted_acc_channels, weighted_mse_channels
from utils.profiling import nvtx_range
from utils.schema import EvaluationConfig

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


class Evaluator:
    """Validation skill of a model during training (collective over the data-parallel ranks).

    Args:
        cfg: the ``evaluation`` section (``key_channels``, ``plot_channel``, ``valid_rollout_steps``).
        data: the run's data; ``data.valid`` yields ``(input (B, C, H, W), targets (B, K, C, H, W),
            sample indices)`` normalized batches on the device, ``K >= valid_rollout_steps``.
        world: this rank's place in the job.
        leads: the lead time of each rollout step, in hours (:func:`lead_hours`).

    Raises:
        UserError: a configured key or plot channel is not in the data, or the data's latitudes
            cannot weight the scores.
    """

    def __init__(self, cfg: EvaluationConfig, data: Data, world: World, leads: list[float]):
        self.data, self.world = data, world
        self.steps = cfg.valid_rollout_steps
        self.lead_hours = leads[:self.steps]
        self.key_channels, self.plot_channel = pick_channels(cfg, data.channel_names)
        self.lat_weights = checked_latitude_weights(data.latitude, world.device)
        # persistence and climatology scores depend only on the (fixed) validation split: computed once
        self.baselines: tuple[torch.Tensor, torch.Tensor] | None = None

    def evaluate(self, model: nn.Module, autocast: Callable[[], ContextManager]) -> tuple[dict, dict]:
        """Score ``model``'s rollouts on the whole validation split under ``autocast()``.

        Returns ``(record, figures)``. The record holds ``loss/valid`` (first lead), ``valid_samples``,
        per channel the first lead's ``rmse/<ch>``, ``acc/<ch>``, ``rmse_persistence/<ch>``,
        ``acc_persistence/<ch>``, ``rmse_climatology/<ch>``; with rollouts (``valid_rollout_steps`` > 1)
        also the key channels' ``rmse_by_lead/<ch>/<lead>``, ``acc_by_lead/<ch>/<lead>`` and the whole
        table as ``scorecard`` (:meth:`Scorecard.to_json`). ``figures`` (rank 0 only, by TensorBoard tag):
        the plot channel's first prediction and, with rollouts, RMSE/ACC against lead time.

        Raises:
            NonFiniteError: the scores are NaN/Inf (naming the validation samples holding NaN/Inf).
        """
        first: list = []

        def keep_first(inp, forecasts, tar, idx) -> None:
            """The first sample's first forecast and target, for the figure (cloned: loader buffers are reused)."""
            if not first:
                first.append((forecasts[0][0].clone(), tar[0, 0].clone()))

        sums, checks = score_rollouts(model, self.data.valid, self.data.stats, self.lat_weights, self.steps,
                                      autocast, keep_first if self.world.is_main else None, self.baselines is None)
        sums.reduce(self.world)
        if self.baselines is None:
            self.baselines = sums.mse[1:].clone(), sums.acc[1:].clone()
        sums.mse[1:], sums.acc[1:] = self.baselines
        n = sums.count.clamp_min(1)
        values = [*sums.mse.flatten().tolist(), *sums.acc.flatten().tolist(), (sums.loss / n).item()]
        if not math.isfinite(sum(values)):
            self._raise_nonfinite(checks)
        card = sums.scorecard(self.data.stats.std, self.lead_hours, self.data.channel_names)
        record = {"loss/valid": values[-1], "valid_samples": card.initial_times, **card.first_lead_record()}
        figures = {}
        if self.steps > 1:
            record.update(card.lead_record(self.key_channels), scorecard=card.to_json())
        if self.world.is_main and first:
            figures[f"prediction({self.plot_channel})/valid"] = self._prediction_figure(*first[0])
            if self.steps > 1:
                from utils.plots import skill_figure  # matplotlib loads only on the rank that draws
                figures["skill_by_lead/valid"] = skill_figure(card.to_json(), self.key_channels)
        return record, figures

    def _raise_nonfinite(self, checks: list) -> None:
        indices = torch.cat([idx for idx, _ in checks]) if checks else torch.zeros(0, dtype=torch.int64)
        finite = torch.cat([ok for _, ok in checks]).cpu() if checks else torch.zeros(0, dtype=torch.bool)
        bad = nonfinite_samples(self.data, indices[~finite].tolist(), "valid", self.world)
        if bad:
            raise NonFiniteError(f"NaN/Inf in the validation data: {bad}; fix or exclude that file "
                                 "(re-run the converter, check for missing values)")
        raise NonFiniteError("validation metrics are NaN/Inf with finite data: the model's predictions overflow; "
                             "lower --lr, set --max_grad_norm 1.0, or use --amp_mode bf16 instead of fp16 or fp8"
                             + (f", or score fewer --valid_rollout_steps than {self.steps}" if self.steps > 1 else ""))

    def _prediction_figure(self, pred: torch.Tensor, target: torch.Tensor):
        """Prediction, target and difference maps of the plot channel, in physical units."""
        from utils.plots import prediction_figure
        names = self.data.channel_names
        ch = names.index(self.plot_channel)
        mean, std = self.data.stats.mean[0, ch], self.data.stats.std[0, ch]
        to_np = lambda x: (x[ch] * std + mean).float().cpu().numpy()  # noqa: E731
        return prediction_figure(to_np(pred), to_np(target), names[ch])


def checked_latitude_weights(latitude, device: torch.device) -> torch.Tensor:
    """:func:`utils.metrics.latitude_weights` with a one-line error for latitudes that cannot weight scores.

    Raises:
        UserError: latitudes not strictly monotonic, or fewer than two rows.
    """
    try:
        return latitude_weights(latitude, device)
    except ValueError as exc:
        raise UserError(f"the data's latitude rows cannot weight the scores ({exc}); re-create the files with "
                        "python -m tools.convert_era5") from None


def nonfinite_samples(data: Data, indices: list[int], split: str, world: World) -> str:
    """Origins of NaN/Inf samples among this rank's ``indices`` of ``split``, or ``""`` when every
    rank's are finite.

    Collective: every rank scans its own samples and the ranks agree on the verdict.
    """
    local = data.find_nonfinite(indices, split)
    anywhere = all_reduce(torch.tensor(float(len(local)), device=world.device), world,
                          op=torch.distributed.ReduceOp.MAX).item()
    return ("; ".join(local) or "a sample on another rank") if anywhere else ""


def pick_channels(cfg: EvaluationConfig, names: list[str]) -> tuple[list[str], str]:
    """(key channels, plot channel) from the evaluation config, defaulting to the first four / the first.

    Raises:
        UserError: a configured channel is not in the data.
    """
    for name in (*cfg.key_channels, *([cfg.plot_channel] if cfg.plot_channel is not None else [])):
        if name not in names:
            raise UserError(f"channel {name!r} (--key_channels / --plot_channel) is not in the data, whose "
                            f"channels are {', '.join(names)}; pick from those")
    return list(cfg.key_channels) or names[:4], cfg.plot_channel or names[0]
