"""A compiled tensor-parallel model with sequence parallelism gets every gradient the eager one gets, with and
without ``--sp_grad_bucketing`` (whose compiled backward then holds one all-reduce).

torch 2.11's dynamo lost the position embedding's gradient (zero on every rank; the loss still fell, so no
training run showed it) when the embedding was sliced after a scatter whose backward all-gathers: the first
GPU run of ``tests/gpu/test_async_tp_fusion.py`` found it. ``_embed_local_tokens`` now slices the replicated
parameter and sums its gradient over TP. ``aot_eager`` traces forward and backward as inductor does (the loss
happened at dynamo's level, before any backend); fp32, 2 and 3 TP ranks (3: uneven token split)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import DeviceMesh

from distributed.launch import LaunchEnv
from distributed.parallelize import parallelize_model
from distributed.tensor_parallel import apply_tensor_context_parallel
from distributed.world import World, build_meshes
from networks.vit import VisionTransformer
from tests.dist_utils import run_distributed
from utils.config.schema import ParallelConfig, PrecisionConfig


def _vit():
    torch.manual_seed(0)
    return VisionTransformer(img_size=(16, 32), patch_size=4, in_chans=3, out_chans=2, embed_dim=48, depth=1,
                             num_heads=6, mlp_ratio=2.0)  # 32 tokens


def _compiled_against_eager(rank, world, backend="aot_eager"):
    tp = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("tp",))
    dense = _vit()
    eager, compiled = (apply_tensor_context_parallel(copy.deepcopy(dense), tp, None, sequence_parallel=True)
                       for _ in range(2))
    x = torch.randn(2, 3, 16, 32, generator=torch.Generator().manual_seed(1))
    eager(x).square().mean().backward()
    _, codes = run_and_get_code(lambda: torch.compile(compiled, backend=backend)(x).square().mean().backward())
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        want, got = p.grad.full_tensor(), q.grad.full_tensor()
        assert want.abs().max() > 0, f"{name}: the eager gradient is zero"
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    return codes


def _bucketed(rank, world):
    w = World(LaunchEnv(rank, world), torch.device("cpu"), 1, 1, world, 0, build_meshes("cpu", world, world, 1,
                                                                                     "tp-cp-dp", 0))
    par = ParallelConfig(tensor_parallel=world, sequence_parallel=True, sp_grad_bucketing=True)
    parallelize_model(_vit(), par, PrecisionConfig(), w)  # --sp_grad_bucketing turns inductor's pass on
    assert inductor_config.bucket_all_reduces_fx == "all"
    with inductor_config.patch(fx_graph_cache=False):  # compiled here, so the code is this pass's
        forward, backward = _compiled_against_eager(rank, world, "inductor")
    # 6 replicated tensors per block and 7 around the blocks, whose gradients were summed one by one
    counts = [len(re.findall(r"_c10d_functional\.all_reduce_?\.default\(", code)) for code in (forward, backward)]
    assert counts == [0, 1], f"all-reduces in the compiled forward and backward: {counts}"


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_sequence_parallel_model_has_every_eager_gradient(world):
    run_distributed(_compiled_against_eager, world)


def test_sp_grad_bucketing_sums_the_replicated_gradients_in_one_all_reduce():
    run_distributed(_bucketed, 2)
