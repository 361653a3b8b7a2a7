"""Asynchronous tensor parallelism (``--async_tp``): torch's micro-pipeline TP on our sequence-parallel linears.

Under sequence parallelism (``distributed/sequence_parallel.py``) every column-parallel linear all-gathers the
tokens before its GEMM and every row-parallel linear reduce-scatters them after it. Our linears hide those
collectives by cutting the tokens into ``CHUNKS`` pieces by hand. Inductor can do the same decomposition
itself (Wang et al., ASPLOS 2023, "Overlap Communication with Dependent Computation via Decomposition in Large
Deep Learning Models"; torch's "async TP", as torchtitan enables it): with
``torch._inductor.config._micro_pipeline_tp`` its post-grad pass finds an ``all_gather_into_tensor`` + wait
feeding an ``mm``, and an ``mm`` feeding one ``reduce_scatter_tensor`` (both along dim 0), and replaces each
pair by ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``: the peers' shards are
read over NVLink from symmetric memory (``torch.distributed._symmetric_memory``) one at a time, each behind the
GEMM of the previous one, with copy engines rather than NCCL kernels competing for the SMs.

The pass only fires on the plain, undecomposed pattern, so :func:`enable_async_tp` sets every sequence-parallel
linear to one piece (``seq_chunks = 1``: no manual decomposition, the column bias added after the GEMM). It
needs the tokens split evenly over TP (no padding between the collective and the GEMM), a compiled model, NCCL
and CUDA: ``utils/config/validate.py`` refuses other combinations before anything is built. Without the pass
(eager, on CPU) the one-piece linears compute the same values, with their collectives exposed.

:func:`enable_async_tp` also registers our CUDA kernel of ``symm_mem::fused_matmul_reduce_scatter``
(:func:`_fused_matmul_reduce_scatter`) for the rest of the process. Torch's kernel (2.11 to 2.13) ends by summing
the ranks' partial products with ``torch.sum``, a reduction kernel that moves 1.4-1.6 TB/s on an H200 at ``mp``'s
shard. At tp 2 ours adds the two halves with one elementwise kernel instead: 2.6x as fast where they lie one after
the other, as the tokens of our sequence-parallel linears do, and 1.5x over a transposed view (``docs/speed.md``,
round 5ab). It leaves every other case to torch's kernel. The GEMMs and the peer-to-peer exchange stay torch's
own (``_pipelined_produce_and_all2all``), and the sum is the same to the bit.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed._symmetric_memory as symm_mem
import torch.distributed.distributed_c10d as c10d
from torch import nn

from distributed.layers import DistributedMatmul

__all__ = ["enable_async_tp", "sum_two_partials", "use_plain_collectives"]

log = logging.getLogger(__name__)

# torch's CUDA kernel of the fused reduce-scatter, which ours calls for every case it does not take itself
_TORCH_KERNEL = getattr(symm_mem, "_fused_matmul_reduce_scatter", None)
# the private pieces of torch's that ours calls: present from torch 2.11 to 2.13 at least
_PIECES = ((symm_mem, "_fused_matmul_reduce_scatter"), (symm_mem, "_pipelined_produce_and_all2all"),
           (symm_mem, "_is_test_mode"), (c10d, "_get_group_size_by_name"))
_registration: torch.library.Library | None = None  # ours stays registered while this lives


def sum_two_partials(stacked: torch.Tensor, shard_shape: tuple[int, ...], scatter_dim: int) -> torch.Tensor:
    """The last step of a matmul + reduce-scatter over 2 ranks: the sum of both ranks' partial products of this
    rank's shard.

    Args:
        stacked: ``(2 * prod(shard_shape), N)``, the two partials one after the other (in either order: the sum
            is exact in any), each's rows in the order of ``A.movedim(scatter_dim, 0)``.
        shard_shape: that order's leading dims for one shard: ``A.movedim(scatter_dim, 0).shape[:-1]`` with the
            first halved.
        scatter_dim: the dim of ``A`` scattered, not its last.

    Returns:
        ``A.shape[:-1]`` with ``scatter_dim`` halved, then ``N``; ``stacked``'s dtype, contiguous, as torch's
        ``reduce_scatter_tensor(A @ B)`` returns it. Bitwise torch's ``torch.sum`` of the two (one rounding).
    """
    halves = stacked.view(2, *shard_shape, stacked.shape[-1]).movedim(1, scatter_dim + 1)
    # into a contiguous output: a + b would keep the halves' strides, transposed where scatter_dim > 0
    return torch.add(halves[0], halves[1], out=halves[0].new_empty(halves[0].shape))


def _fused_matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                                 group_name: str) -> torch.Tensor:
    """``symm_mem::fused_matmul_reduce_scatter`` on CUDA: ``reduce_scatter_tensor(A @ B, reduce_op, scatter_dim)``
    with the GEMMs of the peers' shards behind the exchange (torch's), summed by :func:`sum_two_partials` at 2
    ranks; torch's kernel for more ranks, ``avg``, the last dim or torch's test mode."""
    ours = (reduce_op == "sum" and scatter_dim < A.ndim - 1 and not symm_mem._is_test_mode
            and c10d._get_group_size_by_name(group_name) == 2)
    if not ours:
        return _TORCH_KERNEL(A, B, reduce_op, scatter_dim, group_name)
    with torch.profiler.record_function("fused_matmul_reduce_scatter"):
        rows = A.movedim(scatter_dim, 0)
        shards = rows.flatten(0, -2).chunk(2)
        stacked = rows.new_empty(rows.shape[:-1].numel(), B.shape[1])
        symm_mem._pipelined_produce_and_all2all(lambda rank, out: torch.mm(shards[rank], B, out=out), stacked,
                                               group_name)
        return sum_two_partials(stacked, (rows.shape[0] // 2, *rows.shape[1:-1]), scatter_dim)


def _register_two_rank_sum() -> bool:
    """Register :func:`_fused_matmul_reduce_scatter` over torch's CUDA kernel, once per process; False (and
    torch's kernel kept) where this torch lacks the pieces it calls."""
    global _registration
    if _registration is None and all(hasattr(module, name) for module, name in _PIECES):
        _registration = torch.library.Library("symm_mem", "IMPL")
        with warnings.catch_warnings():  # replacing torch's kernel is the point
            warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
            _registration.impl("fused_matmul_reduce_scatter", _fused_matmul_reduce_scatter, "CUDA",
                                allow_override=True)
    return _registration is not None


def use_plain_collectives(model: nn.Module) -> list[DistributedMatmul]:
    """Set every sequence-parallel linear of ``model`` (a model converted by
    ``apply_tensor_context_parallel(..., sequence_parallel=True)`` at ``tp > 1``) to one piece (``seq_chunks =
    1``); returns those linears. The same values as the chunked path, any dtype or device.

    Raises:
        ValueError: ``model`` has no sequence-parallel linear, or one whose tokens split unevenly over TP (the
            padding would sit between the collective and its GEMM); nothing is changed then.
    """
    linears = [m for m in model.modules() if isinstance(m, DistributedMatmul) and m.groups.sequence_parallel]
    if not linears:
        raise ValueError("async TP decomposes the collectives of sequence parallelism, but the model has no "
                         "sequence-parallel linear; convert it with sequence_parallel=True at tp > 1")
    uneven = next((m.seq_shapes for m in linears if len(set(m.seq_shapes)) > 1), None)
    if uneven is not None:
        raise ValueError(f"async TP needs the tokens split evenly over TP, but they split as {uneven}; pick a "
                         "token count divisible by tp (per context-parallel rank) or leave async TP off")
    for linear in linears:
        linear.seq_chunks = 1
    return linears


def enable_async_tp(model: nn.Module, announce: bool = False) -> None:
    """Turn on inductor's micro-pipeline TP for ``model``'s sequence-parallel linears: one-piece collectives
    (:func:`use_plain_collectives`), symmetric memory for their TP group, the pass for every graph compiled
    afterwards in this process (a global inductor setting) and our kernel of the fused reduce-scatter (module
    docstring). Compile ``model`` afterwards; ``announce`` logs one line (rank 0) when this turns the pass on, so
    models built after the first (the batch tuner's) say nothing.

    Raises:
        ValueError: as :func:`use_plain_collectives`.
    """
    import torch._inductor.config as inductor_config  # here: inductor takes ~1 s of CPU to import
    linears = use_plain_collectives(model)
    announce = announce and not inductor_config._micro_pipeline_tp
    inductor_config._micro_pipeline_tp = True
    for name in sorted({linear.groups.tp.group_name for linear in linears}):
        symm_mem.enable_symm_mem_for_group(name)
    summed = _register_two_rank_sum()
    if announce:
        log.info(f"async TP: inductor's micro-pipeline TP on symmetric memory decomposes the collectives of "
                 f"{len(linears)} sequence-parallel linears (torch {torch.__version__}; at tp 2 its fused "
                 f"reduce-scatter sums {'with our kernel' if summed else 'as torch does: ours needs pieces it lacks'})")
