"""Per-epoch memory report: peaks, cudaMalloc retries and OOMs, reduced over ranks; and the process's
host memory (peak RSS).

The CUDA caching allocator retries a failed ``cudaMalloc`` after freeing its cached blocks
(``num_alloc_retries`` in ``torch.cuda.memory_stats``); every retry synchronizes the device
and stalls the step, so throughput is best just below the batch size that causes retries,
not just below OOM. ``torch.cuda.reset_peak_memory_stats`` does not reset the retry or OOM
counters, so the tracker reports their change over the epoch.
"""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from utils.core.component import Component

GIB = 1024**3
MIB = 1024**2


def size_unit(largest_bytes: float) -> tuple[str, int]:
    """``("GiB", GIB)`` for sizes from 1 GiB up, else ``("MiB", MIB)``: small models' figures read as numbers, not
    as 0.000 GiB."""
    return ("GiB", GIB) if largest_bytes >= GIB else ("MiB", MIB)


def allocator_counters(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's cumulative ``alloc_retries`` and ``ooms`` on ``device`` (a host-side read:
    no device synchronization)."""
    stats = torch.cuda.memory_stats(device)
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}


NO_RETRY = -1  # first_retry_step of an epoch without cudaMalloc retries


class MemoryTracker(Component):
    """The memory figures of each epoch, as record keys ``memory/<key>``: the component's hooks call
    :meth:`start_epoch` before an epoch, :meth:`note_step` after each of its steps, and :meth:`end_epoch`
    after it.

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

    def start_epoch(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = allocator_counters(self.device)
        self._first_retry = NO_RETRY

    def epoch_start(self, state) -> None:
        self.start_epoch()

    def step_end(self, state) -> None:
        self.note_step(state.epoch_step - 1)

    def epoch_end(self, state, record: dict) -> None:
        record.update({f"memory/{k}": v for k, v in self.end_epoch().items()})

    def note_step(self, step: int) -> None:
        """Note the first step of the epoch after which cudaMalloc retries appear (a host-side read of
        the allocator's counters: no device synchronization)."""
        if self.cuda and self._first_retry == NO_RETRY:
            if allocator_counters(self.device)["alloc_retries"] > self._base["alloc_retries"]:
                self._first_retry = step

    def local_stats(self) -> dict[str, float]:
        if not self.cuda:
            return {"peak_rss": peak_rss_bytes() / GIB}
        stats = torch.cuda.memory_stats(self.device)
        now = allocator_counters(self.device)
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


def _glibc_call(name: str, *args: int) -> bool:
    """glibc's ``name(*args)`` returned nonzero; False where there is no glibc or no such function."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(getattr(libc, name)(*args))
    except (OSError, AttributeError):
        return False


def trim_host_heap() -> bool:
    """Give the host heap's free memory back to the kernel (glibc's ``malloc_trim(0)``), so that RSS falls after
    large tensors are freed: glibc otherwise keeps freed heap pages, and a smaller trial after a larger one would
    read as large. False where there is no glibc (``man 3 malloc_trim``)."""
    return _glibc_call("malloc_trim", 0)


# mallopt(3) parameters (glibc's malloc.h) and the defaults glibc starts from
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_THRESHOLD_BYTES = 128 * 1024


def map_large_host_buffers() -> bool:
    """Make glibc give each host buffer of 128 KiB or more a mapping of its own, unmapped when freed: its mmap and
    trim thresholds set to their starting defaults, which also stops glibc raising them (``man 3 mallopt``).

    Why: glibc raises the mmap threshold (up to 32 MiB) as large buffers are freed, and then carves them from the
    heap, whose resident size at a peak depends on how earlier allocations left it laid out (earlier trials,
    address randomization): the same step's peak RSS then varies by several MiB from run to run and with what ran
    before. With every tensor buffer mapped on its own, peak RSS follows the live tensors. The cost: page faults on
    every new buffer (slower CPU steps). False where there is no glibc."""
    return (_glibc_call("mallopt", M_MMAP_THRESHOLD, HEAP_THRESHOLD_BYTES)
            and _glibc_call("mallopt", M_TRIM_THRESHOLD, HEAP_THRESHOLD_BYTES))


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


def host_memory_available() -> int | None:
    """Bytes this process may still allocate on the host: ``MemAvailable`` of ``/proc/meminfo``, capped by the
    job's cgroup (v2 ``memory.max`` minus ``memory.current``: SLURM's ``--mem`` limit); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            found = re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    available = int(found.group(1)) * 1024 if found else None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    if limit.isdigit() and available is not None:
        return min(available, int(limit) - used)
    return available
