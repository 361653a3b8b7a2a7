"""The batch-size tuner's acceptance runs: per setup, the tuner's pick against the largest batch that did
not run out of memory (samples/s and cudaMalloc retries of both), and the tuner's own wall time.

    python benchmarks/tuner_accuracy.py --name short_opt --out benchmarks/results/h100_tune.json \\
        -- --config short_opt
    python benchmarks/tuner_accuracy.py --name vit_2b --nproc 2 --expandable --out ... \\
        -- --config vit_2b --fsdp zero3 --max_minutes 8

Everything after ``--`` goes to ``python -m tools.tune_batch_size`` (under torchrun with ``--nproc`` > 1).
``--expandable`` runs the same tuning again with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
Rows are appended to ``--out`` (one per tuning), so several setups share one file. Prints a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, Results, read_json, table  # noqa: E402
from utils.core.errors import ArgumentParser, UserError, run_cli  # noqa: E402

COLUMNS = [("setup", "name", "s"), ("allocator", "allocator", "s"), ("tuner min", "tuner_minutes", ".1f"),
           ("trials", "trials", "d"), ("pick", "pick.local_batch_size", "d"),
           ("pick samples/s", "pick.samples_per_s", ".1f"), ("pick retries", "pick.alloc_retries", "d"),
           ("largest no-OOM", "largest_no_oom.local_batch_size", "d"),
           ("its samples/s", "largest_no_oom.samples_per_s", ".1f"),
           ("its retries", "largest_no_oom.alloc_retries", "d"), ("first OOM", "first_oom", "d"),
           ("first retry", "first_retry", "d")]


def tune(name: str, tool_args: list[str], nproc: int, out: Path, env: dict) -> dict:
    """Run the tuner once; the row: wall time, trial count, pick, largest no-OOM batch, first OOM/retry."""
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                  f"--nproc_per_node={nproc}"]
    cmd = [*launch, "-m", "tools.tune_batch_size", *tool_args, "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    row = {"name": name, "allocator": env.get("PYTORCH_CUDA_ALLOC_CONF", "default"), "command": " ".join(cmd),
           "returncode": proc.returncode, "tuner_minutes": (time.perf_counter() - start) / 60}
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n", flush=True)
    if proc.returncode != 0 or not out.exists():
        return row
    result = json.loads(out.read_text())
    trials = result["trials"]
    ran = [t for t in trials if not t["ooms"] and t["samples_per_s"] is not None]
    row.update(trials=len(trials), tuning=result, pick=result["choice"]["max-throughput"],
               largest_no_oom=max(ran, key=lambda t: t["local_batch_size"], default=None),
               first_oom=min((t["local_batch_size"] for t in trials if t["ooms"]), default=None),
               first_retry=min((t["local_batch_size"] for t in trials if t["alloc_retries"]), default=None))
    return row


def earlier_results(path: Path) -> list[dict]:
    """The rows of an earlier output of this script at ``path``, which this run adds its own to.

    Raises:
        UserError: unreadable, not JSON, or not this script's output (no list of ``results``).
    """
    fix = "name a new --out, or remove that file"
    saved = read_json(path, f"it is the --out this run adds to; {fix}")
    results = saved.get("results") if isinstance(saved, dict) else None
    if not (isinstance(results, list) and all(isinstance(r, dict) for r in results)):
        raise UserError(f"--out {path} is not a JSON written by benchmarks/tuner_accuracy.py (no list of results); "
                        f"{fix}")
    return results


def main(argv: list[str]) -> None:
    tool_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--expandable", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    rows = Results(args.out, benchmark="tune_batch_size")
    if args.out.exists():  # several setups in one file
        rows.extend(earlier_results(args.out))
    allocators = [{}] + ([{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}] if args.expandable else [])
    for env in allocators:
        suffix = "_expandable" if env else ""
        rows.append(tune(args.name, tool_args, args.nproc, args.out.with_name(f"{args.out.stem}_{args.name}{suffix}"
                                                                               f"_trials.json"), env))
    print(table(rows, COLUMNS))


if __name__ == "__main__":
    sys.exit(run_cli(main))
