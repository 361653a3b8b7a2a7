"""Ensemble scores (training/evaluation/ensemble_metrics.py, ensemble_scoring.py) against independent libraries:

* the fair CRPS against ``scores.probability.crps_for_ensemble(method="fair")``, the standard one (alpha 0) against
  its ``method="ecdf"`` and ``properscoring.crps_ensemble``, latitude-weighted, and a single member's = its MAE;
* the ensemble-mean RMSE against ``scores.continuous.rmse`` of the ensemble mean; the spread against xarray's
  unbiased variance; the spread/skill ratio of a perfectly reliable ensemble near 1 only with the correction;
* the rank histogram against ``scores.probability.rank_histogram`` (ties shared alike);
* ``EnsembleSums``: summed over batches, the scores of the whole set.
"""

from __future__ import annotations

import numpy as np
import properscoring
import pytest
import scores.continuous as scores_continuous  # the dev extra: independent verification libraries
import scores.probability as scores_probability
import torch
import xarray as xr

from training.evaluation.ensemble_metrics import (almost_fair_crps, ensemble_mean_mse, ensemble_variance,
                                                  rank_counts, spread_skill_ratio)
from training.evaluation.ensemble_scoring import EnsembleSums, check_members
from training.evaluation.metrics import latitude_weights
from utils.core.errors import UserError

B, M, C, H, W = 3, 5, 2, 6, 8
DIMS = ("time", "member", "channel", "latitude", "longitude")
LAT = np.linspace(75, -75, H)


def sample(seed: int = 0, m: int = M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Members ``(B, m, C, H, W)`` in float64 (so the comparison sees the formulas, not rounding), a truth, weights."""
    g = torch.Generator().manual_seed(seed)
    members = torch.randn(B, m, C, H, W, generator=g, dtype=torch.float64) * 2 + 1
    target = torch.randn(B, C, H, W, generator=g, dtype=torch.float64) * 2
    return members, target, latitude_weights(LAT)


def as_xarray(members: torch.Tensor, target: torch.Tensor, weights: torch.Tensor):
    fcst = xr.DataArray(members.numpy(), dims=DIMS, coords={"latitude": LAT})
    obs = xr.DataArray(target.numpy(), dims=tuple(d for d in DIMS if d != "member"), coords={"latitude": LAT})
    return fcst, obs, xr.DataArray(weights.double().numpy(), dims="latitude", coords={"latitude": LAT})


@pytest.mark.parametrize("method,alpha", [("fair", 1.0), ("ecdf", 0.0)])
def test_crps_equals_the_scores_library(method, alpha):
    members, target, weights = sample()
    fcst, obs, w = as_xarray(members, target, weights)
    want = scores_probability.crps_for_ensemble(fcst, obs, "member", method=method, weights=w,
                                                preserve_dims=["time", "channel"]).transpose("time", "channel")
    got = almost_fair_crps(members.float(), target.float(), weights, alpha)
    assert got.shape == (B, C) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want.values, rtol=2e-6, atol=0)


def test_standard_crps_equals_properscoring():
    members, target, weights = sample(1)
    per_point = properscoring.crps_ensemble(target.numpy(), members.numpy(), axis=1)  # (B, C, H, W)
    want = (per_point * weights.double().numpy()[:, None]).mean(axis=(-2, -1))
    got = almost_fair_crps(members.float(), target.float(), weights, alpha=0.0)
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-6, atol=0)


def test_one_member_crps_is_its_mean_absolute_error():
    members, target, weights = sample(2, m=1)
    mae = ((members[:, 0] - target).abs() * weights.double().view(1, 1, -1, 1)).mean(dim=(-2, -1))
    for alpha in (0.0, 0.95, 1.0):
        torch.testing.assert_close(almost_fair_crps(members.float(), target.float(), weights, alpha), mae.float())


def test_ensemble_mean_rmse_and_spread_equal_independent_computations():
    members, target, weights = sample(3)
    fcst, obs, w = as_xarray(members, target, weights)
    mse = ensemble_mean_mse(members.float(), target.float(), weights)
    rmse = scores_continuous.rmse(fcst.mean("member"), obs, weights=w, preserve_dims=["channel"])
    np.testing.assert_allclose(mse.mean(0).sqrt().numpy(), rmse.values, rtol=2e-6)  # time mean before the root
    variance = ensemble_variance(members.float(), weights)
    want = (fcst.var("member", ddof=1) * w).mean(["latitude", "longitude"]).transpose("time", "channel")
    np.testing.assert_allclose(variance.numpy(), want.values, rtol=2e-6)
    assert torch.equal(ensemble_variance(members[:, :1].float(), weights), torch.zeros(B, C))


def test_spread_skill_ratio_of_a_reliable_ensemble_is_one_with_the_correction():
    """Truth and members drawn from one distribution around a random centre: the corrected ratio is 1 for 3 members
    (Fortin et al. 2014), the uncorrected one sqrt(3/4)."""
    g = torch.Generator().manual_seed(4)
    n, m = 4000, 3
    centre = torch.randn(n, 1, 1, 1, 64, generator=g) * 3
    members = centre + torch.randn(n, m, 1, 1, 64, generator=g)
    target = (centre + torch.randn(n, 1, 1, 1, 64, generator=g))[:, 0]
    weights = torch.ones(1)
    spread = ensemble_variance(members, weights).mean(0).sqrt()
    skill = ensemble_mean_mse(members, target, weights).mean(0).sqrt()
    assert abs(spread_skill_ratio(spread, skill, m).item() - 1) < 0.02
    assert abs((spread / skill).item() - (m / (m + 1)) ** 0.5) < 0.02
    assert spread_skill_ratio(torch.ones(1), torch.zeros(1), m).item() == 0.0


def test_rank_histogram_equals_the_scores_library():
    members, target, weights = sample(5)
    # ties: a truth equal to one member, to three members, and a member equal to another
    members[0, 1, 0, 0, 0] = target[0, 0, 0, 0]
    members[1, :3, 1, 2, 3] = target[1, 1, 2, 3]
    members[2, 4, 0, 1, 1] = members[2, 3, 0, 1, 1]
    counts = rank_counts(members.float(), target.float(), weights)
    assert counts.shape == (C, M + 1)
    torch.testing.assert_close(counts.sum(-1), torch.full((C,), float(B * H * W)))
    fcst, obs, w = as_xarray(members.float(), target.float(), weights)
    want = scores_probability.rank_histogram(fcst, obs, "member", preserve_dims=["channel"], weights=w)
    shares = (counts / counts.sum(-1, keepdim=True)).numpy()
    np.testing.assert_allclose(shares, want.transpose("channel", "rank").values, rtol=1e-5, atol=1e-7)


def test_summed_scores_equal_those_of_the_whole_set():
    members, target, weights = sample(6)
    members, target = members.float(), target.float()
    std = torch.tensor([2.0, 0.5]).view(1, C, 1, 1)
    sums = EnsembleSums(2, C, M, torch.device("cpu"))
    for part in (slice(0, 1), slice(1, 3)):  # two batches, two leads (the second lead: the members halved)
        tar = torch.stack([target[part], target[part]], 1)
        sums.add([members[part], members[part] / 2], tar, weights)
    got = sums.scores(std, ["a", "b"])
    crps = almost_fair_crps(members, target, weights).mean(0) * std.view(-1)
    skill = ensemble_mean_mse(members, target, weights).mean(0).sqrt() * std.view(-1)
    spread = ensemble_variance(members, weights).mean(0).sqrt() * std.view(-1)
    for c, ch in enumerate("ab"):
        np.testing.assert_allclose(got["crps"][ch][0], crps[c].item(), rtol=1e-6)
        np.testing.assert_allclose(got["ensemble_mean_rmse"][ch][0], skill[c].item(), rtol=1e-6)
        np.testing.assert_allclose(got["spread"][ch][0], spread[c].item(), rtol=1e-6)
        np.testing.assert_allclose(got["spread_skill"][ch][0], (6 / 5) ** 0.5 * (spread / skill)[c].item(), rtol=1e-6)
        assert sum(got["rank_histogram"][ch][1]) == pytest.approx(B * H * W)
    assert sums.count.item() == B


@pytest.mark.parametrize("count,noise,message", [
    (0, 4, "--ensemble_members must be at least 1, got 0"),
    (3, 0, "3 members asked of a deterministic model: it has no noise inputs"),
])
def test_member_counts_that_cannot_be_drawn_are_refused(count, noise, message):
    with pytest.raises(UserError, match=message):
        check_members(count, noise, "--ensemble_members")
    check_members(1, 0, "--ensemble_members")  # one member of a deterministic model: its forecast
