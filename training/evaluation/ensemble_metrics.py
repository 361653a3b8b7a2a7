"""Ensemble scores on ``(B, M, C, H, W)`` members: the CRPS that trains stochastic models and scores ensembles.

The continuous ranked probability score of an ensemble ``x_1 .. x_M`` against the truth ``y`` in its kernel form
(Gneiting and Raftery 2007, eq. 21), with the *fair* estimate of Ferro (2014), which scores an ensemble as if it
had infinitely many members, and the *almost fair* mix of the two that trains ECMWF's AIFS-CRPS (Lang et al. 2024,
"AIFS-CRPS: ensemble forecasting using a model trained with a loss function based on the continuous ranked
probability score", arXiv:2412.15832, section 2.2):

    afCRPS_alpha = 1/M sum_j |x_j - y|  -  (1 - eps) / (2 M (M - 1)) sum_j sum_k |x_j - x_k|,   eps = (1 - alpha) / M

``alpha = 1`` is the fair CRPS, ``alpha = 0`` the standard ensemble CRPS (``1 / (2 M^2)`` in front of the spread
term); a single member (``M = 1``) has no spread term and its CRPS is its absolute error.

For scoring (``ensemble_scoring.py``, after WeatherBench 2, Rasp et al. 2024): the ensemble-mean MSE
(:func:`ensemble_mean_mse`), the unbiased ensemble variance (:func:`ensemble_variance`), their spread/skill ratio
with the finite-ensemble correction of Fortin et al. 2014 (:func:`spread_skill_ratio`), and the rank histogram of
the truth among the members (:func:`rank_counts`, Hamill 2001).
"""

from __future__ import annotations

import torch


def member_pair_sum(members: torch.Tensor) -> torch.Tensor:
    """``sum_j sum_k |x_j - x_k|`` over the member dimension 1 of ``(B, M, ...)``, as ``(B, ...)``.

    From the sorted members ``x_(1) <= .. <= x_(M)``: ``2 sum_i (2 i - M - 1) x_(i)`` (i from 1), which keeps M
    fields in memory where the pairs would keep ``M (M - 1) / 2``; the gradient flows through the sort.
    """
    m = members.shape[1]
    ordered = members.sort(dim=1).values
    rank = torch.arange(1, m + 1, device=members.device, dtype=members.dtype)
    coef = (2 * rank - m - 1).view(1, m, *([1] * (members.dim() - 2)))
    return 2 * (coef * ordered).sum(dim=1)


def almost_fair_crps(members: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                     alpha: float = 1.0) -> torch.Tensor:
    """Latitude-weighted afCRPS per sample and channel: ``mean_{h,w} weights_h afCRPS_alpha(x(h, w), y(h, w))``.

    Args:
        members: ``(B, M, C, H, W)``, the M members of each of B forecasts.
        target: ``(B, C, H, W)``, the truth, in the members' units.
        weights: ``(H,)`` latitude weights (``metrics.latitude_weights``, mean 1).
        alpha: 1 for the fair CRPS, 0 for the standard one; AIFS-CRPS trains with 0.95.

    Returns:
        float32 ``(B, C)`` in the members' units (computed in float32 whatever their dtype).

    Raises:
        ValueError: ``alpha`` outside [0, 1], or shapes that do not match.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if members.dim() != 5 or members.shape[:1] + members.shape[2:] != target.shape:
        raise ValueError(f"members (B, M, C, H, W) and target (B, C, H, W) do not match: {tuple(members.shape)} "
                         f"and {tuple(target.shape)}")
    x, y = members.float(), target.float()
    m = x.shape[1]
    score = (x - y.unsqueeze(1)).abs().mean(dim=1)
    if m > 1:
        eps = (1.0 - alpha) / m
        score = score - (1.0 - eps) / (2 * m * (m - 1)) * member_pair_sum(x)
    return (score * weights.view(1, 1, -1, 1)).mean(dim=(-2, -1))


def ensemble_mean_mse(members: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted MSE of the ensemble mean per sample and channel: ``mean_{h,w} weights_h (xbar - y)^2``.

    ``members`` ``(B, M, C, H, W)``, ``target`` ``(B, C, H, W)``, ``weights`` ``(H,)`` (mean 1). Returns float32
    ``(B, C)`` in squared units; averaged over initial times before the square root it is WeatherBench 2's
    ensemble-mean RMSE (``EnsembleMeanMSE``, Rasp et al. 2024).
    """
    err = (members.float().mean(dim=1) - target.float()) ** 2
    return (err * weights.view(1, 1, -1, 1)).mean(dim=(-2, -1))


def ensemble_variance(members: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted mean of the unbiased ensemble variance per sample and channel:
    ``mean_{h,w} weights_h 1/(M - 1) sum_j (x_j - xbar)^2`` (WeatherBench 2's ``EnsembleVariance``; 0 for one member).

    ``members`` ``(B, M, C, H, W)``, ``weights`` ``(H,)``. Returns float32 ``(B, C)`` in squared units.
    """
    x = members.float()
    if x.shape[1] < 2:
        return x.new_zeros(x.shape[0], x.shape[2])
    return (x.var(dim=1, correction=1) * weights.view(1, 1, -1, 1)).mean(dim=(-2, -1))


def rank_counts(members: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Area-weighted counts of the truth's rank among the members, summed over samples and grid points.

    The rank of ``y`` is the number of members below it, ``0 .. M`` (``M + 1`` bins, Hamill 2001). A truth equal
    to ``e`` members could take any rank from ``below`` to ``below + e``: each of those ``e + 1`` bins gets
    ``1 / (e + 1)`` of it, so that a calibrated ensemble's histogram stays flat (as
    ``scores.probability.rank_histogram`` counts ties; WeatherBench 2 breaks them at random instead). Each grid
    point counts its latitude weight (mean 1), so one sample adds ``H * W`` in all, as many as it has points.

    ``members`` ``(B, M, C, H, W)``, ``target`` ``(B, C, H, W)``, ``weights`` ``(H,)``. Returns float32 ``(C, M + 1)``.
    """
    x, y = members.float(), target.float().unsqueeze(1)
    below = (x < y).sum(dim=1)  # (B, C, H, W)
    ties = (x == y).sum(dim=1)
    share = 1.0 / (ties + 1).float() * weights.view(1, 1, -1, 1)
    bins = [((below <= k) & (k <= below + ties)) * share for k in range(x.shape[1] + 1)]
    return torch.stack([b.sum(dim=(0, 2, 3)) for b in bins], dim=-1)


def spread_skill_ratio(spread: torch.Tensor, skill: torch.Tensor, members: int) -> torch.Tensor:
    """``sqrt((M + 1) / M) * spread / skill``: the spread/skill ratio with the finite-ensemble correction.

    ``spread``: the root of the time-mean ensemble variance; ``skill``: the ensemble-mean RMSE (same shape and
    units). A perfectly reliable ensemble of ``M`` members has expected ensemble-mean MSE ``(M + 1) / M`` times its
    expected ensemble variance (Fortin et al. 2014, "Why should ensemble spread match the RMSE of the ensemble
    mean?", J. Hydrometeorology 15, eq. 3 onwards), so the corrected ratio is 1 for it at any ``M``. WeatherBench 2
    plots the uncorrected ``spread / skill`` (``visualization.compute_spread_skill_ratio``: ``ensemble_stddev /
    ensemble_mean_rmse``): multiply by ``sqrt(M / (M + 1))`` to compare. 0 where the skill is 0.
    """
    factor = ((members + 1) / members) ** 0.5
    return torch.where(skill > 0, factor * spread / skill.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.zeros_like(skill))
