"""Async TP on 2 GPUs (skipped with fewer): inductor's micro-pipeline TP really fuses our sequence-parallel
linears' collectives into ``torch.ops.symm_mem`` kernels, and the fused model computes what the chunked path
computes. The CPU suite checks that the compiled graphs hold the pairs the pass fuses
(``tests/multiprocess/test_async_tp.py``); only here does the fusion itself run (NCCL, symmetric memory).

The two ranks are the gloo ranks of ``tests/dist_utils.py``, with an NCCL group of their own for the model.
NVLink multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` where it is set): the fused all-gather and
reduce-scatter read and write the peers' buffers point to point."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import DeviceMesh

from distributed.async_tp import enable_async_tp
from distributed.tensor_parallel import apply_tensor_context_parallel
from networks.vit import VisionTransformer
from tests.dist_utils import run_distributed
from tests.gpu.background import Run

# fp32 sums over 2 ranks in another order and in pieces: rounding, not a wrong block
TOL = dict(atol=1e-4, rtol=1e-4)


def _fused_worker(rank, world):
    torch.cuda.set_device(rank)
    tp = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda", mesh_dim_names=("tp",))
    torch.manual_seed(0)
    dense = VisionTransformer(img_size=(16, 32), patch_size=4, in_chans=3, out_chans=2, embed_dim=256, depth=2,
                              num_heads=4, mlp_ratio=4.0).cuda()  # 32 tokens: 16 per rank
    chunked = apply_tensor_context_parallel(copy.deepcopy(dense), tp, None, sequence_parallel=True)
    fused = apply_tensor_context_parallel(copy.deepcopy(dense), tp, None, sequence_parallel=True)
    enable_async_tp(fused)
    x = torch.randn(4, 3, 16, 32, device="cuda")
    want = chunked(x)  # eager: the chunked path as it runs without the pass
    want.square().mean().backward()
    compiled = torch.compile(fused)

    def step():
        out = compiled(x)
        out.square().mean().backward()
        return out

    out, codes = run_and_get_code(step)
    code = "\n".join(codes)
    assert "fused_all_gather_matmul" in code and "fused_matmul_reduce_scatter" in code, "nothing was fused"
    torch.testing.assert_close(out, want, **TOL)
    for (name, p), q in zip(fused.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), **TOL, msg=lambda m: f"{name}: {m}")


def fused_on_two_gpus(workdir, data) -> None:
    run_distributed(_fused_worker, 2)


# started with the session's other runs (tests/gpu/background.py)
RUNS = {"fused": Run(job=fused_on_two_gpus, gpus=2)}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.runs("fused")
def test_async_tp_fuses_the_sequence_parallel_collectives_on_two_gpus(train_run):
    train_run("fused")  # raises the worker's failure
