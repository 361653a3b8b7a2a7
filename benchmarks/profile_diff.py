"""Which ops make the difference between two profiled steps: the op tables of two ``profile_step.py`` JSONs, op by op.

``benchmarks/profile_step.py --out DIR`` saves each mode's (each rank's) ``key_averages`` table: per op its calls
and its self device time over the ``steps`` profiled steps. This script puts two such files side by side, per
step in milliseconds, and lists the ops whose self time differs by at least ``--min_ms``, the largest
difference first, with each file's step, profiled step and GPU time split above them:

    python benchmarks/profile_diff.py $OUT/gather/profile_mp_bf16_rank0.json $OUT/ring/profile_mp_bf16_rank0.json

It is how docs/speed.md (round 5g) found where cp 2's ring spends its 14.8 ms more compute than the all-gather:
the attention kernels run in halves, the GEMMs slow beside NCCL, layout copies, merges. Reading the table:

* Times are **self** times: the device time of an op's own kernels, or of a kernel itself. The table holds both
  levels (``aten::mm`` and the GEMM kernel it launches), so its rows must not be summed.
* Ops are matched by their full name. Inductor numbers the kernels it generates (``triton_poi_fused_gelu_7``),
  and two different graphs number them differently. A fused kernel can then show as gone from one file and new
  in the other, under another number.
* On the CPU (no device time in either file) the self CPU time is compared instead.
* Between the two tables, a GPU profile's kernels are added up by kind (:data:`KINDS`, from the kernel's name):
  these rows do sum, to each file's kernel time. Round 5l read async tp 2's cost from them: with
  ``--scale_a 0.5`` (half of a DDP rank's work, which is what a tp 2 rank does) its GEMMs and attention take
  less than half of DDP's, and symmetric memory's reductions, copies and barriers take 14 ms more.
* A name on two rows counts once: an Inductor kernel is both its launch and the kernel, and a
  ``record_function`` range is its CPU op and its span on the GPU timeline, which is left out.

It prints only; the files are read as JSON and checked. A file that is not ``profile_step.py``'s, or a GPU
profile put against a CPU one, is refused with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import read_json  # noqa: E402
from utils.core.errors import ArgumentParser, UserError, run_cli  # noqa: E402

TIMES = ("self_device_time_total_us", "self_cpu_time_total_us")
SPLIT = ("span", "busy", "idle", "compute", "communication", "exposed")
# kernel kinds by name, first match wins: cuBLAS(Lt)/CUTLASS GEMMs, cuDNN/flash attention, Inductor's Triton,
# NCCL, symmetric memory's peer copies and barriers (async tp), other copies, eager ATen kernels
KINDS = (
    ("GEMM", lambda n: n.startswith(("nvjet", "sm90_xmma", "sm80_xmma", "cutlass", "ampere_", "void cublasLt"))
     or "gemm" in n.lower()),
    ("attention", lambda n: "cudnn" in n or "fmha" in n or "flash" in n),
    ("Triton", lambda n: n.startswith("triton_")),
    ("NCCL", lambda n: n.startswith("nccl") and "Kernel" in n),
    ("peer-to-peer copy", lambda n: n.startswith("Memcpy PtoP")),
    ("copy and set", lambda n: n.startswith(("Memcpy", "Memset"))),
    ("symmetric-memory barrier", lambda n: "symmetric_memory::barrier" in n),
    ("eager ATen", lambda n: n.startswith(("void at::", "void (anonymous namespace)::", "void at_cuda_detail"))),
)


def _number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def read_profile(path: Path) -> dict:
    """A ``profile_step.py`` JSON: ``steps`` (positive), ``step_ms`` and ``ops`` (each with a ``name``, ``calls``
    and the self times of :data:`TIMES`).

    Raises:
        UserError: it cannot be read, is not JSON, or lacks those fields.
    """
    saved = read_json(path, "name a JSON written by profile_step.py --out")
    ops = saved.get("ops") if isinstance(saved, dict) else None
    fine = (isinstance(ops, list) and type(saved.get("steps")) is int and saved["steps"] > 0
            and _number(saved.get("step_ms"))
            and all(isinstance(op, dict) and isinstance(op.get("name"), str) and _number(op.get("calls"))
                    and all(_number(op.get(key)) for key in TIMES) for op in ops))
    if not fine:
        raise UserError(f"{path} is not a JSON written by profile_step.py --out (it needs steps, step_ms and ops, "
                        "each op with name, calls and self times)")
    return saved


def _gpu_ranges(ops: list[dict]) -> set[str]:
    """Names of the ranges (``record_function``, DDP's forward) that the profiler also draws on the GPU timeline:
    a device-only row whose name is a CPU op with no device time of its own. Its "self" device time spans other
    kernels, so it is no kernel and no op."""
    cpu_only = {op["name"] for op in ops if op["cpu_time_total_us"] > 0 and op[TIMES[0]] == 0}
    return {op["name"] for op in ops if op["cpu_time_total_us"] == 0 and op["name"] in cpu_only}


def _ops(profile: dict) -> list[dict]:
    """The op and kernel rows, without the GPU timeline's copies of ranges (:func:`_gpu_ranges`)."""
    ranges = _gpu_ranges(profile["ops"])
    return [op for op in profile["ops"] if not (op["name"] in ranges and op["cpu_time_total_us"] == 0)]


def per_step(profile: dict, key: str, scale: float = 1.0) -> dict[str, tuple[float, float]]:
    """Each op's (self time in ms, calls) per profiled step, by name, times ``scale``; ``key``: one of
    :data:`TIMES`. A name on two rows (an Inductor kernel is both its launch on the CPU and the kernel) counts
    once, at the larger time."""
    steps, out = profile["steps"], {}
    for op in _ops(profile):
        ms, calls = op[key] / steps / 1e3 * scale, op["calls"] / steps
        out[op["name"]] = max(out.get(op["name"], (ms, calls)), (ms, calls))
    return out


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel, from its name: the first of :data:`KINDS` whose test holds, else ``other``."""
    return next((kind for kind, test in KINDS if test(name)), "other")


def kernel_kinds(profile: dict, scale: float = 1.0) -> dict[str, float]:
    """Self device time per profiled step (ms, times ``scale``) of a GPU profile's kernels by
    :func:`kernel_kind`; a kernel is a row with device time and no CPU time that is no range
    (:func:`_gpu_ranges`). Kernels that run at once (NCCL beside compute) each count in full."""
    steps, seen, out = profile["steps"], set(), {}
    for op in _ops(profile):
        if op["cpu_time_total_us"] == 0 and op[TIMES[0]] > 0 and op["name"] not in seen:
            seen.add(op["name"])
            kind = kernel_kind(op["name"])
            out[kind] = out.get(kind, 0.0) + op[TIMES[0]] / steps / 1e3 * scale
    return out


def differences(a: dict, b: dict, min_ms: float, scale_a: float = 1.0) -> tuple[str, list[dict]]:
    """The time compared (device time, or CPU time when neither file has any) and the ops whose per-step self
    time differs by at least ``min_ms`` between ``a`` (its times multiplied by ``scale_a``) and ``b``: ``name``,
    ``a_ms``, ``b_ms``, ``diff_ms`` (b - a), ``a_calls``, ``b_calls``, the largest ``|diff_ms|`` first (then by
    name).

    Raises:
        UserError: one file has device time and the other none (a GPU profile against a CPU one).
    """
    a_device, b_device = (any(op[TIMES[0]] for op in p["ops"]) for p in (a, b))
    if a_device != b_device:
        raise UserError(f"{'a' if a_device else 'b'} is a GPU profile and {'b' if a_device else 'a'} a CPU one "
                        "(no device time); compare two profiles of one kind of device")
    key = TIMES[0] if a_device else TIMES[1]
    ta, tb = per_step(a, key, scale_a), per_step(b, key)
    rows = []
    for name in ta.keys() | tb.keys():
        (a_ms, a_calls), (b_ms, b_calls) = ta.get(name, (0.0, 0.0)), tb.get(name, (0.0, 0.0))
        if abs(b_ms - a_ms) >= min_ms:
            rows.append({"name": name, "a_ms": a_ms, "b_ms": b_ms, "diff_ms": b_ms - a_ms, "a_calls": a_calls,
                         "b_calls": b_calls})
    return ("device" if a_device else "CPU"), sorted(rows, key=lambda r: (-abs(r["diff_ms"]), r["name"]))


def summary(a: dict, b: dict, scale_a: float = 1.0) -> list[tuple[str, float, float]]:
    """(label, a's value times ``scale_a``, b's value) of the step, the profiled step and the GPU time split (ms),
    where both files hold the figure (a CPU profile has no split)."""
    def figures(p: dict) -> dict:
        split = p.get("gpu_time_ms") if isinstance(p.get("gpu_time_ms"), dict) else {}
        return {"step ms": p["step_ms"], "profiled step ms": p.get("profiled_step_ms"),
                **{f"GPU {k} ms": split.get(k) for k in SPLIT}}
    fa, fb = figures(a), figures(b)
    return [(label, fa[label] * scale_a, fb[label]) for label in fa if _number(fa[label]) and _number(fb[label])]


def file_label(path: Path) -> str:
    """A file's folder and name: profile_step.py names each rank's file alike in every --out folder."""
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def short(name: str, width: int) -> str:
    """An op's name up to its argument list (a kernel's template arguments kept), at most ``width`` characters."""
    name = name.split("(")[0].strip() or name
    return name if len(name) <= width else name[:width - 3] + "..."


def print_kinds(a: dict, b: dict, scale_a: float) -> None:
    """The kernels' time a step by kind (:func:`kernel_kinds`), a's times multiplied by ``scale_a``; nothing for
    CPU profiles, which have no kernels."""
    ka, kb = kernel_kinds(a, scale_a), kernel_kinds(b)
    if not (ka or kb):
        return
    print("\nkernels' self device time a step by kind (kernels that overlap each count in full)")
    print("| kind | a ms | b ms | b - a ms |\n|---|---|---|---|")
    for kind in sorted(ka.keys() | kb.keys(), key=lambda k: (-abs(kb.get(k, 0.0) - ka.get(k, 0.0)), k)):
        va, vb = ka.get(kind, 0.0), kb.get(kind, 0.0)
        print(f"| {kind} | {va:.2f} | {vb:.2f} | {vb - va:+.2f} |")


def print_ops(rows: list[dict], kind: str, min_ms: float, width: int) -> None:
    """:func:`differences`' rows as a table."""
    print(f"\nops whose self {kind} time a step differs by {min_ms:g} ms or more (rows overlap: an op's "
          "time is also its kernels'; do not sum them)")
    print("| op | a ms | b ms | b - a ms | a calls | b calls |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {short(r['name'], width)} | {r['a_ms']:.2f} | {r['b_ms']:.2f} | {r['diff_ms']:+.2f} | "
              f"{r['a_calls']:g} | {r['b_calls']:g} |")
    if not rows:
        print("| (none) | | | | | |")


def main(argv: list[str]) -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path, help="profile_step.py JSON, the baseline")
    ap.add_argument("b", type=Path, help="profile_step.py JSON compared with it")
    ap.add_argument("--min_ms", type=float, default=0.3, help="smallest difference a step listed (default 0.3 ms)")
    ap.add_argument("--width", type=int, default=90, help="op names cut to this many characters")
    ap.add_argument("--scale_a", type=float, default=1.0,
                    help="a's times multiplied by this (0.5: a DDP rank against a tp 2 rank, which does half its work)")
    args = ap.parse_args(argv)
    if not (args.min_ms >= 0 and math.isfinite(args.min_ms)) or args.width < 10:
        raise UserError(f"--min_ms must be >= 0 and --width >= 10 (got {args.min_ms}, {args.width})")
    if not (args.scale_a > 0 and math.isfinite(args.scale_a)):
        raise UserError(f"--scale_a must be a positive number (got {args.scale_a}); 1 compares the files as they are")
    a, b = read_profile(args.a), read_profile(args.b)
    kind, rows = differences(a, b, args.min_ms, args.scale_a)  # both checked, and of one kind, before any output
    scaled = f" x {args.scale_a:g}" if args.scale_a != 1 else ""
    print(f"| | {file_label(args.a)} (a{scaled}) | {file_label(args.b)} (b) | b - a |\n|---|---|---|---|")
    for label, va, vb in summary(a, b, args.scale_a):
        print(f"| {label} | {va:.2f} | {vb:.2f} | {vb - va:+.2f} |")
    print_kinds(a, b, args.scale_a)
    print_ops(rows, kind, args.min_ms, args.width)


if __name__ == "__main__":
    sys.exit(run_cli(main))
