"""Per-epoch memory report: peaks, cudaMalloc retries and OOMs, reduced over ranks; and what
happens when a device runs out of memory (:class:`OutOfMemoryHandler`).

The CUDA caching allocator retries a failed ``cudaMalloc`` after freeing its cached blocks
(``num_alloc_retries`` in ``torch.cuda.memory_stats``); every retry synchronizes the device
and stalls the step, so throughput is best just below the batch size that causes retries,
not just below OOM. ``torch.cuda.reset_peak_memory_stats`` does not reset the retry or OOM
counters, so the tracker reports their change over the epoch.
"""

from __future__ import annotations

import contextlib
import re
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from utils.errors import OutOfMemory
from utils.schema import MemoryConfig

GIB = 1024**3


NO_RETRY = -1  # first_retry_step of an epoch without cudaMalloc retries


class MemoryTracker:
    """Call :meth:`start_epoch` before an epoch, :meth:`step_end` after each of its steps, and
    :meth:`end_epoch` after it.

    ``end_epoch`` returns a dict with, on CUDA (GiB): ``peak_allocated``, ``peak_reserved``,
    ``peak_active``; fragmentation: ``peak_inactive_split`` (the peak of ``inactive_split_bytes``:
    free space inside split cached blocks, which only requests that fit it can use) and
    ``reserved_minus_allocated`` (peak reserved minus peak allocated: what the cache held beyond
    the tensors at their peak); counts during the epoch: ``alloc_retries``, ``ooms``; and
    ``first_retry_step``, the 0-based step of the epoch after which the first retry was seen
    (:data:`NO_RETRY` if none; the earliest over ranks). On CPU: ``peak_rss`` (GiB, the process's
    high-water mark). Each value but ``first_retry_step`` is the maximum over ranks, and
    ``<key>_rank`` says which rank had it. Keys as in ``torch.cuda.memory_stats``
    (https://pytorch.org/docs/stable/generated/torch.cuda.memory_stats.html).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._base = {"alloc_retries": 0, "ooms": 0}
        self._first_retry = NO_RETRY

    def _counters(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.device)
        return {"alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}

    def start_epoch(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = self._counters()
        self._first_retry = NO_RETRY

    def step_end(self, step: int) -> None:
        """Note the first step of the epoch after which cudaMalloc retries appear (a host-side read of
        the allocator's counters: no device synchronization)."""
        if self.cuda and self._first_retry == NO_RETRY:
            if self._counters()["alloc_retries"] > self._base["alloc_retries"]:
                self._first_retry = step

    def local_stats(self) -> dict[str, float]:
        if not self.cuda:
            rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return {"peak_rss": rss_kib * (1 if sys.platform == "darwin" else 1024) / GIB}
        stats = torch.cuda.memory_stats(self.device)
        now = self._counters()
        allocated, reserved = stats.get("allocated_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)
        return {
            "peak_allocated": allocated / GIB,
            "peak_reserved": reserved / GIB,
            "peak_active": stats.get("active_bytes.all.peak", 0) / GIB,
            "peak_inactive_split": stats.get("inactive_split_bytes.all.peak", 0) / GIB,
            "reserved_minus_allocated": (reserved - allocated) / GIB,
            "alloc_retries": now["alloc_retries"] - self._base["alloc_retries"],
            "ooms": now["ooms"] - self._base["ooms"],
            "first_retry_step": self._first_retry,
        }

    def end_epoch(self) -> dict[str, float]:
        local = self.local_stats()
        if "first_retry_step" in local:  # the earliest over ranks: the max of its negation, none below all
            step = local["first_retry_step"]
            local["first_retry_step"] = -step if step != NO_RETRY else -2**53
        keys = sorted(local)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            out = {**local, **{f"{k}_rank": 0 for k in keys}}
        else:
            out = self._max_over_ranks(local, keys)
        if "first_retry_step" in out:
            out["first_retry_step"] = NO_RETRY if out["first_retry_step"] == -2**53 else -out["first_retry_step"]
        return out

    def _max_over_ranks(self, local: dict[str, float], keys: list[str]) -> dict[str, float]:
        values = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64,
                              device=self.device if dist.get_backend() == "nccl" else "cpu")
        gathered = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, values)
        table = torch.stack(gathered).cpu()
        best, rank = table.max(dim=0)
        out: dict[str, float] = {}
        for i, k in enumerate(keys):
            out[k] = int(best[i]) if k in COUNTS else float(best[i])
            out[f"{k}_rank"] = int(rank[i])
        return out


COUNTS = ("alloc_retries", "ooms", "first_retry_step")


def format_memory(m: dict[str, float]) -> str:
    """One-line memory summary; a warning naming the remedy is appended when retries > 0."""
    if "peak_rss" in m:
        return f"memory: peak RSS {m['peak_rss']:.2f} GiB (rank {m['peak_rss_rank']}, CPU run)"
    line = (f"memory: peak allocated {m['peak_allocated']:.2f} GiB (rank {m['peak_allocated_rank']}), "
            f"reserved {m['peak_reserved']:.2f} GiB (rank {m['peak_reserved_rank']}), "
            f"active {m['peak_active']:.2f} GiB, fragmentation: inactive split {m['peak_inactive_split']:.2f} GiB, "
            f"reserved - allocated {m['reserved_minus_allocated']:.2f} GiB; cudaMalloc retries {m['alloc_retries']} "
            f"(rank {m['alloc_retries_rank']}"
            + (f", first after step {m['first_retry_step']}" if m["first_retry_step"] != NO_RETRY else "")
            + f"), OOMs {m['ooms']}")
    if m["alloc_retries"] > 0:
        line += ("\nWARNING: cudaMalloc retries this epoch: the allocator is flushing its cache and "
                 "synchronizing. Lower --local_batch_size (python -m tools.tune_batch_size finds the fastest batch "
                 "without retries), enable --activation_checkpointing, use "
                 "--fsdp zero3 / lower --fsdp_prefetch, or set "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    return line


# ---------------------------------------------------------------- host memory
def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; False where the kernel does not
    allow it (not Linux, or ``/proc/self/clear_refs`` not writable), so the peak stays cumulative.
    Linux's ``clear_refs`` value 5 (https://docs.kernel.org/filesystems/proc.html)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes since the start or :func:`reset_peak_rss`
    (``VmHWM`` of ``/proc/self/status``; ``ru_maxrss``, never reset, where that is missing)."""
    try:
        with open("/proc/self/status") as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        found = None
    if found:
        return int(found.group(1)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


# ---------------------------------------------------------------- out of memory
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


class OutOfMemoryHandler:
    """Turns a ``torch.OutOfMemoryError`` in a phase of training into :class:`OutOfMemory`: one line
    naming the rank, the phase, the local batch, the memory figures and :data:`OOM_REMEDIES`; every
    rank of the job then exits with :data:`~utils.errors.EXIT_OUT_OF_MEMORY` (``distributed.env``).

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

    def close(self) -> None:
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
