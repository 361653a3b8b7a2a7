"""Convert a plain :class:`networks.vit.VisionTransformer` to tensor + context parallel, in place.

Usage in a training loop (``mesh`` built elsewhere with dims named ``tp``, ``cp``, ``dp``)::

    model = VisionTransformer(...)                       # same seed on every rank
    apply_tensor_context_parallel(model, mesh["tp"], mesh["cp"].get_group())  # sequence parallel by default
    # data parallelism over the joint dp x cp mesh sums the CP parts of every gradient
    # (distributed/parallelize.py: FSDP or replicate; the step scales the loss gradient by cp)
    opt = torch.optim.AdamW(model.parameters())          # build AFTER the conversion
    out = model(inp)                  # (B, C_out, H, W), full and identical on every tp/cp rank

What changes (parameter names are kept, so optimizer and checkpoint code work; the layers are in
``distributed/layers.py``):

* ``patch_embed`` embeds only this CP rank's tokens, and the model's ``embed`` hook adds this rank's
  slice of ``pos_embed``;
* ``blocks[i].norm1/norm2``, ``norm``: LayerNorms with replicated parameters; ``attn``: heads over TP, K/V
  all-gathered over CP (or passed around a ring of the CP ranks, ``cp_attention="ring"``); ``mlp``: column
  ``fc1``, row ``fc2``;
* ``head`` runs on local tokens and the model's ``unpatchify`` hook first all-gathers the head outputs over
  CP (backward: each rank keeps its own tokens' gradient), so every parameter's CP-local gradient covers
  exactly its tokens and summing over CP is exact;
* with ``sequence_parallel`` (and ``tp > 1``) each CP rank's tokens are split over TP too from the patch
  embedding to the head (Megatron-LM's sequence parallelism, ``distributed/sequence_parallel.py``): the
  activations between the blocks are ``(B, n / (cp * tp), D)`` per rank, ``unpatchify`` gathers over TP and
  then CP, and the gradients of the TP-replicated parameters (LayerNorms, row-parallel biases, patch and
  position embeddings, head) are summed over TP in backward, so the gradient contract above is unchanged.

Every parameter becomes a DTensor on the TP mesh (``tp_mesh`` None: plain tensors, context parallel
alone). :func:`checkpoint_views` names the parameters held in another shape than the plain model's.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from distributed.layers import (DistributedAttention, DistributedLayerNorm, DistributedMLP, DistributedPatchEmbed,
                                Groups, ReplicatedLinear, parallel_param, replicated_param, tp_group)
from distributed.mappings import gather_from_parallel_region, group_size
from networks.vit import Attention, VisionTransformer

# wrapper prefixes that are not part of the plain model's names (DDP, torch.compile, activation checkpointing)
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def apply_tensor_context_parallel(model: VisionTransformer, tp_mesh: DeviceMesh | None,
                                  cp_group: dist.ProcessGroup | None,
                                  sequence_parallel: bool = False, cp_attention: str = "all_gather",
                                  attention_backend: str = "auto") -> VisionTransformer:
    """Convert ``model`` in place to TP over ``tp_mesh`` and CP over ``cp_group``, with sequence parallelism
    over TP if ``sequence_parallel`` (ignored without TP); returns it. ``cp_attention`` (``all_gather`` or
    ``ring``) and ``attention_backend`` go to every :class:`DistributedAttention`.

    Every rank must hold the same dense model (same seed or loaded checkpoint): each rank keeps its TP shard
    of it, so the parallel run starts from exactly the single-process initialization. ``None`` (or one rank)
    disables that kind of parallelism. Build the optimizer afterwards (parameters are new tensors); apply data
    parallelism afterwards too. Heads are split over TP, the ``N`` tokens over CP, both by
    ``compute_split_shapes`` (uneven allowed: 15 tokens over 2 CP ranks -> 8 + 7), and under sequence
    parallelism each CP rank's tokens over TP the same way.

    Raises:
        TypeError: ``model`` is not a ``VisionTransformer``.
        ValueError: it is already converted, a block has fewer heads than TP ranks, there are more CP ranks
            than tokens, or ``cp_attention`` is unknown. The model is unchanged when raising.
    """
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"expected a VisionTransformer, got {type(model).__name__}")
    if not isinstance(model.blocks[0].attn, Attention):
        raise ValueError("model is already tensor/context parallel")
    tp, cp, n = group_size(tp_group(tp_mesh)), group_size(cp_group), model.patch_embed.num_patches
    if cp > n:
        raise ValueError(f"{cp} CP ranks but only {n} tokens")
    if cp_attention not in ("all_gather", "ring"):
        raise ValueError(f"cp_attention must be 'all_gather' or 'ring', got {cp_attention!r}")
    for i, blk in enumerate(model.blocks):
        if blk.attn.num_heads < tp:
            raise ValueError(f"block {i} has {blk.attn.num_heads} heads, fewer than {tp} TP ranks")
    sp = sequence_parallel and tp > 1
    model.patch_embed = DistributedPatchEmbed(model.patch_embed, tp_mesh, cp_group, sp)
    model.pos_embed = parallel_param(model.pos_embed, tp_mesh, Replicate())
    seq_shapes = model.patch_embed.tp_shapes if sp else None  # this CP rank's tokens split over TP
    for blk in model.blocks:
        blk.norm1 = DistributedLayerNorm(blk.norm1, tp_mesh, sp)
        blk.attn = DistributedAttention(blk.attn, tp_mesh, cp_group, seq_len=n, seq_shapes=seq_shapes,
                                        cp_attention=cp_attention, attention_backend=attention_backend)
        blk.norm2 = DistributedLayerNorm(blk.norm2, tp_mesh, sp)
        blk.mlp = DistributedMLP(blk.mlp, tp_mesh, cp_group, seq_shapes=seq_shapes)
    model.norm = DistributedLayerNorm(model.norm, tp_mesh, sp)
    model.head = ReplicatedLinear(model.head, tp_mesh, sp)
    model.parallel_groups = Groups(tp_mesh, cp_group, sp)
    model.embed = types.MethodType(_embed_local_tokens, model)
    model.unpatchify = types.MethodType(_gather_then_unpatchify, model)
    return model


def _embed_local_tokens(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """``embed`` under CP: this rank's tokens ``(B, n_r, D)`` and their slice of the position embedding.

    Under sequence parallelism each TP rank adds its own tokens' slice, and backward sums the position
    embedding's gradient over TP (``replicated_param``), so every TP rank holds it for all of the CP rank's
    tokens. (Slicing after a scatter whose backward all-gathers computes the same, but torch 2.11's dynamo lost
    that gradient: zero on every rank, ``tests/multiprocess/test_sequence_parallel_compiled.py``.)"""
    pe = model.patch_embed
    pos = replicated_param(model.pos_embed, model.parallel_groups).narrow(1, pe.offset, pe.num_local)
    return pe(x) + pos


def _gather_then_unpatchify(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """``unpatchify`` under CP: every rank's head outputs all-gathered (over TP under sequence parallelism, then
    over CP), then the image."""
    pe, groups = model.patch_embed, model.parallel_groups
    if groups.sequence_parallel:
        x = gather_from_parallel_region(x, 1, pe.tp_shapes, groups.tp)
    x = gather_from_parallel_region(x, 1, pe.seq_shapes, groups.cp)
    return VisionTransformer.unpatchify(model, x)


def clean_name(name: str) -> str:
    """A parameter name without wrapper prefixes: the plain model's name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def checkpoint_views(model: nn.Module) -> dict[str, torch.Size]:
    """Plain-model parameter name -> plain shape, for every parameter of ``model`` (any wrapper) held in
    another shape (the head axes of tensor-parallel layers); empty for other models."""
    out = {}
    for mod_name, module in model.named_modules():
        for name, shape in getattr(module, "plain_shapes", {}).items():
            out[clean_name(f"{mod_name}.{name}" if mod_name else name)] = shape
    return out
