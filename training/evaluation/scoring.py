"""Forecast skill: autoregressive rollouts scored the WeatherBench 2 way, against persistence and climatology.

Used by the trainer after every ``valid_every``-th epoch (:class:`Evaluator`) and by ``evaluate.py``
(:func:`score_rollouts`). A rollout feeds the model its own forecast ``K`` times; at each lead time
``j * dt`` three forecasts are scored against the data:

* ``model``: the ``j``-th autoregressive forecast;
* ``persistence``: the initial state, unchanged;
* ``climatology``: the climatology at the valid time (``stats/climatology.h5``, by day of year and hour of
  day, WeatherBench 2's), or without that file the time mean (``stats/time_means.npy``); the scorecard
  says which.

Scores, per forecast, lead and channel (``training/evaluation/metrics.py``, after Rasp et al. 2024, WeatherBench
2): latitude-weighted RMSE in the channel's physical units, the MSE averaged over initial times before the
square root; ACC of the anomalies from the climatology, averaged over initial times (0 for the climatology
itself, whose anomaly is zero); bias, the latitude-weighted mean error. Per lead and channel also the zonal
power spectrum of the model's forecast and of the truth (rows within +-60 degrees, averaged over initial
times) and the blurring figure: forecast over truth power in the smallest resolved third of the zonal
wavenumbers (``metrics.blurring_band``). Every data-parallel rank scores its shard of initial times; the sums
are all-reduced, so every rank returns the same scorecard.

Ensembles (:func:`member_rollout`, ``ensemble_scoring.py``): N members per initial time, each with its own noise;
the scores above are then the ensemble mean's, and the members get the fair CRPS, ensemble-mean RMSE, spread,
spread/skill ratio and rank histogram (docs/ensembles.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, ContextManager, Iterable, Iterator

import torch
from torch import nn

from distributed.world import World, all_reduce
from training.evaluation.ensemble_scoring import Ensemble, EnsembleSums, format_ensemble
from training.evaluation.metrics import (blurring_band, relative_l2_loss, rmse_from_mse, weighted_acc_channels,
                                         weighted_bias_channels, weighted_mse_channels, zonal_power_spectrum)
from training.monitor.profiling import nvtx_range
from utils.data.forcing_source import append_forcings
from utils.data.noise import EVALUATION, member_inputs, member_noise
from utils.data.stats import Stats
from utils.data.timestep import lead_label

FORECASTS = ("model", "persistence", "climatology")


METRICS = ("rmse", "acc", "bias")


SPECTRA = ("model", "truth")  # whose zonal power spectra the scorecard holds


# one-step record keys of the model, then of the baselines (the climatology's ACC is 0 by definition)
FIRST_LEAD_KEYS = (("model", "rmse", "rmse"), ("model", "acc", "acc"), ("model", "bias", "bias"),
                   ("persistence", "rmse", "rmse_persistence"), ("persistence", "acc", "acc_persistence"),
                   ("persistence", "bias", "bias_persistence"), ("climatology", "rmse", "rmse_climatology"))


def rollout(model: nn.Module, inp: torch.Tensor, steps: int, autocast: Callable[[], ContextManager],
            forcing: Callable[[int], torch.Tensor] | None = None,
            noise: Callable[[int], torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
    """Yield the model's forecasts at leads 1..``steps``, each fed back as the next input.

    ``inp``: normalized float32 ``(B, C, H, W)``; yields float32 ``(B, C, H, W)`` (the model runs
    under ``autocast()``; its output is cast back so every step starts from the same precision).
    ``forcing(j)``: the ``(B, F + S, H, W)`` input-only channels of lead ``j + 1`` (``utils/data/forcing_source.py``),
    appended to each step's input; None without forcings. ``noise(j)``: the ``(B, Z, H, W)`` noise fields of model
    application ``j`` of a stochastic model, appended last (``utils/data/noise.py``); None for a deterministic one.
    """
    x = inp
    for j in range(steps):
        extra = [e for e in (forcing and forcing(j), noise and noise(j)) if e is not None]
        with autocast():
            x = model(append_forcings(x, torch.cat(extra, 1) if extra else None))
        x = x.float()
        yield x


def member_rollout(model: nn.Module, inp: torch.Tensor, samples: list[int], steps: int,
                   autocast: Callable[[], ContextManager], members: Ensemble,
                   forcing: Callable[[int], torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
    """Yield ``members.count`` forecasts of each state at leads 1..``steps``, float32 ``(B, N, C, H, W)``.

    The states ``inp`` ``(B, C, H, W)`` and their forcings are repeated for the members (sample-major); a
    stochastic model gets, at every lead, each member's own noise keyed by ``(seed, EVALUATION, 0, sample, member,
    lead index)`` (``utils.data.noise.member_noise``): ``samples`` are the states' global sample indices, so a
    member's forecast depends neither on the batch nor on the rank that draws it. ``forcing(j)`` as in
    :func:`rollout`.
    """
    b, n = inp.shape[0], members.count
    shape = (members.noise_channels, *inp.shape[-2:])

    def noise(j: int) -> torch.Tensor:
        return member_noise((members.seed, EVALUATION, 0), samples, range(n), j, shape, inp.device)

    states, extra = member_inputs(inp, n, forcing, noise if shape[0] else None)
    for x in rollout(model, states, steps, autocast, extra):
        yield x.view(b, n, *x.shape[1:])


def lead_hours(dt: int, step_hours: float, steps: int) -> list[float]:
    """Lead times in hours of ``steps`` rollout steps of ``dt`` file steps, ``step_hours`` apart."""
    return [j * dt * step_hours for j in range(1, steps + 1)]


def lead_times(dt: int, step, steps: int) -> list[float]:
    """Lead times of ``steps`` rollout steps of ``dt`` file steps of ``step`` (a ``TimeStep``), in its unit."""
    return [j * dt * float(step.value) for j in range(1, steps + 1)]


@dataclass
class Scorecard:
    """Skill by forecast, metric, channel and lead time.

    ``scores[forecast][metric][channel]`` lists one value per entry of ``leads`` (in ``lead_unit``: hours, days,
    months or years): RMSE and bias in the channel's physical units, ACC in [-1, 1]. ``initial_times`` counts
    the forecasts averaged; ``climatology`` names what ACC and the climatology forecast used. ``spectra``:
    ``{"wavenumber": [0..M], "model"|"truth": {channel: [power by wavenumber, one list per lead]}}`` in squared
    channel units; ``blurring[channel]``: the blurring figure by lead. ``members``: the members scored per initial
    time (0: no ensemble scores; with more than one, ``scores["model"]`` is the ensemble mean's);
    ``ensemble``: :meth:`EnsembleSums.scores` (CRPS, ensemble-mean RMSE, spread, spread/skill, rank histogram).
    """

    leads: list[float]
    channels: list[str]
    scores: dict[str, dict[str, dict[str, list[float]]]]
    initial_times: int
    lead_unit: str = "hours"
    climatology: str = ""
    spectra: dict | None = None
    blurring: dict[str, list[float]] | None = None
    members: int = 0
    ensemble: dict | None = None

    @property
    def lead_hours(self) -> list[float] | None:
        """The leads in hours for hourly and daily data; None for months and years."""
        scale = {"hours": 1.0, "days": 24.0}.get(self.lead_unit)
        return None if scale is None else [v * scale for v in self.leads]

    def label(self, j: int) -> str:
        """Label of lead ``j``: ``006h``, ``002d``, ``003mo``, ``010y``."""
        return lead_label(self.leads[j], self.lead_unit)

    def to_json(self, spectra: bool = True) -> dict:
        """The layout of ``scorecard.json``: ``lead_time`` (in ``lead_time_unit``), ``lead_hours`` (hours and days
        only), ``channels``, ``initial_times``, ``climatology``, ``scores``, ``blurring``, with ensemble scores
        ``members`` and ``ensemble``, and, with ``spectra``, the ``spectra`` (left out of the training record, where
        they would repeat at every validation)."""
        out = {"lead_time": self.leads, "lead_time_unit": self.lead_unit, "lead_hours": self.lead_hours,
               "channels": self.channels, "initial_times": self.initial_times, "climatology": self.climatology,
               "scores": self.scores, "blurring": self.blurring}
        if self.ensemble is not None:
            out.update(members=self.members, ensemble=self.ensemble)
        if spectra and self.spectra is not None:
            out["spectra"] = self.spectra
        return out

    def lead_record(self, channels: Iterable[str]) -> dict[str, float]:
        """The model's scores by lead for ``channels``: ``rmse_by_lead/<channel>/<lead>``, ``acc_by_lead/...``,
        ``bias_by_lead/...`` and ``blurring_by_lead/...`` (one TensorBoard curve per lead time)."""
        out = {f"{metric}_by_lead/{ch}/{self.label(j)}": self.scores["model"][metric][ch][j]
               for metric in METRICS for ch in channels for j in range(len(self.leads))}
        if self.blurring is not None:
            out.update({f"blurring_by_lead/{ch}/{self.label(j)}": self.blurring[ch][j]
                        for ch in channels for j in range(len(self.leads))})
        return out

    def first_lead_record(self) -> dict[str, float]:
        """The first lead's scores as the epoch record keys ``rmse/<ch>``, ``bias_persistence/<ch>``,
        ``blurring/<ch>``, ..."""
        out = {f"{prefix}/{ch}": self.scores[forecast][metric][ch][0]
               for forecast, metric, prefix in FIRST_LEAD_KEYS for ch in self.channels}
        if self.blurring is not None:
            out.update({f"blurring/{ch}": self.blurring[ch][0] for ch in self.channels})
        return out


def beats_until(card: Scorecard, channel: str, baseline: str) -> float | None:
    """The longest lead (in the card's unit) up to which the model's RMSE of ``channel`` is below ``baseline``'s at
    every lead, or None when it is not below at the first lead."""
    model, other = card.scores["model"]["rmse"][channel], card.scores[baseline]["rmse"][channel]
    last = None
    for lead, m, o in zip(card.leads, model, other):
        if not m < o:
            break
        last = lead
    return last


def beats_text(card: Scorecard, channel: str, baseline: str) -> str:
    """``up to 024h``, ``at every lead``, ``at no lead``, or ``at 2 later leads`` when it is below at some leads
    but not at the first (see :func:`beats_until`; "not at the first lead" read as every lead but the first)."""
    until = beats_until(card, channel, baseline)
    if until is not None:
        return "at every lead" if until == card.leads[-1] else f"up to {lead_label(until, card.lead_unit)}"
    below = sum(m < o for m, o in zip(card.scores["model"]["rmse"][channel], card.scores[baseline]["rmse"][channel]))
    return f"at {below} later lead{'s' if below > 1 else ''}" if below else "at no lead"


def summary_leads(card: Scorecard) -> list[int]:
    """Indices of the leads the summary shows: the first, the one nearest a day (hourly data) or the middle one,
    and the last (``6, 24, 120 h`` for 20 six-hourly steps)."""
    n = len(card.leads)
    hours = card.lead_hours
    middle = min(range(n), key=lambda j: abs(hours[j] - 24.0)) if hours else n // 2
    return sorted({0, middle, n - 1})


def format_scorecard(card: Scorecard, channels: list[str], max_rows: int = 12) -> str:
    """A table per channel of RMSE (model, persistence, climatology), ACC (model, persistence), bias (model,
    persistence) and the blurring figure by lead, at most ``max_rows`` leads (evenly spread, the last
    included), and up to which lead the model beats each baseline; then one summary line for every channel
    of the card: the leads it beats persistence and climatology up to, its bias and blurring at
    :func:`summary_leads`. A card with ensemble scores adds, per channel, their lines
    (:func:`ensemble_scoring.format_ensemble`)."""
    n = len(card.leads)
    shown = min(n, max_rows)
    rows = sorted({round(i * (n - 1) / max(1, shown - 1)) for i in range(shown)})
    lines = [f"skill over {card.initial_times} initial times (RMSE and bias in channel units; ACC against the "
             f"climatology)", f"climatology: {card.climatology or 'time mean'}"]
    if card.members > 1:
        lines.append(f"model: the mean of {card.members} members (RMSE, ACC, bias, blurring); CRPS, spread and rank "
                     "histogram of the members")
    for ch in channels:
        r, a, b = ({f: card.scores[f][m][ch] for f in FORECASTS} for m in METRICS)
        blur = card.blurring[ch] if card.blurring else [float("nan")] * n
        lines += ["", f"{ch:>10}  {'RMSE model':>11} {'persistence':>11} {'climatology':>11}  "
                      f"{'ACC model':>9} {'persistence':>11}  {'bias model':>10} {'persistence':>11}  {'blurring':>8}"]
        lines += [f"{card.label(j):>10}  {r['model'][j]:>11.4g} {r['persistence'][j]:>11.4g} "
                  f"{r['climatology'][j]:>11.4g}  {a['model'][j]:>9.3f} {a['persistence'][j]:>11.3f}  "
                  f"{b['model'][j]:>10.3g} {b['persistence'][j]:>11.3g}  {blur[j]:>8.3g}" for j in rows]
        for baseline in FORECASTS[1:]:
            lines.append(f"{'':>10}  model RMSE below {baseline}: {beats_text(card, ch, baseline)}")
        if card.ensemble is not None:
            lines += format_ensemble(card, ch, rows)
    picks = summary_leads(card)
    at = ", ".join(card.label(j) for j in picks)
    lines += ["", f"summary: up to which lead the model's RMSE stays below persistence and below climatology; "
                  f"its bias and blurring at {at}",
              f"{'channel':>10}  {'persistence':>22} {'climatology':>22}  {'bias':>30}  {'blurring':>20}"]
    for ch in card.channels:
        bias = " ".join(f"{card.scores['model']['bias'][ch][j]:>9.3g}" for j in picks)
        blur = " ".join(f"{card.blurring[ch][j]:>6.3g}" for j in picks) if card.blurring else "-"
        lines.append(f"{ch:>10}  {beats_text(card, ch, 'persistence'):>22} {beats_text(card, ch, 'climatology'):>22}"
                     f"  {bias:>30}  {blur:>20}")
    return "\n".join(lines)


class SkillSums:
    """Running sums over initial times, on the device, for a :class:`Scorecard`.

    Per forecast, lead and channel: the latitude-weighted MSE and bias (normalized units) and the ACC, summed
    over initial times; per lead and channel the zonal power spectra (physical units) of the model and the
    truth; the relative L2 loss of the first lead summed over samples; with ``members``, the
    :class:`EnsembleSums` of that many members as ``ensemble`` (else None).

    Args:
        rows: latitude rows the spectra average (``metrics.spectrum_rows``); default all.
        members: members per initial time whose ensemble scores are summed; None: no ensemble scores.
    """

    def __init__(self, n_leads: int, n_channels: int, device: torch.device, n_wavenumbers: int = 1,
                 rows: torch.Tensor | None = None, members: int | None = None):
        self.mse = torch.zeros(len(FORECASTS), n_leads, n_channels, device=device)
        self.acc = torch.zeros_like(self.mse)
        self.bias = torch.zeros_like(self.mse)
        self.spectra = torch.zeros(len(SPECTRA), n_leads, n_channels, n_wavenumbers, device=device)
        self.rows = rows
        self.loss = torch.zeros((), device=device)
        self.count = torch.zeros((), device=device)
        self.ensemble = None if members is None else EnsembleSums(n_leads, n_channels, members, device)

    def add(self, inp: torch.Tensor, forecasts: Iterable[torch.Tensor], tar: torch.Tensor, stats: Stats,
            weights: torch.Tensor, baselines: bool = True, clim: torch.Tensor | None = None) -> torch.Tensor:
        """Score one batch: ``inp`` ``(B, C, H, W)``, the model's ``forecasts`` by lead (each ``(B, C, H, W)``),
        ``tar`` ``(B, K, C, H, W)``, ``clim`` the climatology at each target's valid time ``(B, K, C, H, W)``
        (default: the time mean ``stats.clim``), all normalized; persistence, climatology and the truth's
        spectra too unless not ``baselines``. Returns a bool ``(B,)`` device tensor: whether each sample's
        scores are finite."""
        finite = torch.ones(inp.shape[0], dtype=torch.bool, device=inp.device)
        rows = self.rows if self.rows is not None else torch.arange(inp.shape[-2], device=inp.device)
        physical = lambda x: x * stats.std + stats.mean  # noqa: E731
        for j, pred in enumerate(forecasts):
            target = tar[:, j]
            reference = stats.clim.expand_as(inp) if clim is None else clim[:, j]
            if j == 0:
                self.loss += relative_l2_loss(pred, target) * inp.shape[0]
            for f, forecast in enumerate((pred, inp, reference) if baselines else (pred,)):
                mse = weighted_mse_channels(forecast, target, weights)
                self.mse[f, j] += mse.sum(0)
                self.acc[f, j] += weighted_acc_channels(forecast, target, reference, weights).sum(0)
                self.bias[f, j] += weighted_bias_channels(forecast, target, weights).sum(0)
                finite &= torch.isfinite(mse).all(1)
            self.spectra[0, j] += zonal_power_spectrum(physical(pred), rows).sum(0)
            if baselines:
                self.spectra[1, j] += zonal_power_spectrum(physical(target), rows).sum(0)
        self.count += inp.shape[0]
        return finite

    def reduce(self, world: World) -> None:
        """Sum over the data-parallel ranks (collective)."""
        parts = (self.mse, self.acc, self.bias, self.spectra, self.loss.view(1), self.count.view(1),
                 *(self.ensemble.parts() if self.ensemble is not None else ()))
        packed = torch.cat([p.flatten() for p in parts])
        all_reduce(packed, world, "dp")
        start = 0
        for p in parts:
            p.copy_(packed[start:start + p.numel()].view_as(p))
            start += p.numel()

    def scorecard(self, std: torch.Tensor, leads: list[float], channels: list[str], lead_unit: str = "hours",
                  climatology: str = "") -> Scorecard:
        """RMSE and bias in physical units (``std``: ``(1, C, 1, 1)``), mean ACC, mean spectra and the blurring
        figure, per forecast, metric and channel; ``leads`` in ``lead_unit``; ``climatology`` says what ACC used."""
        n = self.count.clamp_min(1)
        per_channel = std.view(1, 1, -1)
        values = {"rmse": (rmse_from_mse(self.mse, n) * per_channel).tolist(), "acc": (self.acc / n).tolist(),
                  "bias": (self.bias / n * per_channel).tolist()}
        scores = {forecast: {m: {ch: [lead[c] for lead in values[m][f]] for c, ch in enumerate(channels)}
                             for m in METRICS} for f, forecast in enumerate(FORECASTS)}
        spectra = self.spectra / n
        blurring = torch.zeros(spectra.shape[1:3], device=spectra.device)  # (lead, channel)
        for c in range(spectra.shape[2]):
            band = blurring_band(spectra[1, :, c].mean(0))  # the wavenumbers the truth resolves, all leads
            truth = spectra[1, :, c, band].sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
            blurring[:, c] = spectra[0, :, c, band].sum(-1) / truth
        blurring = blurring.tolist()
        lists = spectra.tolist()
        card_spectra = {"wavenumber": list(range(spectra.shape[-1])),
                        **{s: {ch: [lead[c] for lead in lists[i]] for c, ch in enumerate(channels)}
                           for i, s in enumerate(SPECTRA)}}
        ensemble = self.ensemble.scores(std, list(channels)) if self.ensemble is not None else None
        return Scorecard(list(leads), list(channels), scores, int(self.count.item()), lead_unit, climatology,
                         card_spectra, {ch: [lead[c] for lead in blurring] for c, ch in enumerate(channels)},
                         self.ensemble.members if self.ensemble is not None else 0, ensemble)


def score_rollouts(model: nn.Module, batches: Iterable, stats: Stats, weights: torch.Tensor, steps: int,
                   autocast: Callable[[], ContextManager], on_batch: Callable | None = None,
                   baselines: bool = True, climatology: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   rows: torch.Tensor | None = None, forcing: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                   members: Ensemble | None = None) -> tuple[SkillSums, list]:
    """Roll ``model`` out ``steps`` times from every batch ``(inp (B, C, H, W), tar (B, K >= steps, C, H, W), idx)``
    and sum the scores (this rank's share; reduce with :meth:`SkillSums.reduce`).

    ``climatology(idx)``, if given, is the normalized climatology ``(B, K, C, H, W)`` at each target's valid time
    (``Stats.sample_climatology``); else the time mean. ``rows``: the latitude rows of the spectra. ``forcing(idx, j)``:
    the input-only channels of lead ``j + 1`` (``Data.valid_forcings``), None without forcings.
    ``on_batch(inp, forecasts, tar, idx)``, if given, sees each batch with its list of ``steps`` forecasts
    (``evaluate.py --save_forecasts``; the figure of the first sample). Returns the sums and, per batch, ``(idx,
    finite)``: which samples scored finite (for naming NaN/Inf data). Without ``baselines`` only the model is
    scored.

    With ``members``, every initial time gets ``members.count`` members (:func:`member_rollout`), scored by
    ``sums.ensemble``; the deterministic scores are the ensemble mean's, and ``on_batch`` sees the members,
    ``(B, N, C, H, W)`` by lead.
    """
    model.eval()
    sums = SkillSums(steps, stats.std.shape[1], weights.device, stats.clim.shape[-1] // 2 + 1, rows,
                     members and members.count)
    checks = []
    with torch.no_grad():
        for inp, tar, idx in batches:
            step_forcing = forcing and partial(forcing, idx)
            with nvtx_range("validation"):
                if members is None:
                    forecasts = list(rollout(model, inp, steps, autocast, step_forcing))
                else:
                    forecasts = list(member_rollout(model, inp, idx.tolist(), steps, autocast, members, step_forcing))
                    sums.ensemble.add(forecasts, tar, weights)
            clim = climatology(idx)[:, :steps] if climatology is not None else None
            means = forecasts if members is None else [f.mean(1) for f in forecasts]
            checks.append((idx, sums.add(inp, means, tar, stats, weights, baselines, clim)))
            if on_batch is not None:
                on_batch(inp, forecasts, tar, idx)
    return sums, checks
