"""Ensemble parallelism: the M members of each sample spread over the ``ens`` ranks of an ensemble group.

The ranks of an ensemble group read the same samples (they share a data-parallel index) and each forecasts
``M / ens`` of the members, with the noise of those members (``utils/data/noise.py``), so together they hold the
ensemble a single process would. The CRPS compares every member with every other, so before the loss the members
are all-gathered inside the group; every rank then computes the same loss from the same tensor (a replicated
consumer), and the backward of the gather hands each rank the gradient of its own members
(``gather_from_parallel_region`` of ``distributed/mappings.py``: ``y = cat_r(x_r)``, ``dx_r = chunk_r(dy)``).
Each rank's parameter gradient is then its members' part of the sum; data parallelism averages over
``dp x ens`` ranks, so the step multiplies the loss's gradient by ``ens``
(``distributed/parallelize.gradient_factor``), as it does by ``cp`` for context parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distributed.mappings import gather_from_parallel_region, group_rank, group_size


def gather_members(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's members ``(B, m, ...)`` -> the group's ``(B, m * ens, ...)``, rank r's members at
    ``[r m, (r + 1) m)``; differentiable (each rank gets back the gradient of its own members). Identity without a
    group (one rank holds every member)."""
    return gather_from_parallel_region(local, 1, None, group)


def local_members(members: int, group: dist.ProcessGroup | None) -> range:
    """The member numbers this rank forecasts: its ``members / ens`` consecutive ones (all without a group)."""
    share = members // group_size(group)
    first = group_rank(group) * share
    return range(first, first + share)
