"""What a checkpoint costs on the real setup: size, save time (sync and async), load time, and the
training stall each kind of save causes, against the single-file full-model gather to rank 0 that
the run wrote every epoch before sharded checkpoints. As in training, the host buffers that saves
copy the state into are allocated in the background while steps run (``ShardedCheckpoints.prepare``),
before the first save. After three warm-up steps Python's garbage is collected and frozen, as training does
after its first step (``--gc_freeze``).

    torchrun --nproc_per_node 2 benchmarks/checkpoint.py --config vit_2b --fsdp zero3 --amp_mode bf16 \\
        --local_batch_size 8 --data_loader_config synthetic --dir /dev/shm/ckpt \\
        --out benchmarks/results/h200x2_checkpoint.json

Every option but ``--dir``, ``--steps``, ``--async_steps`` and ``--out`` is a ``train.py`` option. The stall of a save
is the time the training loop loses to it: for a sync save, the whole save; for an async one, the
time until ``save`` returns (staging to host memory) plus the extra time of the steps that run
while the background write goes on. Times are the maximum over ranks, in seconds.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import Results, table  # noqa: E402
from distributed.checkpoint.export import save_full_model  # noqa: E402
from distributed.checkpoint.sharded import ShardedCheckpoints  # noqa: E402
from distributed.launch import detect_launch  # noqa: E402
from distributed.world import all_reduce, distributed_session  # noqa: E402
from utils.config.command_line import cli_config  # noqa: E402
from utils.core.errors import ArgumentParser, run_cli  # noqa: E402
from training.loop.trainer import Trainer  # noqa: E402

COLUMNS = [("what", "what", "s"), ("seconds", "seconds", ".2f"), ("GB", "size_gb", ".2f"),
           ("stall s", "stall_s", ".2f"), ("steps during write", "steps_during_write", "d")]


class Stepper:
    """Runs the trainer's optimizer steps on its training data, cycling epochs; times each one."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.epoch = trainer, 0
        self.batches = self._next_epoch()

    def _next_epoch(self):
        self.trainer.data.train.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.trainer.data.train)

    def step(self) -> float:
        t = self.trainer
        t0 = time.perf_counter()
        try:
            t.train_step(self.batches)
        except StopIteration:
            self.batches = self._next_epoch()
            t.train_step(self.batches)
        t.state.step += 1
        synchronize(t.device)
        return time.perf_counter() - t0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float, trainer: Trainer) -> float:
    """The maximum of ``seconds`` over ranks."""
    return all_reduce(torch.tensor(seconds, device=trainer.device), trainer.world, op=dist.ReduceOp.MAX).item()


def folder_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9


def manager(trainer: Trainer, directory: Path, asynchronous: bool, checksums: bool = True) -> ShardedCheckpoints:
    cfg = dataclasses.replace(trainer.cfg.checkpoint, save_checkpoint=True, async_checkpoint=asynchronous,
                              keep_checkpoints=1, checkpoint_checksums=checksums)
    stateful = {"scheduler": trainer.scheduler, "scaler": trainer.scaler, "train_state": trainer.state}
    return ShardedCheckpoints(cfg, directory, trainer.model, trainer.optimizer, stateful, trainer.world)


def timed(trainer: Trainer, fn) -> float:
    synchronize(trainer.device)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    synchronize(trainer.device)
    return slowest(time.perf_counter() - t0, trainer)


KINDS = ("gather", "sync", "async")


def measure(trainer: Trainer, root: Path, n_steps: int, async_steps: int, kinds=KINDS) -> list[dict]:
    stepper = Stepper(trainer)
    for _ in range(3):  # warm-up
        stepper.step()
    trainer.frozen_heap.refreeze()  # as training does after its first step (--gc_freeze)
    step_s = statistics.median(slowest(stepper.step(), trainer) for _ in range(n_steps))
    rows = [{"what": "optimizer step (median)", "seconds": step_s}]

    if "gather" in kinds:
        gather = root / "model.pt"
        seconds = timed(trainer, lambda: save_full_model(trainer.model, gather))
        rows.append({"what": "full-model gather to rank 0 (old per-epoch save)", "seconds": seconds,
                     "size_gb": folder_gb(root) if trainer.world.is_main else None, "stall_s": seconds})
        if trainer.world.is_main:
            gather.unlink()
    if "sync" in kinds:
        for checksums in (True, False):  # the checksums' cost: hashing while writing, verifying before loading
            rows += sync_rows(trainer, stepper, root / "sync", step_s, async_steps, checksums)
    if "async" in kinds:
        rows += async_rows(trainer, stepper, root / "async", step_s, async_steps)
    return rows


def async_rows(trainer: Trainer, stepper: Stepper, directory: Path, step_s: float, async_steps: int) -> list[dict]:
    """The background allocation of host buffers, then two async saves (with checksums)."""
    rows = []
    asynchronous = manager(trainer, directory, asynchronous=True)
    rows.append(prepared(trainer, stepper, asynchronous, step_s, async_steps, "async"))
    for label in ("first", "again"):
        stepper.step()
        row = async_save(trainer, stepper, asynchronous, step_s, async_steps)
        rows.append({**row, "what": f"{row['what']} ({label})"})
    asynchronous.close()
    return rows


def sync_rows(trainer: Trainer, stepper: Stepper, directory: Path, step_s: float, async_steps: int,
              checksums: bool) -> list[dict]:
    """Sync saves (the first and a second) and a load, with or without checksums."""
    sync = manager(trainer, directory, asynchronous=False, checksums=checksums)
    note = "with checksums" if checksums else "without checksums"
    rows = [prepared(trainer, stepper, sync, step_s, async_steps, "sync")] if checksums else []
    for label in ("first", "again"):
        stepper.step()  # a new state to save
        seconds = timed(trainer, lambda: sync.save(trainer.state.step))
        size = folder_gb(sync.latest())
        rows.append({"what": f"sharded save, sync, {note} ({label})", "seconds": seconds, "size_gb": size,
                     "stall_s": seconds})
    seconds = timed(trainer, lambda: sync.load(sync.latest()))
    rows.append({"what": f"sharded load, {note}", "seconds": seconds, "size_gb": size})
    sync.close()
    if trainer.world.is_main:
        shutil.rmtree(directory)
    return rows


def prepared(trainer: Trainer, stepper: Stepper, mgr: ShardedCheckpoints, step_s: float, steps: int,
             kind: str) -> dict:
    """What the trainer does after its first step: start allocating the saves' host buffers in the
    background, and train on. The stall is the extra time of the ``steps`` steps run meanwhile."""
    t0 = time.perf_counter()
    mgr.prepare()
    during = [stepper.step() for _ in range(steps)]
    extra = slowest(time.perf_counter() - t0 - len(during) * step_s, trainer)
    row = {"what": f"host buffers of {kind} saves, allocated in the background", "seconds": slowest(time.perf_counter() - t0, trainer),
           "stall_s": max(extra, 0.0), "extra_step_s": extra, "steps_during_write": steps}
    if trainer.device.type == "cuda":  # page-locked blocks are rounded up to powers of two
        row["host_pinned_gb"] = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / 1e9
    return row


def async_save(trainer: Trainer, stepper: Stepper, mgr: ShardedCheckpoints, step_s: float, steps: int) -> dict:
    """Stage, train ``steps`` steps while the write runs in the background, then commit (``wait``).

    The stall is the staging plus the extra time of those steps over the median step; the final
    wait is reported apart (``commit_s``): a run commits at its next save, long after the write ended.
    """
    t0 = time.perf_counter()
    staging = timed(trainer, lambda: mgr.save(trainer.state.step))
    during = [stepper.step() for _ in range(steps)]
    commit = timed(trainer, mgr.wait)
    total = slowest(time.perf_counter() - t0, trainer)
    extra = slowest(sum(during) - len(during) * step_s, trainer)
    return {"what": "sharded save, async", "seconds": total, "size_gb": folder_gb(mgr.latest()),
            "stall_s": staging + max(extra, 0.0), "staging_s": staging, "extra_step_s": extra,
            "commit_s": commit, "steps_during_write": steps}


def main(argv: list[str]) -> int:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default="/tmp/ckpt_bench", help="where the checkpoints are written (emptied)")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps timed for the median")
    ap.add_argument("--async_steps", type=int, default=10, help="steps run while an async save writes")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="which saves to measure")
    ap.add_argument("--out", required=True)
    args, rest = ap.parse_known_args(argv)
    cfg = cli_config(rest, "vit_2b", "benchmarks/checkpoint.py")
    root = Path(args.dir)
    cfg.logging.expdir = str(root / "runs")
    cfg.checkpoint.resume = "never"
    cfg.checkpoint.save_checkpoint = False  # the trainer writes none of its own: the managers here save
    with distributed_session(cfg.parallel, detect_launch()) as world:
        trainer = Trainer(cfg, world)
        try:
            rows = measure(trainer, root, args.steps, args.async_steps, args.kinds)
        finally:
            trainer.close()
        if world.is_main:
            results = Results(Path(args.out), config=cfg.name, args=rest, world_size=world.world_size,
                              disk=disk_of(root))
            results.extend(rows)
            results.save()
            print(table(rows, COLUMNS))
            print(f"saved {args.out}")
    return 0


def disk_of(path: Path) -> str:
    """The filesystem the checkpoints went to (``df``'s type and source), for the record."""
    out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()
    return " ".join(out[-1].split()[:2]) if len(out) > 1 else "unknown"


if __name__ == "__main__":
    sys.exit(run_cli(main))
