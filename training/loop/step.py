"""The optimizer step and what it needs (parallel model, Adam, schedule, GradScaler, loss), built from
the config.

The trainer runs it for training; the batch-size tuner (``training/tuner/tune.py``) builds one per candidate
batch and times it, so the tuner measures exactly the step training runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, ContextManager, Iterator

import numpy as np
import torch

from distributed.ensemble_parallel import local_members
from distributed.parallelize import build_parallel_model, gradient_factor, gradient_sync
from distributed.world import World
from kernels.cudnn_attention import packed_attention
from networks.vit import build_model
from training.evaluation.ensemble_metrics import almost_fair_crps
from training.evaluation.metrics import latitude_weights, relative_l2_loss
from training.loop.ensemble import Members
from training.loop.rollout import max_rollout_steps, rollout_loss, step_weights
from training.monitor.memory import GIB, host_memory_available
from training.monitor.profiling import nvtx_range
from utils.config.schema import Config, OptimConfig
from utils.core.errors import UserError
from utils.precision.amp import AMP_DTYPES
from utils.precision.float8 import float8_step_hook, log_fp8_advice

log = logging.getLogger(__name__)


def lr_lambda(optim: OptimConfig):
    """Multiplier of the base lr at optimizer step s: linear warmup, then cosine to 0 (or constant)."""
    warmup, total = optim.warmup, max(1, optim.num_iters)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def set_attention_backend(name: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> None:
    """Restrict ``scaled_dot_product_attention`` to one backend (global, so compiled graphs see it), or,
    for ``cudnn_packed``, check that its kernel builds.

    Only CUDA backends are selectable; on CPU PyTorch keeps its own choice. The startup probe runs
    in the run's compute ``dtype`` (the AMP dtype, else float32). Raises UserError when the backend
    cannot run this head size and dtype on this device.
    """
    if name == "auto" or device.type != "cuda":
        return
    if name == "cudnn_packed":  # a kernel of its own (kernels/cudnn_attention.py), not an SDPA backend
        probe = partial(packed_attention, torch.zeros(1, 64, 3, 1, head_dim, device=device, dtype=dtype))
    else:
        flags = {"cudnn": torch.backends.cuda.enable_cudnn_sdp, "flash": torch.backends.cuda.enable_flash_sdp,
                 "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
                 "math": torch.backends.cuda.enable_math_sdp}
        for key, enable in flags.items():
            enable(key == name)
        q = torch.zeros(1, 1, 64, head_dim, device=device, dtype=dtype)
        probe = partial(torch.nn.functional.scaled_dot_product_attention, q, q, q)
    try:
        probe()
    except RuntimeError:
        raise UserError(f"--attention_backend {name} cannot run head dim {head_dim} in {str(dtype)[6:]} on "
                        f"{torch.cuda.get_device_name(device)}; use --attention_backend auto") from None


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


@dataclass
class TrainingStep:
    """One optimizer step over ``accum`` micro-batches: forward and backward of each (gradients synced
    on the last), then unscale, clip, Adam, GradScaler update and the schedule.

    ``amp_dtype`` is the autocast dtype (None: no autocast); ``max_grad_norm`` 0 means no clipping;
    ``after_step``, when set, runs after every optimizer step (the float8 weight scales under FSDP,
    ``utils/precision/float8.py``).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    amp_dtype: torch.dtype | None
    device: torch.device
    accum: int
    max_grad_norm: float
    after_step: Callable[[], None] | None = None
    grad_factor: float = 1.0  # the loss's gradient is multiplied by it (context parallelism: cp)
    rollout_weights: tuple[float, ...] = (1.0,)  # loss weight of each rollout step, up to the run's largest K
    rollout_steps: int = 1  # K of the next steps (the trainer sets it from the curriculum)
    rollout_recompute: bool = False  # activation checkpointing per rollout step
    # (sample indices, rollout step) -> the input-only channels (utils/data/forcing_source.py); None: none
    forcing: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    members: Members | None = None  # a stochastic model's members and their noise (training/loop/ensemble.py)

    def autocast(self) -> ContextManager:
        """Autocast to ``amp_dtype`` on this device, or nothing without AMP."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def __call__(self, batches: Iterator[tuple], phase: Callable[[str], ContextManager] = _no_phase
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run one step on the next ``accum`` batches ``(input (B, C, H, W), targets (B, k, C, H, W), sample
        indices (B,))`` of ``batches``, ``k >= rollout_steps`` (the loss: ``training/loop/rollout.py``);
        ``phase(name)`` wraps the forward, backward and optimizer step
        (the trainer's OOM handler names the phase that ran out of memory).

        Returns:
            The step's loss (a 0-d tensor, not synchronized: the mean micro-batch loss) and the sample
            indices of its micro-batches.
        """
        loss_total = torch.zeros((), device=self.device)
        indices = []
        for micro in range(self.accum):
            inp, tar, idx = next(batches)
            indices.append(idx)
            extra = self.forcing and partial(self.forcing, idx)
            if self.members is not None:  # the members' states, each with its own noise (keyed by the step)
                inp, extra = self.members.inputs(inp, idx, self.scheduler.last_epoch, extra)
            with gradient_sync(self.model, micro == self.accum - 1):
                with nvtx_range("forward"), phase("forward"), self.autocast():
                    loss = rollout_loss(self.model, self.loss_fn, inp, tar, self.rollout_weights[:self.rollout_steps],
                                        self.rollout_recompute, extra) / self.accum
                with nvtx_range("backward"), phase("backward"):
                    self.scaler.scale(loss * self.grad_factor if self.grad_factor != 1 else loss).backward()
            loss_total += loss.detach()
        with nvtx_range("optimizer"), phase("optimizer step"):
            self.optimizer_step()
        return loss_total, indices

    def optimizer_step(self) -> None:
        """Unscale and clip (the global norm over every parameter, DTensor shards included), step Adam, the
        GradScaler and the schedule, then ``after_step``."""
        if self.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.after_step is not None:
            self.after_step()


def count_parameters(cfg: Config) -> int:
    """Parameters of the plain model, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(t.numel() for t in build_model(cfg.model, cfg.data).parameters())


def plain_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the plain model's ``state_dict`` (the layout checkpoints keep), on the meta device."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in build_model(cfg.model, cfg.data).state_dict().items()}


def check_host_memory(cfg: Config, world: World) -> None:
    """Stop before anything is written when the host cannot hold the model: every rank of this host builds its fp32
    weights there (under FSDP alone only rank 0, the full model, which it then shards), and on CPU each rank also
    keeps gradients and Adam's two moments (16 bytes a parameter, sharded under FSDP).

    Raises:
        UserError: the bytes needed exceed what the host (or the job's cgroup) has available.
    """
    available = host_memory_available()
    if available is None:
        return
    n = count_parameters(cfg)
    ranks = world.env.local_world_size
    needed = 4 * n * (1 if world.fsdp_only else ranks)
    if world.device.type == "cpu":
        trained = 16 * n * ranks // (world.dp if world.fsdp_only else 1)
        needed = needed + trained if world.fsdp_only else trained
    if needed > available:
        count = f"{n / 1e9:,.1f} billion" if n >= 1e9 else f"{n / 1e6:,.1f} million"
        raise UserError(f"the model has {count} parameters: {ranks} rank(s) on this host need at least "
                        f"{needed / GIB:,.1f} GiB of host memory for it, but {available / GIB:,.1f} GiB is "
                        "available; make the model smaller (embed_dim, depth), shard it (--fsdp zero3), or use "
                        "fewer ranks per node")


def build_training_step(cfg: Config, world: World, init: dict[str, torch.Tensor] | None = None,
                        forcing: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                        latitude: np.ndarray | None = None) -> TrainingStep:
    """The parallel model (``distributed/parallelize.py``: float8, DDP, FSDP, TP/CP, AC, compile), Adam (fused
    on CUDA and CPU when ``enable_fused``), the lr schedule (:func:`lr_lambda`), the GradScaler (fp16
    only: bf16, bf16_pure and fp8 need none) and the loss (compiled with ``enable_jit``), from ``cfg`` on
    ``world``. With fp8 on a GPU, rank 0 logs once where fp8 pays on it (a warning below that width).

    Weights are seeded with ``optim.seed``, so every rank starts from the same ones; ``init`` (``--init_from``'s
    plain ``state_dict``), when given, replaces them before the model is parallelized. ``forcing``: the training
    split's input-only channels (``Data.train_forcings``), None without forcings and static fields. ``latitude``:
    the crop's ``(H,)`` latitudes in degrees, which weight the CRPS (None: equal weights, for what only measures
    a step: the tuner, the planner).
    """
    torch.manual_seed(cfg.optim.seed)
    opt, prec = cfg.optim, cfg.precision
    if prec.amp_mode == "fp8" and world.device.type == "cuda" and world.is_main:
        log_fp8_advice(torch.cuda.get_device_name(world.device), cfg.model.embed_dim)
    model = build_parallel_model(partial(_initialized_model, cfg, init), cfg.parallel, prec, world,
                                 opt.grad_accum_steps)
    return training_step(cfg, world, model, forcing, latitude)


def _initialized_model(cfg: Config, init: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    """The plain model, with the weights ``init`` when given (not on the meta device, where FSDP builds the shapes
    only and takes rank 0's weights)."""
    model = build_model(cfg.model, cfg.data)
    if init is not None and not next(model.parameters()).is_meta:
        model.load_state_dict(init)
    return model


def training_step(cfg: Config, world: World, model: torch.nn.Module,
                  forcing: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                  latitude: np.ndarray | None = None) -> TrainingStep:
    """The step of :func:`build_training_step` around ``model``, already parallelized for ``world`` (the dry run of
    ``training/tuner/planner.py`` builds it on fake tensors)."""
    opt, prec = cfg.optim, cfg.precision
    fused = prec.enable_fused and world.device.type in ("cuda", "cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                 weight_decay=opt.weight_decay, fused=fused or None)
    # Eager, the loss and its backward are ~10 passes over full-resolution fields (~4 % of an H100
    # step at short_opt); compiled, they fuse into a few kernels.
    loss_fn = torch.compile(relative_l2_loss) if prec.enable_jit else relative_l2_loss
    members = training_members(cfg, world, latitude)
    if opt.loss == "crps":
        loss_fn = members.loss
    # K starts at the run's largest, so what measures a step (the tuner, the planner) measures the largest
    return TrainingStep(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opt)),
                        torch.amp.GradScaler(world.device.type, enabled=prec.amp_mode == "fp16"), loss_fn,
                        AMP_DTYPES[prec.amp_mode], world.device, opt.grad_accum_steps, opt.max_grad_norm,
                        float8_step_hook(model, prec, world.uses_fsdp), gradient_factor(world),
                        step_weights(opt), max_rollout_steps(opt), prec.rollout_checkpointing, forcing, members)


def training_members(cfg: Config, world: World, latitude: np.ndarray | None) -> Members | None:
    """The members of a stochastic model (``noise_channels > 0``) on this rank, None for a deterministic one."""
    if not cfg.model.noise_channels:
        return None
    group = world.group("ens")
    h, w = cfg.data.img_size
    weights = (latitude_weights(latitude, world.device) if latitude is not None
               else torch.ones(h, device=world.device))
    score = torch.compile(almost_fair_crps) if cfg.precision.enable_jit else almost_fair_crps
    return Members(local_members(cfg.optim.ensemble_members, group), cfg.optim.ensemble_members,
                   (cfg.model.noise_channels, h, w), cfg.optim.seed, group, cfg.optim.crps_alpha, weights, score)
