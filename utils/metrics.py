"""Loss and skill metrics on ``(B, C, H, W)`` fields.

Latitude weighting follows WeatherBench (Rasp et al. 2020, "WeatherBench: a benchmark data
set for data-driven weather forecasting", eqs. 1-3): ``w(lat) = cos(lat) / mean(cos(lat))``
over the grid rows, so each grid cell counts in proportion to its area.
"""

from __future__ import annotations

import numpy as np
import torch


def relative_l2_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``||pred_i - target_i||_2 / ||target_i||_2`` (each sample flattened).

    Shapes ``(B, ...)``; returns a scalar in the dtype of ``pred`` (computed in fp32 under autocast).
    """
    b = pred.shape[0]
    diff = (pred.float() - target.float()).reshape(b, -1).norm(dim=1)
    return (diff / target.float().reshape(b, -1).norm(dim=1)).mean()


def latitude_weights(lat_deg: np.ndarray, device=None) -> torch.Tensor:
    """``cos(lat) / mean(cos(lat))`` for latitudes in degrees: float32 ``(H,)`` with mean 1."""
    w = np.cos(np.deg2rad(np.asarray(lat_deg, dtype=np.float64)))
    w = np.clip(w, 0.0, None)  # exact poles give cos ~ -1e-17
    return torch.as_tensor(w / w.mean(), dtype=torch.float32, device=device)


def weighted_rmse_channels(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE per sample and channel: ``sqrt(mean_{h,w} w_h (pred - target)^2)``.

    ``pred``, ``target``: ``(B, C, H, W)``; ``weights``: ``(H,)`` from :func:`latitude_weights`.
    Returns float32 ``(B, C)`` in the units of the inputs.
    """
    err = (pred.float() - target.float()) ** 2
    return (err * weights.view(1, 1, -1, 1)).mean(dim=(-2, -1)).sqrt()


def weighted_acc_channels(pred: torch.Tensor, target: torch.Tensor, clim: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted anomaly correlation coefficient per sample and channel.

    ``ACC = sum(w a b) / sqrt(sum(w a^2) sum(w b^2))`` with anomalies ``a = pred - clim``,
    ``b = target - clim`` (WeatherBench eq. 3; FourCastNet, Pathak et al. 2022, eq. A2).
    ``clim``: ``(1, C, H, W)`` climatology in the same units. Returns float32 ``(B, C)`` in [-1, 1].
    """
    w = weights.view(1, 1, -1, 1)
    a = pred.float() - clim
    b = target.float() - clim
    num = (w * a * b).sum(dim=(-2, -1))
    den = torch.sqrt((w * a * a).sum(dim=(-2, -1)) * (w * b * b).sum(dim=(-2, -1)))
    return num / den.clamp_min(torch.finfo(torch.float32).tiny)
