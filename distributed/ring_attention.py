"""Context-parallel attention as a pass-KV ring: the key/value exchange runs behind the attention it feeds.

Under context parallelism (CP) rank ``r`` of ``P`` holds the queries, keys and values of its chunk of the ``N``
tokens (``compute_split_shapes(N, P)[r]`` of them, the chunks may differ by a token or be empty). Softmax
attention of the local queries needs every key and value. The all-gather of ``distributed/layers.py`` fetches
them all before attention starts; here they travel around a ring instead (Liu et al. 2023, "Ring Attention with
Blockwise Transformers for Near-Infinite Context"): in step ``s`` rank ``r`` holds the K/V chunk of rank
``(r - s) mod P`` and, while it computes its queries' attention to that chunk, passes the chunk on to rank
``r + 1`` and receives the next one from ``r - 1``. ``P - 1`` of the ``P`` exchanges hide behind a chunk's
attention; only the first chunk (the rank's own) needs none.

**Merging the chunks.** A fused attention kernel returns, besides ``O_i = softmax(Q K_i^T / sqrt(d)) V_i``, the
log-sum-exp of each query's scores, ``lse_i = log sum_j exp(Q K_ij^T / sqrt(d))``. Attention over all chunks
is then exactly (the rescaling of FlashAttention's online softmax, Dao et al. 2022, section 3.1, and the
merge of Milakov and Gimelshein 2018, "Online normalizer calculation for softmax")::

    lse = log sum_i exp(lse_i),      O = sum_i exp(lse_i - lse) O_i

:func:`merge_attention` folds the chunks in one at a time with ``logaddexp`` (no ``exp`` of a large number).

**Backward.** With the merged ``O`` and the global ``lse``, the fused backward of chunk ``i`` (given ``dO``)
computes the chunk's probabilities ``exp(Q K_i^T / sqrt(d) - lse)`` and ``rowsum(dO * O)`` of the whole
softmax, so it returns exactly chunk ``i``'s share of ``dQ`` and the whole gradient of ``K_i`` and ``V_i`` from
this rank's queries (FlashAttention-2's backward, Dao 2023, algorithm 2). The ``dK_i, dV_i`` of the ``P`` ranks
are summed on the way back to their owner: rank ``r`` starts the accumulator of chunk ``r - 1``, adds its share
and passes it to ``r + 1``, which adds its own share of that chunk while the next chunk's backward runs; after
``P - 1`` passes every accumulator is home. The K/V chunks of the forward are kept for the backward, the memory
of the all-gather's gathered K/V.

**Communication.** Each pass is one functional ``all_to_all_single`` in which a rank sends to ``r + 1`` and
receives from ``r - 1`` (exact sizes, no padding; traced by ``torch.compile`` like the other mappings). One pass
is in flight at a time: NCCL runs it beside the attention kernel; gloo tolerates no more
(``distributed/sequence_parallel.py``, ``_in_flight``). Passes move the inputs' dtype (bf16 under autocast), as
the all-gather and reduce-scatter do; the chunk sums are fp32 (or the inputs' dtype if wider).

**Kernels** (:func:`attention_kernel`): CPU ``_scaled_dot_product_flash_attention_for_cpu``; CUDA cuDNN under
``--attention_backend cudnn``, else FlashAttention-2; both need bf16/fp16 and a head dim up to 256. Not the
memory-efficient kernel: its backward gave wrong gradients from the merged log-sum-exp on H200s, eagerly in bf16
and compiled in fp32 (``tests/gpu/test_ring_attention_nccl.py``, 2026-11-27), so fp32 rings run on the CPU only.
The CUDA backward is a custom op (:func:`_cuda_chunk_backward`) that lays out the merged output and log-sum-exp
itself, where inductor cannot re-stride them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from distributed.mappings import group_rank, group_size

__all__ = ["attention_kernel", "merge_attention", "chunk_attention", "chunk_attention_backward", "ring_attention"]

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

# ----------------------------------------------------------------------------- one chunk's attention


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, backend: str = "auto") -> str:
    """The fused kernel that computes one chunk: ``cpu``, or on CUDA ``cudnn`` under ``--attention_backend
    cudnn`` (or ``cudnn_packed``) and FlashAttention-2 (``flash``) otherwise.

    Raises:
        ValueError: on CUDA, a dtype other than bf16/fp16, a head dim over 256, or ``backend`` ``efficient`` or
            ``math``: the memory-efficient kernel's backward gave wrong gradients from a merged log-sum-exp on
            H200s (``tests/gpu/test_ring_attention_nccl.py``), and those are what the ring would need.
    """
    if device.type != "cuda":
        return "cpu"
    if dtype not in (torch.bfloat16, torch.float16) or head_dim > 256 or backend in ("efficient", "math"):
        raise ValueError(f"ring attention on CUDA runs FlashAttention-2 or cuDNN, which need bf16 or fp16 and a "
                         f"head dim up to 256 (got {dtype}, head dim {head_dim}, backend {backend!r})")
    return "cudnn" if backend.startswith("cudnn") else "flash"


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str):
    """``softmax(q k^T / sqrt(d)) v`` of one key/value chunk (scaled dot-product attention, Vaswani et al. 2017)
    and its log-sum-exp ``log sum_j exp(q k_j^T / sqrt(d))``.

    ``q`` ``(B, h, n, d)``, ``k``/``v`` ``(B, h, m, d)``, one float dtype, ``n, m > 0`` (the CPU kernel dies
    of an empty one). Returns ``(out (B, h, n, d) in q's dtype, lse (B, h, n) fp32 (fp64 for fp64), aux)``;
    ``aux`` (the kernel's random-number state) goes to
    :func:`chunk_attention_backward`."""
    if kernel == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        return out, lse, ()
    if kernel == "flash":
        out, lse, _, _, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(q, k, v)
        return out, lse, (seed, offset)
    out, lse, _, _, _, _, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
    return out, lse.reshape(q.shape[:3]), (seed, offset)


def chunk_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, aux: tuple, kernel: str):
    """``(dq, dk, dv)`` of one chunk given the merged ``out`` and global ``lse`` of all chunks (shapes as
    :func:`chunk_attention`'s, ``dout`` like ``out``): ``dq`` is this chunk's share of the query gradient,
    ``dk``/``dv`` the whole gradient of this chunk from these queries."""
    if kernel == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, False)
    return _cuda_chunk_backward(dout, q, k, v, out, lse, *aux, kernel)


@torch.library.custom_op("era5vit::ring_chunk_attention_backward", mutates_args=(), device_types="cuda")
def _cuda_chunk_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, seed: torch.Tensor | None, offset: torch.Tensor | None,
                         kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CUDA kernel's backward of one chunk, opaque to inductor: the merged ``out`` and ``lse`` are checked and
    laid out here, eagerly, as the kernel's forward would have returned them. Traced, inductor may give them
    strides the kernels refuse (cuDNN wants ``dO`` strided like ``O`` and its ``(B, h, n, 1)`` statistics packed, last
    stride 1 even for that size-1 dim) or misread. ``out`` and ``dout`` pass as they are when they share
    strides with dense rows, as the ring hands them over (:func:`_kernel_layout`). Returns ``dq`` in the
    kernels' layout (their own, so no copy) and contiguous ``dk``, ``dv``."""
    if out.stride() != dout.stride() or out.stride(-1) != 1:
        out, dout = out.contiguous(), dout.contiguous()
    n, m = q.shape[2], k.shape[2]
    if kernel == "flash":
        grads = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, n, m, 0.0, False, seed, offset)
    else:
        stats = lse.contiguous().unsqueeze(-1)  # packed (B, h, n, 1): strides (h n, n, 1, 1)
        grads = _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, stats, seed, offset, None, None, None, n, m, 0.0, False)
    dq, dk, dv = grads
    return _kernel_layout(dq), dk.contiguous(), dv.contiguous()


@_cuda_chunk_backward.register_fake
def _(dout, q, k, v, out, lse, seed, offset, kernel):
    return _kernel_layout(q.new_empty(q.shape)), k.new_empty(k.shape), v.new_empty(v.shape)


def _kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, h, n, d)`` laid out ``(B, n, h, d)`` in memory, as cuDNN and FlashAttention-2 lay out their
    ``O`` and ``dQ``; ``x`` itself when it is. In that layout the ring's output feeds the projection as a view
    (batch first) and shares the model's ``dO``'s strides, and no chunk's ``dQ`` is copied (round 5g found
    those copies 2.4 ms of a step at ``mp`` cp 2; round 5aa removed them, ``docs/speed.md``)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def merge_attention(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                    block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one chunk's attention into the running result: ``lse' = log(exp(lse) + exp(block_lse))`` and
    ``out' = exp(lse - lse') out + exp(block_lse - lse') block_out`` (module docstring; FlashAttention's
    rescaling, Dao et al. 2022).

    ``out``/``block_out`` ``(B, h, n, d)``, ``lse``/``block_lse`` ``(B, h, n)``; ``out``/``lse`` None before the
    first chunk. Returns the running ``(out, lse)`` in ``lse``'s dtype (fp32, or fp64 for fp64 inputs)."""
    block_out = block_out.to(block_lse.dtype)
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    out = torch.exp(lse - merged).unsqueeze(-1) * out + torch.exp(block_lse - merged).unsqueeze(-1) * block_out
    return out, merged


# ----------------------------------------------------------------------------- the ring


def _start_pass(x: torch.Tensor, incoming: int, rank: int, size: int, group_name: str) -> torch.Tensor:
    """Launch one pass of the ring: send ``x`` to rank ``rank + 1``, receive ``incoming`` elements (flat) from
    ``rank - 1``; :func:`_finish_pass` waits. A permutation as an ``all_to_all_single`` with all other sizes 0."""
    send, recv = [0] * size, [0] * size
    send[(rank + 1) % size], recv[(rank - 1) % size] = x.numel(), incoming
    return _c10d.all_to_all_single(x.reshape(-1), recv, send, group_name)


def _finish_pass(pending: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return _c10d.wait_tensor(pending).view(shape)


class _RingAttention(torch.autograd.Function):
    """Forward: the K/V chunks passed around the ring, each chunk's attention merged by its log-sum-exp;
    backward: each chunk's fused backward, the dK/dV sums passed on towards their owners (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, shapes, rank, group_name, kernel):
        size, n = len(shapes), q.shape[2]
        chunks = [torch.stack([k, v])]  # chunks[s]: rank (rank - s)'s K/V, (2, B, h, m, d)
        out = lse = None
        auxes = []
        for s in range(size):
            incoming = shapes[(rank - s - 1) % size]  # tokens of the next chunk
            if s + 1 < size:  # the next chunk travels while this one is computed
                pending = _start_pass(chunks[s], _chunk_numel(chunks[s], incoming), rank, size, group_name)
            aux = ()
            if n and chunks[s].shape[3]:  # no kernel on empty queries or keys
                block_out, block_lse, aux = chunk_attention(q, chunks[s][0], chunks[s][1], kernel)
                out, lse = merge_attention(out, lse, block_out, block_lse)
            auxes.append(aux)
            if s + 1 < size:
                chunks.append(_finish_pass(pending, _chunk_shape(chunks[s], incoming)))
        out = _kernel_layout(q.new_zeros(q.shape) if out is None else out.to(q.dtype))
        lse = q.new_zeros(q.shape[:3], dtype=torch.float32) if lse is None else lse  # no queries: unread
        flat, ctx.layout = _flatten_aux(auxes)
        ctx.save_for_backward(q, out, lse, *chunks, *flat)
        ctx.shapes, ctx.rank, ctx.group_name, ctx.kernel = shapes, rank, group_name, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *rest = ctx.saved_tensors
        shapes, rank, kernel, size = ctx.shapes, ctx.rank, ctx.kernel, len(ctx.shapes)
        chunks, auxes = rest[:size], _unflatten_aux(rest[size:], ctx.layout)
        dout = dout if dout.stride() == out.stride() else torch.empty_like(out).copy_(dout)  # the kernels' layout
        wide = torch.promote_types(q.dtype, torch.float32)  # the sums' dtype
        dq = pending = None
        for s in range(size):
            owner = (rank - 1 - s) % size  # the chunk whose dK/dV sum this rank holds in step s
            mine = (rank - owner) % size  # its place among this rank's chunks (the forward's step)
            dq_i, dkv = _chunk_grads(dout, q, chunks[mine], out, lse, auxes[mine], kernel)
            dq = dq_i.to(wide) if dq is None else dq + dq_i
            if pending is not None:  # the sum of the ranks before, for the same chunk
                dkv = dkv.to(wide) + _finish_pass(pending, dkv.shape)
            if s + 1 < size:  # on to rank + 1, which adds its share while computing its next chunk
                pending = _start_pass(dkv.to(q.dtype), _chunk_numel(dkv, shapes[(owner - 1) % size]), rank, size,
                                      ctx.group_name)
        return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype), None, None, None, None


def _chunk_grads(dout, q, kv, out, lse, aux, kernel):
    """This rank's share of ``dq`` and the stacked ``(dk, dv)`` ``(2, B, h, m, d)`` of one K/V chunk; zeros
    when the queries or the chunk are empty (no kernel runs on those)."""
    if q.shape[2] == 0 or kv.shape[3] == 0:
        return torch.zeros_like(q), torch.zeros_like(kv)
    dq, dk, dv = chunk_attention_backward(dout, q, kv[0], kv[1], out, lse, aux, kernel)
    return dq, torch.stack([dk, dv])


def _chunk_shape(kv: torch.Tensor, tokens: int) -> tuple[int, ...]:
    return kv.shape[:3] + (tokens,) + kv.shape[4:]


def _chunk_numel(kv: torch.Tensor, tokens: int) -> int:
    return math.prod(_chunk_shape(kv, tokens))


_SAVED = "saved tensor"  # a tensor's place in an aux layout (a kernel may return None among its aux)


def _flatten_aux(auxes: list[tuple]) -> tuple[list[torch.Tensor], list[list]]:
    """The kernels' aux tuples as (tensors, for ``save_for_backward``; the tuples with those marked ``_SAVED``)."""
    tensors = [a for aux in auxes for a in aux if isinstance(a, torch.Tensor)]
    layout = [[_SAVED if isinstance(a, torch.Tensor) else a for a in aux] for aux in auxes]
    return tensors, layout


def _unflatten_aux(tensors: Sequence[torch.Tensor], layout: list[list]) -> list[tuple]:
    it = iter(tensors)
    return [tuple(next(it) if isinstance(a, str) and a == _SAVED else a for a in aux) for aux in layout]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shapes: Sequence[int],
                   group: dist.ProcessGroup | None, backend: str = "auto") -> torch.Tensor:
    """Non-causal softmax attention of this rank's queries over every rank's keys and values, the K/V passed
    around the ring behind the attention (module docstring; Liu et al. 2023).

    ``q``, ``k``, ``v``: ``(B, h, shapes[r], d)``, this CP rank's tokens, one float dtype (bf16 under autocast:
    ``q``'s dtype is used). ``shapes``: every rank's token count (``compute_split_shapes(N, P)``). ``backend``:
    ``--attention_backend``, which picks the CUDA kernel (:func:`attention_kernel`). Returns ``(B, h,
    shapes[r], d)`` in ``q``'s dtype, laid out ``(B, shapes[r], h, d)`` in memory as the fused kernels lay out
    their output, equal to ``F.scaled_dot_product_attention(q, K, V)`` with ``K``, ``V`` the
    concatenation of all ranks' ``k``, ``v`` (within the kernels' rounding); differentiable in ``q``, ``k``,
    ``v``. With ``group`` None or of one rank, ``F.scaled_dot_product_attention(q, k, v)``.

    Raises:
        ValueError: ``shapes`` has not one entry per rank, or disagrees with the local token count.
    """
    size, rank = group_size(group), group_rank(group)
    if size == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    shapes = [int(s) for s in shapes]
    if len(shapes) != size or shapes[rank] != q.shape[2] or k.shape[2] != q.shape[2]:
        raise ValueError(f"CP rank {rank} holds {q.shape[2]} queries and {k.shape[2]} keys, but the split is "
                         f"{shapes} over {size} ranks")
    k, v = k.to(q.dtype), v.to(q.dtype)
    kernel = attention_kernel(q.device, q.dtype, q.shape[-1], backend)
    return _RingAttention.apply(q, k, v, shapes, rank, group.group_name, kernel)
