"""Apply parallelism and memory levers to a plain ``networks/vit.py`` model, in this order:

1. float8 linears in the blocks with ``--amp_mode fp8`` (``distributed/float8.py``), before anything
   wraps or shards them;
2. tensor / context parallel (``distributed/tensor_parallel.py``) over the ``tp``/``cp`` mesh dims;
3. activation checkpointing (full, every k-th block, or an op-level selective policy);
4. ``torch.compile`` (per block under FSDP so FSDP's hooks stay outside compiled code);
5. data parallel over ``dp``: FSDP2 ``fully_shard`` (ZeRO-2, ZeRO-3, HSDP) or DDP.

Also the hooks the training loop needs: gradient-sync suppression during accumulation,
reduction of gradients of tensor/context-replicated parameters, and a GradScaler whose skipped
steps agree over tensor/context-parallel peers (:func:`build_grad_scaler`).
"""

from __future__ import annotations

import contextlib
import inspect
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from distributed.world import World
from distributed.float8 import apply_float8
from kernels.cudnn_attention import packed_attention
from utils.config.schema import ParallelConfig, PrecisionConfig

# autocast dtype, also FSDP's parameter dtype; fp8 runs bf16 wherever its float8 linears do not
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}

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
}


def _op_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int, blocks: int = 0) -> None:
    """Wrap ``model.blocks`` for activation checkpointing (in place).

    ``mode``: ``full`` recomputes every block in backward. ``selective`` with ``blocks=n > 0``
    checkpoints the first n blocks (memory and recompute both move about 1/depth per block, so n
    sets the trade-off finely); else with ``every=k > 0`` every k-th block; with ``every=0`` it keeps
    the matmul/attention outputs of every block and recomputes the rest
    (``torch.utils.checkpoint.create_selective_checkpoint_contexts``).

    ``blocks`` must not exceed the depth (``utils.schema.validate`` checks it).
    """
    if mode == "none":
        return
    for i, block in enumerate(model.blocks):
        if mode == "full" or (blocks > 0 and i < blocks) or (blocks == 0 and every > 0 and i % every == 0):
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif blocks == 0 and every == 0:
            model.blocks[i] = checkpoint_wrapper(
                block, preserve_rng_state=False,
                context_fn=partial(create_selective_checkpoint_contexts, _op_policy))


def apply_packed_attention(model: nn.Module) -> None:
    """Run every block's attention through the packed-QKV cuDNN kernel (``kernels/cudnn_attention.py``):
    it reads q, k, v where the QKV projection wrote them and writes their gradients into one buffer."""
    for block in model.blocks:
        block.attn.attend = packed_attention


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
    dtype (bf16 for fp8), the float8 linears' weights in float8 where ``distributed/float8.py`` enables it.
    """
    mesh = world.meshes["hsdp" if parallel.fsdp == "hsdp" else "dp"]
    param_dtype = AMP_DTYPES[amp_mode]
    reduce_dtype = torch.float32 if parallel.fsdp_reduce_dtype == "fp32" else param_dtype
    kwargs = dict(mesh=mesh, reshard_after_forward=parallel.fsdp != "zero2",
                  mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
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


def uses_fsdp(parallel: ParallelConfig, world: World) -> bool:
    """FSDP applies only with more than one data-parallel rank (one process trains unsharded)."""
    return parallel.fsdp != "none" and world.dp > 1


def build_parallel_model(build, parallel: ParallelConfig, precision: PrecisionConfig, world: World,
                         grad_accum_steps: int = 1) -> nn.Module:
    """Build the model with ``build()`` and parallelize it on ``world.device``.

    Every rank starts from the weights that ``build`` makes on the CPU with the current seed, the
    same as a single-GPU run. With FSDP (and no tensor/context parallelism) the model is built on
    the meta device and sharded first; only rank 0 builds the full weights, on the host, and
    ``set_model_state_dict(broadcast_from_rank0=True)`` sends each rank just its shards, so the
    full model never sits on one GPU. With ``fsdp_cpu_offload`` the shards are materialized on
    the host, where FSDP's offload policy requires them.
    """
    fsdp_only = uses_fsdp(parallel, world) and world.tp == world.cp == 1
    if not fsdp_only:
        return parallelize_model(build().to(world.device), parallel, precision, world, grad_accum_steps)
    full = build().state_dict() if world.is_main else {}
    with torch.device("meta"):
        model = build()
    model = parallelize_model(model, parallel, precision, world, grad_accum_steps)
    model.to_empty(device="cpu" if parallel.fsdp_cpu_offload else world.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def parallelize_model(model: nn.Module, parallel: ParallelConfig, precision: PrecisionConfig, world: World,
                      grad_accum_steps: int = 1) -> nn.Module:
    """Return the model to train: float8, parallelized, checkpointed, compiled and on ``world.device``."""
    fsdp = uses_fsdp(parallel, world)
    if precision.amp_mode == "fp8":
        apply_float8(model, precision, fsdp)
    if world.tp > 1 or world.cp > 1:
        from distributed.tensor_parallel import apply_tensor_context_parallel
        apply_tensor_context_parallel(model, world.group("tp"), world.group("cp"))
    if precision.attention_backend == "cudnn_packed":
        apply_packed_attention(model)
    apply_activation_checkpointing(model, precision.activation_checkpointing, precision.ac_every,
                                   precision.ac_blocks)
    if precision.enable_jit:
        if precision.compile_pdl:
            enable_programmatic_dependent_launch()
        mode = None if precision.compile_mode == "default" else precision.compile_mode
        for part in (model.blocks if fsdp else [model]):
            part.compile(mode=mode)
    if fsdp:
        apply_fsdp(model, parallel, precision.amp_mode, world)
    elif world.dp > 1:
        model = DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None,
                    process_group=world.group("dp"), bucket_cap_mb=parallel.bucket_cap_mb,
                    gradient_as_bucket_view=True, **_NO_BUFFER_SYNC,
                    # static_graph trips an internal assert under no_sync (gradient accumulation)
                    static_graph=parallel.ddp_static_graph and grad_accum_steps == 1)
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
    """The plain model inside DDP (FSDP2 and compile modify modules in place)."""
    return model.module if isinstance(model, DDP) else model


def is_tensor_context_parallel(model: nn.Module) -> bool:
    return getattr(unwrap(model), "_tensor_context_parallel", False)


def reduce_replicated_gradients(model: nn.Module) -> None:
    """Sum gradients of parameters replicated over context-parallel peers (call after the last
    backward of a step, before clipping); nothing to do without tensor/context parallelism."""
    if is_tensor_context_parallel(model):
        from distributed.layers import reduce_replicated_gradients as reduce_tp
        reduce_tp(unwrap(model))


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm of the full (unsharded) model, whatever the parallelism.

    Tensor-parallel shards are plain tensors, so their norm is reduced over the tp group
    (``distributed.tensor_parallel.clip_grad_norm_``); FSDP's DTensor gradients are handled by
    ``torch.nn.utils.clip_grad_norm_``.
    """
    if is_tensor_context_parallel(model):
        from distributed.tensor_parallel import clip_grad_norm_
        return clip_grad_norm_(unwrap(model), max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


class ModelParallelGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check covers the whole model across tensor/context-parallel
    peers.

    Each tp rank checks only its own slices of the gradients, so an overflow in one rank's slice
    would skip the step there and not on its peers, and the replicas (and their loss scales) would
    part. After the check (``unscale_``, or the check a fused optimizer's ``step`` makes) the found-inf
    flags are all-reduced (max) over ``groups``, so every peer skips the same steps and keeps the same
    scale. FSDP's DTensor gradients already agree over dp (DTensor reduces the flag over its mesh),
    and DDP's gradients are equal there.

    Args:
        device: device type of the gradients (``"cuda"``, ``"cpu"``).
        groups: process groups to agree over (the tp and cp groups); None entries are skipped.
        **kwargs: ``torch.amp.GradScaler``'s (``init_scale``, ``growth_interval``, ...).
    """

    def __init__(self, device: str, groups, **kwargs):
        super().__init__(device, **kwargs)
        self.groups = [g for g in groups if g is not None]

    # the one funnel of both unscale_ and _check_inf_per_device (fused optimizers), as torch's own
    # ShardedGradScaler overrides it
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # a rank without gradients still joins the reduction, so no peer waits for it
        for flag in list(per_device.values()) or [found_inf]:
            for group in self.groups:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return per_device


def build_grad_scaler(device_type: str, enabled: bool, world: World) -> torch.amp.GradScaler:
    """The GradScaler of an fp16 run (``enabled``; a disabled one is a no-op): a
    :class:`ModelParallelGradScaler` over the tp and cp groups under tensor/context parallelism,
    else torch's."""
    groups = [world.group("tp"), world.group("cp")]
    if enabled and any(g is not None for g in groups):
        return ModelParallelGradScaler(device_type, groups)
    return torch.amp.GradScaler(device_type, enabled=enabled)
