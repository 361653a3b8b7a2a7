"""Tensor-parallel slices as DCP shards of the dense (single-GPU) tensors.

Our tensor-parallel layers (``distributed/layers.py``) keep each rank's slice of a weight as a plain
tensor under the plain model's name, the same name on every tp rank: handed to
``torch.distributed.checkpoint`` (DCP) as they are, DCP would take them for replicas and keep one.
Here every such tensor, and each optimizer state of its shape (Adam ``exp_avg``, ``exp_avg_sq``), is
presented to DCP as a :class:`DenseShards`: the blocks of the *dense* tensor that this rank holds,
each at its offset in the dense tensor. A checkpoint therefore holds the single-GPU layout, whatever
tp, cp, dp or FSDP wrote it, and DCP reshards it on load to any other of them (or to a plain model).

The map from a rank's tensor to dense blocks composes two splits:

* TP (:class:`~distributed.layers.ShardLayout`): along ``dim``, the dense tensor is ``groups``
  blocks of ``units * unit_size``; a tp rank owns ``count`` units of each group, so its slice is
  ``groups`` separate blocks of the dense tensor (fused qkv: whole heads of q, k and v).
* FSDP over dp: the parameter is a DTensor whose *global* shape is the tp slice's, sharded along
  dim 0 (uneven, HSDP replicas too); this rank holds the rows its ``compute_local_shape_and_global_offset``
  names, which cut the ``groups`` blocks further.

Replicas (DDP and HSDP replicas, cp ranks) produce the same blocks at the same offsets, which DCP's
save planner writes once. :class:`DenseSavePlanner` / :class:`DenseLoadPlanner` (DCP's default
planners, plus the lookup of a :class:`DenseShards` block) must be passed to ``dcp.save`` /
``async_save`` / ``load``; checkpoints they write load with DCP's default planner (``tools.export_model``,
``dcp_to_torch_save``). Blocks are views of the model's and optimizer's tensors, so a load writes
into them in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from distributed.layers import ShardLayout
from distributed.mappings import group_rank, group_size
from distributed.tensor_parallel import tp_layouts

__all__ = ["DenseShards", "DenseSavePlanner", "DenseLoadPlanner", "dense_blocks", "dense_shards", "dense_view",
           "plain_view"]

Block = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the dense tensor, the block's tensor)


class DenseShards:
    """This rank's part of one dense tensor as DCP sees it (``torch.distributed._checkpointable``).

    Args:
        size: the dense tensor's shape.
        dtype: its dtype.
        blocks: ``(offsets, tensor)`` pairs: ``tensor`` (any device, any strides, shape = the block's
            size) sits at ``offsets`` in the dense tensor; blocks do not overlap. May be empty (an
            FSDP rank without rows of this parameter).
        source: the tensor (or DTensor) the blocks are views of, which :func:`plain_view` puts back;
            None for a host copy (``distributed/host_staging.py``).
    """

    def __init__(self, size: torch.Size, dtype: torch.dtype, blocks: list[Block], source: torch.Tensor | None = None):
        self._size, self.dtype, self.blocks, self.source = torch.Size(size), dtype, blocks, source
        self._by_offset = {torch.Size(off): t for off, t in blocks}

    def size(self) -> torch.Size:
        """The dense shape (DCP's load checks it against the checkpoint's)."""
        return self._size

    # ---- DCP's _Checkpointable protocol
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), t.shape),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self._size))
                for off, t in self.blocks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(off), t.shape) for off, t in self.blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._by_offset[torch.Size(index.offset)]

    def __repr__(self) -> str:
        return f"DenseShards(size={tuple(self._size)}, dtype={self.dtype}, blocks={len(self.blocks)})"


def _lookup(state_dict: dict[str, Any], index: MetadataIndex):
    """The tensor of ``index`` when it names a :class:`DenseShards` block, else None."""
    obj = state_dict.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, DenseShards) else None


class DenseSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also writes :class:`DenseShards` (whose blocks DCP's lookup,
    made for tensors, would not find)."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _lookup(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class DenseLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that also reads into :class:`DenseShards` blocks."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up (torch 2.13's _init_state_dict, which materializes meta tensors) replaces every
        # value of a type it does not know by None, in place: put the DenseShards back, in the
        # caller's dict and in the planner's flattened one
        kept = list(_shard_paths(state_dict))
        super().set_up_planner(state_dict, metadata, is_coordinator)
        flat_key = {tuple(path): key for key, path in self.mappings.items()} if self.flatten_state_dict else {}
        for path, shards in kept:
            _set_path(state_dict, path, shards)
            self.state_dict[flat_key.get(path, path[-1])] = shards

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found


def _shard_paths(tree: Any, path: tuple = ()):
    """``(path, DenseShards)`` of every DenseShards in nested dicts and lists (path: keys and indices)."""
    if isinstance(tree, DenseShards):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _shard_paths(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _shard_paths(v, path + (i,))


def _set_path(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def dense_blocks(layout: ShardLayout, rank: int, world: int, offsets: tuple[int, ...],
                 sizes: tuple[int, ...]) -> list[tuple[tuple[int, ...], int, int]]:
    """Where the box ``[offsets, offsets + sizes)`` of tp rank ``rank``'s slice (of ``world``) lies in
    the dense tensor.

    The slice has the dense tensor's shape except along ``layout.dim``
    (``layout.local_size(rank, world)``). Returns ``(dense offsets, start, length)`` per dense block
    the box touches: the box's part ``[start, start + length)`` along ``layout.dim`` (relative to the
    box) sits at ``dense offsets``, with the box's extent in every other dimension. Empty for an empty
    box.
    """
    if 0 in sizes:
        return []
    first, count = layout.unit_range(rank, world)
    dim, unit = layout.dim, layout.unit_size
    mine, dense_group = count * unit, layout.units * unit  # one group's extent in the slice, in the dense tensor
    lo, hi = offsets[dim], offsets[dim] + sizes[dim]
    out = []
    for g in range(layout.groups):
        start, stop = max(lo, g * mine), min(hi, (g + 1) * mine)
        if start < stop:
            dense = list(offsets)
            dense[dim] = g * dense_group + first * unit + (start - g * mine)
            out.append((tuple(dense), start - lo, stop - start))
    return out


def dense_shards(t: torch.Tensor, layout: ShardLayout, rank: int, world: int) -> DenseShards:
    """``t`` (tp rank ``rank``'s slice, a tensor or an FSDP DTensor of the slice) as views of dense blocks.

    Raises:
        ValueError: ``t``'s size along ``layout.dim`` is not the slice's.
    """
    if t.shape[layout.dim] != layout.local_size(rank, world):
        raise ValueError(f"a tensor of shape {tuple(t.shape)} is not tp rank {rank} of {world}'s slice of {layout}")
    if isinstance(t, DTensor):
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
    else:
        sizes, offsets, local = tuple(t.shape), (0,) * t.dim(), t
    size = list(t.shape)
    size[layout.dim] = layout.full_size
    blocks = [(off, local.detach().narrow(layout.dim, start, length))
              for off, start, length in dense_blocks(layout, rank, world, tuple(offsets), tuple(sizes))]
    return DenseShards(torch.Size(size), t.dtype, blocks, source=t)


def dense_view(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (``{"model": ..., "optim": ..., ...}`` as ``get_state_dict`` gives them) with every
    tensor-parallel slice, and every optimizer state of its shape, as :class:`DenseShards` for DCP.

    ``model`` is the model the state belongs to (any wrapper); other entries and tensors are kept
    (the same objects). ``state`` itself is not changed. Returns ``state`` without tp > 1.

    Raises:
        ValueError: a tensor-parallel parameter is missing from ``state["model"]``.
    """
    sharded = {name: (layout, group_rank(group), group_size(group))
               for name, (layout, group) in tp_layouts(model).items() if group_size(group) > 1}
    if not sharded:
        return state
    missing = sorted(sharded.keys() - state["model"].keys())
    if missing:
        raise ValueError(f"tensor-parallel parameters {missing} are not in the model state dict")
    model_sd = {k: dense_shards(v, *sharded[k]) if k in sharded else v for k, v in state["model"].items()}
    optim = dict(state["optim"])
    optim["state"] = {k: _optim_view(v, state["model"].get(k), sharded.get(k)) for k, v in optim["state"].items()}
    return {**state, "model": model_sd, "optim": optim}


def _optim_view(param_state: dict[str, Any], param: torch.Tensor | None, shard) -> dict[str, Any]:
    """One parameter's optimizer state with the tensors of the parameter's shape as DenseShards
    (Adam's moments); scalars (``step``) stay."""
    if shard is None:
        return param_state
    return {k: dense_shards(v, *shard) if isinstance(v, torch.Tensor) and v.dim() and v.shape == param.shape else v
            for k, v in param_state.items()}


def _map_shards(tree: Any, fn) -> Any:
    if isinstance(tree, DenseShards):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_shards(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_shards(v, fn) for v in tree]
    return tree


def plain_view(state: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`dense_view`: every :class:`DenseShards` replaced by the tensor it views (which
    a DCP load wrote into); other values kept, dicts and lists copied."""
    return _map_shards(state, lambda shards: shards.source)

