"""The host copy of a checkpoint: host buffers allocated once, early and in the background.

A DCP save reads the state from host memory: an async save must copy it there before training
changes it again, and on GPUs a sync save is fastest when one device-to-host copy at full bandwidth
comes first and the writer threads then only do file I/O. The copy is fast into page-locked
memory, but allocating and page-locking that memory is slow: on ``vit_2b`` with ZeRO-3 over 2
H200s (11.4 GB of model and Adam state per rank), DCP's ``BlockingAsyncStager`` spent 11-19 s of
the first save doing it (``benchmarks/checkpoint.py``), which a save must not stall training for.

:class:`HostStager` allocates the buffers in a background thread as soon as the state exists
(:meth:`HostStager.prepare`, after the first optimizer step has created Adam's moments), while
training goes on, and reuses them for every save. PyTorch's default page-locking,
``cudaHostAlloc``, holds the CUDA driver while it works, so the training thread's kernel launches
would wait for all of it (11.4 GB on an H200: 7 s of allocation, 7 s of stall,
``benchmarks/host_buffers.py``); :func:`register_pinned_memory` switches PyTorch to touching the
pages first and then registering them (1.3 s, 0.03 s of stall). It follows DCP's ``AsyncStager`` protocol, so
``dcp.async_save(..., async_stager=...)`` uses it; for a sync save, ``dcp.save(stager.stage(state))``.

What :meth:`HostStager.stage` returns for each kind of value in the state:

* a ``DTensor`` (FSDP2 and HSDP shards, tensor-parallel parameters): a DTensor of the same global shape,
  mesh and placements whose local shard is the host copy, which DCP writes exactly as it writes the
  original (same chunks, same metadata, replicas deduplicated the same way);
* a plain tensor: its copy;
* anything else (numbers, strings, RNG states): the same object, as DCP's own stagers keep it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

__all__ = ["HostStager", "register_pinned_memory"]

log = logging.getLogger(__name__)

Spec = tuple[torch.Size, torch.dtype]  # the shape and dtype of one host buffer

CHUNK_BYTES = 64 << 20  # tensors are packed into page-locked chunks of at most this size
ALIGN = 64  # bytes: each tensor's start in a chunk (any dtype's alignment, a cache line)
PINNED_BY_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def register_pinned_memory() -> None:
    """Have PyTorch page-lock host memory with ``cudaHostRegister`` on pages it touched first, in 8
    threads, instead of ``cudaHostAlloc``, which holds the CUDA driver while it works and so stalls
    the training thread's kernel launches (PyTorch's ``pinned_use_cuda_host_register`` allocator
    option, documented under ``PYTORCH_CUDA_ALLOC_CONF``). Call at start-up, before anything is
    page-locked, so every pinned block of the process comes the same way. A pinned setting of the
    user's own in ``PYTORCH_CUDA_ALLOC_CONF`` wins. Nothing on CPU."""
    own = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if torch.cuda.is_available() and "pinned_use_cuda_host_register" not in own:
        torch._C._accelerator_setAllocatorSettings(PINNED_BY_REGISTER)  # what PyTorch's own tests call


def _host_buffers(specs: list[Spec], pin: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Chunks of at most :data:`CHUNK_BYTES` (a bigger tensor gets its own) and one buffer per spec,
    a view of a chunk at an :data:`ALIGN`-byte offset. Few big blocks instead of one per tensor:
    PyTorch rounds each page-locked block up to a power of two, which :data:`CHUNK_BYTES` is."""
    groups: list[list[tuple[int, Spec]]] = []  # (offset in the chunk, spec) per chunk
    used = 0
    for shape, dtype in specs:
        nbytes = shape.numel() * dtype.itemsize
        if not groups or (used and used + nbytes > CHUNK_BYTES):
            groups.append([])
            used = 0
        groups[-1].append((used, (shape, dtype)))
        used += -(-nbytes // ALIGN) * ALIGN
    chunks, buffers = [], []
    for group in groups:
        offset, (shape, dtype) = group[-1]
        chunk = torch.empty(max(offset + shape.numel() * dtype.itemsize, 1), dtype=torch.uint8, pin_memory=pin)
        chunks.append(chunk)
        buffers += [chunk[off:off + s.numel() * d.itemsize].view(d).view(s) for off, (s, d) in group]
    return chunks, buffers


def _leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors a stage copies, in a fixed order: local shards of DTensors, plain tensors (nested dicts,
    lists and tuples are walked)."""
    out: list[torch.Tensor] = []
    _map(tree, lambda t: out.append(t) or t)
    return out


def _map(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with each tensor :func:`_leaves` finds replaced by ``fn(tensor)``; a DTensor's local shard is
    replaced, its global shape, mesh and placements kept."""
    if isinstance(tree, DTensor):
        return DTensor.from_local(fn(tree.to_local()), tree.device_mesh, tree.placements, run_check=False,
                                  shape=tree.shape, stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn) for v in tree)
    return tree


def _specs(tree: Any) -> list[Spec]:
    return [(t.shape, t.dtype) for t in _leaves(tree)]


class HostStager(AsyncStager):
    """Host buffers for every tensor of a checkpointed state, allocated once and reused (DCP's
    ``AsyncStager`` protocol; see the module docstring).

    Args:
        device: the training device. On CUDA the buffers are page-locked (``pin_memory``), so the
            device-to-host copies run at full bandwidth without blocking; on CPU they are plain.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self._specs: list[Spec] | None = None  # what the buffers (being) allocated are for
        self._buffers: list[torch.Tensor] | None = None  # one per tensor of the state, views of _chunks
        self._chunks: list[torch.Tensor] = []  # the host memory itself
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- DCP's AsyncStager protocol
    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # stage() returns after the copies are complete

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` in the host buffers, complete when this returns (local to this rank).

        Allocates the buffers first if :meth:`prepare` was not called for a state of this structure
        (the first save then pays for it). Values change shape the usual way: see the module docstring.

        Raises:
            RuntimeError: allocating the buffers failed (host out of memory, page-locking refused).
        """
        self.prepare(state)
        buffers = self._wait()
        it = iter(buffers)
        staged = _map(state, lambda t: next(it).copy_(t.detach(), non_blocking=self.pin))
        if self.pin:
            torch.cuda.current_stream(self.device).synchronize()
        return staged

    def close(self) -> None:
        """Release the buffers (after the last save has been written)."""
        self._wait_quietly()
        self._thread, self._buffers, self._specs, self._chunks = None, None, None, []

    # ---- ours
    def prepare(self, state: dict[str, Any]) -> None:
        """Start allocating buffers for ``state`` in a background thread, unless buffers for a state of
        the same structure (shapes and dtypes, in order) exist or are on their way. Returns at once."""
        specs = _specs(state)
        if specs == self._specs:
            return
        self.close()
        self._specs, self._error = specs, None
        self._thread = threading.Thread(target=self._allocate, args=(specs,), name="checkpoint-host-buffers",
                                        daemon=True)
        self._thread.start()

    def _allocate(self, specs: list[Spec]) -> None:
        try:
            if self.pin:  # the thread's own current device, else it would make a context on GPU 0
                torch.cuda.set_device(self.device)
            self._chunks, self._buffers = _host_buffers(specs, self.pin)
            log.debug("checkpoint host buffers: %.2f GB", sum(c.nbytes for c in self._chunks) / 1e9)
        except BaseException as exc:  # re-raised on the training thread by stage()
            self._error = exc

    def _wait(self) -> list[torch.Tensor]:
        self._thread.join()
        if self._error is not None:
            error, self._specs = self._error, None  # a later stage() tries again
            raise RuntimeError(f"allocating the checkpoint's host buffers failed: {error}") from error
        return self._buffers

    def _wait_quietly(self) -> None:
        """Let an allocation finish before its buffers are replaced or released (its error no longer matters)."""
        if self._thread is not None:
            self._thread.join()
