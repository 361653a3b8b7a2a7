"""Sequence-parallel linears: tensor parallelism whose activations between the GEMM regions are split along
the tokens (Megatron-LM's sequence parallelism, Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", section 4.2.2).

Plain tensor parallelism leaves the residual stream ``(N, B, D)`` replicated over the ``P`` ranks of the
group, so every rank repeats the LayerNorms and residual adds on all ``N`` tokens. Here rank ``r`` holds only
its chunk ``x_r`` of ``shapes[r]`` tokens (``compute_split_shapes``), and the two mappings of a GEMM region
change:

* entering (column-parallel, ``qkv`` and ``fc1``): ``y = cat_q(x_q) W_r^T + b_r``, an all-gather along the
  tokens instead of the identity. Backward: ``dx_r = chunk_r(sum_q dy_q W_q)``, a reduce-scatter instead of
  the all-reduce;
* leaving (row-parallel, ``proj`` and ``fc2``): ``y_r = chunk_r(sum_q x_q W_q^T)``, a reduce-scatter along
  the tokens instead of the all-reduce. Backward: ``dy`` all-gathered along the tokens, then the local GEMMs.

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes moved per region are unchanged.

**Layout and overlap.** Tokens are dim 0 (sequence-first ``(n, B, features)``, as Megatron-LM holds them),
so the collectives cut and join contiguous blocks. Each rank's tokens are cut into ``chunks`` pieces
(``compute_split_shapes(shapes[r], chunks)``), and every collective runs piece by piece, each piece's
collective behind the GEMM of its neighbour: forward, the all-gather of piece ``j + 1`` while piece ``j``'s
GEMM runs, and the reduce-scatter of piece ``j`` while piece ``j + 1``'s GEMM runs; backward the same with
the input-gradient GEMMs and the weight-gradient GEMM (a collective decomposed to overlap the computation it
depends on, Wang et al., ASPLOS 2023). For that, **inside a region the tokens are in piece-major order**:
piece 0 of rank 0, ..., piece 0 of rank ``P - 1``, piece 1 of rank 0, ... Attention and the MLP do not
depend on the order of the tokens (position enters only through the embedding added before the blocks), so
the region computes the same values, permuted, and the reduce-scatter of each piece returns every rank its
own tokens in its own order. A column-parallel linear and the row-parallel linear that leaves its region must
therefore be given the same ``shapes`` and ``chunks``. Uneven splits are padded for the collectives
(:func:`distributed.mappings.stack_chunks`). On CPU tensors (gloo) one collective is in flight
at a time (:func:`_in_flight`), still behind its neighbouring GEMM.

**One piece** (``chunks=1``, the path of ``--async_tp``, ``distributed/async_tp.py``): no manual
decomposition. Each linear is then one ``all_gather_into_tensor`` along the tokens and its wait feeding the
GEMM (column forward, row backward's ``dy``) or the GEMM feeding one ``reduce_scatter_tensor`` (row forward,
column backward's ``dx``), and the column bias is added after the GEMM, not inside it (``addmm``): the graph
shapes that inductor's micro-pipeline TP finds and decomposes itself, on symmetric memory
(``torch/_inductor/fx_passes/micro_pipeline_tp.py``: ``find_all_gather_patterns``,
``find_reduce_scatter_patterns``).

The column-parallel linear keeps its gathered input for the weight gradient, as the replicated input was kept
without sequence parallelism (Megatron-LM gathers it again in backward instead, to save that memory).

With one rank (``group`` None or of size 1) both are ``F.linear``. Tensors keep their dtype and device; the
input, weight and bias must share one dtype (cast them first under autocast).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed.mappings import compute_split_shapes, group_rank, group_size, stack_chunks

__all__ = ["CHUNKS", "bucket_replicated_gradients", "region_pieces", "sequence_parallel_column_linear",
           "sequence_parallel_row_linear"]

_c10d = torch.ops._c10d_functional  # functional collectives: launched at once, awaited by wait_tensor

CHUNKS = 4  # pieces per rank of the decomposed collectives (module docstring)


def region_pieces(shapes: Sequence[int], chunks: int) -> list[list[int]]:
    """The pieces of a sequence-parallel region in their order: for each piece, every rank's token count in it
    (rank ``r``'s ``shapes[r]`` tokens cut by ``compute_split_shapes(shapes[r], chunks)``; pieces empty on
    every rank are dropped). ``region_pieces([5, 4], 2) == [[3, 2], [2, 2]]``: the region holds rank 0's
    tokens 0-2, rank 1's 0-1, rank 0's 3-4, rank 1's 2-3."""
    cuts = [compute_split_shapes(s, chunks) for s in shapes]
    return [list(piece) for piece in zip(*cuts) if any(piece)]


def _start_all_gather(x: torch.Tensor, shapes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Launch the all-gather of every rank's ``x`` (``shapes[q]`` rows on rank ``q``, padded to the largest)."""
    width = max(shapes)
    if x.shape[0] == width:
        padded = x.contiguous()
    else:
        padded = x.new_zeros((width,) + x.shape[1:])
        padded[: x.shape[0]] = x
    return _c10d.all_gather_into_tensor(padded, len(shapes), group.group_name)


def _finish_all_gather(out: torch.Tensor, shapes: list[int]) -> torch.Tensor:
    """Wait for :func:`_start_all_gather` and drop the padding: ``(sum(shapes), ...)``."""
    out = _c10d.wait_tensor(out)
    width = max(shapes)
    if min(shapes) == width:
        return out
    out = out.view((len(shapes), width) + out.shape[1:])
    return torch.cat([out[q, : shapes[q]] for q in range(len(shapes))], 0)


def _start_reduce_scatter(x: torch.Tensor, shapes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Launch the sum reduce-scatter of ``x`` ``(sum(shapes), ...)``: rank ``q`` receives ``shapes[q]`` rows."""
    return _c10d.reduce_scatter_tensor(stack_chunks(x, shapes), "sum", len(shapes), group.group_name)


def _finish_reduce_scatter(out: torch.Tensor, shapes: list[int], rank: int) -> torch.Tensor:
    return _c10d.wait_tensor(out)[: shapes[rank]]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _piece_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pieces: int) -> torch.Tensor:
    """``x W^T + b``; with one piece the bias is added after the GEMM, so that the all-gather feeds a plain ``mm``
    (inductor's micro-pipeline TP does not match ``addmm``)."""
    if pieces > 1 or bias is None:
        return F.linear(x, weight, bias)
    return F.linear(x, weight) + bias


def _in_flight(x: torch.Tensor, count: int) -> int:
    """How many of a region's ``count`` collectives may be in flight at once. GPU tensors (NCCL): all of them,
    run in order on the communication stream. CPU tensors (gloo, ``distributed/world.py``): one, since gloo
    runs the queued collectives of a group on several threads at once, which corrupted the heap (issue #47:
    ``malloc(): unaligned tcache chunk detected``, SIGABRT); the next piece's collective still runs behind
    this piece's GEMM."""
    return count if x.is_cuda else 1


def _make_room(launched: list[torch.Tensor], depth: int) -> None:
    """Before another collective: wait for the one started ``depth`` collectives ago (waiting twice is a no-op)."""
    if len(launched) >= depth:
        _c10d.wait_tensor(launched[-depth])


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """Forward: all-gather the tokens piece by piece, each piece's ``x W_r^T + b_r`` while the next one is
    gathered; backward: each piece's ``dx`` reduce-scattered while the next piece's GEMMs run."""

    @staticmethod
    def forward(ctx, x, weight, bias, pieces, group):
        rank = group_rank(group)
        parts = torch.split(x.contiguous(), [piece[rank] for piece in pieces], 0)
        depth = _in_flight(x, len(pieces))
        launched = [_start_all_gather(parts[j], pieces[j], group) for j in range(depth)]
        totals, ys = [], []
        for j, piece in enumerate(pieces):
            totals.append(_finish_all_gather(launched[j], piece))
            if j + depth < len(pieces):
                launched.append(_start_all_gather(parts[j + depth], pieces[j + depth], group))
            ys.append(_piece_linear(totals[-1], weight, bias, len(pieces)))  # runs while the next pieces arrive
        ctx.save_for_backward(weight, *totals)
        ctx.has_bias, ctx.pieces, ctx.group = bias is not None, pieces, group
        return torch.cat(ys, 0)

    @staticmethod
    def backward(ctx, dy):
        weight, *totals = ctx.saved_tensors
        pieces, group = ctx.pieces, ctx.group
        dys = torch.split(dy, [sum(piece) for piece in pieces], 0)
        launched, dw, depth = [], None, _in_flight(dy, len(pieces))
        for dy_j, total, piece in zip(dys, totals, pieces):
            dx_j = dy_j @ weight
            _make_room(launched, depth)
            launched.append(_start_reduce_scatter(dx_j, piece, group))
            grad = _rows(dy_j).t() @ _rows(total)  # overlaps piece j's reduce-scatter
            dw = grad if dw is None else dw + grad
        db = _rows(dy).sum(0) if ctx.has_bias else None
        rank = group_rank(group)
        dx = torch.cat([_finish_reduce_scatter(out, piece, rank) for out, piece in zip(launched, pieces)], 0)
        return dx, dw, db, None, None


class _SequenceParallelRowLinear(torch.autograd.Function):
    """Forward: each piece's ``x_r W_r^T`` reduce-scattered while the next piece's GEMM runs; backward: each
    piece of ``dy`` all-gathered while the previous piece's GEMMs run."""

    @staticmethod
    def forward(ctx, x, weight, pieces, group):
        ctx.save_for_backward(x, weight)
        ctx.pieces, ctx.group = pieces, group
        xs = torch.split(x, [sum(piece) for piece in pieces], 0)
        launched, depth = [], _in_flight(x, len(pieces))
        for x_j, piece in zip(xs, pieces):
            y_j = F.linear(x_j, weight)  # runs while the previous piece is reduce-scattered
            _make_room(launched, depth)
            launched.append(_start_reduce_scatter(y_j, piece, group))
        rank = group_rank(group)
        return torch.cat([_finish_reduce_scatter(out, piece, rank) for out, piece in zip(launched, pieces)], 0)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        pieces, group = ctx.pieces, ctx.group
        rank = group_rank(group)
        parts = torch.split(dy.contiguous(), [piece[rank] for piece in pieces], 0)
        depth = _in_flight(dy, len(pieces))
        launched = [_start_all_gather(parts[j], pieces[j], group) for j in range(depth)]
        xs = torch.split(x, [sum(piece) for piece in pieces], 0)
        dxs, dw = [], None
        for j, (x_j, piece) in enumerate(zip(xs, pieces)):
            dy_j = _finish_all_gather(launched[j], piece)
            if j + depth < len(pieces):
                launched.append(_start_all_gather(parts[j + depth], pieces[j + depth], group))
            dxs.append(dy_j @ weight)
            grad = _rows(dy_j).t() @ _rows(x_j)
            dw = grad if dw is None else dw + grad
        return torch.cat(dxs, 0), dw, None, None


def _pieces(n: int, shapes: Sequence[int], group: dist.ProcessGroup, chunks: int, what: str) -> list[list[int]]:
    shapes = [int(s) for s in shapes]
    if len(shapes) != group_size(group) or n != (shapes[group_rank(group)] if what == "local" else sum(shapes)):
        raise ValueError(f"{n} {what} tokens on rank {group_rank(group)} disagree with the split {shapes}")
    return region_pieces(shapes, max(1, chunks))


def sequence_parallel_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                    shapes: Sequence[int], group: dist.ProcessGroup | None,
                                    chunks: int = CHUNKS) -> torch.Tensor:
    """Enter a tensor-parallel region from token-split activations.

    ``x`` ``(shapes[r], ..., in)``: this rank's tokens (sequence-first); ``weight`` ``(out_r, in)`` and ``bias``
    ``(out_r,)``: this rank's output features. Returns ``(sum(shapes), ..., out_r)``: every token of the group
    in the region's piece-major order (module docstring), this rank's features.

    Raises:
        ValueError: ``shapes`` has not one entry per rank or disagrees with ``x.shape[0]``.
    """
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    pieces = _pieces(x.shape[0], shapes, group, chunks, "local")
    return _SequenceParallelColumnLinear.apply(x, weight, bias, pieces, group)


def sequence_parallel_row_linear(x: torch.Tensor, weight: torch.Tensor, shapes: Sequence[int],
                                 group: dist.ProcessGroup | None, chunks: int = CHUNKS) -> torch.Tensor:
    """Leave a tensor-parallel region into token-split activations.

    ``x`` ``(sum(shapes), ..., in_r)``: every token in the region's piece-major order, this rank's input
    features; ``weight`` ``(out, in_r)``. Returns ``(shapes[r], ..., out)``: this rank's tokens, in order, of
    the sum over ranks (no bias: add it after).

    Raises:
        ValueError: ``shapes`` has not one entry per rank or does not sum to ``x.shape[0]``.
    """
    if group_size(group) == 1:
        return F.linear(x, weight)
    return _SequenceParallelRowLinear.apply(x, weight, _pieces(x.shape[0], shapes, group, chunks, "region"), group)


def bucket_replicated_gradients() -> None:
    """Have inductor merge the gradient all-reduces that sequence parallelism adds (``--sp_grad_bucketing``).

    Under sequence parallelism each TP rank applies the replicated parameters (LayerNorm weights and biases, the
    row-parallel biases, the patch and position embeddings, the head) to its own tokens only, so backward sums
    each one's gradient over TP: a separate small all-reduce per tensor (``replicated_param`` in
    ``distributed/layers.py``; 6 per block), each paying a collective's latency. With
    ``torch._inductor.config.bucket_all_reduces_fx`` inductor's post-grad pass
    (``torch/_inductor/fx_passes/bucketing.py``) concatenates the all-reduces of a compiled graph into buckets
    of up to 2000 MB, its default (so one per graph: the whole model, or each block when FSDP compiles blocks),
    each issued once its last gradient is ready, then splits the sums back. A global inductor setting: it
    applies to every graph compiled afterwards in this process. Sequence parallelism's forward has no
    all-reduce, so only these gradients are bucketed; ``utils/config/validate.py`` refuses the setting
    without sequence parallelism or compile."""
    import torch._inductor.config as inductor_config  # here: inductor takes ~1 s of CPU to import
    inductor_config.bucket_all_reduces_fx = "all"
