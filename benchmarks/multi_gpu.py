"""Multi-GPU suites on one node (torchrun): weak scaling (DDP), FSDP memory, tensor/context parallel.

    python benchmarks/multi_gpu.py --suite scaling --gpus 1,2,4 --out benchmarks/results/scaling.json
    python benchmarks/multi_gpu.py --suite fsdp --data_path /data/full --out benchmarks/results/fsdp.json
    python benchmarks/multi_gpu.py --suite vit2b --out benchmarks/results/vit2b.json
    python benchmarks/multi_gpu.py --suite tp --data_path /data/full --out benchmarks/results/tp.json
    python benchmarks/multi_gpu.py --suite offload --gpus_max 2 --out benchmarks/results/offload.json
    python benchmarks/multi_gpu.py --suite ensemble --gpus_max 2 --out benchmarks/results/ensemble.json

Each variant is a ``train.py`` (or ``train_mp.py``) run of two epochs; the second epoch's samples/s,
MFU and per-GPU memory (maximum over ranks) are reported. Prints a table and saves JSON. A suite too long
for one sitting splits into several calls: ``--only`` picks variants by name, ``--steps`` shortens the
epochs, and the vit2b search splits by ``--batches`` and ``--fsdp_prefetches``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, run_variant, table  # noqa: E402
from utils.core.errors import ArgumentParser, run_cli  # noqa: E402

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
    """``mp`` on all GPUs: tp = 1, 2, 4 and cp = 2, 4 (data parallel over the rest; those that need more GPUs
    than ``--gpus_max`` are left out), local batch 16 per dp group; tp 2 also with torch's async TP
    (``mp_tp2_cp1_async``, ``--async_tp true``), with its replicated gradients' all-reduces bucketed
    (``mp_tp2_cp1_buckets``, ``--sp_grad_bucketing true``), with both (``mp_tp2_cp1_async_buckets``) and without
    sequence parallelism (``mp_tp2_cp1_nosp``); each cp with the K/V all-gather (``mp_tp1_cp2``) and with the
    ring (``mp_tp1_cp2_ring``, ``--cp_attention ring``).

    With ``--data_path`` the native loader reads real (or generated) data, so the loss curves of the
    variants can be compared; without it, synthetic batches.
    """
    n = args.gpus_max
    data = (["--data_path", args.data_path, "--data_loader_config", "pytorch", "--num_data_workers", "4"]
            if args.data_path else SYNTH)
    out = []
    for tp_size, cp_size, sp in ((1, 1, True), (2, 1, True), (2, 1, False), (4, 1, True), (1, 2, True),
                                 (1, 4, True)):
        if tp_size * cp_size > n:
            continue
        dp = n // (tp_size * cp_size)
        name = f"mp_tp{tp_size}_cp{cp_size}" + ("" if sp else "_nosp")
        run_args = (["--config", args.config or "mp", "--tensor_parallel", str(tp_size),
                     "--context_parallel", str(cp_size), "--local_batch_size", "16",
                     "--limit_nsamples", str(16 * dp * args.steps), "--sequence_parallel", str(sp).lower()]
                    + OPT + data)
        if cp_size > 1:  # both ways of reaching the other ranks' keys/values
            out += [(name, n, run_args + ["--cp_attention", "all_gather"]),
                    (f"{name}_ring", n, run_args + ["--cp_attention", "ring"])]
        else:
            out.append((name, n, run_args))
    if n >= 2:  # tp 2 with sequence parallelism also through inductor's micro-pipeline TP, and bucketed
        name, gpus, tp2 = out[1]  # mp_tp2_cp1
        out[2:2] = [(f"{name}_async", gpus, tp2 + ["--async_tp", "true"]),
                    (f"{name}_buckets", gpus, tp2 + ["--sp_grad_bucketing", "true"]),
                    (f"{name}_async_buckets", gpus, tp2 + ["--async_tp", "true", "--sp_grad_bucketing", "true"])]
    return out


def ensemble(args) -> list[tuple]:
    """Ensemble training's cost (``short``, local batch ``--local_batch`` initial states, compiled): the deterministic
    model, then the CRPS with M = 2 and 4 members on one GPU and, with ``--gpus_max 2``, the same members spread over
    two GPUs (``--ensemble_parallel 2``: each GPU forecasts M / 2 members of the same samples). samples/s counts
    initial states, so M members cost about M times the deterministic step."""
    bs, name = args.local_batch, args.config or "short"
    base = ["--config", name, "--local_batch_size", str(bs), "--limit_nsamples", str(bs * args.steps)] + OPT + SYNTH
    crps = ["--noise_channels", "4", "--loss", "crps"]
    out = [("deterministic", 1, base)]
    for m in (2, 4):
        out.append((f"crps_m{m}", 1, base + crps + ["--ensemble_members", str(m)]))
    if args.gpus_max >= 2:
        for m in (2, 4):
            out.append((f"crps_m{m}_ens2", 2, base + crps + ["--ensemble_members", str(m), "--ensemble_parallel", "2"]))
    return out


def torchrun(n: int) -> list[str]:
    """The launcher of a variant on ``n`` GPUs of this node."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def ranks_launch(n: int) -> dict:
    """``run_variant``'s launcher keyword for a run on ``n`` ranks: torchrun above 1, none (one process) for 1."""
    return {"launcher": torchrun(n)} if n > 1 else {}


def validation_every(args) -> int:
    """tp validates every epoch (loss curves to compare; no figures, see :func:`run`); the other suites only at
    the end."""
    return 1 if args.suite == "tp" else args.epochs


def run(args, rows: Results, name: str, n: int, run_args: list[str], valid_every: int,
        runner: Callable = run_variant) -> dict:
    """Run one variant under torchrun with ``runner`` (:func:`benchmarks.common.run_variant`) and append its
    row (with ``gpus`` and ``per_gpu`` samples/s) to ``rows``."""
    iters = args.epochs * (args.steps if args.suite != "scaling" else 32)
    # a validation before the reported epoch has its figures drawn during that epoch, on rank 0's drawing thread
    # (training/monitor/drawing.py): not to time them, no figures (docs/speed.md, round 5x)
    figures = ["--figure_every", "0"] if valid_every < args.epochs else []
    row = runner(name, run_args + ["--num_iters", str(iters), "--valid_every", str(valid_every),
                                   "--log_every", "1000", *figures] + args.extra.split(),
                 Path(args.expdir), launcher=torchrun(n), entry=args.entry)
    row["gpus"] = n
    if "samples_per_s" in row:
        row["per_gpu"] = row["samples_per_s"] / n
    rows.append(row)
    return row


def fits(row: dict) -> bool:
    """The run finished without cudaMalloc retries (nor OOM) in any epoch."""
    return row.get("returncode") == 0 and not any(e.get("alloc_retries") for e in row.get("curve", []))


def vit2b(args, rows: Results, runner: Callable = run_variant) -> None:
    """``vit_2b`` with ZeRO-3 + full activation checkpointing: the largest local batch without cudaMalloc
    retries for the first of ``--fsdp_prefetches`` (default 1; ascending through ``--batches``, stopping at the
    first batch that retries or runs out of memory), then the other depths (default 0 and 2) at that batch
    (stepping down if they retry). In several calls: ``--batches 8,16,24 --fsdp_prefetches 1``, then
    ``--batches 32,48 --fsdp_prefetches 1`` if 24 fit, then ``--batches B --fsdp_prefetches 0,2`` at the largest
    batch B that fit."""
    batches = sorted(args.batches)
    first, *others = args.fsdp_prefetches
    best = None
    for bs in batches:
        if not fits(run(args, rows, *vit2b_args(args, first, bs), valid_every=args.epochs, runner=runner)):
            break
        best = bs
    for prefetch in others:
        for bs in [b for b in batches if best and b <= best][::-1]:
            if fits(run(args, rows, *vit2b_args(args, prefetch, bs), valid_every=args.epochs, runner=runner)):
                break


def compare(rows: list[dict], base: dict) -> None:
    """Add each row's peak-reserved reduction (base / row) and speed relative to ``base`` (DDP, tp=1)."""
    for r in rows:
        if "samples_per_s" in r and "samples_per_s" in base:
            r["speed_vs_base"] = r["samples_per_s"] / base["samples_per_s"]
        if "memory/peak_reserved" in r and "memory/peak_reserved" in base:
            r["reserved_cut"] = base["memory/peak_reserved"] / r["memory/peak_reserved"]


def int_list(text: str) -> list[int]:
    """``8,16,24`` -> ``[8, 16, 24]`` (an argparse type: a ValueError is its one-line error)."""
    return [int(x) for x in text.split(",")]


SUITES = {"scaling": scaling, "fsdp": fsdp, "vit2b": vit2b, "tp": tp, "offload": offload, "ensemble": ensemble}
COLUMNS = [("variant", "variant", "s"), ("samples/s", "samples_per_s", ".1f"), ("per GPU", "per_gpu", ".1f"),
           ("efficiency", "efficiency", ".1%"), ("MFU", "mfu", ".1%"),
           ("peak alloc GiB", "memory/peak_allocated", ".2f"), ("peak reserved GiB", "memory/peak_reserved", ".2f"),
           ("retries", "memory/alloc_retries", "d"), ("reserved cut", "reserved_cut", ".2f"),
           ("speed vs first", "speed_vs_base", ".0%"), ("train loss", "loss/train", ".4f"),
           ("valid loss", "loss/valid", ".4f"), ("wall s", "wall_s", ".0f")]


def main(argv: list[str] | None = None, runner: Callable = run_variant) -> int:
    """Run the suite (``argv``: the command line) with ``runner`` per variant, print its table, save its JSON."""
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=SUITES, required=True)
    ap.add_argument("--gpus", default="1,2,4", help="scaling: GPU counts")
    ap.add_argument("--gpus_max", type=int, default=4, help="GPUs for the other suites")
    ap.add_argument("--batches", type=int_list, default="8,16,24,32,48,64", help="vit2b: candidate local batch sizes")
    ap.add_argument("--fsdp_prefetches", type=int_list, default="1,0,2",
                    help="vit2b: --fsdp_prefetch depths; the batch search runs with the first, the others at its result")
    ap.add_argument("--config", default="", help="config name (default: short / mp / vit_2b by suite)")
    ap.add_argument("--steps", type=int, default=16, help="steps per epoch")
    ap.add_argument("--local_batch", type=int, default=16, help="offload, ensemble: local batch size")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--data_path", default="")
    ap.add_argument("--entry", default="train.py")
    ap.add_argument("--only", default="", help="comma list of variant names to run (default: all; not vit2b)")
    ap.add_argument("--extra", default="")
    ap.add_argument("--expdir", default="/tmp/multi_gpu_runs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    variants = [] if args.suite == "vit2b" else SUITES[args.suite](args)
    only = [name for name in args.only.split(",") if name]
    unknown = [name for name in only if name not in [v[0] for v in variants]]
    if unknown:  # before any run: a typo would otherwise run nothing, silently
        ap.error(f"--only {','.join(unknown)}: not a variant of --suite {args.suite} on these GPUs "
                 f"(its variants: {', '.join(v[0] for v in variants) or 'none; vit2b searches by --batches'})")
    rows = Results(Path(args.out), suite=args.suite)
    if args.suite == "vit2b":
        vit2b(args, rows, runner)
    for name, n, run_args in variants:
        if not only or name in only:
            run(args, rows, name, n, run_args, validation_every(args), runner)
    if args.suite == "scaling":
        base = next((r.get("per_gpu") for r in rows if r.get("gpus") == 1), None)
        for r in rows:
            if base and "per_gpu" in r:
                r["efficiency"] = r["per_gpu"] / base
    if args.suite in ("fsdp", "tp", "offload", "ensemble") and rows:
        compare(rows, rows[0])
    rows.save()
    print(table(rows, COLUMNS))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
