"""Where a GPU's time goes in a profiler trace: compute, communication, and the communication nothing hides.

``benchmarks/profile_step.py`` reads the Chrome trace that ``torch.profiler`` exports (the ``traceEvents`` of
complete events, ``"ph": "X"``, with ``ts`` and ``dur`` in microseconds). Every kernel, memcpy and memset of the
trace is an interval of GPU activity; they are split into:

* **communication**: NCCL kernels (name containing ``nccl``) and peer-to-peer copies (``Memcpy PtoP``, the copy
  engine that symmetric-memory collectives such as async TP use);
* **compute**: everything else.

Overlapping intervals (kernels on several streams) are merged before they are measured, so each figure is wall
time on the GPU, not a sum of kernel durations. ``exposed`` is the communication time with no compute interval
beside it: what a parallel layout would win if its collectives hid behind its kernels. A collective's kernel
also runs while it waits for the slowest rank, so ``communication`` and ``exposed`` include that wait.
"""

from __future__ import annotations

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``[start, end)`` intervals, sorted and with overlapping or touching ones merged."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total(intervals: list[tuple[float, float]]) -> float:
    """Summed length of disjoint intervals (microseconds in, microseconds out)."""
    return sum(end - start for start, end in intervals)


def uncovered(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the merged intervals ``a`` that no merged interval of ``b`` covers."""
    length, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        cursor, k = start, j
        while k < len(b) and b[k][0] < end:
            length += max(0.0, b[k][0] - cursor)
            cursor = max(cursor, b[k][1])
            k += 1
        length += max(0.0, end - cursor)
    return length


def is_communication(event: dict) -> bool:
    """Whether a trace event is communication: an NCCL kernel or a peer-to-peer copy (module docstring)."""
    name = event.get("name", "").lower()
    return "nccl" in name or (event.get("cat") == "gpu_memcpy" and "ptop" in name)


def gpu_time_split(trace: dict, steps: int) -> dict | None:
    """The GPU time of a Chrome trace of ``steps`` training steps, per step in milliseconds (module docstring):
    ``span`` (first kernel's start to last one's end), ``busy``, ``idle`` (``span - busy``), ``compute``,
    ``communication`` and ``exposed``. None when the trace holds no GPU activity (a CPU run).

    Raises:
        ValueError: ``steps`` is not positive, or ``traceEvents`` is missing or not a list (not a Chrome trace).
    """
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: no traceEvents list")
    gpu = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return None
    spans = {kind: merged([(e["ts"], e["ts"] + e["dur"]) for e in gpu if is_communication(e) == kind])
             for kind in (False, True)}
    busy = merged(spans[False] + spans[True])
    span = busy[-1][1] - busy[0][0]
    split = {"span": span, "busy": total(busy), "idle": span - total(busy), "compute": total(spans[False]),
             "communication": total(spans[True]), "exposed": uncovered(spans[True], spans[False])}
    return {key: value / steps / 1e3 for key, value in split.items()}
