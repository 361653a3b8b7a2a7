"""The packed-QKV cuDNN attention kernel (kernels/cudnn_attention.py): how it is wired and validated (CPU), and
that it computes what PyTorch's attention computes, forward and backward (GPU, skipped without one)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from distributed.parallelize import apply_packed_attention
from kernels.cudnn_attention import packed_attention
from networks.vit import VisionTransformer
from tests.unit.test_config import load_cfg
from utils.core.errors import UserError
from utils.config.validate import Launch, validate

needs_cudnn_gpu = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cudnn") is None,
                                     reason="needs a CUDA GPU and nvidia-cudnn-frontend")


def small_vit(**kw) -> VisionTransformer:
    return VisionTransformer(img_size=(32, 64), patch_size=8, in_chans=4, out_chans=4, embed_dim=64, depth=2,
                             num_heads=4, **kw)


def test_default_attend_is_softmax_attention_over_the_packed_heads():
    torch.manual_seed(0)
    attn = small_vit().blocks[0].attn
    qkv = torch.randn(2, 10, 3, 4, 16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D)
    weights = torch.softmax(q @ k.transpose(-1, -2) / 16 ** 0.5, dim=-1)
    torch.testing.assert_close(attn.attend(qkv), (weights @ v).transpose(1, 2))


def test_apply_packed_attention_routes_every_block_through_the_kernel():
    model = small_vit()
    apply_packed_attention(model)
    assert all(block.attn.attend is packed_attention for block in model.blocks)
    # the parameters are untouched: checkpoints interchange with the SDPA backends
    assert model.state_dict().keys() == small_vit().state_dict().keys()


def test_packed_attention_rejects_what_cudnn_cannot_take():
    with pytest.raises(ValueError, match=r"needs a \(B, N, 3, H, D\) bf16/fp16 CUDA tensor"):
        packed_attention(torch.zeros(1, 8, 3, 2, 16, dtype=torch.bfloat16))  # on the CPU
    with pytest.raises(ValueError, match="got \\(1, 8, 2, 2, 16\\)"):
        packed_attention(torch.zeros(1, 8, 2, 2, 16))


@pytest.mark.parametrize("overrides,launch,pattern", [
    ({"attention_backend": "cudnn_packed", "amp_mode": "bf16"}, Launch(), "needs a CUDA GPU"),
    ({"attention_backend": "cudnn_packed"}, Launch(cuda=True), "runs only in bf16/fp16"),
])
def test_packed_attention_validation(overrides, launch, pattern):
    with pytest.raises(UserError, match=pattern):
        validate(load_cfg(**overrides), launch)


def test_packed_attention_needs_cudnn_frontend_and_no_tensor_parallelism(monkeypatch):
    cfg = load_cfg(attention_backend="cudnn_packed", amp_mode="bf16", tensor_parallel="2")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cudnn" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install -e '\.\[cudnn\]'"):
        validate(cfg, Launch(world_size=2, cuda=True))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "cudnn" else real(name, *a))
    with pytest.raises(UserError, match="with tensor or context parallelism use --attention_backend cudnn"):
        validate(cfg, Launch(world_size=2, cuda=True))


@needs_cudnn_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_attention_equals_pytorch_attention_forward_and_backward(dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    qkv = torch.randn(2, 300, 3, 4, 48, device="cuda", dtype=dtype)
    grad = torch.randn(2, 300, 4, 48, device="cuda", dtype=dtype)
    mine, ref = qkv.clone().requires_grad_(True), qkv.clone().requires_grad_(True)
    out = packed_attention(mine)
    out.backward(grad)
    with sdpa_kernel(SDPBackend.MATH):
        q, k, v = ref.float().permute(2, 0, 3, 1, 4)
        expected = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    expected.backward(grad.float())
    assert out.shape == (2, 300, 4, 48) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mine.grad.float(), ref.grad.float(), atol=2e-2, rtol=2e-2)


@needs_cudnn_gpu
def test_a_compiled_model_with_packed_attention_trains_like_the_sdpa_one():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 32, 64, device="cuda")
    losses = {}
    for packed in (False, True):
        torch.manual_seed(1)
        model = small_vit().cuda()
        if packed:
            apply_packed_attention(model)
        model.compile()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = (model(x).float() - x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[packed] = loss.item()
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)
