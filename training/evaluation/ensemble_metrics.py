"""Ensemble scores on ``(B, M, C, H, W)`` members: the CRPS that trains stochastic models and scores ensembles.

The continuous ranked probability score of an ensemble ``x_1 .. x_M`` against the truth ``y`` in its kernel form
(Gneiting and Raftery 2007, eq. 21), with the *fair* estimate of Ferro (2014), which scores an ensemble as if it
had infinitely many members, and the *almost fair* mix of the two that trains ECMWF's AIFS-CRPS (Lang et al. 2024,
"AIFS-CRPS: ensemble forecasting using a model trained with a loss function based on the continuous ranked
probability score", arXiv:2412.15832, section 2.2):

    afCRPS_alpha = 1/M sum_j |x_j - y|  -  (1 - eps) / (2 M (M - 1)) sum_j sum_k |x_j - x_k|,   eps = (1 - alpha) / M

``alpha = 1`` is the fair CRPS, ``alpha = 0`` the standard ensemble CRPS (``1 / (2 M^2)`` in front of the spread
term); a single member (``M = 1``) has no spread term and its CRPS is its absolute error.
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
