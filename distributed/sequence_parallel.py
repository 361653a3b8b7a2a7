"""Sequence-parallel linears: tensor parallelism whose activations between the GEMM regions are split along
the tokens (Megatron-LM's sequence parallelism, Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", section 4.2.2).

Plain tensor parallelism leaves the residual stream ``(N, B, D)`` replicated over the ``P`` ranks of the
group, so every rank repeats the LayerNorms and residual adds on all ``N`` tokens. Here rank ``r`` holds only
its chunk ``x_r`` of ``shapes[r]`` tokens (``compute_split_shapes``), and the two mappings of a GEMM region
change:

* entering (column-parallel, ``qkv`` and ``fc1``): ``y_r = cat_q(x_q) W_r^T + b_r``, an all-gather along
  the tokens instead of the identity. Backward: ``dx_r = chunk_r(sum_q dy_q W_q)``, a reduce-scatter instead
  of the all-reduce, launched before ``dW_r``'s GEMM and awaited after it, so the two overlap;
* leaving (row-parallel, ``proj`` and ``fc2``): ``y_r = chunk_r(sum_q x_q W_q^T)``, a reduce-scatter along the
  tokens instead of the all-reduce, in ``chunks`` pieces, each piece's reduce-scatter running while the next
  piece's GEMM does (as :func:`distributed.mappings.row_parallel_linear` chunks its all-reduce). Backward:
  ``dy`` all-gathered along the tokens, then the local GEMMs.

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes moved per region are unchanged.

Layout: the tokens are dim 0 (sequence-first ``(n, B, features)``, as Megatron-LM holds them), so the
collectives cut and join contiguous blocks and need no copy for even splits; uneven splits are padded
(:func:`distributed.mappings.all_gather_uneven`). The row-parallel output is chunked so that every rank keeps
a contiguous block of tokens: viewing the ``N = P n`` rows as ``(P, n, ...)``, piece ``j`` is the tokens
``[o_j, o_j + s_j)`` of every rank's block, a ``P``-strided view whose product with ``W_r^T`` (a batched GEMM,
no copy) is the ``(P, s_j, ...)`` a reduce-scatter cuts into rank ``r``'s ``s_j`` tokens. That needs an even
split; an uneven one is reduce-scattered in one piece. The all-gathers (forward of the column-parallel
linear, backward of the row-parallel one) are not overlapped, as in Megatron-LM without userbuffers. The
column-parallel linear keeps its gathered input for the weight gradient, as the replicated input was kept
without sequence parallelism (Megatron-LM gathers it again in backward instead, to save that memory).

With one rank (``group`` None or of size 1) both are ``F.linear``. Tensors keep their dtype and device; the
input, weight and bias must share one dtype (cast them first under autocast).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed.mappings import (all_gather_uneven, compute_split_shapes, group_rank, group_size,
                                  reduce_scatter_uneven, stack_chunks)

__all__ = ["sequence_parallel_column_linear", "sequence_parallel_row_linear"]


def _start_reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Launch a sum reduce-scatter of ``x`` ``(P * m, ...)`` along dim 0 and return at once (the result, ``(m,
    ...)``, is valid after ``wait_tensor``): the functional op runs on the communicator's stream, so GPU work
    issued before the wait overlaps with it."""
    return torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", group_size(group), group.group_name)


def _check(x: torch.Tensor, shapes: Sequence[int], group: dist.ProcessGroup) -> list[int]:
    shapes = [int(s) for s in shapes]
    if len(shapes) != group_size(group) or shapes[group_rank(group)] != x.shape[0]:
        raise ValueError(f"rank {group_rank(group)} holds {x.shape[0]} tokens but the split is {shapes}")
    return shapes


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """Forward: all-gather the tokens, then ``x W_r^T + b_r``; backward: reduce-scatter ``dx`` over the tokens
    while ``dW_r`` is computed."""

    @staticmethod
    def forward(ctx, x, weight, bias, shapes, group):
        total = all_gather_uneven(x, 0, shapes, group)
        ctx.save_for_backward(total, weight)
        ctx.has_bias, ctx.shapes, ctx.group = bias is not None, shapes, group
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        total, weight = ctx.saved_tensors
        shapes, group = ctx.shapes, ctx.group
        dx = _start_reduce_scatter(stack_chunks(dy @ weight, shapes), group)
        rows = dy.reshape(-1, dy.shape[-1])
        dw = rows.t() @ total.reshape(-1, total.shape[-1])
        db = rows.sum(0) if ctx.has_bias else None
        dx = torch.ops._c10d_functional.wait_tensor(dx)[: shapes[group_rank(group)]]
        return dx, dw, db, None, None


class _SequenceParallelRowLinear(torch.autograd.Function):
    """Forward: ``x_r W_r^T`` reduce-scattered over the tokens, piece by piece (module docstring); backward:
    all-gather ``dy`` over the tokens, then ``dx_r = dy W_r`` and ``dW_r = dy^T x_r``."""

    @staticmethod
    def forward(ctx, x, weight, shapes, group, chunks):
        ctx.save_for_backward(x, weight)
        ctx.shapes, ctx.group = shapes, group
        n = shapes[group_rank(group)]
        if len(set(shapes)) > 1 or chunks == 1 or n == 0:  # the same choice on every rank
            return reduce_scatter_uneven(F.linear(x, weight), 0, shapes, group)
        blocks = x.unflatten(0, (len(shapes), n))  # (P, n, ..., in): rank q's tokens are blocks[q]
        parts, start = [], 0
        for size in filter(None, compute_split_shapes(n, chunks)):
            piece = blocks[:, start:start + size].flatten(1, -2)  # (P, size * rest, in), a strided view
            parts.append(_start_reduce_scatter(torch.matmul(piece, weight.t()).flatten(0, 1), group))
            start += size
        out = torch.cat([torch.ops._c10d_functional.wait_tensor(part) for part in parts], 0)
        return out.view(n, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = all_gather_uneven(dy.contiguous(), 0, ctx.shapes, ctx.group)
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dy @ weight, dw, None, None, None


def sequence_parallel_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                    shapes: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Enter a tensor-parallel region from token-split activations.

    ``x`` ``(shapes[r], ..., in)``: this rank's tokens (sequence-first); ``weight`` ``(out_r, in)`` and ``bias``
    ``(out_r,)``: this rank's output features. Returns ``(sum(shapes), ..., out_r)``: every token of the group,
    this rank's features.

    Raises:
        ValueError: ``shapes`` has not one entry per rank or disagrees with ``x.shape[0]``.
    """
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return _SequenceParallelColumnLinear.apply(x, weight, bias, _check(x, shapes, group), group)


def sequence_parallel_row_linear(x: torch.Tensor, weight: torch.Tensor, shapes: Sequence[int],
                                 group: dist.ProcessGroup | None, chunks: int = 4) -> torch.Tensor:
    """Leave a tensor-parallel region into token-split activations.

    ``x`` ``(sum(shapes), ..., in_r)``: every token, this rank's input features; ``weight`` ``(out, in_r)``.
    Returns ``(shapes[r], ..., out)``: this rank's tokens of the sum over ranks (no bias: add it after),
    reduce-scattered in ``chunks`` pieces of the rank's tokens (capped by its token count; one piece when the
    split is uneven).

    Raises:
        ValueError: ``shapes`` has not one entry per rank or does not sum to ``x.shape[0]``.
    """
    if group_size(group) == 1:
        return F.linear(x, weight)
    if len(shapes) != group_size(group) or sum(shapes) != x.shape[0]:
        raise ValueError(f"{x.shape[0]} tokens cannot be split as {list(shapes)} over {group_size(group)} ranks")
    return _SequenceParallelRowLinear.apply(x, weight, [int(s) for s in shapes], group, max(1, chunks))
