"""What happens when a device runs out of memory: one line naming the rank, phase, batch, figures and
remedies, an allocator snapshot at the failed allocation, and the same exit status on every rank."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

from training.monitor.memory import GIB
from utils.config.schema import MemoryConfig
from utils.core.component import Component
from utils.core.errors import OutOfMemory

# what a user can change, in the order worth trying (the one place the OOM line and the docs take them from)
OOM_REMEDIES = ("lower --local_batch_size (raise --grad_accum_steps to keep the global batch), or find the best "
                "clean one with python -m tools.tune_batch_size (or --local_batch_size auto)",
                "--activation_checkpointing full (or selective --ac_blocks N)", "--fsdp zero3",
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)")


OOM_SNAPSHOT = "oom_snapshot.pickle"


def snapshot_on_oom(cfg: MemoryConfig) -> bool:
    """``memory_snapshot_on_oom``, which defaults (null) to ``memory_profile``."""
    return cfg.memory_profile if cfg.memory_snapshot_on_oom is None else cfg.memory_snapshot_on_oom


def record_history(cfg: MemoryConfig, clear: bool = False) -> None:
    """Record the CUDA allocator's alloc/free history (``torch.cuda.memory._record_memory_history``, a
    ring buffer of ``memory_profile_max_entries`` events, stack traces per ``memory_profile_stacks``)."""
    stacks = cfg.memory_profile_stacks  # context None: no stack traces at all
    torch.cuda.memory._record_memory_history(enabled="all", context=None if stacks == "none" else "all",
                                             stacks="python" if stacks == "none" else stacks,
                                             max_entries=cfg.memory_profile_max_entries, clear_history=clear)


class OutOfMemoryHandler(Component):
    """Turns a ``torch.OutOfMemoryError`` in a phase of training into :class:`OutOfMemory`: one line
    naming the rank, the phase, the local batch, the memory figures and :data:`OOM_REMEDIES`; every
    rank of the job then exits with :data:`~utils.core.errors.EXIT_OUT_OF_MEMORY` (``distributed/world.py``).

    With ``memory_snapshot_on_oom`` on CUDA, the allocator's history is recorded from the start and
    the allocator's OOM observer dumps a snapshot (``<directory>/rank<r>/oom_snapshot.pickle``, for
    https://pytorch.org/memory_viz) at the failed allocation, before anything is freed.

    Args:
        cfg: the ``memory`` config section.
        directory: ``<run_dir>/memory``.
        rank: this process's rank.
        device: its device.
        local_batch_size: samples per micro-batch on this rank (named in the message).
    """

    def __init__(self, cfg: MemoryConfig, directory: Path, rank: int, device: torch.device, local_batch_size: int):
        self.rank, self.device, self.local_batch_size = rank, device, local_batch_size
        self.snapshot: Path | None = None
        if snapshot_on_oom(cfg) and device.type == "cuda":
            self.snapshot = Path(directory) / f"rank{rank}" / OOM_SNAPSHOT
            record_history(cfg)
            torch._C._cuda_attach_out_of_memory_observer(self._dump)

    def close(self, error: BaseException | None) -> None:
        """Stop the allocator history this handler started."""
        if self.snapshot is not None:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _dump(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        self.snapshot.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.snapshot))

    @contextlib.contextmanager
    def phase(self, name: str):
        """Run the ``with`` body as phase ``name`` (forward, backward, optimizer step, validation).

        Raises:
            OutOfMemory: the body ran out of device memory.
        """
        try:
            yield
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(self.message(name, str(exc))) from None

    def message(self, phase: str, error: str) -> str:
        """The one-line description of an OOM in ``phase`` (``error``: PyTorch's message)."""
        asked = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]iB)", error)
        text = (f"rank {self.rank} ran out of {self.device} memory in {phase} at local batch "
                f"{self.local_batch_size}" + (f" trying to allocate {asked.group(1)}" if asked else ""))
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            text += (f": {free / GIB:.2f} GiB free of {total / GIB:.2f} GiB, PyTorch holds "
                     f"{torch.cuda.memory_allocated(self.device) / GIB:.2f} GiB allocated, "
                     f"{torch.cuda.memory_reserved(self.device) / GIB:.2f} GiB reserved")
        if self.snapshot is not None and self.snapshot.exists():
            text += f"; allocator snapshot {self.snapshot} (open at https://pytorch.org/memory_viz)"
        return text + "; try " + "; or ".join(OOM_REMEDIES)
