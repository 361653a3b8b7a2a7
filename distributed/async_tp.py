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
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed._symmetric_memory import enable_symm_mem_for_group

from distributed.layers import DistributedMatmul

__all__ = ["enable_async_tp", "use_plain_collectives"]

log = logging.getLogger(__name__)


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
    (:func:`use_plain_collectives`), symmetric memory for their TP group, and the pass for every graph compiled
    afterwards in this process (a global inductor setting). Compile ``model`` afterwards; ``announce`` logs one
    line (rank 0) when this turns the pass on, so models built after the first (the batch tuner's) say nothing.

    Raises:
        ValueError: as :func:`use_plain_collectives`.
    """
    import torch._inductor.config as inductor_config  # here: inductor takes ~1 s of CPU to import
    linears = use_plain_collectives(model)
    announce = announce and not inductor_config._micro_pipeline_tp
    inductor_config._micro_pipeline_tp = True
    for name in sorted({linear.groups.tp.group_name for linear in linears}):
        enable_symm_mem_for_group(name)
    if announce:
        log.info(f"async TP: inductor's micro-pipeline TP on symmetric memory decomposes the collectives of "
                 f"{len(linears)} sequence-parallel linears (torch {torch.__version__})")
