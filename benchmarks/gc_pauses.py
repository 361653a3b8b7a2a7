"""How long Python's full garbage collections stop a training run, with ``--gc_freeze`` off and on
(docs/speed.md, rounds 5s and 5t).

    python benchmarks/gc_pauses.py --runs 2 --out benchmarks/results/h200_gc_pauses.json -- --config short_opt \\
        --data_path /tmp/full --data_loader_config synthetic --amp_mode bf16 --num_iters 64 --valid_every 2

Each run is ``train.py``'s training in a process of its own, ``--runs`` times with ``--gc_freeze false`` and with
``true``, alternating; each compiles with empty Inductor and Triton caches of its own unless ``--warm_caches``
(a cold compile leaves the most objects behind, as in the first runs of ``benchmarks/check.py`` on a fresh
machine). A component of the run times every collection of generation 2 (``gc.callbacks``) and notes when each
step starts and ends. Per run: the last epoch's samples/s; the full collections and the longest; those that
started after the first step (which compiles: its own collections are the compiler's) and the longest; those
inside a later step (where they stop training: on several ranks, every rank waits for the slowest) and the
longest; the full passes over the frozen objects that ``--gc_freeze true`` makes (and, off, would make) by its
rule, at the first epoch start after each 10-minute mark of the wall clock, reckoned from the epoch starts'
``time.time`` (a pass unfreezes and walks every object: expect one collection that long); the median and
the longest step of the last epoch, in ms; the median and the longest epoch after the first, from its first
step's start to its last step's end, in s (on several ranks a rank that waits for another's collection shows it
here); the objects frozen at the last epoch's end;
and as the run closes, what one full collection of everything (unfrozen) frees while the trainer still holds its
model: the objects, and the GPU memory they held (MiB: garbage that a freeze keeps until the next full pass keeps
any CUDA tensors it refers to).
The JSON rows add every epoch's span and every collection after step 1 (``[epoch of the next step, s]``, the
epochs numbered from 1 as the log numbers them).
With ``--gpus`` N above 1 each run is N ranks under torchrun, and each rank gives its row.
Arguments after ``--`` go to the runs as ``train.py`` options.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (Results, parse_runs, read_json, run_variant, runs_parser,  # noqa: E402
                               succeeded_row, table)
from benchmarks.multi_gpu import ranks_launch  # noqa: E402
from training.loop.garbage import FULL_EVERY_S  # noqa: E402
from utils.core.component import Component  # noqa: E402
from utils.core.errors import run_cli  # noqa: E402

COLUMNS = [("gc_freeze", "gc_freeze", "s"), ("run", "run", "d"), ("rank", "rank", "d"),
           ("samples/s", "samples_per_s", ".1f"),
           ("full collections", "full_collections", "d"), ("longest s", "longest_collection_s", ".3f"),
           ("after step 1", "collections_after_step_1", "d"), ("longest s", "longest_after_step_1_s", ".3f"),
           ("in a later step", "collections_in_later_steps", "d"), ("longest s", "longest_in_a_later_step_s", ".3f"),
           ("full passes due", "full_passes_due", "d"),
           ("step ms median", "step_ms_median", ".1f"), ("step ms longest", "step_ms_longest", ".1f"),
           ("epoch s median", "epoch_s_median", ".3f"), ("epoch s longest", "epoch_s_longest", ".3f"),
           ("frozen objects", "frozen_objects", "d"), ("garbage at the end", "garbage_objects", "d"),
           ("its GPU MiB", "garbage_gpu_mib", ".1f")]


def garbage_held() -> dict:
    """Unfreeze every object and collect all generations: the objects freed, and the CUDA memory they held
    (``torch.cuda.memory_allocated`` before less after, MiB; 0 without CUDA)."""
    import torch

    allocated = torch.cuda.memory_allocated if torch.cuda.is_available() else (lambda: 0)
    gc.unfreeze()
    before = allocated()
    objects = gc.collect()
    return {"garbage_objects": objects, "garbage_gpu_mib": (before - allocated()) / 2**20}


class CollectionTimer(Component):
    """Times each full collection (start, seconds) from its construction on, and notes each step's start and end
    (``time.perf_counter``) with its epoch, the wall clock (``time.time``) at the first step's end and at each epoch
    start, the objects frozen at each epoch's end, and as it closes (after FrozenHeap, which closes first; the
    trainer still holds its model) the garbage left (:func:`garbage_held`)."""

    def __init__(self):
        self.collections: list[tuple[float, float]] = []
        self.steps: list[tuple[int, float, float]] = []  # (epoch, start, end)
        self.first_step_wall = 0.0
        self.epoch_starts_wall: list[float] = []
        self.frozen = 0
        self.garbage: dict = {}
        self._started = self._step_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections.append((self._started, time.perf_counter() - self._started))

    def step_start(self, state) -> None:
        self._step_start = time.perf_counter()

    def step_end(self, state) -> None:
        self.steps.append((state.epoch, self._step_start, time.perf_counter()))
        self.first_step_wall = self.first_step_wall or time.time()

    def epoch_start(self, state) -> None:
        self.epoch_starts_wall.append(time.time())

    def epoch_end(self, state, record: dict) -> None:
        self.frozen = gc.get_freeze_count()  # it walks every frozen object: not in a step (33 ms on a CPU)

    def close(self, error: BaseException | None) -> None:
        gc.callbacks.remove(self._on_gc)
        self.garbage = garbage_held()


def full_passes_due(first_step_wall: float, epoch_starts_wall: list[float], every_s: float = FULL_EVERY_S) -> int:
    """The full passes that FrozenHeap's rule makes: one at the first epoch start after each multiple of
    ``every_s`` seconds of the wall clock that passes after the first step's end (the first freeze)."""
    period, due = first_step_wall // every_s, 0
    for wall in epoch_starts_wall:
        if wall > first_step_wall and wall // every_s != period:
            period, due = wall // every_s, due + 1
    return due


def epoch_spans(steps: list[tuple[int, float, float]]) -> list[float]:
    """Each epoch's span in s, in epoch order: its first step's start to its last step's end."""
    spans: dict[int, tuple[float, float]] = {}
    for epoch, begin, end in steps:
        first, _ = spans.get(epoch, (begin, end))
        spans[epoch] = (first, end)
    return [end - begin for _, (begin, end) in sorted(spans.items())]


def summary(timer: CollectionTimer, record: dict) -> dict:
    """One run's row (see the module docstring) from its timer and its last epoch's record."""
    first_end = timer.steps[0][2]
    later = [(start, seconds) for start, seconds in timer.collections if start > first_end]
    after = [seconds for _, seconds in later]
    # each collection after step 1 by the epoch (numbered from 1, as the log does) of the next step to start
    by_epoch = [[next((epoch + 1 for epoch, begin, _ in timer.steps if begin >= start), None), round(seconds, 4)]
                for start, seconds in later]
    inside = [seconds for start, seconds in timer.collections
              if any(begin <= start <= end for _, begin, end in timer.steps[1:])]
    last = [end - begin for epoch, begin, end in timer.steps if epoch == timer.steps[-1][0]]
    spans = epoch_spans(timer.steps)
    epochs = spans[1:]
    return {"samples_per_s": record["samples_per_s"], "full_collections": len(timer.collections),
            "longest_collection_s": max((s for _, s in timer.collections), default=0.0),
            "collections_after_step_1": len(after), "longest_after_step_1_s": max(after, default=0.0),
            "collections_in_later_steps": len(inside), "longest_in_a_later_step_s": max(inside, default=0.0),
            "full_passes_due": full_passes_due(timer.first_step_wall, timer.epoch_starts_wall),
            "step_ms_median": 1e3 * statistics.median(last), "step_ms_longest": 1e3 * max(last),
            "epoch_s_median": statistics.median(epochs) if epochs else 0.0, "epoch_s_longest": max(epochs, default=0.0),
            "frozen_objects": timer.frozen, **timer.garbage,
            "epoch_spans_s": [round(span, 4) for span in spans], "collections_after_step_1_s": by_epoch}


def child(folder: Path, argv: list[str]) -> None:
    """One run, as ``train.py argv`` would train, with a :class:`CollectionTimer`; each rank's row written to
    ``folder/rank<N>.json``."""
    from distributed.launch import detect_launch
    from distributed.world import distributed_session
    from training.loop.trainer import run
    from utils.config.command_line import cli_config

    cfg = cli_config(argv, "tiny", "benchmarks/gc_pauses.py")
    timer = CollectionTimer()
    with distributed_session(cfg.parallel, detect_launch()) as world:
        record = run(cfg, world, extra=lambda run_dir: [timer])
        (folder / f"rank{world.rank}.json").write_text(json.dumps(summary(timer, record)))


def one_run(args, train_args: list[str], setting: str, index: int) -> list[dict]:
    """A :func:`child` process with ``--gc_freeze setting``, run as every benchmark's runs are (``run_variant``:
    its own run directory, killed with a stopped benchmark), on ``args.gpus`` ranks; its ranks' rows."""
    name = f"gc_freeze_{setting}_{index}"
    folder = Path(args.expdir).absolute() / name
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix="caches") as caches:  # empty, and removed after the run
        env = {} if args.warm_caches else {"TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor",
                                           "TRITON_CACHE_DIR": f"{caches}/triton"}
        succeeded_row(run_variant(name, ["--child", str(folder), *train_args, "--gc_freeze", setting],
                                  folder / "runs", entry="benchmarks/gc_pauses.py", env=env,
                                  **ranks_launch(args.gpus)), name)
    return [{"gc_freeze": setting, "run": index, "rank": rank,
             **read_json(folder / f"rank{rank}.json", "run the benchmark again")} for rank in range(args.gpus)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        child(Path(argv[1]), argv[2:])
        return 0
    ap = runs_parser(__doc__, "gc_pauses")
    ap.add_argument("--warm_caches", action="store_true", help="share this machine's compile caches between runs")
    args, train_args = parse_runs(ap, argv)
    from utils.config.command_line import cli_config
    cli_config([*train_args, "--gc_freeze", "true"], "tiny", "benchmarks/gc_pauses.py")  # bad options: before any run
    results = Results(Path(args.out), train_args=train_args, warm_caches=args.warm_caches)
    for index in range(args.runs):
        for setting in ("false", "true"):
            for row in one_run(args, train_args, setting, index):
                results.append(row)
    print(table(results, COLUMNS))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
