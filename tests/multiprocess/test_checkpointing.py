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
