"""Ring attention (``distributed/ring_attention.py``) against single-process attention.

The log-sum-exp merge on one process; the ring on 2 and 3 gloo ranks (uneven chunks: 7 tokens over 3 ranks are
3 + 3 + 1, 2 tokens over 3 are 1 + 1 + 0) in fp64, fp32 and under bf16 autocast, eagerly and compiled; a short
``tiny`` training run with ``--context_parallel 2 --cp_attention ring`` against one process.

Tolerances (absolute and relative, against fp64 attention of all tokens on one process; the largest errors
measured at 7 tokens over 2 and 3 ranks in brackets): fp64 1e-10 (1.1e-15), fp32 1e-5 (7.2e-7), bf16 autocast
3e-2 (output 1.1e-2, dq 1.0e-2, dk 7.5e-3, dv 2.0e-2). One process in bf16 is 5.4e-3 / 8.1e-3 / 8.0e-3 / 1.1e-2
off: the ring rounds each chunk's output and dK/dV to bf16 before they are merged or passed on, up to twice the
error of one kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from distributed.layers import DistributedAttention
from distributed.mappings import compute_split_shapes, group_rank, group_size
from distributed.ring_attention import (attention_kernel, chunk_attention, chunk_attention_backward,
                                        merge_attention, ring_attention)
from networks.vit import Attention
from tests.dist_utils import run_distributed
from tests.train_utils import assert_state_close, tiny_params, train_checkpoint, train_on_ranks

F64 = dict(atol=1e-10, rtol=1e-10)
F32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=3e-2, rtol=3e-2)


def _rand(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _close(actual, expected, tol, what):
    torch.testing.assert_close(actual.to(expected.dtype), expected, **tol, msg=lambda m: f"{what}: {m}")


def _reference(q, k, v, dout):
    """Single-process attention of all tokens: output and the q, k, v gradients for ``dout``."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


# ----------------------------------------------------------------------------- one process


def _chunked(q, k, v, dout, sizes, kernel):
    """Attention of ``q`` over ``k``/``v`` cut into ``sizes`` along the tokens: merged output, and the
    gradients from the per-chunk backward with the merged output and log-sum-exp."""
    ks, vs = torch.split(k, sizes, 2), torch.split(v, sizes, 2)
    out = lse = None
    auxes = []
    for k_i, v_i in zip(ks, vs):
        o, l, aux = chunk_attention(q, k_i, v_i, kernel)
        out, lse = merge_attention(out, lse, o, l)
        auxes.append(aux)
    out = out.to(q.dtype)
    grads = [chunk_attention_backward(dout, q, k_i, v_i, out, lse, aux, kernel) for k_i, v_i, aux in zip(ks, vs, auxes)]
    dq = sum(g[0].to(lse.dtype) for g in grads)
    return out, dq, torch.cat([g[1] for g in grads], 2), torch.cat([g[2] for g in grads], 2)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64), (torch.float32, F32)])
def test_lse_merge_equals_whole_attention(dtype, tol):
    """Keys cut into 3 + 3 + 1 tokens: the merged output and the per-chunk backward (given the merged output
    and log-sum-exp) equal attention over all 7 keys and its gradients."""
    q, k, v, dout = (_rand((2, 3, 5, 4), seed, dtype) for seed in (1, 2, 3, 4))
    k, v = _rand((2, 3, 7, 4), 2, dtype), _rand((2, 3, 7, 4), 3, dtype)
    want = _reference(q, k, v, dout)
    got = _chunked(q, k, v, dout, [3, 3, 1], "cpu")
    for a, b, name in zip(got, want, ("output", "dq", "dk", "dv")):
        _close(a, b, tol, name)


def test_merge_is_stable_for_large_scores():
    """Scores of 1e4 overflow ``exp`` in fp32: the merge works in log space and stays finite and exact."""
    q, k, v = _rand((1, 1, 3, 4), 1, torch.float32) * 100, _rand((1, 1, 6, 4), 2, torch.float32) * 100, \
        _rand((1, 1, 6, 4), 3, torch.float32)
    out, _, _, _ = _chunked(q, k, v, torch.zeros_like(q), [2, 4], "cpu")
    assert torch.isfinite(out).all()
    _close(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float(), F32, "output")


def test_kernel_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention_kernel(cpu, torch.bfloat16, 128, "cudnn") == "cpu"
    assert attention_kernel(cuda, torch.bfloat16, 128) == "flash"
    assert attention_kernel(cuda, torch.float16, 256, "flash") == "flash"
    assert attention_kernel(cuda, torch.bfloat16, 128, "cudnn") == "cudnn"
    assert attention_kernel(cuda, torch.bfloat16, 128, "cudnn_packed") == "cudnn"
    for dtype, head_dim, backend in ((torch.float32, 128, "auto"), (torch.bfloat16, 512, "auto"),
                                     (torch.bfloat16, 128, "efficient"), (torch.bfloat16, 128, "math")):
        with pytest.raises(ValueError, match="ring attention on CUDA runs FlashAttention-2 or cuDNN"):
            attention_kernel(cuda, dtype, head_dim, backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a GPU")
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_cuda_kernels_merge_equals_whole_attention(kernel):
    """Each CUDA kernel of the ring: 3 chunks of keys (uneven) merged equal attention over all of them,
    forward and backward, in bf16."""
    dtype = torch.bfloat16
    shape = (2, 4, 45, 64)
    q, dout = (_rand(shape, s, dtype).cuda() for s in (1, 4))
    k, v = (_rand((2, 4, 75, 64), s, dtype).cuda() for s in (2, 3))
    want = _reference(q.double(), k.double(), v.double(), dout.double())
    got = _chunked(q, k, v, dout, [33, 33, 9], kernel)
    for a, b, name in zip(got, want, ("output", "dq", "dk", "dv")):
        _close(a, b, BF16, f"{kernel} {name}")


# ----------------------------------------------------------------------------- the ring on 2 and 3 ranks


def _local(t, shapes, rank):
    return t.narrow(2, sum(shapes[:rank]), shapes[rank])


def _check_ring(n, dtype, tol, tag, autocast=False, attend=ring_attention):
    """This rank's ring attention of ``n`` tokens against single-process attention of all of them: the output
    and the q, k, v gradients of this rank's tokens."""
    group = torch.distributed.group.WORLD
    size, rank = group_size(group), group_rank(group)
    shapes = compute_split_shapes(n, size)
    q, k, v, dout = (_rand((2, 3, n, 8), seed, dtype) for seed in (1, 2, 3, 4))
    want = _reference(q, k, v, dout)
    mine = [_local(t, shapes, rank).clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        args = [t.to(torch.bfloat16) if autocast else t for t in mine]
        out = attend(*args, shapes, group)
    out.backward(_local(dout, shapes, rank).to(out.dtype))
    _close(out, _local(want[0], shapes, rank), tol, f"{tag} output")
    for t, g, name in zip(mine, want[1:], ("dq", "dk", "dv")):
        _close(t.grad, _local(g, shapes, rank), tol, f"{tag} {name}")


def _check_layer(world):
    """``DistributedAttention`` with the ring: the dense layer's output and input gradient on this rank's tokens,
    its parameter gradients summed over the ranks (what data parallelism over cp does)."""
    group = torch.distributed.group.WORLD
    torch.manual_seed(0)
    dense = Attention(6, 3).double()
    layer = DistributedAttention(copy.deepcopy(dense), None, group, seq_len=7, cp_attention="ring")
    x, g = _rand((2, 7, 6), 5), _rand((2, 7, 6), 6)
    xr = x.clone().requires_grad_()
    (dense(xr) * g).sum().backward()
    shapes, rank = compute_split_shapes(7, world), group_rank(group)
    xl = x.narrow(1, sum(shapes[:rank]), shapes[rank]).clone().requires_grad_()
    out = layer(xl)
    (out * g.narrow(1, sum(shapes[:rank]), shapes[rank])).sum().backward()
    _close(out, dense(x).narrow(1, sum(shapes[:rank]), shapes[rank]).detach(), F64, "layer output")
    _close(xl.grad, xr.grad.narrow(1, sum(shapes[:rank]), shapes[rank]), F64, "layer input grad")
    for (name, p), q in zip(layer.named_parameters(), dense.parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        _close(grad.reshape(q.shape), q.grad, F64, f"layer {name} grad")
    with pytest.raises(ValueError, match="cp_attention"):
        DistributedAttention(dense, None, group, cp_attention="ulysses")


def _ring_worker(rank, world):
    _check_layer(world)
    for n in (7, 2, 16):  # uneven; with an empty chunk at 3 ranks; even
        _check_ring(n, torch.float64, F64, f"fp64 {n} tokens")
    _check_ring(7, torch.float32, F32, "fp32 7 tokens")
    _check_ring(7, torch.float32, BF16, "bf16 autocast 7 tokens", autocast=True)
    compiled = torch.compile(ring_attention, backend="aot_eager", fullgraph=True)
    _check_ring(7, torch.float64, F64, "compiled 7 tokens", attend=compiled)
    with pytest.raises(ValueError, match="split"):
        ring_attention(*(_rand((1, 1, 5, 4), 0) for _ in range(3)), [4] * world, torch.distributed.group.WORLD)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_equals_single_process(world):
    run_distributed(_ring_worker, world)


def _tp_cp_worker(rank, world):
    """On a 2 x 2 (tp, cp) mesh, with and without sequence parallelism (q, k, v then hold the cp rank's tokens
    sequence-first, piece-major): the ring layer computes what the all-gather layer does (which
    ``tests/multiprocess/test_tensor_parallel.py`` checks against one process), gradients included."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
    tp, cp = mesh["tp"], mesh["cp"].get_group()
    torch.manual_seed(0)
    dense = Attention(6, 3).double()  # 3 heads over tp 2: 2 + 1
    cp_shapes = compute_split_shapes(7, 2)  # 4 + 3 tokens
    for sp in (False, True):
        seq = compute_split_shapes(cp_shapes[group_rank(cp)], 2) if sp else None
        x = _rand((2, 7, 6), 5).narrow(1, sum(cp_shapes[:group_rank(cp)]), cp_shapes[group_rank(cp)])
        if sp:
            x = x.narrow(1, sum(seq[:group_rank(tp.get_group())]), seq[group_rank(tp.get_group())])
        results = []
        for mode in ("all_gather", "ring"):
            layer = DistributedAttention(copy.deepcopy(dense), tp, cp, seq_len=7, seq_shapes=seq, cp_attention=mode)
            xl = x.clone().requires_grad_()
            out = layer(xl)
            (out * _rand(out.shape, 6)).sum().backward()
            results.append([out, xl.grad] + [p.grad.to_local() for p in layer.parameters()])
        for a, b in zip(*results):
            _close(a, b, F64, f"sp={sp} ring vs all-gather")


def test_ring_under_tensor_and_sequence_parallelism():
    run_distributed(_tp_cp_worker, 4)


# ----------------------------------------------------------------------------- training through the loop

# 32x64 grid, patch 4 -> 128 tokens over cp 2 (64 + 64); max_grad_norm: the global norm over the cp ranks
STEPS = {"num_iters": 3, "global_batch_size": 8, "max_grad_norm": 0.5}


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    """The one-process run both cases compare with (the same ``STEPS``: trained once)."""
    return train_checkpoint(tiny_params(tiny_data, tmp_path_factory.mktemp("single"), **STEPS))


@pytest.mark.parametrize("overrides", [{}, {"activation_checkpointing": "selective", "ac_every": 0}],
                         ids=["plain", "op-level-checkpointing"])
def test_cp2_ring_training_matches_single_process(tiny_data, tmp_path, single, overrides):
    """The op-level checkpointing policy keeps the attention kernels' outputs and recomputes the rest of the
    block, the ring's passes included."""
    run_distributed(train_on_ranks, 2, str(tiny_data), str(tmp_path / "cp2"),
                    {**STEPS, **overrides, "context_parallel": 2, "cp_attention": "ring"})
    ring = torch.load(tmp_path / "cp2" / "tiny" / "2CPU" / "00" / "checkpoints" / "model.pt")["model"]
    assert_state_close(single, ring, atol=1e-5)
