"""Scoring ensembles: the members a stochastic model draws per initial time, and their scores by lead and channel.

``evaluate.py --ensemble_members N`` and ``Forecaster.forecast(..., members=N)`` roll ``N`` members out of every
initial state (``scoring.member_rollout``), each with its own noise inputs (``utils/data/noise.py``). The scores
(``ensemble_metrics.py``; docs/ensembles.md gives the formulas and their sources), summed over initial times like
``scoring.SkillSums``: the fair CRPS, the ensemble-mean RMSE, the spread (root of the time-mean ensemble variance),
the spread/skill ratio with the finite-ensemble correction, and the rank histogram. A deterministic model is one
member: its CRPS is its mean absolute error, its spread 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.evaluation.ensemble_metrics import (almost_fair_crps, ensemble_mean_mse, ensemble_variance,
                                                  rank_counts, spread_skill_ratio)
from utils.core.errors import UserError

# the per-lead scores of an ensemble, in the scorecard's order: CRPS, ensemble-mean RMSE and spread in channel
# units, spread/skill 1
ENSEMBLE_SCORES = ("crps", "ensemble_mean_rmse", "spread", "spread_skill")


@dataclass(frozen=True)
class Ensemble:
    """How many members to draw per initial state, and the noise they are drawn with.

    ``count``: members ``N`` (>= 1); ``noise_channels``: the model's ``Z`` (0: deterministic, then ``count`` is 1);
    ``seed``: the run's seed, the first entry of the noise key ``(seed, EVALUATION, 0, sample, member, lead)``.
    """

    count: int = 1
    noise_channels: int = 0
    seed: int = 0


def check_members(count: int, noise_channels: int, option: str) -> None:
    """Refuse a member count that cannot be drawn; ``option`` names the argument (``--ensemble_members``).

    Raises:
        UserError: ``count`` < 1, or ``count`` > 1 of a model without noise inputs (its members would be identical).
    """
    if count < 1:
        raise UserError(f"{option} must be at least 1, got {count}")
    if count > 1 and noise_channels < 1:
        raise UserError(f"{count} members asked of a deterministic model: it has no noise inputs (noise_channels 0), "
                        f"so its members would be identical; pass {option} 1, or train a stochastic model "
                        "(--noise_channels 4 --loss crps --ensemble_members 4, docs/ensembles.md)")


class EnsembleSums:
    """Running sums over initial times of the ensemble scores, on the device.

    Per lead and channel: the latitude-weighted fair CRPS, ensemble-mean MSE and ensemble variance (normalized
    units), summed over initial times; the area-weighted rank counts ``(lead, channel, N + 1)``; the count of
    initial times.
    """

    def __init__(self, n_leads: int, n_channels: int, members: int, device: torch.device):
        self.members = members
        self.crps = torch.zeros(n_leads, n_channels, device=device)
        self.mse = torch.zeros_like(self.crps)
        self.variance = torch.zeros_like(self.crps)
        self.ranks = torch.zeros(n_leads, n_channels, members + 1, device=device)
        self.count = torch.zeros((), device=device)

    def add(self, forecasts: list[torch.Tensor], tar: torch.Tensor, weights: torch.Tensor) -> None:
        """Score one batch: ``forecasts`` by lead, each ``(B, N, C, H, W)``; ``tar`` ``(B, K >= leads, C, H, W)``;
        ``weights`` ``(H,)`` latitude weights; all normalized."""
        for j, members in enumerate(forecasts):
            target = tar[:, j]
            self.crps[j] += almost_fair_crps(members, target, weights, alpha=1.0).sum(0)
            self.mse[j] += ensemble_mean_mse(members, target, weights).sum(0)
            self.variance[j] += ensemble_variance(members, weights).sum(0)
            self.ranks[j] += rank_counts(members, target, weights)
        self.count += tar.shape[0]

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The tensors summed over ranks (``SkillSums.reduce`` packs them with its own)."""
        return self.crps, self.mse, self.variance, self.ranks, self.count.view(1)

    def scores(self, std: torch.Tensor, channels: list[str]) -> dict:
        """``{score: {channel: [one value per lead]}}`` for :data:`ENSEMBLE_SCORES` in physical units (``std``:
        ``(1, C, 1, 1)``), and ``rank_histogram: {channel: [[area-weighted count per rank 0..N] per lead]}``.

        MSE and variance are averaged over initial times before the square root (WeatherBench 2, Rasp et al. 2024).
        """
        n, scale = self.count.clamp_min(1), std.view(1, -1)
        skill = (self.mse / n).sqrt() * scale
        spread = (self.variance / n).sqrt() * scale
        values = {"crps": self.crps / n * scale, "ensemble_mean_rmse": skill, "spread": spread,
                  "spread_skill": spread_skill_ratio(spread, skill, self.members)}
        out = {name: by_channel(values[name].tolist(), channels) for name in ENSEMBLE_SCORES}
        out["rank_histogram"] = by_channel(self.ranks.tolist(), channels)
        return out


def by_channel(per_lead: list, channels: list[str]) -> dict[str, list]:
    """``[lead][channel]...`` lists -> ``{channel: [value per lead]}``."""
    return {ch: [lead[c] for lead in per_lead] for c, ch in enumerate(channels)}


def format_ensemble(card, channel: str, rows: list[int]) -> list[str]:
    """The ensemble lines of ``channel``'s table in the printed scorecard (``card``: a ``scoring.Scorecard`` with
    ``ensemble`` scores): CRPS, ensemble-mean RMSE, spread and spread/skill at the lead indices ``rows``; with
    more than one member, the rank histogram (frequencies) at the first, middle and last lead."""
    e, n = card.ensemble, card.members
    what = "one member: CRPS = mean absolute error" if n == 1 else f"{n} members"
    lines = ["", f"{channel:>10}  {'CRPS model':>11} {'RMSE mean':>11} {'spread':>11} {'spread/skill':>12}"
                 f"  ({what})"]
    lines += [f"{card.label(j):>10}  {e['crps'][channel][j]:>11.4g} {e['ensemble_mean_rmse'][channel][j]:>11.4g} "
              f"{e['spread'][channel][j]:>11.4g} {e['spread_skill'][channel][j]:>12.3f}" for j in rows]
    if n > 1:
        for j in sorted({0, len(card.leads) // 2, len(card.leads) - 1}):
            counts = e["rank_histogram"][channel][j]
            total = sum(counts) or 1.0
            shares = " ".join(f"{c / total:.3f}" for c in counts)
            lines.append(f"{'':>10}  rank histogram at {card.label(j)}: {shares} (flat: {1 / (n + 1):.3f})")
    return lines
