"""Tests of training/evaluation/metrics.py against plain NumPy and xarray reference implementations (float64)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from training.evaluation.metrics import (latitude_weights, relative_l2_loss, rmse_from_mse, weighted_acc_channels,
                                      weighted_bias_channels, weighted_mse_channels)

TOL = dict(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- references
def ref_relative_l2(pred: np.ndarray, target: np.ndarray) -> float:
    vals = []
    for p, t in zip(pred, target):
        d = (p - t).ravel()
        vals.append(np.sqrt(np.sum(d * d)) / np.sqrt(np.sum(t.ravel() ** 2)))
    return float(np.mean(vals))


def ref_latitude_weights(lat_deg: np.ndarray) -> np.ndarray:
    """WeatherBench 2's cell areas: a row reaches half-way to its neighbours (an outer row as far beyond
    as its inner neighbour is), clipped at the poles."""
    lat, n, out = list(lat_deg), len(lat_deg), []
    for i in range(n):
        before = lat[i] - (lat[1] - lat[0]) if i == 0 else lat[i - 1]
        after = lat[i] + (lat[-1] - lat[-2]) if i == n - 1 else lat[i + 1]
        a, b = (min(max(x, -90.0), 90.0) for x in ((before + lat[i]) / 2, (lat[i] + after) / 2))
        out.append(abs(np.sin(np.radians(b)) - np.sin(np.radians(a))))
    out = np.array(out)
    return out / out.mean()


def ref_weighted_mse(pred, target, w):
    b, c, h, wd = pred.shape
    out = np.zeros((b, c))
    for i in range(b):
        for j in range(c):
            acc = 0.0
            for k in range(h):
                acc += w[k] * np.sum((pred[i, j, k] - target[i, j, k]) ** 2)
            out[i, j] = acc / (h * wd)
    return out


def weighted_rmse(pred, target, w):
    """Per-sample RMSE through the module's MSE."""
    return weighted_mse_channels(pred, target, w).sqrt()


def ref_weighted_acc(pred, target, clim, w):
    b, c, h, _ = pred.shape
    out = np.zeros((b, c))
    for i in range(b):
        for j in range(c):
            a = pred[i, j] - clim[0, j]
            t = target[i, j] - clim[0, j]
            ww = w[:, None]
            out[i, j] = np.sum(ww * a * t) / np.sqrt(np.sum(ww * a * a) * np.sum(ww * t * t))
    return out


def rand(rng, *shape):
    """float32-representable random values, as float64 (so both sides see identical inputs)."""
    return rng.standard_normal(shape).astype(np.float32).astype(np.float64)


# ---------------------------------------------------------------- relative L2
def test_relative_l2_matches_reference():
    rng = np.random.default_rng(0)
    pred, target = rand(rng, 3, 2, 5, 7), rand(rng, 3, 2, 5, 7) + 0.5
    got = relative_l2_loss(torch.from_numpy(pred), torch.from_numpy(target))
    assert got.ndim == 0
    np.testing.assert_allclose(got.item(), ref_relative_l2(pred, target), **TOL)


def test_relative_l2_is_per_sample_mean_not_global_ratio():
    # sample 0 has a tiny target norm: a global ratio would hide its large relative error
    target = torch.stack([torch.full((1, 2, 2), 0.01), torch.full((1, 2, 2), 10.0)])
    pred = target + 0.01
    got = relative_l2_loss(pred, target).item()
    assert got == pytest.approx((1.0 + 0.001) / 2, rel=1e-4)


def test_relative_l2_zero_for_identical_and_scale_invariant():
    rng = np.random.default_rng(1)
    t = torch.from_numpy(rand(rng, 2, 3, 4, 4)).float()
    assert relative_l2_loss(t, t).item() == 0.0
    p = t + 0.1 * torch.randn_like(t)
    assert relative_l2_loss(5 * p, 5 * t).item() == pytest.approx(relative_l2_loss(p, t).item(), rel=1e-5)


def test_relative_l2_under_bf16_inputs_is_fp32():
    t = torch.randn(2, 3, 4, 4).bfloat16()
    p = (t.float() + 0.1).bfloat16()
    out = relative_l2_loss(p, t)
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.item(), ref_relative_l2(p.double().numpy(), t.double().numpy()), rtol=1e-5)


# ---------------------------------------------------------------- latitude weights
@pytest.mark.parametrize("lat", [np.linspace(90, -90, 19), np.linspace(88.5, -88.5, 60),
                                 np.array([10.0, 20.0, 30.0, 40.0]), np.linspace(-90, 90, 7)])
def test_latitude_weights_match_reference(lat):
    w = latitude_weights(lat)
    assert w.dtype == torch.float32 and w.shape == (len(lat),)
    np.testing.assert_allclose(w.numpy(), ref_latitude_weights(lat), **TOL)
    assert w.double().mean().item() == pytest.approx(1.0, abs=1e-6)


def test_latitude_weights_are_cell_areas_not_cosines():
    lat = np.linspace(90, -90, 37)
    w = latitude_weights(lat).numpy()
    np.testing.assert_allclose(w, w[::-1], rtol=0, atol=1e-6)
    assert np.argmax(w) == 18 and w[18] > 1.0  # equator
    # a pole row is half a cell, a polar cap: sin(90) - sin(87.5) of the 5-degree grid, not cos(90) = 0
    cap = 1 - np.sin(np.radians(87.5))
    band = np.sin(np.radians(2.5)) - np.sin(np.radians(-2.5))
    assert w[0] / w[18] == pytest.approx(cap / band, rel=1e-5)
    # away from the poles, the area of a cell is cos(lat) times its height, to second order
    np.testing.assert_allclose(w[3:-3] / w[18], np.cos(np.radians(lat[3:-3])), rtol=2e-3)


@pytest.mark.parametrize("lat", [np.array([10.0]), np.array([10.0, 10.0, 5.0]), np.array([95.0, 0.0])])
def test_latitude_weights_reject_unusable_rows(lat):
    with pytest.raises(ValueError, match="latitudes"):
        latitude_weights(lat)


# ---------------------------------------------------------------- MSE and RMSE
def test_weighted_mse_matches_reference():
    rng = np.random.default_rng(2)
    pred, target = rand(rng, 2, 3, 6, 5), rand(rng, 2, 3, 6, 5)
    lat = np.linspace(80, -80, 6)
    w = latitude_weights(lat)
    got = weighted_mse_channels(torch.from_numpy(pred), torch.from_numpy(target), w)
    assert got.shape == (2, 3) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref_weighted_mse(pred, target, w.double().numpy()), **TOL)


def test_rmse_averages_mse_over_initial_times_before_the_root():
    # WeatherBench 2: sqrt(mean_t MSE_t), not mean_t sqrt(MSE_t)
    mse = torch.tensor([[1.0], [9.0]])
    assert rmse_from_mse(mse.sum(0), 2).item() == pytest.approx(np.sqrt(5.0))
    assert rmse_from_mse(mse.sum(0), 2).item() != pytest.approx(mse.sqrt().mean().item())


def test_weighted_rmse_zero_for_identical_and_unweighted_case():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rand(rng, 2, 2, 4, 3))
    w = latitude_weights(np.linspace(60, -60, 4))
    assert torch.count_nonzero(weighted_rmse(x, x, w)) == 0
    # with unit weights it is the plain RMSE; a constant error e gives RMSE |e|
    ones = torch.ones(4)
    np.testing.assert_allclose(weighted_rmse(x + 0.25, x, ones).numpy(), 0.25, rtol=1e-5)
    np.testing.assert_allclose(weighted_rmse(x - 0.25, x, w).numpy(), 0.25, rtol=1e-5)


def test_weighted_rmse_downweights_polar_errors():
    h = 9
    w = latitude_weights(np.linspace(90, -90, h))
    t = torch.zeros(1, 1, h, 4)
    pole, eq = t.clone(), t.clone()
    pole[..., 0, :] = 1.0  # error only on the north-pole row (a small cap)
    eq[..., h // 2, :] = 1.0  # error only on the equator row
    assert weighted_rmse(pole, t, w).item() < 0.3 * weighted_rmse(eq, t, w).item()
    assert weighted_rmse(eq, t, w).item() > weighted_rmse(eq, t, torch.ones(h)).item()


# ---------------------------------------------------------------- ACC
def test_weighted_acc_matches_reference():
    rng = np.random.default_rng(4)
    pred, target, clim = rand(rng, 3, 2, 6, 8), rand(rng, 3, 2, 6, 8), rand(rng, 1, 2, 6, 8)
    target = 0.6 * pred + 0.4 * target  # correlated, so the values are not all near 0
    w = latitude_weights(np.linspace(75, -75, 6))
    got = weighted_acc_channels(torch.from_numpy(pred), torch.from_numpy(target),
                                torch.from_numpy(clim).float(), w)
    assert got.shape == (3, 2) and got.dtype == torch.float32
    ref = ref_weighted_acc(pred, target, clim, w.double().numpy())
    np.testing.assert_allclose(got.numpy(), ref, **TOL)
    assert np.all(np.abs(got.numpy()) <= 1 + 1e-6)


def test_weighted_acc_is_one_for_perfect_and_minus_one_for_negated_anomaly():
    rng = np.random.default_rng(5)
    target = torch.from_numpy(rand(rng, 2, 3, 5, 4)).float()
    clim = torch.from_numpy(rand(rng, 1, 3, 5, 4)).float()
    w = latitude_weights(np.linspace(60, -60, 5))
    assert (target - clim).abs().sum(dim=(-2, -1)).min() > 0.1  # anomalies non-zero in every channel
    perfect = weighted_acc_channels(target, target, clim, w)
    np.testing.assert_allclose(perfect.numpy(), 1.0, atol=1e-5)
    negated = clim - (target - clim)
    np.testing.assert_allclose(weighted_acc_channels(negated, target, clim, w).numpy(), -1.0, atol=1e-5)
    # ACC ignores the amplitude of the anomaly
    scaled = clim + 3.0 * (target - clim)
    np.testing.assert_allclose(weighted_acc_channels(scaled, target, clim, w).numpy(), 1.0, atol=1e-5)


def test_weighted_acc_uses_anomalies_not_raw_fields():
    # pred == climatology + noise, target == climatology + other noise: raw fields correlate
    # strongly through the shared climatology, but the anomalies do not
    rng = np.random.default_rng(6)
    h, wd = 16, 32
    clim = torch.from_numpy(100 * rand(rng, 1, 1, h, wd)).float()
    pred = clim + torch.from_numpy(rand(rng, 1, 1, h, wd)).float()
    target = clim + torch.from_numpy(rand(rng, 1, 1, h, wd)).float()
    w = torch.ones(h)
    assert abs(weighted_acc_channels(pred, target, clim, w).item()) < 0.3
    zero = torch.zeros_like(clim)
    assert weighted_acc_channels(pred, target, zero, w).item() > 0.99


def test_weighted_acc_zero_anomaly_is_finite():
    clim = torch.randn(1, 2, 4, 4)
    target = clim + torch.randn(1, 2, 4, 4)
    out = weighted_acc_channels(clim.clone(), target, clim, torch.ones(4))
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out) == 0


# ---------------------------------------------------------------- bias
def test_weighted_bias_matches_reference():
    rng = np.random.default_rng(7)
    pred, target = rand(rng, 3, 2, 6, 5), rand(rng, 3, 2, 6, 5)
    lat = np.linspace(80, -80, 6)
    w = ref_latitude_weights(lat)
    want = np.einsum("bchw,h->bc", pred - target, w) / (6 * 5)
    got = weighted_bias_channels(torch.from_numpy(pred), torch.from_numpy(target), latitude_weights(lat))
    assert got.shape == (3, 2) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, **TOL)


def test_weighted_bias_is_signed_and_zero_for_pure_noise_around_the_truth():
    lat = np.linspace(60, -60, 4)
    target = torch.randn(2, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    w = latitude_weights(lat)
    # a constant offset is the bias whatever the weights (they average to 1); its sign says too high or too low
    torch.testing.assert_close(weighted_bias_channels(target + 2.5, target, w), torch.full((2, 1), 2.5))
    torch.testing.assert_close(weighted_bias_channels(target - 1.0, target, w), torch.full((2, 1), -1.0))
    # +e and -e errors cancel in the bias (not in the RMSE)
    err = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(1))
    both = torch.cat([target[:1] + err, target[:1] - err])
    assert abs(weighted_bias_channels(both, target[:1].expand(2, -1, -1, -1), w).sum().item()) < 1e-5


def wb2_latitude_weights(lat: np.ndarray) -> np.ndarray:
    """WeatherBench 2's rule (``get_lat_weights``): cell edges half-way between rows, the outer edges at the
    poles whatever the grid; mean 1."""
    rad = np.radians(lat)
    first = -np.pi / 2 * np.sign(lat[-1] - lat[0])  # the pole the first row lies towards
    bounds = np.concatenate([[first], (rad[:-1] + rad[1:]) / 2, [-first]])
    w = np.abs(np.diff(np.sin(bounds)))
    return w / w.mean()


def test_latitude_weights_equal_weatherbench2s_only_on_grids_that_reach_both_poles():
    """docs/evaluation.md says so: equal pole to pole; a grid trimmed short of a pole differs in its last row; on a
    regional grid WB2's rule gives the edge rows the caps up to the poles."""
    for lat in (np.linspace(90, -90, 61), np.linspace(-90, 90, 721)):
        np.testing.assert_allclose(latitude_weights(lat).numpy(), wb2_latitude_weights(lat), rtol=1e-5)
    trimmed = np.linspace(90, -87, 60)  # data/era5_sample
    ours, wb2 = latitude_weights(trimmed).numpy(), wb2_latitude_weights(trimmed)
    assert wb2[-1] / wb2[30] > 1.1 * ours[-1] / ours[30]  # WB2's last cell reaches the pole: 4.5 degrees, not 3
    regional = np.linspace(60, 30, 31)
    ours, wb2 = latitude_weights(regional).numpy(), wb2_latitude_weights(regional)
    assert wb2[0] / wb2[15] > 10 and ours[0] / ours[15] < 1  # an edge row many times an inside row's weight
    text = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text()
    assert "equal WeatherBench 2's weights\nonly on grids whose outer rows are the poles" in text
