"""The planner without a GPU (``--simulate_world_size N`` on a CPU): the config and the mesh checked, the model
built and two steps run on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes of every tensor,
no storage), which give the parts and the tensor peak as estimates."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from distributed.launch import LaunchEnv, validation_launch
from distributed.parallelize import parallelize_model
from distributed.world import World
from training.loop.rollout import max_rollout_steps
from training.loop.step import training_step
from training.tuner.rank_plan import RankPlan, in_simulated_world, meta_model, planned_ranks, tracked_plan, with_rank
from utils.config.schema import Config
from utils.config.types import AUTO
from utils.config.validate import batch_sizes, validate
from utils.core.errors import UserError
from utils.data.forcing_source import nominal_forcings
from utils.data.layout import DEFAULT_STEP_HOURS


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
    return [in_simulated_world(with_rank(cfg, r), env, fake_plan) for r in planned_ranks(cfg, env)]


def fake_plan(cfg: Config, world: World) -> RankPlan:
    """One rank's plan from two steps on fake tensors (the second tracked, with Adam's state made by the first)."""
    local, global_batch = batch_sizes(cfg.optim, world.dp)
    model = meta_model(cfg, world)
    indices = torch.arange(local)  # real: the forcings read the sample indices on the host
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=world.device)
        if world.ddp:  # DDP's reducer needs real tensors: stepped unwrapped (see meta_model)
            model = parallelize_model(model, cfg.parallel, cfg.precision, replace(world, dp=1, ens=1))
        c, (h, w) = cfg.data.n_in_channels, cfg.data.img_size
        step = training_step(cfg, world, model, nominal_forcings(cfg.data, DEFAULT_STEP_HOURS, world.device))
        k = max_rollout_steps(cfg.optim)  # the step runs the run's largest K (training/loop/step.py)
        dev = world.device  # the model's device: a dry run on a GPU machine steps fake CUDA tensors
        batch = (torch.randn(local, c, h, w, device=dev), torch.randn(local, k, c, h, w, device=dev), indices)
        plan = tracked_plan(cfg, world, step, itertools.repeat(batch), local, global_batch)
    plan.notes.append("estimated: fake tensors (exact shapes and dtypes; no allocator rounding, cache or "
                      "fragmentation; CPU autocast; eager); nothing searched: run the planner on a GPU for the "
                      "boundary, the pick and the allocator's peaks")
    if world.ddp:
        plan.notes.append("DDP not wrapped (its reducer needs real tensors); its buckets hold the gradients "
                          "(gradient_as_bucket_view), so the parts stand")
    return plan
