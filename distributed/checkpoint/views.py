"""Checkpoints in the single-GPU layout for parameters held in another shape.

Tensor-parallel layers hold the fused QKV weight as ``(3, heads, head_dim, D)`` and the output projection as
``(D, heads, head_dim)`` (``distributed/layers.py``), so that DTensor's split of the head axis gives each rank
whole heads. The plain model's shapes, ``(3 * D, D)`` and ``(D, D)``, are the same numbers in the same
row-major order: a reshape. These planners write such tensors (parameters and their Adam moments) in the
plain shape and read them back from it, so a checkpoint of any parallelism holds the single-GPU layout and
loads into any other, or into the plain model.

A rank's box of the viewed tensor (its DTensor shard: ``compute_local_shape_and_global_offset``) is, in the
plain shape, several boxes: along each plain dimension made of merged view dimensions, one contiguous run for
every index of the merged dimensions before the last one the box cuts (the q, k and v parts of a rank's heads
are three runs). Each run is a DCP chunk of its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from distributed.world import local_tensor
from utils.core.errors import UnsafeCheckpoint
from utils.core.safe_load import load_data

# a box of a tensor: (offsets, sizes) per dimension
Box = tuple[tuple[int, ...], tuple[int, ...]]


def merged_dims(view: tuple[int, ...], plain: tuple[int, ...]) -> list[range]:
    """The view dimensions each plain dimension merges (consecutive runs whose sizes multiply to it).

    Raises:
        ValueError: ``plain`` is not ``view`` with some consecutive dimensions merged.
    """
    groups, start = [], 0
    for size in plain:
        end = start
        while end < len(view) and math.prod(view[start:end]) < size:
            end += 1
        if math.prod(view[start:end]) != size:
            raise ValueError(f"shape {tuple(plain)} does not merge dimensions of {tuple(view)}")
        groups.append(range(start, end))
        start = end
    if start != len(view) or any(len(g) == 0 for g in groups):
        raise ValueError(f"shape {tuple(plain)} does not merge dimensions of {tuple(view)}")
    return groups


def _runs(view: tuple[int, ...], dims: range, offsets, sizes) -> Iterator[tuple[int, int, tuple]]:
    """``(plain offset, length, index)`` of the contiguous runs of one merged group: ``index`` selects the run
    in the box (ints for the dimensions before the last cut one, slices after)."""
    dims = list(dims)
    cut = max((i for i, d in enumerate(dims) if sizes[d] < view[d]), default=0)
    inner = math.prod(view[d] for d in dims[cut + 1:])
    strides = [math.prod(view[d] for d in dims[i + 1:]) for i in range(len(dims))]
    for lead in itertools.product(*(range(sizes[d]) for d in dims[:cut])):
        start = sum((offsets[d] + i) * strides[k] for k, (d, i) in enumerate(zip(dims, lead)))
        start += offsets[dims[cut]] * strides[cut]
        yield start, sizes[dims[cut]] * inner, tuple(lead) + (slice(None),) * (len(dims) - cut)


def plain_boxes(view: tuple[int, ...], plain: tuple[int, ...], box: Box) -> list[tuple[Box, tuple]]:
    """The boxes of the plain-shaped tensor that the view's ``box`` covers, each with the index of its part in
    the box's local tensor (reshape that part to the plain box's sizes)."""
    offsets, sizes = box
    if 0 in sizes:
        return []
    per_group = [list(_runs(view, dims, offsets, sizes)) for dims in merged_dims(tuple(view), tuple(plain))]
    out = []
    for combo in itertools.product(*per_group):
        plain_box = (tuple(r[0] for r in combo), tuple(r[1] for r in combo))
        out.append((plain_box, tuple(i for r in combo for i in r[2])))
    return out


def _box(t: torch.Tensor) -> Box:
    """This rank's box of ``t`` in its global shape (all of a plain tensor)."""
    if isinstance(t, DTensor):
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(offsets), tuple(sizes)
    return (0,) * t.dim(), tuple(t.shape)


class _Views:
    """Which state-dict entries are viewed, by their flattened DCP key: a model parameter ``model.<name>`` or an
    optimizer state of its shape ``optim.state.<name>.<state>``."""

    def __init__(self, views: dict[str, torch.Size]):
        self.views = {name: tuple(shape) for name, shape in views.items()}

    def plain(self, fqn: str, obj: Any) -> tuple[int, ...] | None:
        """The plain shape of entry ``fqn`` when it holds a viewed tensor, else None."""
        if not isinstance(obj, torch.Tensor) or not self.views:
            return None
        name = fqn.removeprefix("model.") if fqn.startswith("model.") else \
            fqn.removeprefix("optim.state.").rpartition(".")[0] if fqn.startswith("optim.state.") else None
        plain = self.views.get(name)
        if plain is None or tuple(obj.shape) == plain or obj.numel() != math.prod(plain):
            return None
        return plain

    def part(self, obj: torch.Tensor, plain: tuple[int, ...], offset: torch.Size) -> tuple[tuple, Box]:
        """``(index into the local tensor, plain box)`` of the plain box at ``offset``."""
        for plain_box, index in plain_boxes(tuple(obj.shape), plain, _box(obj)):
            if plain_box[0] == tuple(offset):
                return index, plain_box
        raise ValueError(f"no chunk of this rank at offset {tuple(offset)}")


class ViewSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that writes viewed tensors in their plain shape (``views``: plain parameter
    name -> plain shape, ``distributed.tensor_parallel.checkpoint_views``)."""

    def __init__(self, views: dict[str, torch.Size]):
        super().__init__()
        self.views = _Views(views)

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(plan, items=[w for item in plan.items for w in self._plain_items(item)])
        return self.plan

    def _plain_items(self, item: WriteItem) -> list[WriteItem]:
        obj = self.state_dict.get(item.index.fqn)
        plain = self.views.plain(item.index.fqn, obj)
        if plain is None or item.tensor_data is None:
            return [item]
        return [WriteItem(index=MetadataIndex(item.index.fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                                                      properties=item.tensor_data.properties, size=torch.Size(plain)))
                for (off, size), _ in plain_boxes(tuple(obj.shape), plain, _box(obj))]

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        plain = self.views.plain(index.fqn, obj)
        if plain is None:
            return super().lookup_object(index)
        part, (_, sizes) = self.views.part(obj, plain, index.offset)
        return local_tensor(obj)[part].reshape(sizes)


class ViewLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that reads viewed tensors from their plain shape: each plain box is read into a
    buffer, which is copied into the local tensor once all its reads are done; and that reads the non-tensor
    items (the schedule's, the train state's numbers) with ``torch.load(weights_only=True)``
    (:func:`utils.core.safe_load.load_data`, printing no warning), so a crafted checkpoint runs no code (DCP's own
    planner unpickles them without restriction).

    Raises:
        UnsafeCheckpoint: a non-tensor item holds more than plain data.
    """

    def __init__(self, views: dict[str, torch.Size], **kwargs):
        super().__init__(**kwargs)
        self.views = _Views(views)
        self.buffers: dict[tuple[str, tuple], list] = {}  # (fqn, plain offset) -> [buffer, reads left, target]

    def create_local_plan(self) -> LoadPlan:
        viewed = {k: v for k, v in self.state_dict.items() if self.views.plain(k, v) is not None}
        rest = {k: v for k, v in self.state_dict.items() if k not in viewed}
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        return dataclasses.replace(plan, items=plan.items + [r for k, v in viewed.items() for r in self._plain_reads(k, v)])

    def _plain_reads(self, fqn: str, obj: torch.Tensor) -> list[ReadItem]:
        plain = self.views.plain(fqn, obj)
        md = self.metadata.state_dict_metadata.get(fqn)
        if md is None:
            raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
        if tuple(md.size) != plain:
            raise ValueError(f"Size mismatch between saved {md.size} and current: {torch.Size(plain)} for {fqn}")
        local = local_tensor(obj)
        reads = []
        for (off, size), part in plain_boxes(tuple(obj.shape), plain, _box(obj)):
            chunk = ChunkStorageMetadata(torch.Size(off), torch.Size(size))
            items = create_read_items_for_chunk_list(fqn, md, [chunk])
            self.buffers[(fqn, off)] = [torch.empty(size, dtype=local.dtype, device=local.device), len(items),
                                        local[part]]
            reads += items
        return reads

    def load_bytes(self, read_item: ReadItem, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = load_data(value)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint(f"checkpoint item {fqn} holds more than plain data: loading it could run code, so "
                                   "it is refused; use a checkpoint you trust") from None
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        *parents, last = self.mappings[fqn]
        container = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = obj

    def resolve_tensor(self, read_item: ReadItem):
        entry = self.buffers.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset)))
        if entry is None:
            return super().resolve_tensor(read_item)
        return self.transform_tensor(read_item, entry[0])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
        entry = self.buffers.get(key)
        if entry is None:
            return super().commit_tensor(read_item, tensor)
        entry[1] -= 1
        if entry[1] == 0:  # every read of this box is in the buffer: into the parameter (or moment) itself
            buffer, _, target = self.buffers.pop(key)
            with torch.no_grad():
                target.copy_(buffer.reshape(target.shape))
