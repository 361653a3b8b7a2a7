"""Apply parallelism and memory levers to a plain ``networks/vit.py`` model, in this order:

1. float8 linears in the blocks with ``--amp_mode fp8`` (``utils/precision/float8.py``), before anything
   wraps or shards them; with ``--amp_mode bf16_pure`` a bf16 residual stream (:func:`apply_bf16_residual`);
2. tensor / context parallel (``distributed/tensor_parallel.py``) over the ``tp``/``cp`` mesh dims: every
   parameter a DTensor on the ``tp`` mesh;
3. activation checkpointing (full, every k-th block, or an op-level selective policy);
4. ``torch.compile`` (per block under FSDP so FSDP's hooks stay outside compiled code);
5. data parallel: FSDP2 ``fully_shard`` (ZeRO-2, ZeRO-3, HSDP) or DDP over ``dp``. Under tensor or context
   parallelism the data-parallel mesh also spans the ``cp`` ranks (``dp_cp``), reduced by FSDP or ``replicate``
   (FSDP2's DDP, which takes DTensor parameters): each context-parallel rank's gradient covers its own tokens,
   so the step multiplies the loss's gradient by ``cp`` (:func:`gradient_factor`) and the mean over ``dp x cp``
   is the single-process gradient of the global batch.

Also the hook the training loop needs: gradient-sync suppression during accumulation. Clipping, Adam and the
GradScaler need no special case: they see DTensors (``torch.nn.utils.clip_grad_norm_`` reduces the norm over
their meshes; the GradScaler's inf check over the DTensor's mesh).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from functools import partial

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from distributed.async_tp import enable_async_tp
from distributed.ddp import FixedBucketsDDP
from distributed.sequence_parallel import bucket_replicated_gradients
from distributed.simulate import is_simulated
from distributed.tensor_parallel import apply_tensor_context_parallel
from distributed.world import World
from kernels.cudnn_attention import packed_attention
from kernels.cudnn_fp8_attention import fp8_attention_unsupported, fp8_packed_attention
from utils.config.schema import ParallelConfig, PrecisionConfig
from utils.precision.amp import AMP_DTYPES, apply_bf16_residual
from utils.precision.float8 import apply_float8

log = logging.getLogger(__name__)

# Op-level selective checkpointing: keep the outputs of matmuls and attention (expensive to
# recompute), recompute the cheap pointwise and normalization ops (most of the activation bytes).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_mm.default,  # the float8 GEMMs of --amp_mode fp8
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.era5vit.cudnn_packed_attention.default,
    torch.ops.era5vit.cudnn_fp8_attention.default,
}


# The amax reductions behind float8 scales (torchao: ``max`` tensorwise, ``amax`` rowwise): a scalar or a column
# each, but each reads a whole activation or weight; saving them keeps full checkpointing from recomputing them
# (torchtitan's selective policy saves ``max`` for the same reason)
_SCALE_OPS = {torch.ops.aten.max.default, torch.ops.aten.amax.default}


def _op_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _scale_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SCALE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int, blocks: int = 0,
                                   save_scales: bool = False, compiled: bool = False) -> None:
    """Wrap ``model.blocks`` for activation checkpointing (in place).

    ``mode``: ``full`` recomputes every block in backward. ``selective`` with ``blocks=n > 0``
    checkpoints the first n blocks (memory and recompute both move about 1/depth per block, so n
    sets the trade-off finely); else with ``every=k > 0`` every k-th block; with ``every=0`` it keeps
    the matmul/attention outputs of every block and recomputes the rest
    (``torch.utils.checkpoint.create_selective_checkpoint_contexts``).

    With ``save_scales`` (float8 training) a recomputed block keeps the amax reductions of its float8 scales
    from the forward instead of recomputing them. ``compiled`` (the blocks will run under ``torch.compile``):
    a recomputed block tags every op for recomputation through the selective-checkpoint dispatch mode, which
    sees the ops inside ``torch.autograd.Function`` s (fp8 attention, torchao's float8 matmul, the tensor-parallel
    mappings). torch's plain checkpoint under compile tagged only the region's top-level graph, so the
    partitioner saved those ops' outputs instead (pytorch/pytorch#177396 routes plain checkpointing through the
    same mode): with torch 2.11 at ``vit_2b`` in fp8, fp8 attention ran once a step instead of twice and peak
    memory rose 1.9 GiB (docs/speed.md).

    ``blocks`` must not exceed the depth (``utils.config.validate.validate`` checks it).
    """
    if mode == "none":
        return
    policy = _scale_policy if save_scales else _recompute_policy if compiled else None
    whole = {"context_fn": partial(create_selective_checkpoint_contexts, policy)} if policy else {}
    for i, block in enumerate(model.blocks):
        if mode == "full" or (blocks > 0 and i < blocks) or (blocks == 0 and every > 0 and i % every == 0):
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False, **whole)
        elif blocks == 0 and every == 0:
            model.blocks[i] = checkpoint_wrapper(
                block, preserve_rng_state=False,
                context_fn=partial(create_selective_checkpoint_contexts, _op_policy))


def apply_packed_attention(model: nn.Module) -> None:
    """Run every block's attention through the packed-QKV cuDNN kernel (``kernels/cudnn_attention.py``):
    it reads q, k, v where the QKV projection wrote them and writes their gradients into one buffer."""
    for block in model.blocks:
        block.attn.attend = packed_attention


def fp8_attention_fallback(model: nn.Module, precision: PrecisionConfig, world: World) -> str | None:
    """Under ``--amp_mode fp8``: None when attention runs in fp8 (``kernels/cudnn_fp8_attention.py``), else why
    bf16 attention runs instead (one phrase for the startup line)."""
    if not precision.fp8_attention:
        return "--fp8_attention false"
    if world.model_parallel:
        return "tensor and context parallel attention have kernels of their own"
    if precision.attention_backend not in ("auto", "cudnn", "cudnn_packed"):
        return f"--attention_backend {precision.attention_backend} was chosen"
    return fp8_attention_unsupported(world.device, model.blocks[0].attn.head_dim)


def apply_fp8_attention(model: nn.Module, precision: PrecisionConfig, world: World) -> None:
    """Run every block's attention in fp8 where :func:`fp8_attention_fallback` allows; rank 0 logs which
    attention runs, once per process and reason (the batch tuner builds a model per trial)."""
    reason = fp8_attention_fallback(model, precision, world)
    if reason is None:
        for block in model.blocks:
            block.attn.attend = fp8_packed_attention
    if world.is_main:
        _log_fp8_attention(reason)


@functools.lru_cache(maxsize=None)
def _log_fp8_attention(reason: str | None) -> None:
    log.info("fp8 attention: cuDNN, e4m3 q, k, v and output, e5m2 gradients" if reason is None else
             f"fp8 attention off, bf16 attention instead: {reason}")


def data_parallel_mesh(parallel: ParallelConfig, world: World):
    """The mesh data parallelism reduces gradients over: ``dp``, with context parallelism ``dp_cp``, with ensemble
    parallelism alone ``dp_ens`` (``hsdp``, ``hsdp_cp``, ``hsdp_ens``: 2D, replicate x shard)."""
    hsdp = parallel.fsdp == "hsdp"
    if world.cp > 1:
        return world.meshes["hsdp_cp" if hsdp else "dp_cp"]
    if world.ens > 1:
        return world.meshes["hsdp_ens" if hsdp else "dp_ens"]
    return world.meshes["hsdp" if hsdp else "dp"]


def _fsdp_shard_dim(param: nn.Parameter):
    """FSDP shards a tensor-parallel parameter along its largest dimension that tensor parallelism does not
    split (the fused QKV weight ``(3, heads, head_dim, D)`` along ``D``), others along dim 0."""
    placements = getattr(param, "placements", ())
    taken = {p.dim for p in placements if isinstance(p, Shard)}
    free = [d for d in range(param.dim()) if d not in taken]
    return Shard(max(free, key=lambda d: param.shape[d])) if free and taken else Shard(0)


def apply_fsdp(model: nn.Module, parallel: ParallelConfig, amp_mode: str, world: World) -> None:
    """Shard with FSDP2 ``fully_shard``: each block, then the root (in place).

    ``zero3``/``hsdp`` free the gathered parameters after forward (re-gathered in backward);
    ``zero2`` keeps them through backward (only gradients and optimizer state sharded).
    ``hsdp`` shards within ``dp_shard`` and replicates across ``dp_replicate``.
    ``fsdp_prefetch`` = n lets the next n blocks' all-gathers run ahead of compute
    (``set_modules_to_forward_prefetch``/``set_modules_to_backward_prefetch``): more overlap,
    more memory held; 0 keeps FSDP2's defaults (gather on use, backward implicit next-1).
    ``fsdp_cpu_offload`` keeps shards, gradients and optimizer state on the host
    (``CPUOffloadPolicy``; the model must be materialized on the CPU). Parameters are gathered in the AMP
    dtype (bf16 for fp8), the float8 linears' weights in float8 where ``utils/precision/float8.py`` enables it.
    """
    kwargs = dict(mesh=data_parallel_mesh(parallel, world), reshard_after_forward=parallel.fsdp != "zero2",
                  mp_policy=mixed_precision(parallel, amp_mode), shard_placement_fn=_fsdp_shard_dim)
    if parallel.fsdp_cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    n = parallel.fsdp_prefetch
    if n > 0:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + n])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - n):i][::-1])


def mixed_precision(parallel: ParallelConfig, amp_mode: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered in the AMP dtype (bf16 for fp8), gradients reduced in fp32 (or, with
    ``fsdp_reduce_dtype param``, in the parameters' dtype)."""
    param_dtype = AMP_DTYPES[amp_mode]
    return MixedPrecisionPolicy(param_dtype=param_dtype,
                                reduce_dtype=torch.float32 if parallel.fsdp_reduce_dtype == "fp32" else param_dtype)


def gradient_factor(world: World) -> float:
    """What the loss's gradient is multiplied by so that data parallelism yields the single-process gradient:
    ``cp x ens``. DDP, FSDP and ``replicate`` average over the ``dp x ens x cp`` ranks of the data-parallel mesh,
    while each context-parallel rank's gradient is only its tokens' part of the sum and each ensemble-parallel
    rank's only its members' part (exact when ``cp x ens`` is a power of two)."""
    return float(world.cp * world.ens)


def build_parallel_model(build, parallel: ParallelConfig, precision: PrecisionConfig, world: World,
                         grad_accum_steps: int = 1) -> nn.Module:
    """Build the model with ``build()`` and parallelize it on ``world.device``.

    Every rank starts from the weights that ``build`` makes on the CPU with the current seed, the
    same as a single-GPU run. With FSDP (and no tensor/context parallelism) the model is built on
    the meta device and sharded first; only rank 0 builds the full weights, on the host, and
    ``set_model_state_dict(broadcast_from_rank0=True)`` sends each rank just its shards, so the
    full model never sits on one GPU. With ``fsdp_cpu_offload`` the shards are materialized on
    the host, where FSDP's offload policy requires them. Under tensor/context parallelism each rank
    builds the full model and keeps its shards. A simulated rank (``distributed/simulate.py``) has no rank 0 to
    load from: under FSDP its shards stay uninitialized (its losses are meaningless anyway).
    """
    if not world.fsdp_only:
        return parallelize_model(build().to(world.device), parallel, precision, world, grad_accum_steps)
    simulated = is_simulated(world.env)  # one rank with no peers to load from: its weights stay uninitialized
    full = build().state_dict() if world.is_main and not simulated else {}
    with torch.device("meta"):
        model = build()
    model = parallelize_model(model, parallel, precision, world, grad_accum_steps)
    model.to_empty(device="cpu" if parallel.fsdp_cpu_offload else world.device)
    if not simulated:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def parallelize_model(model: nn.Module, parallel: ParallelConfig, precision: PrecisionConfig, world: World,
                      grad_accum_steps: int = 1) -> nn.Module:
    """Return the model to train: float8, parallelized, checkpointed, compiled and on ``world.device``."""
    fsdp = world.uses_fsdp
    if precision.amp_mode == "fp8":
        apply_float8(model, precision, fsdp)
    if world.model_parallel:
        apply_tensor_context_parallel(model, world.meshes["tp"] if world.tp > 1 else None, world.group("cp"),
                                      parallel.sequence_parallel, parallel.cp_attention, precision.attention_backend)
        if parallel.async_tp:  # before compiling: the linears' one-piece graphs are what inductor's pass fuses
            enable_async_tp(model, announce=world.is_main)
        if parallel.sp_grad_bucketing:
            bucket_replicated_gradients()
    if precision.attention_backend == "cudnn_packed":
        apply_packed_attention(model)
    if precision.amp_mode == "fp8":
        apply_fp8_attention(model, precision, world)
    if precision.amp_mode == "bf16_pure":
        apply_bf16_residual(model)
    apply_activation_checkpointing(model, precision.activation_checkpointing, precision.ac_every,
                                   precision.ac_blocks,
                                   save_scales=precision.amp_mode == "fp8" and precision.fp8_save_scales,
                                   compiled=precision.enable_jit)
    if precision.enable_jit:
        if precision.compile_pdl:
            enable_programmatic_dependent_launch()
        mode = None if precision.compile_mode == "default" else precision.compile_mode
        for part in (model.blocks if fsdp else [model]):
            part.compile(mode=mode)
    if fsdp:
        apply_fsdp(model, parallel, precision.amp_mode, world)
    elif world.model_parallel and world.dp * world.ens * world.cp > 1:
        replicate(model, mesh=data_parallel_mesh(parallel, world),
                  mp_policy=mixed_precision(parallel, precision.amp_mode))
    elif world.ddp:
        model = FixedBucketsDDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None,
                                process_group=data_parallel_mesh(parallel, world).get_group(),
                                bucket_cap_mb=parallel.bucket_cap_mb, gradient_as_bucket_view=True, **_NO_BUFFER_SYNC,
                                # static_graph trips an internal assert under no_sync (gradient accumulation)
                                static_graph=parallel.ddp_static_graph and grad_accum_steps == 1)
        if is_simulated(world.env):
            # the fake process group's all-reduce returns no tensor, which DDP's reducer rejects; the no-op
            # hook hands back the bucket in place, as NCCL's all-reduce does, so the memory is the real rank's
            model.register_comm_hook(None, noop_hook)
    return model


# The model has no buffers to keep in sync; torch >= 2.13 renamed the DDP switch.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                   else {"broadcast_buffers": False})


def enable_programmatic_dependent_launch() -> None:
    """Compile Triton kernels with Programmatic Dependent Launch (Inductor's ``triton.enable_pdl``).

    On Hopper and newer GPUs each kernel is launched while the previous one on the stream drains, so
    the ~2-5 us gap between dependent kernels (about 1.5 ms of a 90 ms ``short_opt`` step on an H100,
    hundreds of kernels per step) overlaps with work. Other devices ignore it. Global: it applies to
    every graph compiled afterwards in this process.
    """
    import torch._inductor.config as inductor_config
    inductor_config.triton.enable_pdl = True


def gradient_sync(model: nn.Module, sync: bool):
    """Context for one micro-step: gradients are reduced across ``dp`` only when ``sync``.

    DDP: ``no_sync()``; FSDP2: ``set_requires_gradient_sync``; otherwise nothing to do.
    """
    if isinstance(model, DDP):
        return contextlib.nullcontext() if sync else model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP (FSDP2, ``replicate`` and compile modify modules in place)."""
    return model.module if isinstance(model, DDP) else model
