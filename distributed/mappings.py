"""Differentiable communication primitives for tensor (TP) and context (CP) parallelism.

Each mapping is a ``torch.autograd.Function`` whose backward is the adjoint of its
forward, so a model written with them differentiates exactly like its single-process
twin (Megatron-LM's "f/g" conjugate operators, Shoeybi et al. 2019, extended to uneven
splits along any dimension).

Notation for a group of ``P`` ranks, rank ``r`` holding ``x_r``:

=====================================================  ==================================  ==================================
functional wrapper                                     forward                             backward (given ``dy``)
=====================================================  ==================================  ==================================
``copy_to_parallel_region(x, g)``                      ``y_r = x``                         ``dx = sum_r dy_r``
``reduce_from_parallel_region(x, g)``                  ``y = sum_r x_r``                   ``dx_r = dy``
``scatter_to_parallel_region(x, dim, g)``              ``y_r = chunk_r(x)``                ``dx = cat_r(dy_r)``
``gather_from_parallel_region(x, dim, shapes, g)``     ``y = cat_r(x_r)``                  ``dx_r = chunk_r(dy)``
``gather_from_sequence_parallel_region(...)``          ``y = cat_r(x_r)``                  ``dx_r = chunk_r(sum_q dy_q)``
``reduce_scatter_to_sequence_parallel_region(...)``    ``y_r = chunk_r(sum_q x_q)``        ``dx = cat_r(dy_r)``
``sequence_parallel_column_linear(x, W_r, b_r, ...)``  ``y_r = cat_q(x_q) W_r^T + b_r``    ``dx_r = chunk_r(sum_q dy_q W_q)``
``sequence_parallel_row_linear(x, W_r, ...)``          ``y_r = chunk_r(sum_q x_q W_q^T)``  ``dx_r = cat_q(dy_q) W_r``
=====================================================  ==================================  ==================================

The last two (``distributed/sequence_parallel.py``) are Megatron-LM's sequence parallelism (Korthikanti et
al. 2022): between the tensor-parallel GEMM regions each rank holds a chunk of the tokens, so the all-reduce
of the row-parallel output becomes a reduce-scatter along the tokens and the column-parallel input is
all-gathered along them (the same bytes as the all-reduce, split in two halves); the token-wise work between
the regions (LayerNorms, residual adds) then runs on ``1/P`` of the tokens. Their collectives run in pieces
behind the GEMMs, which orders the tokens inside a region piece-major (that module's docstring).

Two fused linears overlap their all-reduce with a GEMM: ``column_parallel_linear`` (``y_r = x W_r^T + b_r``
after ``copy_to_parallel_region``) all-reduces ``dx`` in backward while ``dW_r``'s GEMM runs (as Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication`` does), and ``row_parallel_linear`` (``y = sum_r x_r W_r^T``)
all-reduces each chunk of rows while the next chunk's GEMM runs (a collective decomposed to overlap the
computation it depends on, Wang et al., ASPLOS 2023). Both launch functional collectives and wait where the code says, so the overlap holds eagerly and in a
compiled graph alike.

``chunk_r`` and ``cat_r`` use :func:`compute_split_shapes` (``torch.chunk``'s rule, as DTensor's ``Shard``)
unless explicit ``shapes`` are given. The two "gather" mappings differ only in
their backward: ``gather_from_parallel_region`` assumes the consumer of ``y`` is
replicated (every rank holds the same ``dy``), while the sequence-parallel variant assumes
each rank's consumer differs (e.g. rank ``q``'s queries attending to all keys), so the
partial gradients must be summed.

Groups: ``None`` or a group of one rank means "not parallel" and every mapping is then
the identity (no communication, no ``torch.distributed`` call), so the same code runs on
one process. Collectives use padded equal-size buffers, so uneven splits work on gloo
(CPU) and NCCL alike. All tensors keep their dtype and device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

__all__ = [
    "compute_split_shapes",
    "group_size",
    "group_rank",
    "copy_to_parallel_region",
    "reduce_from_parallel_region",
    "scatter_to_parallel_region",
    "gather_from_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "column_parallel_linear",
    "row_parallel_linear",
    "all_gather_uneven",
    "reduce_scatter_uneven",
    "stack_chunks",
    "split_along_dim",
]

# Eager mode uses the in-place c10d collectives; under torch.compile the functional collectives are
# used instead, because Dynamo's rewrite of in-place c10d calls inside autograd.Functions gave wrong
# results with NCCL + inductor (PyTorch 2.11, pytorch/pytorch#174280) while the functional ones trace
# cleanly into one graph.
# torch >= 2.13 renamed the single-tensor collectives; keep older releases working.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------- helpers


def compute_split_shapes(size: int, num_chunks: int) -> list[int]:
    """Sizes of ``num_chunks`` chunks of ``size`` elements as ``torch.chunk`` cuts them, which is also how a
    DTensor ``Shard`` placement splits a dimension: ``ceil(size / num_chunks)`` each, the last ones smaller or
    empty.

    ``compute_split_shapes(4050, 4) == [1013, 1013, 1013, 1011]``; ``compute_split_shapes(5, 4) == [2, 2, 1, 0]``.
    Every split of tokens (context parallel) and of heads and features (tensor parallel, whose parameters are
    DTensors) follows this rule, so a rank can compute any peer's chunk without communication.

    Raises:
        ValueError: if ``num_chunks < 1`` or ``size < 0``.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    chunk = -(-size // num_chunks)
    return [max(0, min(chunk, size - r * chunk)) for r in range(num_chunks)]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group``; ``None`` counts as one rank (not parallel)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; ``0`` when ``group`` is ``None``."""
    return 0 if group is None else dist.get_rank(group)


def _check_shapes(shapes: Sequence[int], group: dist.ProcessGroup | None) -> list[int]:
    shapes = [int(s) for s in shapes]
    if len(shapes) != group_size(group):
        raise ValueError(f"shapes has {len(shapes)} entries but the group has {group_size(group)} ranks")
    if any(s < 0 for s in shapes):
        raise ValueError(f"shapes must be non-negative, got {shapes}")
    return shapes


def split_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
                    shapes: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication, not differentiable-aware).

    ``shapes`` defaults to ``compute_split_shapes(x.shape[dim], P)``. Returns a contiguous copy
    so that later in-place collectives never alias ``x``.

    Raises:
        ValueError: if ``shapes`` does not sum to ``x.shape[dim]`` or has the wrong length.
    """
    n = group_size(group)
    shapes = compute_split_shapes(x.shape[dim], n) if shapes is None else _check_shapes(shapes, group)
    if sum(shapes) != x.shape[dim]:
        raise ValueError(f"shapes {shapes} do not sum to the size {x.shape[dim]} of dim {dim}")
    rank = group_rank(group)
    return x.narrow(dim, sum(shapes[:rank]), shapes[rank]).contiguous()


def all_gather_uneven(x: torch.Tensor, dim: int, shapes: Sequence[int] | None,
                      group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; rank ``r`` contributes ``shapes[r]`` rows.

    ``shapes=None`` means every rank holds ``x.shape[dim]`` rows. Each rank's tensor is
    padded to ``max(shapes)`` so a single equal-size all-gather works on every backend.
    Not differentiable by itself (see the mapping wrappers).

    Raises:
        ValueError: if ``shapes`` has the wrong length or ``shapes[rank] != x.shape[dim]``.
    """
    n = group_size(group)
    if n == 1:
        return x
    shapes = [x.shape[dim]] * n if shapes is None else _check_shapes(shapes, group)
    if shapes[group_rank(group)] != x.shape[dim]:
        raise ValueError(f"rank {group_rank(group)} holds {x.shape[dim]} rows along dim {dim}, "
                         f"but shapes says {shapes[group_rank(group)]}")
    xm = x.movedim(dim, 0)
    width = max(shapes)
    even = min(shapes) == width
    if even:  # no padding needed: gather straight into the concatenated layout
        padded = xm.contiguous()
    else:
        padded = xm.new_zeros((width,) + xm.shape[1:])
        padded[: xm.shape[0]] = xm
    if _compiling():
        out = funcol.all_gather_tensor(padded, 0, group)
    else:
        out = xm.new_empty((n * width,) + xm.shape[1:])
        _ALL_GATHER_SINGLE(out, padded, group=group)
    if even:
        return out.movedim(0, dim)
    out = out.view((n, width) + xm.shape[1:])
    return torch.cat([out[r, : shapes[r]] for r in range(n)], 0).movedim(0, dim)


def reduce_scatter_uneven(x: torch.Tensor, dim: int, shapes: Sequence[int] | None,
                          group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``.

    Every rank passes a tensor of the same full shape; ``shapes`` (default
    :func:`compute_split_shapes`) says how ``dim`` is split. Chunks are padded to
    ``max(shapes)`` and reduced by one equal-size reduce-scatter. Not differentiable by itself.

    Raises:
        ValueError: if ``shapes`` has the wrong length or does not sum to ``x.shape[dim]``.
    """
    n = group_size(group)
    if n == 1:
        return x
    shapes = compute_split_shapes(x.shape[dim], n) if shapes is None else _check_shapes(shapes, group)
    if sum(shapes) != x.shape[dim]:
        raise ValueError(f"shapes {shapes} do not sum to the size {x.shape[dim]} of dim {dim}")
    xm = x.movedim(dim, 0)
    width = max(shapes)
    stacked = stack_chunks(xm, shapes)
    if _compiling():
        out = funcol.reduce_scatter_tensor(stacked, "sum", 0, group)
    else:
        out = xm.new_empty((width,) + xm.shape[1:])
        _REDUCE_SCATTER_SINGLE(out, stacked, group=group)
    return out[: shapes[group_rank(group)]].movedim(0, dim)


def stack_chunks(x: torch.Tensor, shapes: Sequence[int]) -> torch.Tensor:
    """``x`` ``(sum(shapes), ...)`` as ``len(shapes)`` chunks along dim 0, each zero-padded to ``max(shapes)``
    rows: the ``(P * max(shapes), ...)`` input of an equal-size reduce-scatter (``x`` itself, made contiguous,
    when the chunks are equal)."""
    width = max(shapes)
    if min(shapes) == width:  # already the concatenation of equal chunks
        return x.contiguous()
    stacked = x.new_zeros((len(shapes), width) + x.shape[1:])
    for r, chunk in enumerate(torch.split(x, list(shapes), 0)):
        stacked[r, : shapes[r]] = chunk
    return stacked.view((len(shapes) * width,) + x.shape[1:])


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if _compiling():
        return funcol.all_reduce(x.contiguous(), "sum", group)
    # Out of place: the input may be saved by autograd or be a gradient buffer shared elsewhere.
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _start_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Launch a sum all-reduce of ``x`` and return at once; :func:`_wait` gives the result. The functional op
    runs on the communicator's stream, so GPU work issued before the wait overlaps with it."""
    return torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(x)


def _norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} out of range for a {ndim}-d tensor")
    return dim % ndim


# ----------------------------------------------------------------------------- autograd functions


class _CopyToParallelRegion(torch.autograd.Function):
    """Forward identity; backward all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.group), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    """Forward all-reduce (sum); backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterToParallelRegion(torch.autograd.Function):
    """Forward: keep own chunk along ``dim``; backward: all-gather the chunks' gradients."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        ctx.shapes = compute_split_shapes(x.shape[dim], group_size(group))
        return split_along_dim(x, dim, group, ctx.shapes)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_uneven(dy.contiguous(), ctx.dim, ctx.shapes, ctx.group), None, None


class _GatherFromParallelRegion(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: keep own chunk of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, dim, shapes, group):
        shapes = [x.shape[dim]] * group_size(group) if shapes is None else _check_shapes(shapes, group)
        ctx.dim, ctx.shapes, ctx.group = dim, shapes, group
        return all_gather_uneven(x, dim, shapes, group)

    @staticmethod
    def backward(ctx, dy):
        return split_along_dim(dy, ctx.dim, ctx.group, ctx.shapes), None, None, None


class _GatherFromSequenceParallelRegion(_GatherFromParallelRegion):
    """Forward: all-gather along ``dim``; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter_uneven(dy, ctx.dim, ctx.shapes, ctx.group), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along ``dim``; backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, shapes, group):
        shapes = compute_split_shapes(x.shape[dim], group_size(group)) if shapes is None \
            else _check_shapes(shapes, group)
        ctx.dim, ctx.shapes, ctx.group = dim, shapes, group
        return reduce_scatter_uneven(x, dim, shapes, group)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_uneven(dy.contiguous(), ctx.dim, ctx.shapes, ctx.group), None, None, None


class _ColumnParallelLinear(torch.autograd.Function):
    """Forward ``x W_r^T + b_r`` (no communication); backward all-reduces ``dx`` while ``dW_r`` is computed."""

    @staticmethod
    def forward(ctx, x, weight, bias, group_name):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.group_name = bias is not None, group_name
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = _start_all_reduce(dy @ weight, ctx.group_name)
        rows = dy.reshape(-1, dy.shape[-1])
        dw = rows.t() @ x.reshape(-1, x.shape[-1])
        db = rows.sum(0) if ctx.has_bias else None
        return _wait(dx), dw, db, None


class _RowParallelLinear(torch.autograd.Function):
    """Forward ``sum_r x_r W_r^T`` chunk by chunk of rows, each chunk's all-reduce overlapping the next chunk's
    GEMM; backward local (``dx_r = dy W_r``, ``dW_r = dy^T x_r``)."""

    @staticmethod
    def forward(ctx, x, weight, group_name, chunks):
        ctx.save_for_backward(x, weight)
        parts = []
        for part in x.chunk(chunks, 0):
            y = F.linear(part, weight)
            if parts and not x.is_cuda:  # gloo: one collective in flight (sequence_parallel._in_flight says why)
                _wait(parts[-1])
            parts.append(_start_all_reduce(y, group_name))
        return torch.cat([_wait(part) for part in parts], 0)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dy @ weight, dw, None, None


# ----------------------------------------------------------------------------- functional API


def copy_to_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Enter a parallel region with a replicated input (Megatron's ``f``).

    Forward ``y_r = x`` (any shape/dtype, returned as is); backward ``dx = sum_r dy_r``
    (all-reduce), because every rank's branch of the computation used the same ``x``.
    Identity when ``group`` is ``None`` or has one rank.
    """
    if group_size(group) == 1:
        return x
    return _CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Leave a parallel region by summing partial results (Megatron's ``g``).

    Forward ``y = sum_r x_r`` (all-reduce, same shape as ``x``); backward ``dx_r = dy``
    (the replicated consumer's gradient flows unchanged to every partial sum).
    Identity when ``group`` is ``None`` or has one rank.
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromParallelRegion.apply(x, group)


def scatter_to_parallel_region(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Split a replicated tensor and keep this rank's chunk along ``dim``.

    Forward: ``x`` of size ``S`` along ``dim`` -> ``y_r`` of size
    ``compute_split_shapes(S, P)[r]`` (uneven allowed). Backward: ``dx = cat_r(dy_r)``
    (all-gather), so the replicated ``x`` receives every chunk's gradient on every rank.
    Identity when ``group`` is ``None`` or has one rank.

    Raises:
        IndexError: if ``dim`` is out of range.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToParallelRegion.apply(x, _norm_dim(dim, x.dim()), group)


def gather_from_parallel_region(x: torch.Tensor, dim: int, shapes: Sequence[int] | None,
                                group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` into a replicated tensor.

    Forward: ``y = cat_r(x_r)`` with rank ``r`` holding ``shapes[r]`` rows (``None``: all
    equal to the local size). Backward: ``dx_r = chunk_r(dy)`` (no communication), valid
    because the consumer of ``y`` is replicated, so ``dy`` is the same on every rank.
    Identity when ``group`` is ``None`` or has one rank.

    Raises:
        ValueError: if ``shapes`` has the wrong length or disagrees with the local size.
        IndexError: if ``dim`` is out of range.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromParallelRegion.apply(x, _norm_dim(dim, x.dim()), shapes, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, dim: int, shapes: Sequence[int] | None,
                                         group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather along ``dim`` for a consumer that differs per rank (e.g. K/V in context parallel).

    Forward: ``y = cat_r(x_r)`` as in :func:`gather_from_parallel_region`. Backward:
    ``dx_r = chunk_r(sum_q dy_q)`` (reduce-scatter), because each rank's ``y`` fed a
    different computation (its own queries) and all of them depend on ``x_r``.
    Identity when ``group`` is ``None`` or has one rank.

    Raises:
        ValueError: if ``shapes`` has the wrong length or disagrees with the local size.
        IndexError: if ``dim`` is out of range.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, _norm_dim(dim, x.dim()), shapes, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, dim: int, shapes: Sequence[int] | None,
                                               group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum partial full-size tensors over the group and keep this rank's chunk along ``dim``.

    Forward: ``y_r = chunk_r(sum_q x_q)`` with chunk sizes ``shapes`` (default
    :func:`compute_split_shapes`). Backward: ``dx = cat_r(dy_r)`` (all-gather), the
    adjoint of a sum followed by a split. Identity when ``group`` is ``None`` or has one rank.

    Raises:
        ValueError: if ``shapes`` has the wrong length or does not sum to ``x.shape[dim]``.
        IndexError: if ``dim`` is out of range.
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, _norm_dim(dim, x.dim()), shapes, group)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: dist.ProcessGroup | None) -> torch.Tensor:
    """``F.linear(copy_to_parallel_region(x, group), weight, bias)`` with the backward all-reduce of ``dx``
    overlapped with the GEMM of ``dW`` (Megatron-LM's asynchronous input-gradient all-reduce).

    ``x`` ``(..., in)`` replicated over ``group``; ``weight`` ``(out_r, in)`` and ``bias`` ``(out_r,)`` this
    rank's rows; returns ``(..., out_r)``. All three must share one dtype (cast them first under autocast:
    the all-reduce then runs in that dtype). Plain ``F.linear`` when ``group`` is ``None`` or has one rank.
    """
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return _ColumnParallelLinear.apply(x, weight, bias, group.group_name)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None,
                        chunks: int = 4) -> torch.Tensor:
    """``reduce_from_parallel_region(F.linear(x, weight), group)`` computed in ``chunks`` pieces along dim 0,
    each piece's all-reduce running while the next piece's GEMM does.

    ``x`` ``(B, ..., in_r)`` this rank's input features, ``weight`` ``(out, in_r)`` of one dtype; returns the
    summed ``(B, ..., out)`` on every rank (no bias: add it once, after). ``chunks`` is capped by ``B``
    (``torch.chunk``). Plain ``F.linear`` when ``group`` is ``None`` or has one rank.
    """
    if group_size(group) == 1:
        return F.linear(x, weight)
    return _RowParallelLinear.apply(x, weight, group.group_name, chunks)
