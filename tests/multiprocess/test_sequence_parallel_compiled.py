"""A compiled tensor-parallel model with sequence parallelism gets every gradient the eager one gets.

torch 2.11's dynamo lost the position embedding's gradient (zero on every rank; the loss still fell, so no
training run showed it) when the embedding was sliced after a scatter whose backward all-gathers: the first
GPU run of ``tests/gpu/test_async_tp_fusion.py`` found it. ``_embed_local_tokens`` now slices the replicated
parameter and sums its gradient over TP. ``aot_eager`` traces forward and backward as inductor does (the loss
happened at dynamo's level, before any backend); fp32, 2 and 3 TP ranks (3: uneven token split)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from distributed.tensor_parallel import apply_tensor_context_parallel
from networks.vit import VisionTransformer
from tests.dist_utils import run_distributed


def _compiled_against_eager(rank, world):
    tp = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("tp",))
    torch.manual_seed(0)
    dense = VisionTransformer(img_size=(16, 32), patch_size=4, in_chans=3, out_chans=2, embed_dim=48, depth=1,
                              num_heads=6, mlp_ratio=2.0)  # 32 tokens
    eager, compiled = (apply_tensor_context_parallel(copy.deepcopy(dense), tp, None, sequence_parallel=True)
                       for _ in range(2))
    x = torch.randn(2, 3, 16, 32, generator=torch.Generator().manual_seed(1))
    eager(x).square().mean().backward()
    torch.compile(compiled, backend="aot_eager")(x).square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        want, got = p.grad.full_tensor(), q.grad.full_tensor()
        assert want.abs().max() > 0, f"{name}: the eager gradient is zero"
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_sequence_parallel_model_has_every_eager_gradient(world):
    run_distributed(_compiled_against_eager, world)
