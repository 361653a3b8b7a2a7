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
  tokens instead of the all-reduce. Backward: ``dy`` all-gathered along the tokens, then the local GEMMs.

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes moved per region are unchanged.

Layout: the tokens are dim 0 (sequence-first ``(n, B, features)``, as Megatron-LM holds them), so the
collectives cut and join contiguous blocks and need no copy for even splits; uneven splits are padded
(:func:`distributed.mappings.all_gather_uneven`). The row-parallel reduce-scatter is not chunked to overlap
its GEMM as :func:`distributed.mappings.row_parallel_linear`'s all-reduce is: chunks along the tokens would
give each rank a scattered set of tokens, and chunks along the batch (dim 1) are strided slices that the GEMM
would first copy.

With one rank (``group`` None or of size 1) both are ``F.linear``. Tensors keep their dtype and device; the
input, weight and bias must share one dtype (cast them first under autocast).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed.mappings import all_gather_uneven, group_rank, group_size, reduce_scatter_uneven, stack_chunks

__all__ = ["sequence_parallel_column_linear", "sequence_parallel_row_linear"]


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
        dx = torch.ops._c10d_functional.reduce_scatter_tensor(stack_chunks(dy @ weight, shapes), "sum",
                                                              len(shapes), group.group_name)
        rows = dy.reshape(-1, dy.shape[-1])
        dw = rows.t() @ total.reshape(-1, total.shape[-1])
        db = rows.sum(0) if ctx.has_bias else None
        dx = torch.ops._c10d_functional.wait_tensor(dx)[: shapes[group_rank(group)]]
        return dx, dw, db, None, None


class _SequenceParallelRowLinear(torch.autograd.Function):
    """Forward: ``x_r W_r^T`` reduce-scattered over the tokens; backward: all-gather ``dy`` over the tokens,
    then ``dx_r = dy W_r`` and ``dW_r = dy^T x_r``."""

    @staticmethod
    def forward(ctx, x, weight, shapes, group):
        ctx.save_for_backward(x, weight)
        ctx.shapes, ctx.group = shapes, group
        return reduce_scatter_uneven(F.linear(x, weight), 0, shapes, group)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = all_gather_uneven(dy.contiguous(), 0, ctx.shapes, ctx.group)
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dy @ weight, dw, None, None


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
                                 group: dist.ProcessGroup | None) -> torch.Tensor:
    """Leave a tensor-parallel region into token-split activations.

    ``x`` ``(sum(shapes), ..., in_r)``: every token, this rank's input features; ``weight`` ``(out, in_r)``.
    Returns ``(shapes[r], ..., out)``: this rank's tokens of the sum over ranks (no bias: add it after).

    Raises:
        ValueError: ``shapes`` has not one entry per rank or does not sum to ``x.shape[0]``.
    """
    if group_size(group) == 1:
        return F.linear(x, weight)
    if len(shapes) != group_size(group) or sum(shapes) != x.shape[0]:
        raise ValueError(f"{x.shape[0]} tokens cannot be split as {list(shapes)} over {group_size(group)} ranks")
    return _SequenceParallelRowLinear.apply(x, weight, [int(s) for s in shapes], group)
