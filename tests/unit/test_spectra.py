"""Zonal power spectra and the blurring figure (training/evaluation/metrics.py, SkillSums/Scorecard in scoring.py) on
fields whose spectrum is known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from utils.data.stats import Stats
from training.evaluation.metrics import blurring_band, latitude_weights, spectrum_rows, zonal_power_spectrum
from training.evaluation.scoring import SkillSums


def wave(amplitude: float, k: int, h: int, w: int, phase: float = 0.3) -> torch.Tensor:
    """``amplitude * cos(k * longitude + phase)`` on every row of an (h, w) grid."""
    lon = torch.arange(w, dtype=torch.float64) * 2 * np.pi / w
    return (amplitude * torch.cos(k * lon + phase)).expand(h, w).float()


@pytest.mark.parametrize("w,k", [(64, 5), (64, 1), (63, 7), (64, 32), (36, 12)])
def test_single_zonal_wave_has_its_energy_at_its_wavenumber(w, k):
    """A * cos(k lambda) has power A^2 / 2 at k (A^2 at the Nyquist wavenumber, where cos carries no phase
    freedom: phase 0 there) and nothing elsewhere."""
    amplitude = 3.0
    phase = 0.0 if 2 * k == w else 0.3
    x = wave(amplitude, k, 4, w, phase)
    power = zonal_power_spectrum(x, torch.arange(4))
    assert power.shape == (w // 2 + 1,) and power.dtype == torch.float32
    want = amplitude ** 2 if 2 * k == w else amplitude ** 2 / 2
    assert power[k].item() == pytest.approx(want, rel=1e-5)
    others = torch.cat([power[:k], power[k + 1:]])
    assert others.abs().max().item() < 1e-6 * want


def test_spectrum_sums_to_the_mean_square_and_averages_rows():
    """Parseval per row, then the plain mean over the chosen rows; the mean (wavenumber 0) counts once."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 40, generator=g) + 1.5
    rows = torch.tensor([1, 2, 4])
    power = zonal_power_spectrum(x, rows)
    assert power.shape == (2, 3, 21)
    want = (x[..., rows, :] ** 2).mean(-1).mean(-1)
    torch.testing.assert_close(power.sum(-1), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(power[..., 0], (x[..., rows, :].mean(-1) ** 2).mean(-1), rtol=1e-5, atol=1e-6)


def test_rows_beyond_60_degrees_are_left_out():
    lat = np.array([85.0, 70.0, 60.0, 20.0, -20.0, -60.0, -75.0])
    assert spectrum_rows(lat).tolist() == [2, 3, 4, 5]
    assert spectrum_rows(np.array([88.0, 80.0])).tolist() == [0, 1]  # none within: every row
    x = torch.zeros(7, 32)
    x[[0, 1, 6]] = wave(1.0, 4, 3, 32)  # a wave only poleward of 60 degrees
    assert zonal_power_spectrum(x, torch.as_tensor(spectrum_rows(lat))).abs().max().item() == 0.0


def test_blurring_band_is_the_smallest_resolved_third():
    white = torch.ones(33)  # wavenumbers 0..32, all resolved
    assert blurring_band(white) == slice(22, 33)
    # a field with nothing beyond wavenumber 9 but rounding noise resolves 1..9: its band is 7..9
    truncated = torch.cat([torch.ones(10), torch.full((23,), 1e-12)])
    assert blurring_band(truncated) == slice(7, 10)


def scored(forecast: torch.Tensor, truth: torch.Tensor, lat: np.ndarray, stats: Stats):
    """The scorecard of one lead: ``forecast``/``truth`` ``(B, C, H, W)`` normalized."""
    sums = SkillSums(1, forecast.shape[1], torch.device("cpu"), forecast.shape[-1] // 2 + 1,
                     torch.as_tensor(spectrum_rows(lat)))
    sums.add(truth, [forecast], truth[:, None], stats, latitude_weights(lat))
    return sums.scorecard(stats.std, [6.0], [f"c{i}" for i in range(forecast.shape[1])])


def test_scorecard_spectra_are_physical_and_blurring_tells_sharp_from_smooth():
    h, w = 8, 48
    lat = np.linspace(70, -70, h)
    mean, std = torch.tensor([280.0, 5.0]).view(1, 2, 1, 1), torch.tensor([10.0, 2.0]).view(1, 2, 1, 1)
    stats = Stats(mean, std, torch.zeros(1, 2, h, w))
    # truth: a large wave at k=2 and a small one at k=20 (in the smallest resolved third), in physical units
    physical = (wave(4.0, 2, h, w) + wave(0.5, 20, h, w)).expand(1, 2, h, w) + mean
    truth = (physical - mean) / std
    card = scored(truth, truth, lat, stats)
    spectrum = np.array(card.spectra["truth"]["c0"][0])
    assert spectrum[2] == pytest.approx(8.0, rel=1e-4) and spectrum[20] == pytest.approx(0.125, rel=1e-4)
    assert spectrum[0] == pytest.approx(280.0 ** 2, rel=1e-5)  # the mean, in physical units
    assert card.spectra["model"]["c1"] == card.spectra["truth"]["c1"]
    assert card.blurring == {"c0": [pytest.approx(1.0)], "c1": [pytest.approx(1.0)]}
    # a smoothed forecast (the small-scale wave gone) has blurring ~0; a noisy one > 1
    smooth = ((wave(4.0, 2, h, w).expand(1, 2, h, w) + mean) - mean) / std
    assert card.blurring["c0"][0] > 0.99 and scored(smooth, truth, lat, stats).blurring["c0"][0] < 1e-6
    noisy = truth + 0.2 * torch.randn(truth.shape, generator=torch.Generator().manual_seed(0))
    assert scored(noisy, truth, lat, stats).blurring["c0"][0] > 1.5


def test_the_spectrum_is_row_power_without_weatherbench2s_circumference():
    """docs/evaluation.md names the difference: WB2's ZonalEnergySpectrum multiplies each row's power by its
    circle's circumference 2 pi R cos(lat); ours averages the rows' power as it is. The mean over rows of
    different latitudes differs; one row's forecast-to-truth ratio does not."""
    from pathlib import Path
    lat = np.array([60.0, 0.0])
    x = torch.stack([wave(1.0, 3, 1, 32)[0], wave(2.0, 3, 1, 32)[0]])  # (2 rows, 32 longitudes)
    ours = zonal_power_spectrum(x, torch.arange(2))
    per_row = torch.stack([zonal_power_spectrum(x[i:i + 1], torch.arange(1)) for i in range(2)])
    circumference = torch.as_tensor(2 * np.pi * 6.371e6 * np.cos(np.radians(lat)), dtype=torch.float32)
    wb2 = (per_row * circumference[:, None]).mean(0)
    assert ours[3].item() == pytest.approx((0.5 + 2.0) / 2, rel=1e-5)  # the plain mean of A^2 / 2
    assert wb2[3].item() / ours[3].item() != pytest.approx(circumference.mean().item(), rel=1e-2)  # not a rescale
    text = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text()
    assert "It is not WeatherBench 2's `ZonalEnergySpectrum`, which multiplies each row's power by the circumference" \
        in " ".join(text.split())
