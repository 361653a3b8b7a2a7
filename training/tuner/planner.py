"""The job planner (``plan_job``): batch size, memory and its parts for one rank of an N-rank job, on one device.

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

Here the command's flow and its report; one rank's plan and the ranks to plan in ``rank_plan.py``, the dry run in
``dry_run.py``, the analytic estimates in ``estimates.py``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import fields
from functools import partial
from pathlib import Path

import torch

from distributed.launch import LaunchEnv, validation_launch
from distributed.simulate import dry_run_wanted
from distributed.world import World
from training.loop.rollout import max_rollout_steps
from training.loop.step import build_training_step
from training.monitor.memory import GIB
from training.tuner.dry_run import dry_run
from training.tuner.estimates import analytic_shard_bytes, nccl_allowance, rank_tokens
from training.tuner.rank_plan import RankPlan, in_simulated_world, planned_ranks, tracked_plan, with_rank
from training.tuner.report import device_peak, governing, plan_table, submit_line
from training.tuner.search import Trial, choice_args
from training.tuner.trials import endless, release, trial_config
from training.tuner.tune import (AUTO_OBJECTIVE, TuneResult, base_batch, journal_path, summary, tune, tune_combination,
                                 write_outputs)
from utils.config.schema import Config
from utils.config.validate import validate
from utils.core.files import write_json_atomic
from utils.data.loaders import build_data

log = logging.getLogger(__name__)


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
        plan = tracked_plan(cfg, world, step, endless(data.train), pick.local_batch_size, pick.global_batch_size)
    except torch.OutOfMemoryError:
        plan = RankPlan(cfg.parallel.simulate_rank, pick.local_batch_size, pick.global_batch_size,
                        rank_tokens(cfg, world), {}, analytic_shard_bytes(cfg, world), nccl_allowance(cfg, world),
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
        plans = [in_simulated_world(with_rank(cfg, r), env, partial(_searched, base_args=base_args, journal=journal))
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
