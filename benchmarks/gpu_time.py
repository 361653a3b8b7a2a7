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

Run alone, it splits saved traces (``profile_step.py --trace``, ``.json`` or gzipped ``.json.gz``), one row each:

    python benchmarks/gpu_time.py $OUT/profile_mp_bf16_rank0.trace.json $OUT/profile_mp_bf16_rank1.trace.json --steps 5
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.core.errors import ArgumentParser, UserError, exit_status  # noqa: E402

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
        ValueError: ``steps`` is not positive, ``traceEvents`` is missing or not a list (not a Chrome trace), or
            a GPU event lacks a finite ``ts`` or a non-negative ``dur``.
    """
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: no traceEvents list")
    gpu = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return None
    for e in gpu:
        if not all(type(e.get(k)) in (int, float) and math.isfinite(e[k]) for k in ("ts", "dur")) or e["dur"] < 0:
            raise ValueError(f"GPU event {str(e.get('name'))[:60]!r} has no finite ts and non-negative dur")
    spans = {kind: merged([(e["ts"], e["ts"] + e["dur"]) for e in gpu if is_communication(e) == kind])
             for kind in (False, True)}
    busy = merged(spans[False] + spans[True])
    span = busy[-1][1] - busy[0][0]
    split = {"span": span, "busy": total(busy), "idle": span - total(busy), "compute": total(spans[False]),
             "communication": total(spans[True]), "exposed": uncovered(spans[True], spans[False])}
    return {key: value / steps / 1e3 for key, value in split.items()}


FIELDS = ("span", "busy", "idle", "compute", "communication", "exposed")


def read_trace(path: Path) -> dict:
    """A Chrome trace from ``path`` (gzip-compressed when its name ends in ``.gz``).

    Raises:
        UserError: the file cannot be read, or is not JSON (nor gzipped JSON).
    """
    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
            return json.load(f)
    except OSError as e:
        if isinstance(e, gzip.BadGzipFile):
            raise UserError(f"{path} is not gzip-compressed; name a plain trace .json") from None
        raise UserError(f"cannot read {path}: {e.strerror or e}; name a trace written by profile_step.py "
                        "--trace") from None
    except (ValueError, EOFError, zlib.error) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UserError(f"{path} is not a JSON Chrome trace ({type(e).__name__}); name a trace written by "
                        "profile_step.py --trace") from None


def main(argv: list[str]) -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path, help="torch.profiler Chrome traces (.json or .json.gz)")
    ap.add_argument("--steps", type=int, default=1, help="training steps each trace covers (figures are per step)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    splits = {path: split_file(path, args.steps) for path in args.traces}  # every file checked before the table
    print("| trace | " + " | ".join(f"{k} ms" for k in FIELDS) + " |")
    for path, split in splits.items():
        cells = [f"{split[k]:.1f}" for k in FIELDS] if split else ["no GPU activity"] + [""] * (len(FIELDS) - 1)
        print(f"| {path.name} | " + " | ".join(cells) + " |")


def split_file(path: Path, steps: int) -> dict | None:
    """:func:`gpu_time_split` of the trace at ``path``; its problems as :class:`UserError`."""
    try:
        return gpu_time_split(read_trace(path), steps)
    except ValueError as e:
        raise UserError(f"{path}: {e}; name a trace written by profile_step.py --trace") from None


if __name__ == "__main__":
    sys.exit(exit_status(main, sys.argv[1:]))
