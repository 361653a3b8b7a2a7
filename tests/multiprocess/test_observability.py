"""Memory report (max over ranks, retry warning) and the Nsight profiler window."""

from __future__ import annotations

import logging

import torch

from tests.dist_utils import run_distributed
from training.loop.state import TrainState
from training.monitor.memory import MemoryTracker, NO_RETRY, format_memory
from training.monitor.profiling import ProfilerWindow


def test_memory_line_warns_with_remedies_when_allocator_retried():
    stats = {"peak_allocated": 60.0, "peak_reserved": 75.5, "peak_active": 61.0, "alloc_retries": 3, "ooms": 0,
             "peak_inactive_split": 1.25, "reserved_minus_allocated": 15.5, "first_retry_step": 7,
             "peak_allocated_rank": 1, "peak_reserved_rank": 2, "peak_active_rank": 1, "alloc_retries_rank": 2,
             "ooms_rank": 0}
    line = format_memory(stats)
    assert "reserved 75.50 GiB (rank 2)" in line and "cudaMalloc retries 3 (rank 2, first after step 7)" in line
    assert "inactive split 1.25 GiB, reserved - allocated 15.50 GiB" in line
    assert "WARNING" in line and "--local_batch_size" in line and "expandable_segments" in line
    quiet = format_memory({**stats, "alloc_retries": 0, "first_retry_step": NO_RETRY})
    assert "WARNING" not in quiet and "first after" not in quiet


def _fragmentation_over_ranks(rank: int, world_size: int) -> None:
    """CUDA's allocator statistics, faked per rank: maxima over ranks, the earliest first retry."""
    tracker = MemoryTracker(torch.device("cpu"))
    tracker.cuda = True
    retries = {"num_alloc_retries": 0}
    stats = lambda device=None: {"allocated_bytes.all.peak": (4 + rank) * 2**30,  # noqa: E731
                                 "reserved_bytes.all.peak": 8 * 2**30, "inactive_split_bytes.all.peak": rank * 2**29,
                                 **retries}
    monkeypatch_cuda(stats)
    tracker.start_epoch()
    for step in range(6):
        if step == 4 - 2 * rank:  # rank 1 retries first, after step 2
            retries["num_alloc_retries"] = 1
        tracker.note_step(step)
    report = tracker.end_epoch()
    assert report["first_retry_step"] == 2 and report["alloc_retries"] == 1
    assert report["peak_inactive_split"] == 0.5 and report["peak_inactive_split_rank"] == 1
    assert report["reserved_minus_allocated"] == 4.0 and report["reserved_minus_allocated_rank"] == 0


def monkeypatch_cuda(stats) -> None:
    torch.cuda.memory_stats = stats
    torch.cuda.reset_peak_memory_stats = lambda device=None: None


def test_fragmentation_and_first_retry_step_over_ranks():
    run_distributed(_fragmentation_over_ranks, 2)


def _memory_max_over_ranks(rank: int, world_size: int) -> None:
    tracker = MemoryTracker(torch.device("cpu"))
    tracker.local_stats = lambda: {"peak_rss": 1.0 + rank}  # rank 1 has the larger peak
    report = tracker.end_epoch()
    assert report == {"peak_rss": 2.0, "peak_rss_rank": 1}


def test_memory_report_is_the_maximum_over_ranks_with_its_rank():
    run_distributed(_memory_max_over_ranks, 2)


def test_profiler_window_starts_and_stops_at_the_configured_steps(monkeypatch, caplog):
    monkeypatch.setenv("ENABLE_PROFILING", "1")
    """Epochs counted from 1 (``--profile_epoch 2``: the console's ``epoch 2``, the state's second and last one)."""
    window = ProfilerWindow(epoch=2, start_step=2, steps=3, rank=0)
    with caplog.at_level(logging.INFO, logger="training.monitor.profiling"):
        for epoch in range(2):
            for step in range(8):
                window.step_start(TrainState(epoch=epoch, epoch_step=step))
            window.epoch_end(TrainState(epoch=epoch + 1), {"epoch": epoch + 1})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("rank 0: CUDA profiler start at epoch 2 step 2")
    assert lines[1].startswith("rank 0: CUDA profiler stop at epoch 2 step 5")


def test_profiler_window_is_off_without_the_environment_and_on_other_ranks(monkeypatch):
    monkeypatch.delenv("ENABLE_PROFILING", raising=False)
    assert not ProfilerWindow(1, 2, 3, rank=0).enabled
    monkeypatch.setenv("ENABLE_PROFILING", "1")
    assert not ProfilerWindow(1, 2, 3, rank=1).enabled
    monkeypatch.setenv("PROFILE_ALL_RANKS", "1")
    assert ProfilerWindow(1, 2, 3, rank=1).enabled
