"""Convert a plain :class:`networks.vit.VisionTransformer` to tensor + context parallel, in place.

Usage in a training loop (``mesh`` built elsewhere with dims named ``tp``, ``cp``, ``dp``)::

    model = VisionTransformer(...)                       # same seed on every rank
    apply_tensor_context_parallel(model, mesh["tp"].get_group(), mesh["cp"].get_group())
    opt = torch.optim.AdamW(model.parameters())          # build AFTER the conversion
    ...
    out = model(inp)                  # (B, C_out, H, W), full and identical on every tp/cp rank
    loss = loss_fn(out, tar)          # the same full loss on every tp/cp rank
    loss.backward()
    reduce_replicated_gradients(model)   # sums gradients over cp (no-op without cp)
    clip_grad_norm_(model, 1.0)          # optional; TP-aware (torch's would see only local shards)
    opt.step()
    torch.save(full_state_dict(model), path)   # collective; loadable by the plain model

What changes (parameter names and order are kept, so optimizer and checkpoint code work):

* ``patch_embed`` -> :class:`DistributedPatchEmbed`: the full image goes in on every rank,
  only this CP rank's tokens come out (``pos_embed`` is sliced the same way).
* ``blocks[i].norm1/norm2`` -> :class:`DistributedLayerNorm`; ``attn`` ->
  :class:`DistributedAttention` (heads over TP, K/V all-gathered over CP); ``mlp`` ->
  :class:`DistributedMLP` (column ``fc1``, row ``fc2``).
* ``norm`` and ``head`` run on local tokens; the head outputs are all-gathered over CP
  (backward: each rank keeps its own tokens' gradient) and un-patchified, so every
  parameter's CP-local gradient covers exactly its tokens and summing over CP is exact.
* ``head``, ``pos_embed`` and ``patch_embed`` stay replicated over TP.

The model file keeps no distributed code: the instance's class is swapped for
:class:`TensorContextParallelViT`, a subclass overriding ``forward`` / ``forward_features``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distributed.layers import (
    DistributedAttention,
    DistributedLayerNorm,
    DistributedMLP,
    DistributedPatchEmbed,
    ParallelGroups,
    ShardLayout,
    ParallelModule,
    find_groups,
    local_tensor,
    tp_sharded_params,
    reduce_replicated_gradients,
)
from distributed.mappings import all_gather_uneven, gather_from_parallel_region, group_rank, group_size
from networks.vit import VisionTransformer

__all__ = [
    "TensorContextParallelViT",
    "apply_tensor_context_parallel",
    "full_state_dict",
    "load_full_state_dict",
    "tp_layouts",
    "reduce_replicated_gradients",
    "clip_grad_norm_",
]

# wrapper prefixes that do not belong to the plain model's names (DDP, torch.compile, checkpointing)
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class TensorContextParallelViT(ParallelModule, VisionTransformer):
    """A :class:`VisionTransformer` after :func:`apply_tensor_context_parallel` (never built directly).

    ``forward``: ``(B, C_in, H, W)`` full image on every rank -> ``(B, C_out, H, W)`` full
    prediction, identical on every TP and CP rank. Differentiating a loss of it on every
    rank gives each rank its CP-local share of every gradient (see
    :func:`reduce_replicated_gradients`); the image gradient is partial per CP rank.
    """

    parallel_groups: ParallelGroups
    # marker read by distributed.parallelize (which avoids importing this module eagerly)
    _tensor_context_parallel = True

    def forward_local_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> normalized tokens of this CP rank ``(B, n_r, D)``."""
        pe = self.patch_embed
        x = pe(x) + self.pos_embed.narrow(1, pe.offset, pe.num_local)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> all normalized tokens ``(B, N, D)`` (all-gathered over CP)."""
        return gather_from_parallel_region(self.forward_local_features(x), 1, self.patch_embed.seq_shapes,
                                           self.cp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # head on local tokens, then gather: keeps the head's gradient CP-local like every other one
        y = self.head(self.forward_local_features(x))
        y = gather_from_parallel_region(y, 1, self.patch_embed.seq_shapes, self.cp_group)
        return self.unpatchify(y)


def apply_tensor_context_parallel(model: VisionTransformer, tp_group: dist.ProcessGroup | None,
                                  cp_group: dist.ProcessGroup | None) -> TensorContextParallelViT:
    """Convert ``model`` in place to TP over ``tp_group`` and CP over ``cp_group``; returns it.

    Every rank must hold the same dense model (same seed or loaded checkpoint): each rank
    keeps its TP shard of it, so the parallel run starts from exactly the single-process
    initialization. ``None`` / one-rank groups disable that kind of parallelism. Build the
    optimizer afterwards (parameters are new tensors); apply DDP / FSDP over the dp group
    afterwards too.

    Heads are split over TP with :func:`compute_split_shapes` (uneven allowed), and the
    ``N`` tokens over CP likewise (e.g. 15 tokens over 2 CP ranks -> 8 + 7).

    Raises:
        TypeError: if ``model`` is not a ``VisionTransformer``.
        ValueError: if it is already converted, a block has fewer heads than TP ranks, or
            there are more CP ranks than tokens. The model is unchanged when raising.
    """
    if isinstance(model, TensorContextParallelViT):
        raise ValueError("model is already tensor/context parallel")
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"expected a VisionTransformer, got {type(model).__name__}")
    tp, cp = group_size(tp_group), group_size(cp_group)
    n = model.patch_embed.num_patches
    if cp > n:
        raise ValueError(f"{cp} CP ranks but only {n} tokens")
    for i, blk in enumerate(model.blocks):
        if blk.attn.num_heads < tp:
            raise ValueError(f"block {i} has {blk.attn.num_heads} heads, fewer than {tp} TP ranks")

    model.patch_embed = DistributedPatchEmbed.from_dense(model.patch_embed, tp_group, cp_group)
    for blk in model.blocks:
        blk.norm1 = DistributedLayerNorm.from_dense(blk.norm1, tp_group, cp_group)
        blk.attn = DistributedAttention.from_dense(blk.attn, tp_group, cp_group, seq_len=n)
        blk.norm2 = DistributedLayerNorm.from_dense(blk.norm2, tp_group, cp_group)
        blk.mlp = DistributedMLP.from_dense(blk.mlp, tp_group, cp_group)
    model.norm = DistributedLayerNorm.from_dense(model.norm, tp_group, cp_group)
    model.parallel_groups = ParallelGroups(tp_group, cp_group)
    model.__class__ = TensorContextParallelViT
    return model


# ----------------------------------------------------------------------------- checkpoints


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tp_layouts(model: nn.Module) -> dict[str, tuple[ShardLayout, dist.ProcessGroup | None]]:
    """Plain-model parameter name -> (layout, tp group) of every TP-sharded tensor of ``model`` (any
    wrapper: DDP, compile, activation checkpointing, FSDP2); empty for a model without TP layers.
    The group is None (or of one rank) when the layer is not split."""
    out = {}
    for mod_name, mod in model.named_modules():
        for pname, layout in getattr(mod, "tp_layouts", {}).items():
            key = _clean_name(f"{mod_name}.{pname}" if mod_name else pname)
            out[key] = (layout, mod.tp_group)
    return out


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense ``state_dict`` of a (possibly TP/CP-converted) model, on every rank.

    TP shards are all-gathered over their TP group and reassembled in the plain model's
    layout (e.g. fused QKV rows back to ``(3, heads, head_dim)``); DTensor parameters
    (FSDP2) are first gathered with ``full_tensor()``. Names are the plain
    ``VisionTransformer``'s (wrapper prefixes such as ``module.`` / ``_orig_mod.`` dropped),
    so ``VisionTransformer(...).load_state_dict(full_state_dict(model))`` works on one GPU.
    Returns detached copies on the parameters' devices.

    Collective: every rank of the TP (and dp, for FSDP) groups must call it.
    """
    layouts = tp_layouts(model)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = _clean_name(name)
        t = t.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if key in layouts:
            layout, group = layouts[key]
            shapes = [layout.local_size(r, group_size(group)) for r in range(group_size(group))]
            gathered = all_gather_uneven(t.contiguous(), layout.dim, shapes, group)
            t = layout.unshard(list(torch.split(gathered, shapes, layout.dim)))
        out[key] = t.clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load a dense (plain ``VisionTransformer``) state dict into a TP/CP-converted model.

    Each rank copies its TP shard of every sharded tensor and the whole of every
    replicated one; no communication. Keys may carry wrapper prefixes (``module.``).
    Load before wrapping with FSDP2 (``fully_shard``); DDP / compile wrappers are fine.

    Raises:
        KeyError: with ``strict``, if keys are missing or unexpected.
        ValueError: if a tensor's shape does not match the plain model's.
        TypeError: if a parameter is a DTensor (already sharded by FSDP2).
    """
    layouts = tp_layouts(model)
    own = {_clean_name(k): v for k, v in model.state_dict(keep_vars=True).items()}
    given = {_clean_name(k): v for k, v in state_dict.items()}
    missing, unexpected = sorted(own.keys() - given.keys()), sorted(given.keys() - own.keys())
    if strict and (missing or unexpected):
        raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    for key, t in own.items():
        if key not in given:
            continue
        if hasattr(t, "full_tensor"):
            raise TypeError(f"{key} is a DTensor: call load_full_state_dict before fully_shard")
        full = given[key]
        if key in layouts:
            layout, group = layouts[key]
            full = layout.shard(full, group_rank(group), group_size(group))
        if full.shape != t.shape:
            raise ValueError(f"{key}: shape {tuple(full.shape)} does not match the model's {tuple(t.shape)}")
        t.copy_(full)


# ----------------------------------------------------------------------------- gradient clipping


def _local_norm_part(g: torch.Tensor, norm_type: float, dtype: torch.dtype) -> torch.Tensor:
    """``max|g|`` for the inf-norm, else ``sum |g|^p`` (DTensor shards gathered by ``full_tensor``)."""
    n = torch.linalg.vector_norm(g, norm_type, dtype=dtype)
    n = n.full_tensor() if hasattr(n, "full_tensor") else n
    return n if norm_type == float("inf") else n.pow(norm_type)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """TP-aware ``torch.nn.utils.clip_grad_norm_``: the norm of the *dense* gradient.

    ``||g||_p^p = sum_tp(sum_{sharded} |g_r|^p) + sum_{replicated} |g|^p`` (sharded parts
    all-reduced over TP, replicated ones counted once; inf-norm: a max). Every rank then
    scales its gradients by ``min(1, max_norm / (norm + 1e-6))`` exactly like torch, so TP
    replicas stay identical. Call after :func:`reduce_replicated_gradients` (gradients are
    then identical over CP, so no CP reduction is needed). Returns the total norm as a
    0-d tensor (float64 if any gradient is float64, else float32) on the gradients' device.

    Raises:
        RuntimeError: if ``error_if_nonfinite`` and the norm is nan or inf.
    """
    tp_group, _ = find_groups(model)
    sharded = tp_sharded_params(model)
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    dtype = torch.float64 if any(p.grad.dtype == torch.float64 for p in params) else torch.float32
    device = params[0].grad.device
    is_inf = norm_type == float("inf")
    parts = {True: torch.zeros((), dtype=dtype, device=device), False: torch.zeros((), dtype=dtype, device=device)}
    for p in params:
        n = _local_norm_part(p.grad, norm_type, dtype).to(device)
        key = id(p) in sharded
        parts[key] = torch.maximum(parts[key], n) if is_inf else parts[key] + n
    if tp_group is not None:
        dist.all_reduce(parts[True], op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=tp_group)
    total = torch.maximum(parts[True], parts[False]) if is_inf else (parts[True] + parts[False]).pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        local_tensor(p.grad).mul_(coef.to(p.grad.dtype))
    return total
