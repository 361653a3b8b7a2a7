"""Bytes of a training step by kind: parameters, gradients, optimizer state (this rank's shards), and the
activations autograd saves for backward, per step and per ViT block (:class:`ActivationCounter`)."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from distributed.world import local_tensor

# model.blocks[i] of networks/vit.py, also inside DDP ("module.blocks.0"); under activation
# checkpointing this is the checkpoint wrapper, which saves the block's input before the block runs
BLOCK_NAME = re.compile(r"(?:^|\.)(blocks\.\d+)$")


OUTSIDE_BLOCKS = "other"  # patch embedding, final norm, head and loss


# how far back a saved tensor's autograd graph is followed through single-input nodes (views, casts)
# to find the parameter it was computed from
PARAMETER_COPY_DEPTH = 4


def tensor_bytes(tensors) -> int:
    """Bytes (numel x element size) of this rank's parts of ``tensors``."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``; local shards)."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


def optimized_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def gradient_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's gradients (local shards) of the optimizer's parameters, as they are now."""
    return tensor_bytes(p.grad for p in optimized_parameters(optimizer) if p.grad is not None)


def is_parameter_copy(t: torch.Tensor) -> bool:
    """True if ``t`` is a parameter, or was computed from one parameter by views and casts alone: its
    autograd graph leads, through single-input nodes, to a parameter's ``AccumulateGrad``. This covers
    ``weight.t()`` saved by ``F.linear``, autocast's low-precision weight copies and FSDP2's unsharded
    parameters (``nn.Parameter`` during forward)."""
    if isinstance(t, nn.Parameter):
        return True
    node = t.grad_fn
    for _ in range(PARAMETER_COPY_DEPTH):
        inputs = [] if node is None else [f for f, _ in node.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf
            return isinstance(node.variable, nn.Parameter)
    return False


@dataclass
class StepActivations:
    """Activation bytes of one training step: ``by_block`` maps ``blocks.<i>`` and ``other`` to bytes;
    ``micro_batches`` counts the model's forward calls."""

    by_block: dict[str, int] = field(default_factory=dict)
    micro_batches: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_block.values())


class ActivationCounter:
    """Counts the bytes autograd saves for backward during forward, per step and per ViT block.

    A ``torch.autograd.graph.saved_tensors_hooks`` pack hook sees every tensor saved for backward
    (https://pytorch.org/docs/stable/autograd.html#hooks-for-saved-tensors). Counted: the storage
    bytes (``untyped_storage().nbytes()``) of each saved tensor that is not a parameter copy
    (:func:`is_parameter_copy`), each storage once per step (views of one storage, such as q, k and v
    of the fused QKV output, count once). Attributed to the ``model.blocks[i]`` running when it was
    saved, else to ``other`` (patch embedding, head, and the loss computed under the step).

    Activation checkpointing (``torch.utils.checkpoint``, non-reentrant, as
    ``distributed/parallelize.py`` applies it): a checkpointed block stores its inputs through the
    pack hooks active when it is called (``_CheckpointFrame.save_inputs``), so they are counted;
    inside the block checkpoint pushes its own hooks, which store nothing and hide the block's saves
    from this counter, also during the recomputation in backward. So a fully checkpointed block
    counts exactly its input, the memory it keeps alive. The outputs an op-level selective policy
    (``--activation_checkpointing selective --ac_every 0 --ac_blocks 0``) caches are held by
    checkpoint's dispatch mode, not saved through hooks: they are not counted (the module table has
    them, under activations).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.blocks = {m: match.group(1) for name, m in model.named_modules() if (match := BLOCK_NAME.search(name))}

    @contextlib.contextmanager
    def count(self) -> Iterator[StepActivations]:
        """Count during the ``with`` body (one training step); yields its :class:`StepActivations`."""
        result = StepActivations()
        seen = WeakIdKeyDictionary()  # storages counted this step (weak: a freed one is forgotten)
        current = [OUTSIDE_BLOCKS]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not is_parameter_copy(t):
                with torch.no_grad():
                    storage = local_tensor(t).untyped_storage()
                if storage not in seen:
                    seen[storage] = True
                    result.by_block[current[0]] = result.by_block.get(current[0], 0) + storage.nbytes()
            return t

        def enter(module, args):
            current[0] = self.blocks[module]

        def leave(module, args, output):
            current[0] = OUTSIDE_BLOCKS

        def forward_call(module, args):
            result.micro_batches += 1

        handles = [self.model.register_forward_pre_hook(forward_call)]
        for block in self.blocks:
            handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield result
        finally:
            for handle in handles:
                handle.remove()
