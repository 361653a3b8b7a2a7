"""One simulated rank's memory plan (:class:`RankPlan`): the ranks to plan (:func:`planned_ranks`,
:func:`distinct_ranks`), each in its simulated world (:func:`in_simulated_world`), and the parts of its peak from
PyTorch's memory tracker over one step (:func:`tracked_plan`)."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from distributed.launch import LaunchEnv
from distributed.parallelize import parallelize_model
from distributed.world import World, init_distributed, local_tensor, shutdown
from networks.vit import build_model
from training.monitor.activations import gradient_bytes, optimizer_state_bytes, tensor_bytes
from training.monitor.module_table import load_trackers
from training.tuner.estimates import NcclAllowance, all_tokens, analytic_shard_bytes, nccl_allowance, rank_tokens
from training.tuner.report import PARTS
from training.tuner.tune import TuneResult
from utils.config.schema import ALL_DISTINCT, Config

# the tracker's categories (their names in torch.distributed._tools) in each of the report's PARTS
_PART_OF = {"Sharded Param": "parameters", "Parameter": "parameters", "Buffer": "parameters",
            "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Gradient": "gradients",
            "OptState": "optimizer state", "Optstate": "optimizer state", "Activation": "activations",
            "Unsharded Param": "all-gather buffers", "All Gather": "all-gather buffers"}  # the rest: "other"


@dataclass
class RankPlan:
    """What the planner found for one simulated rank. Bytes throughout.

    ``parts`` splits ``tensor_peak`` (the tracker's peak of tensor storage over one step) by :data:`PARTS`;
    ``shards`` are this rank's local shards (``report.SHARDS``), counted; ``analytic`` the same from the sharding
    rule (FSDP without tensor/context parallelism, else empty). ``peak_allocated``/``peak_reserved``: the allocator's peaks of the pick's
    trial (GPU only); ``tune``: the search; ``tokens``: this rank's tokens (context parallelism splits them).
    """

    rank: int
    local_batch: int
    global_batch: int
    tokens: int
    shards: dict[str, int]
    analytic: dict[str, int]
    nccl: NcclAllowance
    parts: dict[str, int] | None = None
    tensor_peak: int | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    tune: TuneResult | None = None
    notes: list[str] = field(default_factory=list)


def with_rank(cfg: Config, rank: int) -> Config:
    """A copy of ``cfg`` simulating ``rank``."""
    cfg = copy.deepcopy(cfg)
    cfg.parallel.simulate_rank = rank
    return cfg


def planned_ranks(cfg: Config, env: LaunchEnv) -> list[int]:
    """``[simulate_rank]``, or for ``all-distinct`` the :func:`distinct_ranks`."""
    rank = cfg.parallel.simulate_rank
    return distinct_ranks(cfg, env) if rank == ALL_DISTINCT else [rank]


def in_simulated_world(cfg: Config, env: LaunchEnv, plan):
    """``plan(cfg, world)`` in the simulated world of ``cfg``, closed afterwards (also after an error)."""
    world = init_distributed(cfg.parallel, env)
    try:
        return plan(cfg, world)
    finally:
        shutdown()


def meta_model(cfg: Config, world: World) -> nn.Module:
    """The model on the meta device, parallelized as training does it (DDP excepted: it needs real tensors)."""
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.data)
    if world.ddp:
        return model
    return parallelize_model(model, cfg.parallel, cfg.precision, world, cfg.optim.grad_accum_steps)


def tracked_plan(cfg: Config, world: World, step, batches, local: int, global_batch: int) -> RankPlan:
    """Run ``step`` twice, the second under the memory tracker; the plan with its parts and shard bytes."""
    grads: list[int] = []
    hook = step.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append(gradient_bytes(opt)))
    try:
        step(batches)
        fsdp_tracker, plain_tracker = load_trackers()
        if isinstance(step.model, FSDPModule):
            tracker = fsdp_tracker(step.model, step.optimizer)
        else:
            tracker = plain_tracker()
            tracker.track_external(step.model, step.optimizer)
        with tracker:
            step(batches)
    finally:
        hook.remove()
    parts, total = _parts(tracker.get_tracker_snapshot("peak"), world.device)
    shards = {"parameters": tensor_bytes(step.model.parameters()), "gradients": grads[-1],
              "optimizer state": optimizer_state_bytes(step.optimizer)}
    return RankPlan(cfg.parallel.simulate_rank, local, global_batch, rank_tokens(cfg, world), shards,
                    analytic_shard_bytes(cfg, world), nccl_allowance(cfg, world), parts, total)


def _parts(snapshot: dict, device: torch.device) -> tuple[dict[str, int], int]:
    """The tracker's peak snapshot on ``device``'s type, summed by :data:`PARTS`, and its total."""
    parts = dict.fromkeys(PARTS, 0)
    total = 0
    for dev, categories in snapshot.items():
        if torch.device(dev).type != device.type:
            continue
        for category, nbytes in categories.items():
            name = getattr(category, "value", category)
            if name == "Total":
                total += nbytes
            else:
                parts[_PART_OF.get(name, "other")] += nbytes
    return parts, total


def distinct_ranks(cfg: Config, env: LaunchEnv) -> list[int]:
    """One rank of each group whose shards (parameter bytes, tokens) differ, the largest first.

    Shard sizes follow ``torch.chunk``'s rule along every sharded mesh dimension, so they change only where a
    chunk runs short or out (:func:`_breaks`): those coordinates of rank 0's meshes are the candidates, each
    probed on the meta device for its bytes. Rank 0 always holds the largest chunks.
    """
    first, candidates = in_simulated_world(with_rank(cfg, 0), env, _probe)
    found = {first: 0}
    for rank in sorted(candidates - {0}):
        found.setdefault(in_simulated_world(with_rank(cfg, rank), env, lambda c, w: _probe(c, w)[0]), rank)
    return [rank for _, rank in sorted(found.items(), key=lambda item: (-item[0][0], -item[0][1], item[1]))]


def _probe(cfg: Config, world: World) -> tuple[tuple[int, int], set[int]]:
    """This rank's (parameter bytes, tokens), and the ranks whose shards may differ from it."""
    model = meta_model(cfg, world)
    params = list(model.parameters())
    candidates: set[int] = set()
    by_mesh: dict[tuple, tuple] = {}
    for p in (p for p in params if isinstance(p, DTensor)):
        mesh, breaks = by_mesh.setdefault(p.device_mesh.mesh_dim_names, (p.device_mesh, {}))
        for dim, placement in enumerate(p.placements):
            if placement.is_shard():
                for length in (p.shape[placement.dim], local_tensor(p).shape[placement.dim]):
                    breaks.setdefault(dim, {0}).update(_breaks(length, mesh.size(dim)))
    for mesh, breaks in by_mesh.values():
        coordinates = [sorted(breaks.get(d, {0})) for d in range(mesh.ndim)]
        candidates.update(int(mesh.mesh[index]) for index in itertools.product(*coordinates))
    if world.cp > 1:
        candidates.update(int(world.meshes["cp"].mesh[c]) for c in {0} | _breaks(all_tokens(cfg), world.cp))
    return (tensor_bytes(params), rank_tokens(cfg, world)), candidates


def _breaks(length: int, n: int) -> set[int]:
    """Chunk indices where ``torch.chunk(length, n)``'s chunk sizes change: the first short or empty chunk, and
    the one after it."""
    if length == 0:
        return set()
    full = length // -(-length // n)
    return {c for c in (full, full + 1) if c < n}
