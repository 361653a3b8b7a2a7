"""Per-epoch memory report: peaks, cudaMalloc retries and OOMs, reduced over ranks.

The CUDA caching allocator retries a failed ``cudaMalloc`` after freeing its cached blocks
(``num_alloc_retries`` in ``torch.cuda.memory_stats``); every retry synchronizes the device
and stalls the step, so throughput is best just below the batch size that causes retries,
not just below OOM. ``torch.cuda.reset_peak_memory_stats`` does not reset the retry or OOM
counters, so the tracker reports their change over the epoch.
"""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist

GIB = 1024**3


class MemoryTracker:
    """Call :meth:`start_epoch` before and :meth:`end_epoch` after an epoch.

    ``end_epoch`` returns a dict with (GiB) ``peak_allocated``, ``peak_reserved``, ``peak_active``,
    ``alloc_retries`` and ``ooms`` (counts during the epoch) on CUDA, or ``peak_rss`` (GiB, the
    process's high-water mark) on CPU; each value is the maximum over ranks, and ``<key>_rank``
    says which rank had it.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._base = {"alloc_retries": 0, "ooms": 0}

    def _counters(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.device)
        return {"alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}

    def start_epoch(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = self._counters()

    def local_stats(self) -> dict[str, float]:
        if not self.cuda:
            rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return {"peak_rss": rss_kib * (1 if sys.platform == "darwin" else 1024) / GIB}
        stats = torch.cuda.memory_stats(self.device)
        now = self._counters()
        return {
            "peak_allocated": stats.get("allocated_bytes.all.peak", 0) / GIB,
            "peak_reserved": stats.get("reserved_bytes.all.peak", 0) / GIB,
            "peak_active": stats.get("active_bytes.all.peak", 0) / GIB,
            "alloc_retries": now["alloc_retries"] - self._base["alloc_retries"],
            "ooms": now["ooms"] - self._base["ooms"],
        }

    def end_epoch(self) -> dict[str, float]:
        local = self.local_stats()
        keys = sorted(local)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return {**local, **{f"{k}_rank": 0 for k in keys}}
        values = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64,
                              device=self.device if dist.get_backend() == "nccl" else "cpu")
        gathered = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, values)
        table = torch.stack(gathered).cpu()
        best, rank = table.max(dim=0)
        out: dict[str, float] = {}
        for i, k in enumerate(keys):
            out[k] = int(best[i]) if k in ("alloc_retries", "ooms") else float(best[i])
            out[f"{k}_rank"] = int(rank[i])
        return out


def format_memory(m: dict[str, float]) -> str:
    """One-line memory summary; a warning naming the remedy is appended when retries > 0."""
    if "peak_rss" in m:
        return f"memory: peak RSS {m['peak_rss']:.2f} GiB (rank {m['peak_rss_rank']}, CPU run)"
    line = (f"memory: peak allocated {m['peak_allocated']:.2f} GiB (rank {m['peak_allocated_rank']}), "
            f"reserved {m['peak_reserved']:.2f} GiB (rank {m['peak_reserved_rank']}), "
            f"active {m['peak_active']:.2f} GiB, cudaMalloc retries {m['alloc_retries']} "
            f"(rank {m['alloc_retries_rank']}), OOMs {m['ooms']}")
    if m["alloc_retries"] > 0:
        line += ("\nWARNING: cudaMalloc retries this epoch: the allocator is flushing its cache and "
                 "synchronizing. Lower --local_batch_size, enable --activation_checkpointing, use "
                 "--fsdp zero3 / lower --fsdp_prefetch, or set "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    return line
