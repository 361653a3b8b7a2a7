"""Async TP on 2 GPUs (skipped with fewer): inductor's micro-pipeline TP really fuses our sequence-parallel
linears' collectives into ``torch.ops.symm_mem`` kernels, the fused model computes what the chunked path
computes, and our kernel of the fused reduce-scatter returns torch's kernel's result to the bit. The CPU suite
checks that the compiled graphs hold the pairs the pass fuses (``tests/multiprocess/test_async_tp.py``); only here
does the fusion itself run (NCCL, symmetric memory).

The two ranks are the gloo ranks of ``tests/dist_utils.py``, with an NCCL group of their own for the model.
NVLink multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` where it is set): the fused all-gather and
reduce-scatter read and write the peers' buffers point to point."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code
import torch._inductor.config as inductor_config
from torch.distributed.device_mesh import DeviceMesh

import distributed.async_tp as async_tp
from distributed.async_tp import enable_async_tp, use_plain_collectives
from distributed.tensor_parallel import apply_tensor_context_parallel
from networks.vit import VisionTransformer
from tests.dist_utils import run_distributed
from tests.gpu.background import Run

# fp32 sums over 2 ranks in another order and in pieces, compiled against eager: rounding, relative to each
# tensor's largest entry. A wrong block is off by O(1).
REL = 1e-4


def _mismatches(model, reference) -> dict[str, str]:
    """Each gradient of ``model`` off ``reference``'s by more than ``REL`` of its largest entry: name -> how far."""
    off = {}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        got, want = p.grad.full_tensor(), q.grad.full_tensor()
        scale, err = want.abs().max().item(), (got - want).abs().max().item()
        if not err <= REL * scale + 1e-12:
            off[name] = f"max error {err:.3g}, largest entry {scale:.3g}, norms {got.norm():.4g} / {want.norm():.4g}"
    return off


def _step(model, x):
    out = model(x)
    out.square().mean().backward()
    return out


def _fused_worker(rank, world):
    torch.cuda.set_device(rank)
    tp = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda", mesh_dim_names=("tp",))
    torch.manual_seed(0)
    dense = VisionTransformer(img_size=(16, 32), patch_size=4, in_chans=3, out_chans=2, embed_dim=256, depth=2,
                              num_heads=4, mlp_ratio=4.0).cuda()  # 32 tokens: 16 per rank
    chunked, plain, fused = (apply_tensor_context_parallel(copy.deepcopy(dense), tp, None, sequence_parallel=True)
                             for _ in range(3))
    x = torch.randn(4, 3, 16, 32, device="cuda")
    want = _step(chunked, x)  # eager: the chunked path as it runs without the pass
    use_plain_collectives(plain)
    with inductor_config.patch(_micro_pipeline_tp=False):  # the one-piece path compiled, without the pass
        _step(torch.compile(plain), x)
    enable_async_tp(fused)
    out, codes = run_and_get_code(_step, torch.compile(fused), x)
    code = "\n".join(codes)
    assert "fused_all_gather_matmul" in code and "fused_matmul_reduce_scatter" in code, "nothing was fused"
    torch.testing.assert_close(out, want, atol=REL * want.abs().max().item(), rtol=REL)
    off = _mismatches(fused, chunked)
    assert not off, f"async TP's gradients are off eager's: {off}; compiled without the pass: {_mismatches(plain, chunked)}"
    _reduce_scatter_is_torchs(rank, tp.get_group().group_name)


def _reduce_scatter_is_torchs(rank, group):
    """Our CUDA kernel of ``fused_matmul_reduce_scatter`` (registered by ``enable_async_tp``) against torch's,
    in bf16 at mp's width: scattered along the tokens first (as our sequence-parallel linears do), and along a
    second dim with A laid out as Inductor restrides it (tokens first) and contiguous."""
    assert "distributed/async_tp.py" in torch._C._dispatch_dump("symm_mem::fused_matmul_reduce_scatter")
    torch.manual_seed(rank)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    tokens_first = torch.randn(256, 4, 512, device="cuda", dtype=torch.bfloat16)
    for a, dim, shape in ((tokens_first, 0, (128, 4, 1024)), (tokens_first.movedim(0, 1), 1, (4, 128, 1024)),
                          (tokens_first.movedim(0, 1).contiguous(), 1, (4, 128, 1024))):
        ours = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", dim, group)
        torchs = async_tp._TORCH_KERNEL(a, w, "sum", dim, group)
        assert ours.shape == shape and ours.is_contiguous() and torch.equal(ours, torchs), (dim, a.stride())


def fused_on_two_gpus(workdir, data) -> None:
    run_distributed(_fused_worker, 2)


# started with the session's other runs (tests/gpu/background.py)
RUNS = {"fused": Run(job=fused_on_two_gpus, gpus=2)}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.runs("fused")
def test_async_tp_fuses_the_sequence_parallel_collectives_on_two_gpus(train_run):
    train_run("fused")  # raises the worker's failure
