"""Tests of networks/vit.py: shapes, gradients, patch layout, validation, init and AMP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from networks.vit import VisionTransformer, build_model

TINY = dict(patch_size=4, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0)


def patchify(img: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C*p*p): patches in row-major order, each flattened as (c, i, j)."""
    b, c, h, w = img.shape
    gh, gw = h // p, w // p
    x = img.reshape(b, c, gh, p, gw, p)  # b c gh i gw j
    x = x.permute(0, 2, 4, 1, 3, 5)  # b gh gw c i j
    return x.reshape(b, gh * gw, c * p * p)


@pytest.mark.parametrize(
    "img_size,patch,c_in,c_out,embed,heads",
    [
        ((16, 16), 4, 3, 3, 32, 4),   # square
        ((8, 24), 4, 5, 2, 24, 3),    # non-square, C_in != C_out
        ((12, 6), 3, 1, 7, 16, 2),    # tall grid, odd patch, more outputs than inputs
        ((32, 64), 8, 20, 20, 48, 8),  # the base layout scaled down
    ],
)
def test_output_shape(img_size, patch, c_in, c_out, embed, heads):
    torch.manual_seed(0)
    model = VisionTransformer(img_size=img_size, patch_size=patch, in_chans=c_in, out_chans=c_out,
                              embed_dim=embed, depth=1, num_heads=heads, mlp_ratio=2.0)
    x = torch.randn(2, c_in, *img_size)
    y = model(x)
    assert y.shape == (2, c_out, *img_size)
    assert y.dtype == torch.float32
    assert torch.isfinite(y).all()
    n = (img_size[0] // patch) * (img_size[1] // patch)
    assert model.patch_embed.num_patches == n
    assert model.pos_embed.shape == (1, n, embed)
    assert model.forward_features(x).shape == (2, n, embed)


@pytest.mark.parametrize("loss", ["sum", "mse"])
def test_gradient_reaches_every_parameter(loss):
    torch.manual_seed(1)
    model = VisionTransformer(img_size=(8, 12), in_chans=3, out_chans=2, **TINY)
    x = torch.randn(2, 3, 8, 12)
    y = model(x)
    if loss == "sum":
        out = y.sum()
    else:
        out = F.mse_loss(y, torch.randn_like(y))
    out.backward()
    names = [n for n, _ in model.named_parameters()]
    assert "pos_embed" in names and "patch_embed.proj.weight" in names and "head.weight" in names
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


def test_unpatchify_inverts_patchify():
    torch.manual_seed(2)
    p, c = 4, 3
    model = VisionTransformer(img_size=(8, 20), in_chans=1, out_chans=c, **TINY)
    img = torch.arange(2 * c * 8 * 20, dtype=torch.float32).reshape(2, c, 8, 20)
    tokens = patchify(img, p)
    assert tokens.shape == (2, (8 // p) * (20 // p), c * p * p)
    # spot check of the hand-made layout: token 1 is the patch at row 0, column p..2p-1
    assert torch.equal(tokens[0, 1].reshape(c, p, p), img[0, :, :p, p:2 * p])
    assert torch.equal(model.unpatchify(tokens), img)
    # and the other way round, starting from arbitrary tokens
    t = torch.randn(2, 10, c * p * p)
    assert torch.equal(patchify(model.unpatchify(t), p), t)


def test_patch_embed_uses_the_same_patch_order_as_unpatchify():
    """With an identity projection, patch_embed yields exactly patchify(x), so the head's tokens
    (mapped back by unpatchify) line up with the input patches."""
    p, c = 2, 2
    model = VisionTransformer(img_size=(4, 6), patch_size=p, in_chans=c, out_chans=c,
                              embed_dim=c * p * p, depth=1, num_heads=1)
    proj = model.patch_embed.proj
    with torch.no_grad():
        proj.weight.copy_(torch.eye(c * p * p).reshape(c * p * p, c, p, p))
        proj.bias.zero_()
    x = torch.randn(3, c, 4, 6)
    tokens = model.patch_embed(x)
    assert torch.allclose(tokens, patchify(x, p), atol=1e-6)
    assert torch.allclose(model.unpatchify(tokens), x, atol=1e-6)


def test_rejects_indivisible_img_size():
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        VisionTransformer(img_size=(10, 16), in_chans=1, out_chans=1, **TINY)
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        VisionTransformer(img_size=(16, 18), in_chans=1, out_chans=1, **TINY)


def test_rejects_embed_dim_not_divisible_by_heads():
    with pytest.raises(ValueError, match="num_heads"):
        VisionTransformer(img_size=(8, 8), patch_size=4, in_chans=1, out_chans=1, embed_dim=30,
                          depth=1, num_heads=4)


def test_meta_device_init_weights():
    torch.manual_seed(3)
    with torch.device("meta"):
        model = VisionTransformer(img_size=(16, 32), patch_size=4, in_chans=4, out_chans=4,
                                  embed_dim=64, depth=2, num_heads=4)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    with torch.no_grad():  # whatever init_weights misses would stay NaN
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights()
    for name, p in model.named_parameters():
        assert p.device.type == "cpu"
        assert torch.isfinite(p).all(), f"{name} not initialized"

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, proj, fc1, fc2 per block + head
    for m in linears:
        if m.weight.numel() >= 4096:
            assert m.weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert m.weight.abs().max() < 0.02 * 5
        assert torch.count_nonzero(m.bias) == 0
    assert model.pos_embed.std().item() == pytest.approx(0.02, rel=0.1)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight))
            assert torch.count_nonzero(m.bias) == 0
    conv = model.patch_embed.proj
    bound = 1.0 / (4 * 4 * 4) ** 0.5
    assert conv.weight.abs().max() <= bound
    # uniform(-b, b) has std b / sqrt(3)
    assert conv.weight.std().item() == pytest.approx(bound / 3 ** 0.5, rel=0.1)
    # and the materialized model runs
    y = model(torch.randn(1, 4, 16, 32))
    assert y.shape == (1, 4, 16, 32) and torch.isfinite(y).all()


def test_init_weights_is_reproducible_with_a_seed():
    kw = dict(img_size=(8, 8), in_chans=2, out_chans=2, **TINY)
    torch.manual_seed(7)
    a = VisionTransformer(**kw)
    torch.manual_seed(7)
    b = VisionTransformer(**kw)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


def test_build_model_reads_config_keys():
    from utils.config.schema import DataConfig, ModelConfig

    model = build_model(ModelConfig(patch_size=4, embed_dim=24, depth=3, num_heads=2, mlp_ratio=3.0),
                        DataConfig(img_size=(12, 20), n_in_channels=3, n_out_channels=5))
    assert model.img_size == (12, 20)
    assert model.patch_size == 4
    assert model.out_chans == 5
    assert model.patch_embed.proj.in_channels == 3
    assert model.patch_embed.proj.out_channels == 24
    assert len(model.blocks) == 3
    assert model.blocks[0].attn.num_heads == 2
    assert model.blocks[0].mlp.fc1.out_features == 72
    assert model.head.out_features == 5 * 4 * 4
    assert model(torch.randn(1, 3, 12, 20)).shape == (1, 5, 12, 20)


def test_forcings_and_static_fields_widen_the_input_only():
    from utils.config.schema import DataConfig, ModelConfig

    data = DataConfig(img_size=(8, 16), n_in_channels=2, n_out_channels=2,
                      forcings=("cos_solar_zenith_angle", "sin_local_time", "cos_local_time"), static_fields=("lsm",))
    model = build_model(ModelConfig(patch_size=4, embed_dim=16, depth=1, num_heads=2), data)
    assert data.model_in_channels == 6 and model.patch_embed.proj.in_channels == 6 and model.out_chans == 2
    assert model(torch.randn(3, 6, 8, 16)).shape == (3, 2, 8, 16)


def test_residual_adds_the_prognostic_input_to_the_same_network():
    kw = dict(img_size=(8, 16), patch_size=4, in_chans=3, out_chans=2, embed_dim=16, depth=1, num_heads=2)
    torch.manual_seed(0)
    plain = VisionTransformer(**kw)
    torch.manual_seed(0)
    residual = VisionTransformer(**kw, residual=True)
    x = torch.randn(2, 3, 8, 16)
    torch.testing.assert_close(residual(x), plain(x) + x[:, :2], rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert residual(x).dtype == torch.float32  # the bf16 change is added to the fp32 state, not rounded to bf16


def test_build_model_from_yaml_config():
    from utils.config.loading import load_config

    cfg = load_config("config/ViT.yaml", "tiny")
    model = build_model(cfg.model, cfg.data)
    assert model.img_size == cfg.data.img_size == (32, 64)
    assert len(model.blocks) == cfg.model.depth
    assert model.patch_embed.proj.out_channels == cfg.model.embed_dim


def test_bf16_autocast_cpu_close_to_fp32():
    torch.manual_seed(4)
    model = VisionTransformer(img_size=(16, 16), in_chans=3, out_chans=3, **TINY).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
    assert out.dtype == torch.bfloat16  # the head ran in bf16
    assert out.shape == ref.shape
    out = out.float()
    assert torch.isfinite(out).all()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 0.05, rel
    assert not torch.equal(out, ref)  # autocast really changed the precision


def test_patch_embed_equals_strided_convolution():
    from networks.vit import PatchEmbed
    torch.manual_seed(0)
    pe = PatchEmbed((12, 20), 4, 3, 16).double()
    x = torch.randn(2, 3, 12, 20, dtype=torch.float64)
    ref = torch.nn.functional.conv2d(x, pe.proj.weight, pe.proj.bias, stride=4).flatten(2).transpose(1, 2)
    torch.testing.assert_close(pe(x), ref, atol=1e-12, rtol=0)


def test_nettype_selects_the_network_class(monkeypatch):
    """``nettype`` is read: build_model looks the class up in networks.vit.MODELS."""
    import networks.vit as vit
    from utils.config.schema import DataConfig, ModelConfig

    class Marked(vit.VisionTransformer):
        pass

    monkeypatch.setitem(vit.MODELS, "VisionTransformer", Marked)
    model = build_model(ModelConfig(embed_dim=8, depth=1, num_heads=2, patch_size=4),
                        DataConfig(img_size=(8, 8), n_in_channels=2, n_out_channels=2))
    assert type(model) is Marked
