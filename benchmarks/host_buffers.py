"""How to page-lock a checkpoint's host buffers without stalling training (one GPU).

A background thread allocates ``--gb`` GB of page-locked host memory in ``--chunk_mb`` pieces while
the main thread runs GPU work in timed "steps" (bf16 matmuls, synchronized each step). Each method's
row gives the allocation time and the stall: the steps' extra time over their median without
allocation. Methods:

* ``pin_memory``: ``torch.empty(..., pin_memory=True)`` (PyTorch's caching host allocator,
  ``cudaHostAlloc``);
* ``register``: ``torch.empty`` (pageable), pages touched by the thread, then ``cudaHostRegister``;
* ``pin_memory`` again in a process started with
  ``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8``.

    python benchmarks/host_buffers.py --out benchmarks/results/h200_host_buffers.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Results, table  # noqa: E402
from utils.core.errors import ArgumentParser, run_cli  # noqa: E402

COLUMNS = [("method", "method", "s"), ("alloc s", "alloc_s", ".2f"), ("step ms", "step_ms", ".1f"),
           ("stall s", "stall_s", ".2f"), ("steps", "steps", "d")]
ALLOC_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def pinned(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


def registered(n: int) -> torch.Tensor:
    t = torch.empty(n, dtype=torch.uint8)
    t.fill_(0)  # fault the pages in here, outside the driver call
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    return t


def run(method: str, gb: float, chunk_mb: int) -> dict:
    torch.cuda.set_device(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(40):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(5):
        step()
    base = statistics.median(step() for _ in range(20))
    make = registered if method == "register" else pinned
    chunks, n = [], chunk_mb << 20
    done = threading.Event()

    def allocate() -> None:
        t0 = time.perf_counter()
        for _ in range(int(gb * 1e9) // n):
            chunks.append(make(n))
        chunks.append(time.perf_counter() - t0)
        done.set()

    thread = threading.Thread(target=allocate)
    t0 = time.perf_counter()
    thread.start()
    during = []
    while not done.is_set():
        during.append(step())
    thread.join()
    elapsed = time.perf_counter() - t0
    assert chunks[0].is_pinned()
    return {"method": method, "alloc_s": chunks[-1], "step_ms": base * 1e3, "steps": len(during),
            "stall_s": elapsed - len(during) * base, "gb": gb, "chunk_mb": chunk_mb}


def main(argv: list[str]) -> int:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=11.4, help="host memory to page-lock (GB)")
    ap.add_argument("--chunk_mb", type=int, default=64, help="size of each allocation (MiB)")
    ap.add_argument("--method", choices=["pin_memory", "register"], help="run one method in this process")
    ap.add_argument("--out", help="JSON results")
    args = ap.parse_args(argv)
    if args.method:
        print(json.dumps(run(args.method, args.gb, args.chunk_mb)), flush=True)
        return 0
    rows = []
    for method, conf in (("pin_memory", None), ("register", None), ("pin_memory", ALLOC_CONF)):
        env = dict(os.environ, **({"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else {}))
        out = subprocess.run([sys.executable, __file__, "--method", method, "--gb", str(args.gb),
                              "--chunk_mb", str(args.chunk_mb)], env=env, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.splitlines()[-1])
        rows.append({**row, "method": method + (" (host register conf)" if conf else "")})
    print(table(rows, COLUMNS))
    if args.out:
        results = Results(Path(args.out))
        results.extend(rows)
        results.save()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
