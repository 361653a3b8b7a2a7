"""The planner: batch size, memory and its parts for one rank of an N-rank job, on one device.

``python -m tools.tune_batch_size --simulate_world_size N [--simulate_rank r|all-distinct] ...`` runs the
tuner's search (``tune.py``) as rank r of the N-rank job on the fake process group (``distributed/simulate.py``),
then one more step at the pick under PyTorch's memory tracker (``torch.distributed._tools``: ``FSDPMemTracker``
for FSDP2 models, ``MemTracker`` otherwise) for the parts of the peak. Without a GPU the same command, and
``train.py --simulate_world_size N``, is a dry run (:func:`dry_run`): the config and the mesh are checked, the
model is built and one step runs on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes of
every tensor, no storage), which gives the parts and the tensor peak as estimates.

Measured and estimated:

* on a GPU, the peaks of allocated and reserved memory and the allocator's retries are measured (the
  pick's timed steps, as the run will compile them); the parts are tensor storage at the tracker's peak of
  one eager step at the pick (measured, but eager: ``torch.compile`` hides the tensors inside its graphs);
* in a dry run every memory figure is an estimate: tensor bytes without the allocator's rounding, cache or
  fragmentation, under CPU autocast; nothing is searched;
* NCCL's buffers are outside PyTorch's allocator in both: :func:`nccl_allowance` estimates them;
* the shard bytes (parameters, gradients, optimizer state) are counted from this rank's local shards, and
  under FSDP without tensor/context parallelism also computed from the sharding rule
  (:func:`analytic_shard_bytes`).

``--simulate_rank all-distinct`` plans each rank whose shard sizes differ (:func:`distinct_ranks`): uneven
sharding (``torch.chunk``'s rule: the first ranks hold the larger chunks) makes the largest the one to plan for.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from distributed.launch import LaunchEnv, validation_launch
from distributed.mappings import compute_split_shapes
from distributed.parallelize import data_parallel_mesh, parallelize_model, uses_fsdp
from distributed.simulate import dry_run_wanted
from distributed.world import World, init_distributed, local_tensor, shutdown
from networks.vit import build_model
from utils.config.schema import ALL_DISTINCT, Config
from utils.config.types import AUTO
from utils.config.validate import batch_sizes, validate
from utils.core.errors import UserError
from utils.core.files import write_json_atomic
from utils.data.loaders import build_data
from utils.monitor.activations import gradient_bytes, optimizer_state_bytes, tensor_bytes
from utils.monitor.memory import GIB
from utils.monitor.module_table import load_trackers
from utils.train.rollout import max_rollout_steps
from utils.train.step import build_training_step, training_step
from utils.tuner.report import PARTS, device_peak, governing, plan_table, submit_line
from utils.tuner.search import Trial, choice_args
from utils.tuner.trials import endless, release, trial_config
from utils.tuner.tune import (AUTO_OBJECTIVE, TuneResult, base_batch, journal_path, summary, tune,
                              tune_combination, write_outputs)

log = logging.getLogger(__name__)

# the tracker's categories (their names in torch.distributed._tools) in each of the report's PARTS
_PART_OF = {"Sharded Param": "parameters", "Parameter": "parameters", "Buffer": "parameters",
            "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Gradient": "gradients",
            "OptState": "optimizer state", "Optstate": "optimizer state", "Activation": "activations",
            "Unsharded Param": "all-gather buffers", "All Gather": "all-gather buffers"}  # the rest: "other"

# NCCL's documented default buffer per channel and peer (NCCL_BUFFSIZE, 4 MiB; NCCL user guide, "Environment
# Variables": https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize). NCCL picks the
# channel count from the topology; NCCL_MAX_NCHANNELS bounds it, else 32 channels are assumed (an assumption, not
# a documented default). A ring connects each rank to two peers.
NCCL_BUFFSIZE_DEFAULT = 4 * 2**20
NCCL_CHANNELS_ASSUMED = 32
RING_PEERS = 2


@dataclass
class NcclAllowance:
    """NCCL's own buffers for this rank (outside PyTorch's allocator, so neither measured nor tracked): per
    collective group ``buffsize x channels x peers`` bytes (peers: ring neighbours, 1 in a group of 2)."""

    groups: list[tuple[str, int]]  # (the group's mesh dimensions, its size)
    buffsize: int = NCCL_BUFFSIZE_DEFAULT
    channels: int = NCCL_CHANNELS_ASSUMED

    def group_bytes(self, size: int) -> int:
        return self.buffsize * self.channels * min(RING_PEERS, size - 1)

    @property
    def total(self) -> int:
        return sum(self.group_bytes(size) for _, size in self.groups)


def nccl_allowance(cfg: Config, world: World, environ=os.environ) -> NcclAllowance:
    """The allowance for the collective groups this rank joins: the whole world, ``dp``, ``tp``, ``cp`` and the
    dimensions data parallelism reduces over; ``NCCL_BUFFSIZE`` and ``NCCL_MAX_NCHANNELS`` from ``environ``
    (set them as the job will) or the defaults above."""
    groups: dict[str, tuple[str, int]] = {}
    meshes = [world.meshes[name] for name in ("dp", "tp", "cp")] if world.meshes else []
    if world.meshes:
        meshes.append(data_parallel_mesh(cfg.parallel, world))
    for mesh in meshes:
        for dim, name in enumerate(mesh.mesh_dim_names):
            group = mesh.get_group(dim)
            if mesh.size(dim) > 1:
                groups[group.group_name] = (name, mesh.size(dim))
    named = ([("world", world.world_size)] if world.world_size > 1 else []) + list(groups.values())
    return NcclAllowance(named, int(environ.get("NCCL_BUFFSIZE", NCCL_BUFFSIZE_DEFAULT)),
                         int(environ.get("NCCL_MAX_NCHANNELS", NCCL_CHANNELS_ASSUMED)))


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


def dry_run_config(cfg: Config) -> Config:
    """``cfg`` as the dry run steps it: synthetic batches (no data is read) and no ``torch.compile`` (fake tensors
    cannot be compiled).

    Raises:
        UserError: fp8 or CPU offload, which the dry run cannot step without their GPU kernels.
    """
    p, par = cfg.precision, cfg.parallel
    if p.amp_mode == "fp8" or par.fsdp_cpu_offload:
        raise UserError("the dry run (no GPU) cannot step --amp_mode fp8 or --fsdp_cpu_offload: their kernels need "
                        "the GPU; plan with --amp_mode bf16 and without offload here, or run the planner on a GPU")
    cfg = copy.deepcopy(cfg)
    cfg.data.data_loader_config = "synthetic"
    cfg.precision.enable_jit = False
    return cfg


def dry_run(cfg: Config, env: LaunchEnv, batch: int | None = None) -> list[RankPlan]:
    """Check ``cfg`` for the simulated job, build the mesh and step each planned rank on fake tensors at local batch
    ``batch`` (default: the config's; ``tune_start`` for ``local_batch_size auto``).

    Raises:
        UserError: the config does not fit the simulated job (``utils/config/validate.py``), or
            :func:`dry_run_config`'s limits.
    """
    cfg = dry_run_config(cfg)
    if batch is not None or cfg.optim.local_batch_size == AUTO:
        cfg.optim.local_batch_size = batch or cfg.tune.tune_start
    validate(cfg, validation_launch(env))
    return [_planned(with_rank(cfg, r), env, fake_plan) for r in planned_ranks(cfg, env)]


def planned_ranks(cfg: Config, env: LaunchEnv) -> list[int]:
    """``[simulate_rank]``, or for ``all-distinct`` the :func:`distinct_ranks`."""
    rank = cfg.parallel.simulate_rank
    return distinct_ranks(cfg, env) if rank == ALL_DISTINCT else [rank]


def _planned(cfg: Config, env: LaunchEnv, plan):
    """``plan(cfg, world)`` in the simulated world of ``cfg``, closed afterwards (also after an error)."""
    world = init_distributed(cfg.parallel, env)
    try:
        return plan(cfg, world)
    finally:
        shutdown()


def fake_plan(cfg: Config, world: World) -> RankPlan:
    """One rank's plan from two steps on fake tensors (the second tracked, with Adam's state made by the first)."""
    local, global_batch = batch_sizes(cfg.optim, world.dp)
    model = _meta_model(cfg, world)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=world.device)
        if _plain_ddp(cfg, world):  # DDP's reducer needs real tensors: stepped unwrapped (see _meta_model)
            model = parallelize_model(model, cfg.parallel, cfg.precision, replace(world, dp=1))
        step = training_step(cfg, world, model)
        c, (h, w) = cfg.data.n_in_channels, cfg.data.img_size
        k = max_rollout_steps(cfg.optim)  # the step runs the run's largest K (utils/train/step.py)
        batch = (torch.randn(local, c, h, w), torch.randn(local, k, c, h, w), torch.arange(local))
        plan = _tracked(cfg, world, step, itertools.repeat(batch), local, global_batch)
    plan.notes.append("estimated: fake tensors (exact shapes and dtypes; no allocator rounding, cache or "
                      "fragmentation; CPU autocast; eager); nothing searched: run the planner on a GPU for the "
                      "boundary, the pick and the allocator's peaks")
    if _plain_ddp(cfg, world):
        plan.notes.append("DDP not wrapped (its reducer needs real tensors); its buckets hold the gradients "
                          "(gradient_as_bucket_view), so the parts stand")
    return plan


def _plain_ddp(cfg: Config, world: World) -> bool:
    return world.dp > 1 and not uses_fsdp(cfg.parallel, world) and not world.model_parallel


def _meta_model(cfg: Config, world: World) -> nn.Module:
    """The model on the meta device, parallelized as training does it (DDP excepted: it needs real tensors)."""
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.data)
    if _plain_ddp(cfg, world):
        return model
    return parallelize_model(model, cfg.parallel, cfg.precision, world, cfg.optim.grad_accum_steps)


def _tracked(cfg: Config, world: World, step, batches, local: int, global_batch: int) -> RankPlan:
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
    return RankPlan(cfg.parallel.simulate_rank, local, global_batch, _tokens(cfg, world), shards,
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


def _all_tokens(cfg: Config) -> int:
    h, w = cfg.data.img_size
    return (h // cfg.model.patch_size) * (w // cfg.model.patch_size)


def _tokens(cfg: Config, world: World) -> int:
    """This rank's tokens: all of them, or its context-parallel share."""
    tokens = _all_tokens(cfg)
    return compute_split_shapes(tokens, world.cp)[world.meshes["cp"].get_local_rank()] if world.cp > 1 else tokens


def analytic_shard_bytes(cfg: Config, world: World) -> dict[str, int]:
    """This rank's parameter, gradient and Adam bytes under FSDP (ZeRO-2/3, HSDP) without tensor/context
    parallelism, from the sharding rule alone: FSDP2 splits every parameter along dim 0 into as many chunks as the
    shard group has ranks (``dp``; HSDP: ``hsdp_shard_size``), as ``torch.chunk`` does
    (:func:`distributed.mappings.compute_split_shapes`); gradients are sharded alike, in the parameters' dtype;
    Adam keeps ``exp_avg`` and ``exp_avg_sq`` of each shard and a float32 ``step`` per parameter (PyTorch's
    ``torch.optim.Adam``). Empty for any other layout. FSDP2 pads each shard's storage to the largest chunk;
    these are the shards' own bytes."""
    if not uses_fsdp(cfg.parallel, world) or world.model_parallel:
        return {}
    with torch.device("meta"):
        plain = list(build_model(cfg.model, cfg.data).parameters())
    hsdp = cfg.parallel.fsdp == "hsdp"
    chunks = cfg.parallel.hsdp_shard_size if hsdp else world.dp
    shard = world.meshes["hsdp"].get_local_rank("dp_shard") if hsdp else world.meshes["dp"].get_local_rank()
    numel = sum(compute_split_shapes(p.shape[0], chunks)[shard] * p[0].numel() for p in plain)
    size = plain[0].element_size()
    return {"parameters": numel * size, "gradients": numel * size,
            "optimizer state": 2 * numel * size + 4 * len(plain)}


def distinct_ranks(cfg: Config, env: LaunchEnv) -> list[int]:
    """One rank of each group whose shards (parameter bytes, tokens) differ, the largest first.

    Shard sizes follow ``torch.chunk``'s rule along every sharded mesh dimension, so they change only where a
    chunk runs short or out (:func:`_breaks`): those coordinates of rank 0's meshes are the candidates, each
    probed on the meta device for its bytes. Rank 0 always holds the largest chunks.
    """
    first, candidates = _planned(with_rank(cfg, 0), env, _probe)
    found = {first: 0}
    for rank in sorted(candidates - {0}):
        found.setdefault(_planned(with_rank(cfg, rank), env, lambda c, w: _probe(c, w)[0]), rank)
    return [rank for _, rank in sorted(found.items(), key=lambda item: (-item[0][0], -item[0][1], item[1]))]


def _probe(cfg: Config, world: World) -> tuple[tuple[int, int], set[int]]:
    """This rank's (parameter bytes, tokens), and the ranks whose shards may differ from it."""
    model = _meta_model(cfg, world)
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
        candidates.update(int(world.meshes["cp"].mesh[c]) for c in {0} | _breaks(_all_tokens(cfg), world.cp))
    return (tensor_bytes(params), _tokens(cfg, world)), candidates


def _breaks(length: int, n: int) -> set[int]:
    """Chunk indices where ``torch.chunk(length, n)``'s chunk sizes change: the first short or empty chunk, and
    the one after it."""
    if length == 0:
        return set()
    full = length // -(-length // n)
    return {c for c in (full, full + 1) if c < n}


def measured_plan(cfg: Config, world: World, result: TuneResult, objective: str) -> RankPlan:
    """The plan at ``result``'s ``objective`` choice: its trial's measured peaks, and the parts of one more step
    at that batch, eager, under the memory tracker (the parts are None when that step runs out of memory)."""
    pick = result.choices[objective]
    cfg = trial_config(cfg, pick.local_batch_size)
    cfg.precision.enable_jit = False
    release(world.device)
    data = build_data(cfg.data, pick.local_batch_size, world.dp_rank, world.dp, world.device, cfg.optim.seed,
                      train_target_steps=max_rollout_steps(cfg.optim))
    try:
        step = build_training_step(cfg, world)
        plan = _tracked(cfg, world, step, endless(data.train), pick.local_batch_size, pick.global_batch_size)
    except torch.OutOfMemoryError:
        plan = RankPlan(cfg.parallel.simulate_rank, pick.local_batch_size, pick.global_batch_size,
                        _tokens(cfg, world), {}, analytic_shard_bytes(cfg, world), nccl_allowance(cfg, world),
                        notes=["parts not measured: the eager step under the tracker ran out of memory"])
    finally:
        data.close()
    release(world.device)
    cuda = world.device.type == "cuda"
    plan.peak_allocated = pick.peak_allocated_bytes if cuda else None
    plan.peak_reserved, plan.tune = pick.peak_reserved_bytes, result
    plan.notes.append(f"measured: {'the CUDA allocator' if cuda else 'peak RSS (CPU)'} over the pick's timed steps; "
                      "parts: tensor storage at the memory tracker's peak of one eager step at the pick; samples/s "
                      "without communication time (the fake process group moves no data)")
    return plan


def mesh_text(cfg: Config) -> str:
    """The simulated job's layout in words: ``"256 ranks: ZeRO-3 over dp 256, tp 1, cp 1"``."""
    par, n = cfg.parallel, cfg.parallel.simulate_world_size
    dp = n // (par.tensor_parallel * par.context_parallel)
    data = {"none": f"DDP over dp {dp}" if dp > 1 else "dp 1", "zero2": f"ZeRO-2 over dp {dp}",
            "zero3": f"ZeRO-3 over dp {dp}",
            "hsdp": f"HSDP over dp {dp} = replicate {dp // max(1, par.hsdp_shard_size)} x shard {par.hsdp_shard_size}"}
    return f"{n} rank{'s' * (n > 1)}: {data[par.fsdp]}, tp {par.tensor_parallel}, cp {par.context_parallel}"


def plan_job(cfg: Config, base_args: list[str], env: LaunchEnv, out: Path | None = None, batch: int | None = None
             ) -> str:
    """Plan the simulated job of ``cfg`` and return the report: on a GPU the tuner's search per planned rank
    (``cfg.tune``), its table and choices, the plan and the ``submit_pm.sh`` line of the pick; without one the
    :func:`dry_run` at ``batch`` and its plan. ``base_args``: the ``train.py`` arguments the suggested line starts
    from. Writes the JSON (and, after a search, the PNG) to ``out`` unless None.

    Raises:
        UserError: bad config for the simulated job; NoCleanTrial: no batch ran clean on some rank.
    """
    n = cfg.parallel.simulate_world_size
    if dry_run_wanted(cfg.parallel):
        plans = dry_run(cfg, env, batch)
        title = f"DRY RUN (no GPU), {mesh_text(cfg)}; every memory figure estimated"
        dp = n // (cfg.parallel.tensor_parallel * cfg.parallel.context_parallel)
        args = choice_args(Trial(plans[0].local_batch, plans[0].global_batch), base_args, cfg.optim.lr,
                           base_batch(cfg, dp), cfg.optim.num_iters)
    else:
        validate(trial_config(cfg, cfg.tune.tune_start), validation_launch(env))
        journal = journal_path(out if out is not None else Path(cfg.logging.expdir) / cfg.name / "plan.json")
        plans = [_planned(with_rank(cfg, r), env, partial(_searched, base_args=base_args, journal=journal))
                 for r in planned_ranks(cfg, env)]
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU (peak RSS for reserved)"
        title = f"PLAN, {mesh_text(cfg)}; simulated on {device}"
    budget = _budget(cfg)
    worst = governing(plans)
    if worst.tune is not None:
        args = worst.tune.args[AUTO_OBJECTIVE]
    submit = submit_line(n, args)
    text = plan_table(plans, title, budget) + f"\nsubmit: {submit}"
    if worst.tune is not None:
        text = f"{summary(worst.tune)}\n\n{text}"
    if out is not None:
        record = {"plan": {"title": title, "budget_bytes": budget, "submit": submit,
                           "ranks": [_record(p) for p in plans]}}
        written = write_outputs(worst.tune, out, record) if worst.tune is not None else [_written(out, record)]
        log.info("wrote %s", " and ".join(map(str, written)))
    return text


def _budget(cfg: Config) -> int | None:
    """The device memory a rank may use, bytes: ``memory_budget_gib``, else the GPU's; None in a dry run without it."""
    if cfg.tune.memory_budget_gib is not None:
        return int(cfg.tune.memory_budget_gib * GIB)
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _searched(cfg: Config, world: World, base_args: list[str], journal: Path) -> RankPlan:
    """The tuner's search on this simulated rank, with the device memory the job's NCCL buffers take kept from the
    allocator (``torch.cuda.set_per_process_memory_fraction``) and from the budget; then :func:`measured_plan`."""
    nccl, budget, cuda = nccl_allowance(cfg, world).total, _budget(cfg), world.device.type == "cuda"
    cfg = copy.deepcopy(cfg)
    if budget is not None:
        cfg.tune.memory_budget_gib = (budget - nccl) / GIB
    if cuda:
        total = torch.cuda.get_device_properties(world.device).total_memory
        torch.cuda.set_per_process_memory_fraction(max(0.0, (total - nccl) / total), world.device)
    try:
        search = tune if cfg.tune.tune == "batch" else tune_combination
        result = search(cfg, world, base_args, journal)
        return measured_plan(cfg, world, result, AUTO_OBJECTIVE)
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, world.device)


def _record(plan: RankPlan) -> dict:
    """A plan as JSON-ready data (the search's trials are the JSON's own ``trials``)."""
    record = {f.name: getattr(plan, f.name) for f in fields(plan) if f.name not in ("tune", "nccl")}
    nccl = plan.nccl
    return {**record, "device_memory_bytes": device_peak(plan),
            "nccl": {"groups": nccl.groups, "buffsize": nccl.buffsize, "channels": nccl.channels, "bytes": nccl.total}}


def _written(path: Path, record: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    return path
