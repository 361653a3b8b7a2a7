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

and with ``--collectives`` also says which collectives take that time and how much of each is exposed
(:func:`collectives`).
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

from utils.core.errors import ArgumentParser, UserError, run_cli  # noqa: E402

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


def gpu_events(trace: dict, steps: int) -> list[dict]:
    """The GPU events (kernels, memcpys, memsets) of a Chrome trace of ``steps`` steps, checked.

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
    for e in gpu:
        if not all(type(e.get(k)) in (int, float) and math.isfinite(e[k]) for k in ("ts", "dur")) or e["dur"] < 0:
            raise ValueError(f"GPU event {str(e.get('name'))[:60]!r} has no finite ts and non-negative dur")
    return gpu


def _spans(events: list[dict]) -> list[tuple[float, float]]:
    return merged([(e["ts"], e["ts"] + e["dur"]) for e in events])


def gpu_time_split(trace: dict, steps: int) -> dict | None:
    """The GPU time of a Chrome trace of ``steps`` training steps, per step in milliseconds (module docstring):
    ``span`` (first kernel's start to last one's end), ``busy``, ``idle`` (``span - busy``), ``compute``,
    ``communication`` and ``exposed``. None when the trace holds no GPU activity (a CPU run).

    Raises:
        ValueError: as :func:`gpu_events`.
    """
    gpu = gpu_events(trace, steps)
    if not gpu:
        return None
    spans = {kind: _spans([e for e in gpu if is_communication(e) == kind]) for kind in (False, True)}
    busy = merged(spans[False] + spans[True])
    span = busy[-1][1] - busy[0][0]
    split = {"span": span, "busy": total(busy), "idle": span - total(busy), "compute": total(spans[False]),
             "communication": total(spans[True]), "exposed": uncovered(spans[True], spans[False])}
    return {key: value / steps / 1e3 for key, value in split.items()}


def collectives(trace: dict, steps: int) -> list[dict]:
    """The communication of a Chrome trace of ``steps`` steps by kernel (its name up to the first ``(``: NCCL's
    names say the collective, algorithm and protocol, ``ncclDevKernel_AllGather_RING_LL``), most exposed first:
    ``kernel``, ``count``, ``ms`` and ``exposed_ms`` per step. Which collective waits where is what the split
    alone cannot say (docs/speed.md, round 5f: cp 2's exposed time was its K/V all-gather and dK/dV
    reduce-scatter, not the gradient all-reduce). Each kernel's exposed time is measured against the compute
    alone, so two collectives running at once are each counted.

    Raises:
        ValueError: as :func:`gpu_events`.
    """
    gpu = gpu_events(trace, steps)
    compute = _spans([e for e in gpu if not is_communication(e)])
    kinds: dict[str, list[dict]] = {}
    for e in gpu:
        if is_communication(e):
            kinds.setdefault(str(e.get("name")).split("(")[0].strip(), []).append(e)
    rows = [{"kernel": name, "count": len(events) / steps, "ms": total(_spans(events)) / steps / 1e3,
             "exposed_ms": uncovered(_spans(events), compute) / steps / 1e3} for name, events in kinds.items()]
    return sorted(rows, key=lambda r: (-r["exposed_ms"], r["kernel"]))


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
    ap.add_argument("--collectives", action="store_true",
                    help="also a table of each trace's communication by kernel: count, ms and exposed ms a step")
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    traces = {path: read_trace(path) for path in args.traces}  # every file read and checked before a table
    splits = {path: checked(path, gpu_time_split, trace, args.steps) for path, trace in traces.items()}
    by_kernel = ({path: checked(path, collectives, trace, args.steps) for path, trace in traces.items()}
                 if args.collectives else {})
    print("| trace | " + " | ".join(f"{k} ms" for k in FIELDS) + " |")
    for path, split in splits.items():
        cells = [f"{split[k]:.1f}" for k in FIELDS] if split else ["no GPU activity"] + [""] * (len(FIELDS) - 1)
        print(f"| {path.name} | " + " | ".join(cells) + " |")
    if by_kernel:
        print("\n| trace | kernel | a step | ms | exposed ms |")
        for path, rows in by_kernel.items():
            for r in rows or [{"kernel": "no communication", "count": 0, "ms": 0.0, "exposed_ms": 0.0}]:
                print(f"| {path.name} | {r['kernel']} | {r['count']:g} | {r['ms']:.2f} | {r['exposed_ms']:.2f} |")


def checked(path: Path, analysis, trace: dict, steps: int):
    """``analysis(trace, steps)`` with its problems as :class:`UserError` naming ``path``."""
    try:
        return analysis(trace, steps)
    except ValueError as e:
        raise UserError(f"{path}: {e}; name a trace written by profile_step.py --trace") from None


def analyse_file(path: Path, steps: int) -> tuple[dict | None, list[dict]]:
    """:func:`gpu_time_split` and :func:`collectives` of the trace at ``path``; its problems as
    :class:`UserError`."""
    trace = read_trace(path)
    return checked(path, gpu_time_split, trace, steps), checked(path, collectives, trace, steps)


if __name__ == "__main__":
    sys.exit(run_cli(main))
