"""Cross-field checks of a resolved config against the launch, run once before anything is built or written."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path

from utils.config.schema import (ALL_DISTINCT, CUDA_ONLY_ATTENTION, FP8_KEYS, FP8_MIN_CAPABILITY, HALF_ONLY_ATTENTION,
                                 KEYS, Config, OptimConfig, ParallelConfig)
from utils.config.types import AUTO
from utils.core.errors import UserError
from utils.core.files import check_output_path


@dataclass(frozen=True)
class Launch:
    """What validation needs to know about the job: its world size, whether a CUDA GPU is visible and that
    GPU's compute capability ``(major, minor)``, e.g. ``(9, 0)`` for Hopper (None: no GPU; the entry points
    fill it from ``distributed.launch.validation_launch``)."""

    world_size: int = 1
    cuda: bool = False
    cuda_capability: tuple[int, int] | None = None


def validate(cfg: Config, launch: Launch) -> None:
    """Cross-field checks, run once before anything is built or written.

    Raises:
        UserError: the first problem found, naming the keys involved and a fix.
    """
    launch = simulated_launch(cfg, launch)
    for check in (_check_model, _check_batches, _check_rollout, _check_ensemble, _check_precision, _check_parallel,
                  _check_checkpoint, _check_paths):
        check(cfg, launch)


# the GPU a dry run without one checks the config for (--simulate_world_size on a CPU): Hopper, as FP8 needs
PLANNED_GPU_CAPABILITY = (9, 0)


def simulated_launch(cfg: Config, launch: Launch) -> Launch:
    """The launch the config is checked against: ``launch`` itself, or with ``--simulate_world_size N`` the
    simulated job of N ranks (``distributed/simulate.py``), on this GPU or, for a dry run without one, on GPUs of
    compute capability :data:`PLANNED_GPU_CAPABILITY`.

    Raises:
        UserError: ``--simulate_rank`` without ``--simulate_world_size`` or outside the simulated world; a
            simulation launched as several processes, continuing a checkpoint, in fp16, or with HSDP and no
            ``--hsdp_shard_size``.
    """
    par = cfg.parallel
    n, rank = par.simulate_world_size, par.simulate_rank
    if not n:
        if rank != KEYS["simulate_rank"].default:
            raise UserError(f"--simulate_rank {rank} has no effect without --simulate_world_size; add "
                            "--simulate_world_size N (the job's ranks) or drop --simulate_rank")
        return launch
    if launch.world_size > 1:
        raise UserError(f"--simulate_world_size runs one process as one rank of a simulated job, but this job has "
                        f"{launch.world_size} processes; start it as one process (no torchrun or srun), or drop "
                        "--simulate_world_size to train for real")
    if rank != ALL_DISTINCT and rank >= n:
        raise UserError(f"--simulate_rank {rank} is outside the simulated world of {n} ranks; pick 0 to {n - 1} "
                        f"or {ALL_DISTINCT}")
    if cfg.checkpoint.resume not in ("auto", "never"):
        raise UserError(f"--simulate_world_size writes no checkpoint and continues none, but --resume is "
                        f"{cfg.checkpoint.resume}; drop --resume")
    if cfg.precision.amp_mode == "fp16":
        raise UserError("--amp_mode fp16 under --simulate_world_size: the GradScaler skips the optimizer steps of a "
                        "simulated rank, whose gradients are arbitrary, so Adam's state would be missing from the "
                        "plan; plan with --amp_mode bf16 (the same bytes)")
    if par.fsdp == "hsdp" and not par.hsdp_shard_size:
        raise UserError("--fsdp hsdp under --simulate_world_size needs --hsdp_shard_size: the ranks per shard "
                        "group of the job you plan (its GPUs per node, 4 on Perlmutter), which this machine "
                        "cannot tell")
    return Launch(n, True, launch.cuda_capability if launch.cuda else PLANNED_GPU_CAPABILITY)


def _check_model(cfg: Config, launch: Launch) -> None:
    m, d = cfg.model, cfg.data
    h, w = d.img_size
    if h % m.patch_size or w % m.patch_size:
        tiling = math.gcd(h, w)
        fits = [p for p in range(1, min(tiling + 1, m.patch_size)) if tiling % p == 0][-3:]  # patches that tile the grid
        grid = (f"--img_size [{h - h % m.patch_size},{w - w % m.patch_size}] or " if min(h, w) >= m.patch_size
                else "")  # rounding down a side smaller than the patch would give 0
        raise UserError(f"img_size [{h},{w}] is not a multiple of patch_size {m.patch_size}; pick {grid}"
                        f"--patch_size {' or '.join(map(str, fits))}")
    if m.embed_dim % m.num_heads:
        raise UserError(f"embed_dim {m.embed_dim} is not divisible by num_heads {m.num_heads}; pick "
                        f"--num_heads from {_divisors(m.embed_dim)}")
    if int(m.embed_dim * m.mlp_ratio) < 1:
        raise UserError(f"mlp_ratio {m.mlp_ratio} gives an MLP of width 0; raise --mlp_ratio")
    if d.n_out_channels != d.n_in_channels:
        raise UserError(f"n_out_channels {d.n_out_channels} must equal n_in_channels {d.n_in_channels}: "
                        "targets are the same fields dt steps later")
    p = cfg.precision
    if p.activation_checkpointing == "selective" and p.ac_blocks > m.depth:
        raise UserError(f"--ac_blocks {p.ac_blocks} exceeds the model depth {m.depth}; use at most {m.depth} "
                        "(or --activation_checkpointing full)")


def _divisors(n: int) -> str:
    small = [k for k in range(1, min(n, 64) + 1) if n % k == 0]
    return ", ".join(map(str, small[:8]))


def data_parallel_size(world_size: int, parallel: ParallelConfig) -> int:
    """``world_size / (tp * cp * ens)``: the ranks that read different samples. Raises UserError when it does not
    divide."""
    tp, cp, ens = parallel.tensor_parallel, parallel.context_parallel, parallel.ensemble_parallel
    if world_size % (tp * cp * ens):
        sizes = f"tensor_parallel x context_parallel x ensemble_parallel = {tp} x {cp} x {ens}"
        raise UserError(f"world size {world_size} is not divisible by {sizes}; launch a multiple of "
                        f"{tp * cp * ens} processes or change the sizes")
    return world_size // (tp * cp * ens)


def batch_sizes(optim: OptimConfig, dp: int) -> tuple[int, int]:
    """(local micro-batch per data-parallel rank, global batch per optimizer step).

    ``global = local * dp * grad_accum_steps``; ``local_batch_size``, when set, wins.
    Raises UserError when the global batch does not divide over the ranks and micro-steps.
    """
    k = optim.grad_accum_steps
    if optim.local_batch_size == AUTO:
        raise ValueError("local_batch_size auto is resolved by the batch tuner before batch sizes are computed")
    if optim.local_batch_size is not None:
        return optim.local_batch_size, optim.local_batch_size * dp * k
    gbs = optim.global_batch_size
    if gbs % (dp * k):
        raise UserError(f"global_batch_size {gbs} is not divisible by data-parallel size {dp} x "
                        f"grad_accum_steps {k}; pick a multiple of {dp * k} or set --local_batch_size")
    return gbs // (dp * k), gbs


def _check_batches(cfg: Config, launch: Launch) -> None:
    dp = data_parallel_size(launch.world_size, cfg.parallel)
    if cfg.optim.local_batch_size != AUTO:
        batch_sizes(cfg.optim, dp)
    t = cfg.tune
    if t.tune_start > t.tune_max_batch:
        raise UserError(f"--tune_start {t.tune_start} exceeds --tune_max_batch {t.tune_max_batch}; lower the first "
                        "or raise the second")
    if t.tune == "fsdp_prefetch" and cfg.parallel.fsdp == "none":
        raise UserError("--tune fsdp_prefetch tunes FSDP's prefetch depth, but --fsdp is none; add --fsdp zero3 "
                        "(or zero2, hsdp) or tune ac_blocks")


def _check_rollout(cfg: Config, launch: Launch) -> None:
    """Rollout training: a curriculum that only goes up, one loss weight per step, and no key without effect."""
    o = cfg.optim
    start, top = o.train_rollout_steps, o.rollout_max_steps
    if top and top < start:
        raise UserError(f"--rollout_max_steps {top} is below --train_rollout_steps {start}: a rollout curriculum only "
                        f"raises K; pass --rollout_max_steps {start} or more (0: no curriculum)")
    for name in ("rollout_raise_every", "rollout_raise_unit"):
        if not top and getattr(o, name) != KEYS[name].default:
            raise UserError(f"--{name} has no effect without a rollout curriculum; add --rollout_max_steps K or drop "
                            f"--{name}")
    k = max(start, top)
    weights = o.rollout_step_weights
    if weights and len(weights) != k:
        raise UserError(f"--rollout_step_weights has {len(weights)} weight(s) but the run trains up to {k} rollout "
                        f"steps; give {k} (one per step) or [] for uniform weights")
    if weights and sum(weights[:start]) <= 0:  # weights are >= 0: later K only add to the sum
        raise UserError(f"--rollout_step_weights {list(weights)}: the first {start} weights sum to 0, so the loss "
                        "would be 0/0; give the first step a positive weight")
    if cfg.memory.memory_profile and k > 1:
        raise UserError(f"--memory_profile is not supported with rollout training ({k} rollout steps): its per-module "
                        "table restarts at each call of the model, which rollout calls K times a step; profile at "
                        "--train_rollout_steps 1, or plan with --simulate_world_size, which measures K steps")
    if cfg.precision.rollout_checkpointing and k == 1:
        raise UserError("--rollout_checkpointing has no effect with one rollout step; add --train_rollout_steps K > 1 "
                        "(or --rollout_max_steps) or drop --rollout_checkpointing")


def _check_precision(cfg: Config, launch: Launch) -> None:
    p = cfg.precision
    backend = p.attention_backend
    if backend in CUDA_ONLY_ATTENTION and not launch.cuda:
        raise UserError(f"--attention_backend {backend} needs a CUDA GPU and none is visible; "
                        "use --attention_backend auto (or math) on CPU")
    if backend in HALF_ONLY_ATTENTION and p.amp_mode == "none":
        raise UserError(f"--attention_backend {backend} runs only in bf16/fp16, but --amp_mode is none; "
                        "add --amp_mode bf16 or use --attention_backend auto")
    if backend == "cudnn_packed":
        _check_packed_attention(cfg)
    if p.compile_mode != "default" and not p.enable_jit:
        raise UserError(f"--compile_mode {p.compile_mode} has no effect without --enable_jit; "
                        "add --enable_jit or drop --compile_mode")
    if cfg.data.data_loader_config == "dali" and importlib.util.find_spec("nvidia.dali") is None:
        raise UserError("--data_loader_config dali needs NVIDIA DALI: pip install '.[dali]' "
                        "(nvidia-dali-cuda120; nvidia-dali-cuda130 on CUDA 13), or use --data_loader_config pytorch")
    _check_fp8(cfg, launch)


def model_parallel(par: ParallelConfig) -> bool:
    """Whether tensor or context parallelism replaces the dense layers (``distributed/tensor_parallel.py``)."""
    return par.tensor_parallel > 1 or par.context_parallel > 1


def _check_fp8(cfg: Config, launch: Launch) -> None:
    p, par, m = cfg.precision, cfg.parallel, cfg.model
    if p.amp_mode != "fp8":
        for name in FP8_KEYS:
            if getattr(p, name) != KEYS[name].default:
                raise UserError(f"--{name} has no effect without --amp_mode fp8; add --amp_mode fp8 or drop --{name}")
        return
    # the config's own conflicts first, then what this machine lacks
    if model_parallel(par):
        raise UserError("--amp_mode fp8 is not supported with tensor or context parallelism (their layers run their "
                        "own GEMMs); use --amp_mode bf16, or --tensor_parallel 1 --context_parallel 1")
    if par.fsdp_cpu_offload:
        raise UserError("--amp_mode fp8 is not supported with --fsdp_cpu_offload; drop --fsdp_cpu_offload or use "
                        "--amp_mode bf16")
    hidden = int(m.embed_dim * m.mlp_ratio)
    if m.embed_dim % 16 or hidden % 16:
        raise UserError(f"--amp_mode fp8: float8 GEMMs need widths that are multiples of 16, but embed_dim is "
                        f"{m.embed_dim} and the MLP hidden width (embed_dim x mlp_ratio) {hidden}; pick multiples "
                        "of 16 or use --amp_mode bf16")
    capability = launch.cuda_capability if launch.cuda else None
    if capability is None or capability < FP8_MIN_CAPABILITY:
        found = f"this GPU's is {capability[0]}.{capability[1]}" if capability else "no CUDA GPU is visible"
        raise UserError(f"--amp_mode fp8 needs an NVIDIA GPU of compute capability 9.0 (Hopper) or newer, but {found}; "
                        "use --amp_mode bf16")
    if importlib.util.find_spec("torchao") is None:
        raise UserError("--amp_mode fp8 needs torchao: pip install -e '.[fp8]', or use --amp_mode bf16")


def _check_packed_attention(cfg: Config) -> None:
    if importlib.util.find_spec("cudnn") is None:
        raise UserError("--attention_backend cudnn_packed needs cudnn-frontend: pip install -e '.[cudnn]' "
                        "(nvidia-cudnn-frontend), or use --attention_backend cudnn")
    if model_parallel(cfg.parallel):
        raise UserError("--attention_backend cudnn_packed runs whole-sequence, all-head attention; with tensor or "
                        "context parallelism use --attention_backend cudnn")


def _check_parallel(cfg: Config, launch: Launch) -> None:
    par = cfg.parallel
    dp = data_parallel_size(launch.world_size, par)
    if par.fsdp == "hsdp" and par.hsdp_shard_size and dp % par.hsdp_shard_size:
        raise UserError(f"--hsdp_shard_size {par.hsdp_shard_size} must divide the data-parallel size {dp}")
    if par.fsdp_cpu_offload:
        if par.fsdp == "none" or dp == 1:
            raise UserError("--fsdp_cpu_offload needs FSDP over more than one data-parallel rank; add "
                            "--fsdp zero3 (or zero2/hsdp) and launch 2+ processes, or drop --fsdp_cpu_offload")
        if not launch.cuda:
            raise UserError("--fsdp_cpu_offload moves FSDP shards from the GPU to the host, but no GPU is "
                            "visible; drop --fsdp_cpu_offload on CPU")
        if model_parallel(par):
            raise UserError("--fsdp_cpu_offload is not supported with tensor or context parallelism; "
                            "drop it or use --tensor_parallel 1 --context_parallel 1")
        if cfg.precision.amp_mode == "fp16":
            raise UserError("--fsdp_cpu_offload cannot unscale fp16 gradients on the host; "
                            "use --amp_mode bf16 (no GradScaler needed)")
    if par.async_tp:
        _check_async_tp(cfg, launch)
    if par.sp_grad_bucketing and not (par.tensor_parallel > 1 and par.sequence_parallel and cfg.precision.enable_jit):
        raise UserError("--sp_grad_bucketing merges the gradient all-reduces that sequence parallelism adds, in "
                        "compiled graphs; add --tensor_parallel 2 (or more) --sequence_parallel true --enable_jit "
                        "true, or drop --sp_grad_bucketing")
    if par.cp_attention == "ring" and par.context_parallel > 1 and launch.cuda:
        _check_ring_on_cuda(cfg)


def _check_ring_on_cuda(cfg: Config) -> None:
    """The ring's CUDA kernels (``distributed/ring_attention.py``, ``attention_kernel``): FlashAttention-2 or
    cuDNN, in bf16/fp16, head dim up to 256."""
    head_dim, backend = cfg.model.embed_dim // cfg.model.num_heads, cfg.precision.attention_backend
    if cfg.precision.amp_mode not in ("bf16", "bf16_pure", "fp16"):
        raise UserError(f"--cp_attention ring runs FlashAttention-2 or cuDNN on GPUs, which need bf16 or fp16, but "
                        f"--amp_mode is {cfg.precision.amp_mode}; use --amp_mode bf16 or --cp_attention all_gather")
    if backend in ("efficient", "math"):
        raise UserError(f"--cp_attention ring runs FlashAttention-2 or cuDNN on GPUs, not --attention_backend "
                        f"{backend}; use --attention_backend auto or cudnn, or --cp_attention all_gather")
    if head_dim > 256:
        raise UserError(f"--cp_attention ring needs a head dim up to 256 on GPUs (FlashAttention-2, cuDNN), but "
                        f"embed_dim / num_heads is {head_dim}; raise --num_heads or use --cp_attention all_gather")


def _check_async_tp(cfg: Config, launch: Launch) -> None:
    """``--async_tp`` (``distributed/async_tp.py``): inductor's pass on the even, one-piece collectives of
    sequence parallelism, with NCCL and symmetric memory."""
    par = cfg.parallel
    tp, cp = par.tensor_parallel, par.context_parallel
    if tp == 1:
        raise UserError("--async_tp has no effect without tensor parallelism; add --tensor_parallel 2 (or more) "
                        "--sequence_parallel true, or drop --async_tp")
    if not par.sequence_parallel:
        raise UserError("--async_tp decomposes the collectives of sequence parallelism; add --sequence_parallel true "
                        "or drop --async_tp")
    if not cfg.precision.enable_jit:
        raise UserError("--async_tp is a pass of torch.compile's inductor; add --enable_jit true or drop --async_tp")
    if cfg.precision.compile_mode in ("reduce-overhead", "max-autotune"):
        # torch 2.11 on 2 H200s: CUDA graph trees stop at the symmetric-memory buffers the fused ops allocate
        # ("tensor(s) in the cudagraph pool not tracked as outputs"); docs/speed.md, round 5l
        raise UserError(f"--async_tp cannot run under CUDA graphs (--compile_mode {cfg.precision.compile_mode}): "
                        "its symmetric-memory buffers are not a graph's outputs; use --compile_mode default or "
                        "max-autotune-no-cudagraphs, or drop --async_tp")
    if par.simulate_world_size:
        raise UserError("--async_tp needs the job's real peers for its symmetric memory; plan with "
                        "--simulate_world_size without --async_tp")
    if not launch.cuda:
        raise UserError("--async_tp needs CUDA GPUs (NCCL, symmetric memory) and none is visible; drop --async_tp "
                        "on CPU")
    h, w = cfg.data.img_size
    tokens = (h // cfg.model.patch_size) * (w // cfg.model.patch_size)
    per_cp = -(-tokens // cp)  # compute_split_shapes (distributed/mappings.py): ceil(n / cp), the last ranks fewer
    counts = {max(0, min(per_cp, tokens - i * per_cp)) for i in range(cp)}
    uneven = sorted(n for n in counts if n % tp)
    if uneven:
        raise UserError(f"--async_tp needs each context-parallel rank's {uneven[0]} tokens to split evenly over "
                        f"--tensor_parallel {tp} (no padding between a collective and its GEMM); pick an img_size "
                        f"and patch_size whose token count per context-parallel rank is a multiple of {tp}, or "
                        "drop --async_tp")


def _check_ensemble(cfg: Config, launch: Launch) -> None:
    o, members, ens = cfg.optim, cfg.optim.ensemble_members, cfg.parallel.ensemble_parallel
    if o.loss == "crps" and members < 2:
        raise UserError(f"--loss crps scores an ensemble, but --ensemble_members is {members}; train 2 or more "
                        "members (--ensemble_members 4), or use --loss l2")
    if o.loss == "crps" and cfg.model.noise_channels < 1:
        raise UserError("--loss crps with --noise_channels 0: a deterministic model's members would all be the same "
                        "forecast; give the model noise inputs (--noise_channels 4)")
    if o.loss == "l2" and members > 1:
        raise UserError(f"--ensemble_members {members} with --loss l2: the L2 loss scores one forecast, not an "
                        "ensemble; add --loss crps or drop --ensemble_members")
    if members % ens:
        raise UserError(f"--ensemble_members {members} is not divisible by --ensemble_parallel {ens}: each of the "
                        f"{ens} ranks of an ensemble group forecasts the same number of members; pick a multiple of "
                        f"{ens} members or another --ensemble_parallel")


def _check_checkpoint(cfg: Config, launch: Launch) -> None:
    c = cfg.checkpoint
    if c.resume not in ("auto", "never") and not Path(c.resume).is_dir():
        raise UserError(f"--resume {c.resume}: no such checkpoint folder; pass auto, never, or a folder such as "
                        "runs/<config>/<N>GPU/<run>/checkpoints")
    if c.init_from is not None:
        if c.resume not in ("auto", "never"):
            raise UserError(f"--init_from and --resume {c.resume} both say where a new run starts; pass one of them")
        if not Path(c.init_from).exists():
            raise UserError(f"--init_from {c.init_from}: no such run directory or file; pass a finished run's "
                            "directory (runs/<config>/<N>GPU/<run>) or its checkpoints/model.pt")


def _check_paths(cfg: Config, launch: Launch) -> None:
    check_output_path("--run_num", cfg.logging.run_num, name=True)
    expdir = check_output_path("--expdir", cfg.logging.expdir)
    existing = next(p for p in (expdir, *expdir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"--expdir {expdir}: {existing} is a file, not a directory; pass another --expdir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--expdir {expdir}: {existing} is not writable; pass a writable --expdir")
