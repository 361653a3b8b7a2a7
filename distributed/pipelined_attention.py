"""Context-parallel attention with the key/value all-gather pipelined over head groups.

The all-gather of ``distributed/layers.py`` fetches every rank's keys and values before attention starts, and
its backward reduce-scatters dK, dV after the attention backward ends: on 2 H200s at ``mp`` both stood fully
exposed, 17.6 ms of a 124.5 ms step (docs/speed.md, "Round 5e"). Attention heads are independent, so the
exchange can be cut along them: the local heads are split into up to :data:`HEAD_GROUPS` groups; group ``g + 1``'s
K/V are gathered while group ``g``'s attention runs, and in backward group ``g``'s dK/dV are reduce-scattered while
group ``g + 1``'s attention backward runs. Only the first gather and the last reduce-scatter are exposed (a
``1 / groups`` share of each).

Unlike the ring (``distributed/ring_attention.py``), each group's attention sees all ``N`` keys at once: one
fused kernel per group, no log-sum-exp merge and no fp32 accumulators, and the exchange is the all-gather and
reduce-scatter of the plain path (the bytes moved are the same). Memory is the plain path's too: the gathered
K/V are kept for the backward.

**Communication.** Functional ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (traced by
``torch.compile`` like the other mappings), chunks padded to the largest rank's token count. One collective is
in flight at a time (gloo tolerates no more, ``distributed/sequence_parallel.py``); NCCL queues collectives on
one stream anyway, so waiting for group ``g`` before starting ``g + 1`` costs nothing there.

**Kernels**: those of the ring (:func:`distributed.ring_attention.attention_kernel`): the CPU flash kernel, or on
CUDA FlashAttention-2 or cuDNN in bf16/fp16 with a head dim up to 256, whose backward takes the forward's
log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from distributed.mappings import group_rank, group_size, stack_chunks
from distributed.ring_attention import (attention_kernel, chunk_attention, chunk_attention_backward, flatten_aux,
                                        unflatten_aux)

__all__ = ["HEAD_GROUPS", "head_groups", "pipelined_attention"]

HEAD_GROUPS = 4  # the first gather and last reduce-scatter exposed: a quarter of each

_c10d = torch.ops._c10d_functional


def head_groups(heads: int, groups: int = HEAD_GROUPS) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``min(groups, heads)`` consecutive head groups, sizes differing by at most one."""
    groups = min(groups, heads)
    bounds = [g * heads // groups for g in range(groups + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _start_gather(k, v, heads, shapes, group_name):
    """Launch the all-gather of heads ``heads`` of ``k``, ``v`` ``(B, h, n, d)``: returns the pending
    ``(P * max(shapes), 2, B, h_g, d)``, token-major (the collective concatenates along dim 0)."""
    a, b = heads
    part = torch.stack([k[:, a:b], v[:, a:b]]).movedim(3, 0)  # (n, 2, B, h_g, d)
    width = max(shapes)
    if part.shape[0] < width:
        part = torch.cat([part, part.new_zeros((width - part.shape[0],) + part.shape[1:])])
    return _c10d.all_gather_into_tensor(part.contiguous(), len(shapes), group_name)


def _finish_gather(pending, shapes):
    """Wait for a gather; its ``(2, B, h_g, N, d)`` K/V without the padding."""
    full = _c10d.wait_tensor(pending)
    width = max(shapes)
    if min(shapes) < width:
        full = torch.cat([full[r * width:r * width + s] for r, s in enumerate(shapes)])
    return full.movedim(0, 3)


def _start_reduce_scatter(dkv, shapes, group_name):
    """Launch the sum over the ranks of ``dkv`` ``(2, B, h_g, N, d)``, each rank keeping its tokens."""
    return _c10d.reduce_scatter_tensor(stack_chunks(dkv.movedim(3, 0), shapes), "sum", len(shapes), group_name)


def _finish_reduce_scatter(pending, n):
    return _c10d.wait_tensor(pending)[:n].movedim(0, 3)  # (2, B, h_g, n, d)


class _PipelinedAttention(torch.autograd.Function):
    """Forward: per head group, wait for its K/V, start the next group's gather, run its attention; backward:
    per head group, its attention backward, then its dK/dV reduce-scatter behind the next group's."""

    @staticmethod
    def forward(ctx, q, k, v, shapes, group_name, kernel):
        groups, n = head_groups(q.shape[1]), q.shape[2]
        pending = _start_gather(k, v, groups[0], shapes, group_name)
        kvs, outs, lses, auxes = [], [], [], []
        for g, (a, b) in enumerate(groups):
            kvs.append(_finish_gather(pending, shapes))
            if g + 1 < len(groups):  # travels while this group's attention runs
                pending = _start_gather(k, v, groups[g + 1], shapes, group_name)
            if n:  # no kernel on empty queries
                out, lse, aux = chunk_attention(q[:, a:b], kvs[g][0], kvs[g][1], kernel)
            else:
                out, lse, aux = q[:, a:b].clone(), q.new_zeros(q[:, a:b].shape[:3], dtype=torch.float32), ()
            outs.append(out)
            lses.append(lse)
            auxes.append(aux)
        flat, ctx.layout = flatten_aux(auxes)
        ctx.save_for_backward(q, *kvs, *outs, *lses, *flat)
        ctx.groups, ctx.shapes, ctx.group_name, ctx.kernel = groups, shapes, group_name, kernel
        return torch.cat(outs, 1)

    @staticmethod
    def backward(ctx, dout):
        groups, shapes, kernel = ctx.groups, ctx.shapes, ctx.kernel
        q, *rest = ctx.saved_tensors
        m = len(groups)
        kvs, outs, lses = rest[:m], rest[m:2 * m], rest[2 * m:3 * m]
        auxes = unflatten_aux(rest[3 * m:], ctx.layout)
        n = q.shape[2]
        dqs, dkvs, pending = [], [], None
        for g, (a, b) in enumerate(groups):
            if n:
                dq, dk, dv = chunk_attention_backward(dout[:, a:b].contiguous(), q[:, a:b], kvs[g][0], kvs[g][1],
                                                      outs[g], lses[g], auxes[g], kernel)
                dkv = torch.stack([dk, dv])
            else:  # still this rank's part of every reduce-scatter
                dq, dkv = torch.zeros_like(q[:, a:b]), torch.zeros_like(kvs[g])
            dqs.append(dq)
            if pending is not None:
                dkvs.append(_finish_reduce_scatter(pending, n))
            pending = _start_reduce_scatter(dkv.to(q.dtype), shapes, ctx.group_name)
        dkvs.append(_finish_reduce_scatter(pending, n))
        dkv = torch.cat(dkvs, 2)
        return torch.cat(dqs, 1), dkv[0], dkv[1], None, None, None


def pipelined_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shapes: Sequence[int],
                        group: dist.ProcessGroup | None, backend: str = "auto") -> torch.Tensor:
    """Non-causal softmax attention of this rank's queries over every rank's keys and values, the K/V all-gather
    and the dK/dV reduce-scatter pipelined over head groups (module docstring).

    ``q``, ``k``, ``v``: ``(B, h, shapes[r], d)``, this CP rank's tokens, one float dtype (``q``'s is used, bf16
    under autocast). ``shapes``: every rank's token count (``compute_split_shapes(N, P)``). ``backend``:
    ``--attention_backend``, which picks the CUDA kernel. Returns ``(B, h, shapes[r], d)`` in ``q``'s dtype, equal
    to ``F.scaled_dot_product_attention(q, K, V)`` with ``K``, ``V`` all ranks' ``k``, ``v`` concatenated (within
    the kernels' rounding); differentiable in ``q``, ``k``, ``v``. With ``group`` None or of one rank,
    ``F.scaled_dot_product_attention(q, k, v)``.

    Raises:
        ValueError: ``shapes`` has not one entry per rank or disagrees with the local token count; on CUDA, a
            dtype, head dim or backend the kernels refuse (:func:`distributed.ring_attention.attention_kernel`).
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
    return _PipelinedAttention.apply(q, k, v, shapes, group.group_name, kernel)
