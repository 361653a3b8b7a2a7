"""Multi-GPU suites on one node (torchrun): weak scaling (DDP), FSDP memory, tensor/context parallel.

    python benchmarks/multi_gpu.py --suite scaling --gpus 1,2,4 --out benchmarks/results/scaling.json
    python benchmarks/multi_gpu.py --suite fsdp --data_path /data/full --out benchmarks/results/fsdp.json
    python benchmarks/multi_gpu.py --suite vit2b --out benchmarks/results/vit2b.json
    python benchmarks/multi_gpu.py --suite tp --data_path /data/full --out benchmarks/results/tp.json
    python benchmarks/multi_gpu.py --suite offload --gpus_max 2 --out benchmarks/results/offload.json

Each variant is a ``train.py`` (or ``train_mp.py``) run of two epochs; the second epoch's samples/s,
MFU and per-GPU memory (maximum over ranks) are reported. Prints a table and saves JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, run_variant, table  # noqa: E402
from utils.core.errors import ArgumentParser  # noqa: E402

OPT = ["--amp_mode", "bf16", "--enable_fused", "true", "--enable_jit", "true"]
SYNTH = ["--data_loader_config", "synthetic"]


def scaling(args) -> list[tuple]:
    """Weak scaling: local batch 16 per GPU, 32 steps per epoch whatever the GPU count."""
    out = []
    for n in map(int, args.gpus.split(",")):
        out.append((f"ddp_{n}gpu", n, ["--config", args.config or "short", "--local_batch_size", "16",
                                       "--limit_nsamples", str(512 * n)] + OPT + SYNTH))
    return out


def fsdp(args) -> list[tuple]:
    """``mp`` (embed 1024) at local batch 16 on all GPUs: DDP vs ZeRO-2 / ZeRO-3 / ZeRO-3 + AC.

    ``zero3_ac`` checkpoints every block, ``zero3_sel2`` every second block, ``zero3_ac7`` the first 7 of 12
    (on 4 H200s each checkpointed block saved about 1.8 GiB and cost about 1.5 % of DDP's speed).
    """
    n = args.gpus_max
    base = ["--config", args.config or "mp", "--local_batch_size", "16",
            "--limit_nsamples", str(16 * n * args.steps)] + OPT + SYNTH
    return [(f"mp_{name}", n, base + extra) for name, extra in (
        ("ddp", []), ("zero2", ["--fsdp", "zero2"]), ("zero3", ["--fsdp", "zero3"]),
        ("zero3_ac", ["--fsdp", "zero3", "--activation_checkpointing", "full"]),
        ("zero3_sel2", ["--fsdp", "zero3", "--activation_checkpointing", "selective", "--ac_every", "2"]),
        ("zero3_ac7", ["--fsdp", "zero3", "--activation_checkpointing", "selective", "--ac_blocks", "7"]))]


def offload(args) -> list[tuple]:
    """``mp`` (or ``--config``) at ``--local_batch`` with ZeRO-3, without and with ``--fsdp_cpu_offload``
    (shards, gradients and Adam state on the host; the optimizer step runs on the CPU)."""
    n, bs, name = args.gpus_max, args.local_batch, args.config or "mp"
    base = ["--config", name, "--local_batch_size", str(bs), "--fsdp", "zero3",
            "--limit_nsamples", str(bs * n * args.steps)] + OPT + SYNTH
    return [(f"{name}_zero3", n, base), (f"{name}_zero3_offload", n, base + ["--fsdp_cpu_offload"])]


def vit2b_args(args, prefetch: int, bs: int) -> tuple:
    n = args.gpus_max
    return (f"vit2b_pf{prefetch}_bs{bs}", n,
            ["--config", args.config or "vit_2b", "--fsdp", "zero3", "--fsdp_prefetch", str(prefetch),
             "--local_batch_size", str(bs), "--limit_nsamples", str(bs * n * args.steps)] + OPT + SYNTH)


def tp(args) -> list[tuple]:
    """``mp`` on all GPUs: tp = 1, 2, 4 and cp = 2 (data parallel over the rest), local batch 16 per dp group;
    tp 2 also without sequence parallelism (``mp_tp2_cp1_nosp``).

    With ``--data_path`` the native loader reads real (or generated) data, so the loss curves of the
    variants can be compared; without it, synthetic batches.
    """
    n = args.gpus_max
    data = (["--data_path", args.data_path, "--data_loader_config", "pytorch", "--num_data_workers", "4"]
            if args.data_path else SYNTH)
    out = []
    for tp_size, cp_size, sp in ((1, 1, True), (2, 1, True), (2, 1, False), (4, 1, True), (1, 2, True)):
        dp = n // (tp_size * cp_size)
        out.append((f"mp_tp{tp_size}_cp{cp_size}" + ("" if sp else "_nosp"), n,
                    ["--config", args.config or "mp", "--tensor_parallel", str(tp_size),
                     "--context_parallel", str(cp_size), "--sequence_parallel", str(sp).lower(),
                     "--local_batch_size", "16", "--limit_nsamples", str(16 * dp * args.steps)] + OPT + data))
    return out


def run(args, rows: Results, name: str, n: int, run_args: list[str], valid_every: int) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    iters = args.epochs * (args.steps if args.suite != "scaling" else 32)
    row = run_variant(name, run_args + ["--num_iters", str(iters), "--valid_every", str(valid_every),
                                        "--log_every", "1000"] + args.extra.split(),
                      Path(args.expdir), launcher=launcher, entry=args.entry)
    row["gpus"] = n
    if "samples_per_s" in row:
        row["per_gpu"] = row["samples_per_s"] / n
    rows.append(row)
    return row


def fits(row: dict) -> bool:
    """The run finished without cudaMalloc retries (nor OOM) in any epoch."""
    return row.get("returncode") == 0 and not any(e.get("alloc_retries") for e in row.get("curve", []))


def vit2b(args, rows: Results) -> None:
    """``vit_2b`` with ZeRO-3 + full activation checkpointing: the largest local batch without cudaMalloc
    retries for ``--fsdp_prefetch`` 1 (ascending through ``--batches``, stopping at the first batch that
    retries or runs out of memory), then prefetch 0 and 2 at that batch (stepping down if they retry)."""
    batches = sorted(map(int, args.batches.split(",")))
    best = None
    for bs in batches:
        if not fits(run(args, rows, *vit2b_args(args, 1, bs), valid_every=args.epochs)):
            break
        best = bs
    for prefetch in (0, 2):
        for bs in [b for b in batches if best and b <= best][::-1]:
            if fits(run(args, rows, *vit2b_args(args, prefetch, bs), valid_every=args.epochs)):
                break


def compare(rows: list[dict], base: dict) -> None:
    """Add each row's peak-reserved reduction (base / row) and speed relative to ``base`` (DDP, tp=1)."""
    for r in rows:
        if "samples_per_s" in r and "samples_per_s" in base:
            r["speed_vs_base"] = r["samples_per_s"] / base["samples_per_s"]
        if "memory/peak_reserved" in r and "memory/peak_reserved" in base:
            r["reserved_cut"] = base["memory/peak_reserved"] / r["memory/peak_reserved"]


SUITES = {"scaling": scaling, "fsdp": fsdp, "vit2b": vit2b, "tp": tp, "offload": offload}
COLUMNS = [("variant", "variant", "s"), ("samples/s", "samples_per_s", ".1f"), ("per GPU", "per_gpu", ".1f"),
           ("efficiency", "efficiency", ".1%"), ("MFU", "mfu", ".1%"),
           ("peak alloc GiB", "memory/peak_allocated", ".2f"), ("peak reserved GiB", "memory/peak_reserved", ".2f"),
           ("retries", "memory/alloc_retries", "d"), ("reserved cut", "reserved_cut", ".2f"),
           ("speed vs first", "speed_vs_base", ".0%"), ("train loss", "loss/train", ".4f"),
           ("valid loss", "loss/valid", ".4f"), ("wall s", "wall_s", ".0f")]


def main() -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=SUITES, required=True)
    ap.add_argument("--gpus", default="1,2,4", help="scaling: GPU counts")
    ap.add_argument("--gpus_max", type=int, default=4, help="GPUs for the other suites")
    ap.add_argument("--batches", default="8,16,24,32,48,64", help="vit2b: candidate local batch sizes")
    ap.add_argument("--config", default="", help="config name (default: short / mp / vit_2b by suite)")
    ap.add_argument("--steps", type=int, default=16, help="steps per epoch")
    ap.add_argument("--local_batch", type=int, default=16, help="offload: local batch size")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--data_path", default="")
    ap.add_argument("--entry", default="train.py")
    ap.add_argument("--only", default="", help="comma list of variant names to run (default: all)")
    ap.add_argument("--extra", default="")
    ap.add_argument("--expdir", default="/tmp/multi_gpu_runs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = Results(Path(args.out), suite=args.suite)
    if args.suite == "vit2b":
        vit2b(args, rows)
    else:
        # tp: validate every epoch for loss curves; others only at the end
        valid_every = 1 if args.suite == "tp" else args.epochs
        for name, n, run_args in SUITES[args.suite](args):
            if not args.only or name in args.only.split(","):
                run(args, rows, name, n, run_args, valid_every)
    if args.suite == "scaling":
        base = next((r.get("per_gpu") for r in rows if r.get("gpus") == 1), None)
        for r in rows:
            if base and "per_gpu" in r:
                r["efficiency"] = r["per_gpu"] / base
    if args.suite in ("fsdp", "tp", "offload") and rows:
        compare(rows, rows[0])
    rows.save()
    print(table(rows, COLUMNS))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
