"""The scales of fp8 attention (``kernels/cudnn_fp8_attention.py``) hold their bounds: computed on the CPU against
exact float64 attention, every quantized value fits its format with the promised headroom, and the choice between
fp8 and bf16 attention is logged with its reason."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from distributed.launch import LaunchEnv
from distributed.parallelize import apply_fp8_attention, fp8_attention_fallback
from distributed.world import World
from kernels.cudnn_fp8_attention import (DESCALE_K, DESCALE_O, DESCALE_Q, DESCALE_V, E4M3_MAX, E5M2_MAX, P_SCALE,
                                         backward_scales, center_keys, forward_scales, pow2_scale)
from networks.vit import VisionTransformer
from utils.config.schema import PrecisionConfig


def test_pow2_scale_is_a_power_of_two_with_a_binade_of_headroom():
    bounds = torch.tensor([1e-30, 3e-3, 1.0, 447.0, 448.0, 5e6, 0.0])
    scale = pow2_scale(bounds, E4M3_MAX)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    assert (scale * bounds <= E4M3_MAX / 2).all()
    normal = (bounds > 1e-20)  # tiny and zero bounds take the largest scale, 2^100
    assert (scale[normal] * bounds[normal] > E4M3_MAX / 4).all()  # no binade more than the promised one
    assert torch.equal(scale[~normal], torch.full_like(scale[~normal], 2.0 ** 100))


def _attention(qkv: torch.Tensor, grad: torch.Tensor):
    x = qkv.double().requires_grad_()
    q, k, v = x.permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    p = scores.softmax(-1)
    out = (p @ v).transpose(1, 2)
    dp = grad.double().transpose(1, 2) @ v.transpose(-1, -2)
    out.backward(grad.double())
    return out.detach(), p.detach(), dp.detach(), x.grad


@pytest.mark.parametrize("sharpness", [0.1, 1.0, 8.0], ids=["flat", "soft", "peaked"])
def test_every_quantized_tensor_fits_its_format(sharpness):
    torch.manual_seed(0)
    b, n, h, d = 2, 96, 2, 32
    qkv = torch.randn(b, n, 3, h, d) * torch.tensor([sharpness, 1.0, 3.0]).view(1, 1, 3, 1, 1)
    grad = torch.randn(b, n, h, d) * 1e-4
    out, p, dp, dqkv = _attention(qkv, grad)
    scale, saved = forward_scales(qkv)
    assert torch.equal(scale, 1 / saved[[DESCALE_Q, DESCALE_K, DESCALE_V]])
    assert (qkv.abs().amax(dim=(0, 1, 3, 4)) * scale <= E4M3_MAX / 2).all()
    assert (p * P_SCALE <= E4M3_MAX).all()
    assert (out.abs().max() / saved[DESCALE_O] <= E4M3_MAX / 2).item()
    sc = backward_scales(grad, saved, n, d)
    assert (grad.abs().max() * sc["scale_dO"] <= E5M2_MAX / 2).item()
    assert (dp.abs().max() * sc["scale_dP"] <= E4M3_MAX / 2).item()
    for i, name in enumerate(("scale_dQ", "scale_dK", "scale_dV")):
        assert (dqkv[:, :, i].abs().max() * sc[name] <= E5M2_MAX / 2).item(), name
        # loose bounds still leave most of e5m2's range: the largest gradient is within 2^16 of the top
        assert (dqkv[:, :, i].abs().max() * sc[name] >= E5M2_MAX * 2.0 ** -16).item(), name


def _largest_logit_per_row(qkv: torch.Tensor) -> torch.Tensor:
    q, k, _ = qkv.permute(2, 0, 3, 1, 4)
    return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).amax(-1)


def test_centred_keys_keep_attention_and_its_gradient_and_lift_each_rows_largest_logit():
    """Queries facing away from every key (each row's logits near -600: the case where cuDNN's fp8 kernels gave
    zeros and NaN): centring the keys leaves output and gradient as they were (float64), the function maps the
    centred keys' gradient back (as the backward uses it), and every row's largest logit becomes >= 0."""
    torch.manual_seed(0)
    b, n, h, d = 2, 64, 2, 32
    away = torch.full((d,), 60 / math.sqrt(d), dtype=torch.float64)
    qkv = torch.randn(b, n, 3, h, d, dtype=torch.float64)
    qkv[:, :, 0] -= away
    qkv[:, :, 1] += away
    grad = torch.randn(b, n, h, d, dtype=torch.float64)
    out, _, _, dqkv = _attention(qkv.clone(), grad)  # float64 in: _attention's leaf would be qkv itself
    centred = center_keys(qkv)
    out_c, _, _, d_centred = _attention(centred, grad)
    torch.testing.assert_close(out_c, out)
    torch.testing.assert_close(center_keys(d_centred), dqkv)
    assert _largest_logit_per_row(qkv).max() < -100
    assert _largest_logit_per_row(centred).min() >= 0
    torch.testing.assert_close(centred[:, :, 0::2], qkv[:, :, 0::2], rtol=0, atol=0)  # q and v untouched


def test_fallback_reasons_are_logged_once_per_reason(caplog):
    from distributed import parallelize
    parallelize._log_fp8_attention.cache_clear()  # once per process: another test of this worker may have logged
    model = VisionTransformer(img_size=(16, 16), patch_size=4, in_chans=2, out_chans=2, embed_dim=32, depth=1,
                              num_heads=2)
    world = World(LaunchEnv(), torch.device("cpu"))
    on, off = PrecisionConfig(amp_mode="fp8"), PrecisionConfig(amp_mode="fp8", fp8_attention=False)
    assert fp8_attention_fallback(model, on, world) == "no CUDA GPU"
    assert fp8_attention_fallback(model, off, world) == "--fp8_attention false"
    flash = PrecisionConfig(amp_mode="fp8", attention_backend="flash")
    assert fp8_attention_fallback(model, flash, world) == "--attention_backend flash was chosen"
    with caplog.at_level(logging.INFO, logger="distributed.parallelize"):
        for precision in (on, on, off):
            apply_fp8_attention(model, precision, world)
    lines = [r.getMessage() for r in caplog.records if "fp8 attention" in r.getMessage()]
    assert lines == ["fp8 attention off, bf16 attention instead: no CUDA GPU",
                     "fp8 attention off, bf16 attention instead: --fp8_attention false"]
    assert "attend" not in vars(model.blocks[0].attn)  # the plain attention stays


def test_fp8_attention_keeps_the_plain_attention_numerics_on_cpu():
    """Without a GPU the model under --amp_mode fp8 attends exactly as before."""
    torch.manual_seed(0)
    model = VisionTransformer(img_size=(16, 16), patch_size=4, in_chans=2, out_chans=2, embed_dim=32, depth=1,
                              num_heads=2)
    x = torch.randn(2, 2, 16, 16)
    before = model(x)
    apply_fp8_attention(model, PrecisionConfig(amp_mode="fp8"), World(LaunchEnv(), torch.device("cpu")))
    assert torch.equal(model(x), before)
    qkv = torch.randn(1, 4, 3, 2, 16)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    torch.testing.assert_close(model.blocks[0].attn.attend(qkv),
                               F.scaled_dot_product_attention(q, k, v).transpose(1, 2))
