"""Activation checkpointing under torch.compile recomputes what runs inside autograd functions too (fp8
attention, torchao's float8 matmul and the tensor-parallel mappings are such functions)."""

from __future__ import annotations

import torch
from torch import nn

from distributed.parallelize import apply_activation_checkpointing

CALLS = [0]


@torch.library.custom_op("era5vit_test::counted_tanh", mutates_args=(), device_types="cpu")
def counted_tanh(x: torch.Tensor) -> torch.Tensor:
    CALLS[0] += 1
    return torch.tanh(x)


@counted_tanh.register_fake
def _(x):
    return torch.empty_like(x)


class _Tanh(torch.autograd.Function):
    """tanh through the counted op; the backward reuses its saved output, so recomputation must run the op."""

    @staticmethod
    def forward(ctx, x):
        y = counted_tanh(x * 1.5)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * 1.5 * (1 - y * y)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return x + self.fc2(_Tanh.apply(self.fc1(x)))


def test_compiled_full_checkpointing_recomputes_inside_autograd_functions():
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(_Block() for _ in range(2))
    apply_activation_checkpointing(model, "full", 0, compiled=True)
    step = torch.compile(lambda x: sum(b(x) for b in model.blocks).square().mean())
    x = torch.randn(4, 32)
    step(x).backward()  # compiles
    CALLS[0] = 0
    step(x).backward()
    assert CALLS[0] == 4  # each block's op in the forward and again in its recompute


def test_compiled_full_checkpointing_gives_the_gradients_of_no_checkpointing():
    """The policy path under compile (torch warns that in-place ops in the region would break it) is exact on
    our ViT: its gradients equal those of the eager model without checkpointing, to float32 rounding (worst
    relative difference 7.2e-7; Inductor's fused kernels round otherwise than eager). The reference is eager
    because compiling it too would double the test's time."""
    from networks.vit import VisionTransformer
    grads = []
    for ac in ("none", "full"):
        torch.manual_seed(0)
        model = VisionTransformer(img_size=(16, 32), patch_size=4, in_chans=2, out_chans=2, embed_dim=32, depth=2,
                                  num_heads=2)
        if ac == "full":
            apply_activation_checkpointing(model, ac, 0, compiled=True)
            model.compile()
        x = torch.randn(2, 2, 16, 32, generator=torch.Generator().manual_seed(1))
        model(x).square().mean().backward()
        grads.append([(name.replace("_checkpoint_wrapped_module.", ""), p.grad)
                      for name, p in model.named_parameters()])
    for (name, grad), (wrapped, checkpointed) in zip(grads[0], grads[1], strict=True):
        assert name == wrapped
        torch.testing.assert_close(checkpointed, grad, rtol=1e-5, atol=1e-7, msg=name)
