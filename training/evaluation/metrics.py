"""Loss and skill metrics on ``(B, C, H, W)`` fields, following WeatherBench 2.

WeatherBench 2 (Rasp et al. 2024, "WeatherBench 2: A benchmark for the next generation of data-driven
global weather models", section 4 and appendix) defines the scores compared here:

* latitude weights proportional to each grid row's cell area, ``sin(upper edge) - sin(lower edge)``,
  normalized to mean 1 (:func:`latitude_weights`; equal to WeatherBench 2's on grids whose outer rows are the
  poles: it puts the outer edges at the poles on any grid, this module half a grid step out);
* RMSE: the weighted MSE of each forecast, averaged over initial times, then the square root
  (:func:`weighted_mse_channels`, summed by the caller before :func:`rmse_from_mse`);
* ACC: the weighted correlation of forecast and observed anomalies from a climatology, per
  initial time, then averaged over initial times (:func:`weighted_acc_channels`);
* bias: the weighted mean error, averaged over initial times (:func:`weighted_bias_channels`).

Spectra (:func:`zonal_power_spectrum`, :func:`blurring_band`) show the blurring of deterministic forecasts, as
makani/PhysicsNeMo's power spectra do: the power of each zonal wavenumber along latitude circles, averaged over
latitude rows. WeatherBench 2's ``ZonalEnergySpectrum`` also multiplies each row by its circle's circumference
``2 pi R cos(lat)``; these do not (docs/evaluation.md#spectra-and-blurring).
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
    """Cell-area weights of grid rows at latitudes ``lat_deg`` (degrees, either order), mean 1.

    A row's cell spans half-way to its neighbours (the outer rows as far as the inner spacing,
    clipped at the poles), and its area is proportional to ``sin(upper) - sin(lower)``. On a grid
    whose outer rows are the poles this is the WeatherBench 2 weighting (Rasp et al. 2024), which puts the
    outer edges at the poles on every grid (on a regional grid, giving each edge row the cap up to its pole).
    On an equiangular grid this is ``cos(lat)`` away from the poles, and a pole row keeps the area of its
    half cell instead of zero.
    Returns float32 ``(H,)`` on ``device``.

    Raises:
        ValueError: fewer than two rows, or latitudes outside [-90, 90] or not strictly monotonic.
    """
    lat = np.asarray(lat_deg, dtype=np.float64)
    step = np.diff(lat)
    if lat.ndim != 1 or lat.size < 2 or np.abs(lat).max() > 90 or not (np.all(step > 0) or np.all(step < 0)):
        raise ValueError(f"latitudes must be 1-D, at least 2, strictly monotonic in [-90, 90], got {lat}")
    mid = (lat[1:] + lat[:-1]) / 2
    edges = np.clip(np.concatenate([[lat[0] - step[0] / 2], mid, [lat[-1] + step[-1] / 2]]), -90.0, 90.0)
    w = np.abs(np.diff(np.sin(np.deg2rad(edges))))
    return torch.as_tensor(w / w.mean(), dtype=torch.float32, device=device)


def weighted_mse_channels(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted MSE per sample and channel: ``mean_{h,w} weights_h (pred - target)^2``.

    ``pred``, ``target``: ``(B, C, H, W)``; ``weights``: ``(H,)`` from :func:`latitude_weights`.
    Returns float32 ``(B, C)`` in squared input units. WeatherBench 2 averages this over initial
    times before the square root (:func:`rmse_from_mse`).
    """
    err = (pred.float() - target.float()) ** 2
    return (err * weights.view(1, 1, -1, 1)).mean(dim=(-2, -1))


def rmse_from_mse(mse_sum: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    """``sqrt(mse_sum / count)``: RMSE from MSE summed over ``count`` initial times (WeatherBench 2)."""
    return (mse_sum / count).sqrt()


def weighted_acc_channels(pred: torch.Tensor, target: torch.Tensor, clim: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted anomaly correlation coefficient per sample and channel.

    ``ACC = sum(w a b) / sqrt(sum(w a^2) sum(w b^2))`` with anomalies ``a = pred - clim``,
    ``b = target - clim``, sums over the grid (WeatherBench 2, Rasp et al. 2024, ACC; FourCastNet,
    Pathak et al. 2022, eq. A2); WeatherBench 2 averages it over initial times.
    ``clim``: ``(1, C, H, W)`` climatology in the same units. Returns float32 ``(B, C)`` in [-1, 1];
    0 where an anomaly is zero everywhere (the climatology as forecast).
    """
    w = weights.view(1, 1, -1, 1)
    a = pred.float() - clim
    b = target.float() - clim
    num = (w * a * b).sum(dim=(-2, -1))
    den = torch.sqrt((w * a * a).sum(dim=(-2, -1)) * (w * b * b).sum(dim=(-2, -1)))
    return num / den.clamp_min(torch.finfo(torch.float32).tiny)


def weighted_bias_channels(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted mean error per sample and channel: ``mean_{h,w} weights_h (pred - target)``.

    ``pred``, ``target``: ``(B, C, H, W)``; ``weights``: ``(H,)`` from :func:`latitude_weights`. Returns float32
    ``(B, C)`` in input units (positive: the forecast is too high); averaged over initial times it is the bias
    of WeatherBench 2's scorecards.
    """
    return ((pred.float() - target.float()) * weights.view(1, 1, -1, 1)).mean(dim=(-2, -1))


SPECTRUM_MAX_LATITUDE = 60.0  # degrees: spectra average the rows within +-60 degrees


def spectrum_rows(lat_deg: np.ndarray, max_latitude: float = SPECTRUM_MAX_LATITUDE) -> np.ndarray:
    """Indices of the rows whose latitude lies within ``+-max_latitude`` degrees (all rows when none does: a
    regional grid near a pole), int64 ``(n,)``."""
    lat = np.asarray(lat_deg, dtype=np.float64)
    rows = np.flatnonzero(np.abs(lat) <= max_latitude)
    return rows if rows.size else np.arange(lat.size)


def zonal_power_spectrum(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Zonal power spectrum of fields ``x`` ``(..., H, W)``, averaged over the latitude ``rows`` (an index tensor).

    Per row, the discrete Fourier transform along longitude gives ``X_m``; the power of zonal wavenumber
    ``m = 0 .. W // 2`` is ``|X_m|^2 / W^2``, doubled for ``0 < m < W / 2`` (the negative wavenumbers), so that
    the powers sum to the row's mean square (Parseval): a wave ``A cos(m lambda)`` has power ``A^2 / 2`` at
    ``m``. Returns float32 ``(..., W // 2 + 1)`` in squared input units, the plain mean over ``rows``.
    """
    w = x.shape[-1]
    coeffs = torch.fft.rfft(x.float().index_select(-2, rows), dim=-1)
    power = coeffs.real ** 2 + coeffs.imag ** 2
    power = power / w ** 2
    double = torch.full((power.shape[-1],), 2.0, device=x.device)
    double[0] = 1.0
    if w % 2 == 0:
        double[-1] = 1.0  # the Nyquist wavenumber has no negative twin
    return (power * double).mean(dim=-2)


RESOLVED_POWER = 1e-6  # a wavenumber is resolved where the truth holds at least this fraction of its peak power


def blurring_band(truth_power: torch.Tensor, resolved: float = RESOLVED_POWER) -> slice:
    """The smallest resolved third of the zonal wavenumbers of a truth spectrum ``(M + 1,)`` (wavenumbers ``0 .. M``):
    ``m`` in ``(2 R / 3, R]``, where ``R`` is the largest wavenumber at which the truth holds at least ``resolved``
    of its peak power over ``m >= 1`` (``R = M`` on real data; on smooth synthetic fields, whose high wavenumbers
    hold only rounding noise, the wavenumbers they have). The ratio of forecast to truth power there is the
    blurring figure (1: as sharp as the truth; toward 0: smoothed out)."""
    power = truth_power[1:]
    if power.numel() == 0:
        return slice(0, 1)
    above = torch.nonzero(power >= resolved * power.max()).flatten()
    top = int(above.max()) + 1 if above.numel() else power.numel()
    return slice(2 * top // 3 + 1, top + 1)
