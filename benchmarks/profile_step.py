"""Where a training step's time goes: torch.profiler over a few steps of the real trainer, top ops by device time.

    python benchmarks/profile_step.py --config short_opt --data_loader_config synthetic --out $OUT
    python benchmarks/profile_step.py --config short_opt --data_loader_config synthetic --amp_modes bf16 bf16_pure fp8

Every option but those below is a ``train.py`` option. Per precision mode (``--amp_modes``; default the
config's own) the trainer (``training/loop/trainer.py``) is built, ``--warmup_steps`` steps run (compilation
happens there), Python's garbage is collected and frozen as training does after its first step (``--gc_freeze``;
``frozen_objects`` in the JSON), ``--steps`` steps are timed without and then with the profiler, and the table of the
``--rows`` ops with the most device time (CPU time on the CPU) is printed. The timed steps' peak memory is
recorded too (``memory``: the GiB of ``training/monitor/memory.py``'s ``MemoryTracker``, on CUDA peak allocated
and reserved and the cudaMalloc retries, on the CPU peak RSS), so a trade of memory for speed (activation
checkpointing, ``--fp8_save_scales``) shows both sides. On a GPU the profiled steps' GPU time is split into
compute, communication (NCCL kernels, peer copies) and the communication no kernel hides (``gpu_time_ms``,
``benchmarks/gpu_time.py``): where a parallel layout loses; ``collectives`` says which communication kernels
take that time, each one's count, ms and exposed ms a step. With ``--out DIR`` each mode's
step times, memory and every op's averages (``key_averages``: calls, total and self device and CPU time in
microseconds) go to ``DIR/profile_<config>_<mode>.json``; with ``--trace`` a Chrome trace per mode beside it
(open in chrome://tracing or Perfetto). The modes run one after another in this process, each trainer
closed before the next is built.

One process profiles a single GPU or the CPU; under ``torchrun`` (or ``python -m tools.torchrun``) every rank
profiles its own steps of the parallel run (DDP, FSDP, tensor and context parallel), so the communication
kernels (NCCL's, gloo's ops on the CPU) show in each rank's table beside the compute; each rank writes
``..._rank<r>.json`` (and trace), and rank 0 prints the table:

    torchrun --nproc_per_node 2 benchmarks/profile_step.py --config mp --context_parallel 2 \
        --data_loader_config synthetic --out $OUT
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save_json  # noqa: E402
from utils.core.errors import ArgumentParser, run_cli  # noqa: E402

KEPT_ROWS = 300  # ops saved per mode, by device time (a step has a few hundred distinct ops)


def parser() -> ArgumentParser:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                        usage="%(prog)s [options] [train.py options]")
    ap.add_argument("--amp_modes", nargs="+", choices=["none", "fp16", "bf16", "bf16_pure", "fp8"],
                    help="profile each of these --amp_mode in turn (default: the config's)")
    ap.add_argument("--warmup_steps", type=int, default=8, help="steps before timing (compilation happens here)")
    ap.add_argument("--steps", type=int, default=5, help="steps timed, then profiled")
    ap.add_argument("--rows", type=int, default=30, help="rows of the printed table")
    ap.add_argument("--out", help="folder for the JSON of each mode (e.g. $OUT)")
    ap.add_argument("--trace", action="store_true", help="also write a Chrome trace per mode into --out")
    return ap


def batches(loader):
    """The loader's batches, epoch after epoch, without end."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def op_rows(averages, cuda: bool) -> list[dict]:
    """``key_averages`` as plain rows, most device (CPU: CPU) time first; times in microseconds."""
    rows = [{"name": e.key, "calls": e.count, "device_time_total_us": e.device_time_total,
             "self_device_time_total_us": e.self_device_time_total, "cpu_time_total_us": e.cpu_time_total,
             "self_cpu_time_total_us": e.self_cpu_time_total} for e in averages]
    rows.sort(key=lambda r: r["device_time_total_us" if cuda else "cpu_time_total_us"], reverse=True)
    return rows[:KEPT_ROWS]


def profile_mode(cfg, world, args, name: str) -> dict:
    """Build the trainer of ``cfg``, time and profile its steps; print the table (rank 0); the mode's record;
    ``name``: the file name of its JSON, without the suffix."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from training.loop.trainer import Trainer
    from training.monitor.memory import MemoryTracker, reset_peak_rss

    cuda = world.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(world.device)) if cuda else (lambda: None)
    trainer = Trainer(cfg, world)
    try:
        trainer.model.train()
        it = batches(trainer.data.train)

        def steps(n: int) -> float:
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                trainer.train_step(it)
                trainer.state.step += 1
            sync()
            return (time.perf_counter() - t0) / n * 1e3

        steps(args.warmup_steps)
        trainer.frozen_heap.refreeze()  # as training does after its first step (--gc_freeze)
        tracker = MemoryTracker(world.device)
        tracker.start_epoch()  # peaks of the timed steps, not of compilation
        if not cuda:
            reset_peak_rss()
        plain_ms = steps(args.steps)
        memory = tracker.local_stats()  # this rank's own, as its ops
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            profiled_ms = steps(args.steps)
        frozen = gc.get_freeze_count()  # before close unfreezes them
    finally:
        trainer.close()
    mode, samples = cfg.precision.amp_mode, trainer.global_bs
    peak = memory.get("peak_allocated", memory.get("peak_rss"))
    rank = f"rank {world.rank}: " if world.world_size > 1 else ""
    print(f"{rank}{cfg.name} --amp_mode {mode}: step {plain_ms:.1f} ms ({samples / plain_ms * 1e3:.1f} samples/s), "
          f"profiled {profiled_ms:.1f} ms, peak {'allocated' if cuda else 'RSS'} {peak:.2f} GiB")
    averages = prof.key_averages()
    if world.rank == 0:
        print(averages.table(sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=args.rows,
                             max_name_column_width=70))
    record = {"config": cfg.name, "amp_mode": mode, "global_batch": samples, "step_ms": plain_ms,
              "samples_per_s": samples / plain_ms * 1e3, "profiled_step_ms": profiled_ms, "steps": args.steps,
              "memory": memory, "frozen_objects": frozen, "ops": op_rows(averages, cuda)}
    trace = Path(args.out) / f"{name}.trace.json" if args.out and args.trace else None
    if trace:
        prof.export_chrome_trace(str(trace))
    split, by_kernel = analyse_gpu_time(prof, trace, args.steps) if cuda else (None, [])
    if split:
        record["gpu_time_ms"] = split
        print(f"{rank}GPU time a step: " + ", ".join(f"{k} {v:.1f} ms" for k, v in split.items()))
    if by_kernel:
        record["collectives"] = by_kernel
    return record


def analyse_gpu_time(prof, trace: Path | None, steps: int) -> tuple[dict | None, list[dict]]:
    """``benchmarks/gpu_time.py``'s split of the profiled steps' GPU time (None without GPU activity) and their
    communication by kernel, from the Chrome trace ``trace`` (or one exported to a temporary file and removed)."""
    from benchmarks.gpu_time import analyse_file

    with tempfile.TemporaryDirectory() as tmp:
        if trace is None:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
        return analyse_file(trace, steps)


def main(argv: list[str]) -> None:
    import torch

    from distributed.launch import detect_launch, validation_launch
    from distributed.world import distributed_session
    from utils.config.command_line import cli_config
    from utils.config.validate import validate

    args, rest = parser().parse_known_args(argv)
    base = cli_config(rest, "short_opt", "benchmarks/profile_step.py")
    if base is None:
        return
    if not any(a.split("=")[0] == "--expdir" for a in rest):
        base.logging.expdir = "/tmp/profile_runs"
    base.checkpoint.save_checkpoint, base.checkpoint.resume = False, "never"
    launch = detect_launch()
    configs = []
    for mode in args.amp_modes or [base.precision.amp_mode]:
        cfg = copy.deepcopy(base)
        cfg.precision.amp_mode = mode
        cfg.logging.run_num = "auto"  # with --resume never: the next free number, agreed by every rank
        validate(cfg, validation_launch(launch))  # every mode's bad input before the first is built
        configs.append(cfg)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    with distributed_session(base.parallel, launch) as world:
        for cfg in configs:
            name = f"profile_{cfg.name}_{cfg.precision.amp_mode}" + (f"_rank{world.rank}" if world.world_size > 1
                                                                      else "")
            record = profile_mode(cfg, world, args, name)
            record.update(device=torch.cuda.get_device_name(world.device) if world.device.type == "cuda" else "cpu",
                          torch=torch.__version__, command=" ".join([sys.executable, __file__, *argv]))
            if args.out:
                path = Path(args.out) / f"{name}.json"
                save_json(path, record)
                print(f"saved {path}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
