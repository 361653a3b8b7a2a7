"""The batch-size tuner on the real setup: one trial per local batch, in this process, on every rank.

A trial builds the training step exactly as training does (``utils/train_step.py``: DDP, FSDP,
TP/CP, AC, AMP, compile), runs ``tune_warmup_steps`` steps (compilation happens there), then times
``tune_steps`` steps and reads the allocator's counters over those steps only. The search, the
agreement of all ranks on each verdict and the report are ``utils/batch_tuner.py``'s.

Out of memory. With one process, an OOM is caught: the trial is recorded as failed, the model,
optimizer, compiled graphs and cached blocks are freed, and the search goes on. With several, the
other ranks are inside the step's collectives waiting for the failed one, which nothing in PyTorch
can cancel short of aborting the communicators, so the job stops instead: the OOM is written to the
tuner's journal (``<out>.journal.jsonl``, which every finished trial is also written to) and every
rank exits with status 3. Running the same command again continues from the journal with that batch
marked OOM; ``torchrun --max-restarts N`` does so by itself.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

import torch

from distributed.env import World, broadcast_from_main
from distributed.parallelize import AMP_DTYPES
from utils.batch_tuner import (OBJECTIVES, Trial, choice_args, choose, combine, plot, report_table, save_json,
                                search)
from utils.data_loader import build_data
from utils.errors import OutOfMemory
from utils.flops import peak_flops, vit_flops_per_sample
from utils.memory import GIB, peak_rss_bytes, reset_peak_rss
from utils.schema import AUTO, Config, TuneConfig, batch_sizes
from utils.train_step import build_training_step, set_attention_backend

log = logging.getLogger(__name__)

TUNE_FILE = "tune_batch_size.json"  # the tuner's JSON; also in the run directory of --local_batch_size auto
AUTO_OBJECTIVE = "max-throughput"  # what --local_batch_size auto trains with

# keys that steer the tuner but not the training it measures: left out of the printed train.py arguments
# and of the journal's fingerprint
TUNER_ONLY = tuple(f.name for f in fields(TuneConfig))


@dataclass
class TuneResult:
    """The agreed trials in measurement order, the choice per objective, the ``train.py`` arguments of
    each choice, and the global batch and learning rate the arguments were scaled from."""

    trials: list[Trial]
    choices: dict[str, Trial]
    args: dict[str, list[str]]
    base_global: int
    base_lr: float
    dimension: str = "batch"  # "batch", or the second dimension searched at a fixed global batch

    def lr(self, objective: str) -> float:
        """The learning rate ``args[objective]`` trains with (the scaled one when it sets ``--lr``)."""
        return args_lr(self.args[objective]) or self.base_lr


# ---------------------------------------------------------------- one trial
def trial_config(cfg: Config, local_batch: int) -> Config:
    """``cfg`` training at ``local_batch``, with the synthetic loader unless ``tune_data`` is ``real``."""
    cfg = copy.deepcopy(cfg)
    cfg.optim.local_batch_size = local_batch
    if cfg.tune.tune_data == "synthetic":
        cfg.data.data_loader_config = "synthetic"
    return cfg


def _endless(batches) -> Iterator[tuple]:
    """The loader's batches, epoch after epoch (a trial may need more steps than an epoch has)."""
    epoch = 0
    while True:
        batches.set_epoch(epoch)
        yield from batches
        epoch += 1


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Free what a trial left: compiled graphs (each trial compiles for its own shapes, as training
    does), unreachable objects, and the allocator's cached blocks; reset the peak statistics."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class _Counters:
    """Peak memory and the allocator's retry and OOM counts from :meth:`start` on (CPU: peak RSS)."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, {}

    def _stats(self) -> dict:
        return torch.cuda.memory_stats(self.device) if self.device.type == "cuda" else {}

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()
        self.base = self._stats()

    def read(self) -> dict:
        """Trial fields: peaks in bytes, fragmentation, retries and OOMs since :meth:`start`."""
        if self.device.type != "cuda":
            return {"peak_reserved_bytes": peak_rss_bytes()}
        now = self._stats()
        return {"peak_allocated_bytes": now.get("allocated_bytes.all.peak", 0),
                "peak_reserved_bytes": now.get("reserved_bytes.all.peak", 0),
                "inactive_split_bytes": now.get("inactive_split_bytes.all.peak", 0),
                "alloc_retries": now.get("num_alloc_retries", 0) - self.base.get("num_alloc_retries", 0),
                "ooms": now.get("num_ooms", 0) - self.base.get("num_ooms", 0)}


class BatchTrials:
    """``run_trial`` for :func:`utils.batch_tuner.search`: measures one local batch on this rank.

    Trials found in ``journal`` (a previous attempt of the same tuning) are returned as recorded;
    every other one is measured and then recorded there by rank 0.
    """

    def __init__(self, cfg: Config, world: World, journal: Journal, warmup: int, steps: int):
        self.cfg, self.world, self.journal = cfg, world, journal
        self.warmup, self.steps = warmup, steps
        self.budget = None if cfg.tune.memory_budget_gib is None else cfg.tune.memory_budget_gib * GIB
        self.flops_per_sample = vit_flops_per_sample(cfg.model, cfg.data)
        self.peak_flops = peak_flops(world.device, cfg.precision.amp_mode)
        prec, m = cfg.precision, cfg.model
        set_attention_backend(prec.attention_backend, world.device, m.embed_dim // m.num_heads,
                              AMP_DTYPES[prec.amp_mode] or torch.float32)

    def __call__(self, local_batch: int) -> Trial:
        if local_batch in self.journal.trials:
            log.info("batch tuner: local batch %d taken from the journal %s", local_batch, self.journal.path)
            return self.journal.trials[local_batch]
        trial = self.measure(local_batch)
        self.journal.record(trial)
        return trial

    def measure(self, local_batch: int) -> Trial:
        """Build, warm up and time the step at ``local_batch``; OOM recorded in the trial (one process).

        Raises:
            OutOfMemory: an OOM with several processes (after writing it to the journal).
        """
        cfg, device = trial_config(self.cfg, local_batch), self.world.device
        _, global_batch = batch_sizes(cfg.optim, self.world.dp)
        trial, counters = Trial(local_batch, global_batch), _Counters(device)
        self.journal.running(trial)
        _release(device)
        counters.start()
        try:
            elapsed = self._run(cfg, counters)
        except torch.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0]
            elapsed = None
        if elapsed is None:  # the peaks first: the release resets them
            self._read(trial, counters)
            trial.ooms = max(1, trial.ooms)
            _release(device)  # after the except block: its traceback no longer holds the step's tensors
            self._out_of_memory(trial, message)
        else:
            trial.step_time_s = elapsed / self.steps
            trial.samples_per_s = global_batch / trial.step_time_s
            if self.peak_flops:
                trial.mfu = trial.samples_per_s * self.flops_per_sample / (self.peak_flops * self.world.world_size)
            self._read(trial, counters)
        _release(device)
        trial.over_budget = self.budget is not None and trial.peak_reserved_bytes > self.budget
        return trial

    def _run(self, cfg: Config, counters: _Counters) -> float:
        """Warm up, then time ``steps`` steps (seconds); counters restart after the warm-up."""
        world = self.world
        data = build_data(cfg.data, cfg.optim.local_batch_size, world.dp_rank, world.dp, world.device,
                          cfg.optim.seed)
        try:
            step = build_training_step(cfg, world)
            batches = _endless(data.train)
            for _ in range(self.warmup):
                step(batches)
            _synchronize(world.device)
            counters.start()
            start = time.perf_counter()
            for _ in range(self.steps):
                step(batches)
            _synchronize(world.device)
            return time.perf_counter() - start
        finally:
            data.close()

    @staticmethod
    def _read(trial: Trial, counters: _Counters) -> None:
        for name, value in counters.read().items():
            setattr(trial, name, value)

    def _out_of_memory(self, trial: Trial, message: str) -> None:
        """Log the OOM and go on (one process), or journal it and raise (several)."""
        if self.world.world_size == 1:
            log.info("batch tuner: local batch %d ran out of memory (%s); freed, going on", trial.local_batch_size,
                     message)
            return
        self.journal.out_of_memory(trial, self.world.rank)
        raise OutOfMemory(f"rank {self.world.rank} ran out of {self.world.device} memory at local batch "
                          f"{trial.local_batch_size} during tuning ({message}); with several processes the tuner "
                          f"cannot recover in-process: run the same command again to continue from "
                          f"{self.journal.path} (torchrun --max-restarts N does it by itself)")


# ---------------------------------------------------------------- the journal
class Journal:
    """The trials of one tuning, appended as JSON lines to ``path`` so a stopped job continues.

    Line kinds: ``{"fingerprint": ...}`` (first; the config and world it belongs to), ``{"running": B,
    "global": G}`` before trial B (global batch G), ``{"trial": {...}}`` after it, and ``{"oom": B, "rank": R}`` from a rank that ran
    out of memory. Rank 0 writes all but the last, which the failing rank appends itself. A trial
    that was running when the job stopped counts as OOM if some rank said so, else as an error.
    """

    def __init__(self, path: Path, fingerprint: dict, world: World):
        self.path, self.world = path, world
        self.trials: dict[int, Trial] = broadcast_from_main(self._read(fingerprint) if world.is_main else None, world)
        if world.is_main and not self.trials:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")

    def _read(self, fingerprint: dict) -> dict[int, Trial]:
        try:
            lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return {}
        if not lines or lines[0].get("fingerprint") != fingerprint:
            return {}
        trials = {t["local_batch_size"]: _trial(t) for t in (line["trial"] for line in lines if "trial" in line)}
        ooms = {line["oom"] for line in lines if "oom" in line}
        for line in (line for line in lines if "running" in line):
            batch = line["running"]
            if batch not in trials:
                trials[batch] = _stopped_trial(batch, line["global"], batch in ooms)
        if trials:
            log.info("batch tuner: continuing from %s (%d trials done)", self.path, len(trials))
        return trials

    def _append(self, entry: dict) -> None:
        with open(self.path, "a") as f:  # one write per line: appends of ranks do not interleave
            f.write(json.dumps(entry) + "\n")

    def running(self, trial: Trial) -> None:
        if self.world.is_main:
            self._append({"running": trial.local_batch_size, "global": trial.global_batch_size})

    def record(self, trial: Trial) -> None:
        if self.world.is_main:
            self._append({"trial": _fields(trial)})

    def out_of_memory(self, trial: Trial, rank: int) -> None:
        try:
            self._append({"oom": trial.local_batch_size, "rank": rank})
        except OSError as exc:
            log.warning("could not write the OOM to %s: %s", self.path, exc)

    def remove(self) -> None:
        """Delete the journal (rank 0), once the result is written."""
        if self.world.is_main:
            self.path.unlink(missing_ok=True)


def _fields(trial: Trial) -> dict:
    return {f.name: getattr(trial, f.name) for f in fields(Trial)}


def _trial(entry: dict) -> Trial:
    return Trial(**{f.name: entry[f.name] for f in fields(Trial) if f.name in entry})


def _stopped_trial(batch: int, global_batch: int, oom: bool) -> Trial:
    if oom:
        return Trial(batch, global_batch, ooms=1)
    return Trial(batch, global_batch, error="the job stopped during this trial")


# ---------------------------------------------------------------- the whole tuning
def base_batch(cfg: Config, dp: int) -> int:
    """The global batch the config's learning rate belongs to: its own, or ``global_batch_size`` when
    the local batch is ``auto`` (or unset)."""
    if cfg.optim.local_batch_size in (None, AUTO):
        return cfg.optim.global_batch_size
    return batch_sizes(cfg.optim, dp)[1]


def fingerprint(cfg: Config, world: World) -> dict:
    """What the journal's trials depend on: every key that is not the tuner's own or the local batch
    (``tune_data`` is kept: it changes what is measured), and the world's shape."""
    flat = {k: v for k, v in cfg.flat().items()
            if k not in TUNER_ONLY + ("local_batch_size", "global_batch_size") or k == "tune_data"}
    return {"config": flat, "world": [world.world_size, world.dp, world.cp, world.tp]}


def tune(cfg: Config, world: World, base_args: list[str], journal_path: Path, quick: bool = False) -> TuneResult:
    """Search the local batch on ``world`` (collective: every rank calls it) and choose per objective.

    ``base_args`` are the ``train.py`` arguments the printed ones start from. ``quick`` (``train.py
    --local_batch_size auto``) times at most 3 steps after at most 2 of warm-up and measures nothing
    below the boundary.

    Raises:
        NoCleanTrial: no batch ran clean.
        OutOfMemory: an OOM with several processes (the journal keeps the progress).
    """
    t = cfg.tune
    warmup, steps, below = (min(2, t.tune_warmup_steps), min(3, t.tune_steps), 0) if quick else (
        t.tune_warmup_steps, t.tune_steps, t.tune_below)
    journal = Journal(journal_path, fingerprint(cfg, world), world)
    deadline = None if t.max_minutes is None else time.monotonic() + 60 * t.max_minutes
    trials = search(BatchTrials(cfg, world, journal, warmup, steps), world, start=t.tune_start,
                    resolution=t.resolution, max_batch=t.tune_max_batch, below=below, deadline=deadline)
    choices = choose(trials, t.tolerance)
    base = base_batch(cfg, world.dp)
    args = {name: choice_args(choice, base_args, cfg.optim.lr, base) for name, choice in choices.items()}
    journal.remove()
    return TuneResult(trials, choices, args, base, cfg.optim.lr)


# ---------------------------------------------------------------- a second dimension at a fixed global batch
def setting_values(cfg: Config, dimension: str) -> list[int]:
    """The values tried: checkpointed blocks 0, 1/4, 1/2, 3/4 and all of the depth (memory falls as they
    rise); FSDP prefetch depths 0 to 3."""
    if dimension == "ac_blocks":
        depth = cfg.model.depth
        return sorted({0, depth // 4, depth // 2, 3 * depth // 4, depth})
    return [0, 1, 2, 3]


def setting_args(cfg: Config, dimension: str, value: int) -> list[str]:
    """The ``train.py`` arguments of one setting: no, selective (the first ``value`` blocks) or full
    activation checkpointing; or ``--fsdp_prefetch value``."""
    if dimension == "fsdp_prefetch":
        return ["--fsdp_prefetch", str(value)]
    if value == 0:
        return ["--activation_checkpointing", "none"]
    if value == cfg.model.depth:
        return ["--activation_checkpointing", "full"]
    return ["--activation_checkpointing", "selective", "--ac_blocks", str(value)]


def with_setting(cfg: Config, dimension: str, value: int, accumulation: int) -> Config:
    """A copy of ``cfg`` with the setting of :func:`setting_args` and ``accumulation`` micro-batches per step."""
    cfg = copy.deepcopy(cfg)
    if dimension == "fsdp_prefetch":
        cfg.parallel.fsdp_prefetch = value
    else:
        cfg.precision.activation_checkpointing = ("none" if value == 0 else "full" if value == cfg.model.depth
                                                  else "selective")
        cfg.precision.ac_blocks = value if cfg.precision.activation_checkpointing == "selective" else 0
    cfg.optim.grad_accum_steps = accumulation
    return cfg


def accumulated_batches(global_batch: int, dp: int) -> list[int]:
    """Local batches that keep ``global_batch`` on ``dp`` ranks, largest first: the global batch per rank,
    halved while it divides (each halving doubles the accumulation)."""
    batches, local = [], global_batch // dp
    while local >= 1 and global_batch % (dp * local) == 0:
        batches.append(local)
        if local % 2:
            break
        local //= 2
    return batches


def tune_combination(cfg: Config, world: World, base_args: list[str], journal_path: Path) -> TuneResult:
    """At the config's global batch, the fastest clean combination of local batch (with the accumulation
    that keeps the global batch) and ``cfg.tune.tune`` (``ac_blocks`` or ``fsdp_prefetch``); collective.
    Trials are those of :func:`tune`, journaled per setting and accumulation.

    Raises:
        NoCleanTrial: no combination ran clean.
        OutOfMemory: an OOM with several processes (the journals keep the progress).
    """
    t, dimension = cfg.tune, cfg.tune.tune
    global_batch = base_batch(cfg, world.dp)
    journals: list[Journal] = []

    def run_trial(value: int, local_batch: int) -> Trial:
        accumulation = global_batch // (world.dp * local_batch)
        trial_cfg = with_setting(cfg, dimension, value, accumulation)
        journal = Journal(journal_path.with_name(f"{journal_path.stem}.{dimension}{value}_x{accumulation}.jsonl"),
                          fingerprint(trial_cfg, world), world)
        journals.append(journal)
        return BatchTrials(trial_cfg, world, journal, t.tune_warmup_steps, t.tune_steps)(local_batch)

    deadline = None if t.max_minutes is None else time.monotonic() + 60 * t.max_minutes
    trials = combine(run_trial, world, settings=setting_values(cfg, dimension),
                     local_batches=accumulated_batches(global_batch, world.dp), monotone=dimension == "ac_blocks",
                     deadline=deadline)
    choices = choose(trials, t.tolerance)
    args = {name: choice_args(c, base_args, cfg.optim.lr, global_batch) + setting_args(cfg, dimension, c.setting)
            + ["--grad_accum_steps", str(global_batch // (world.dp * c.local_batch_size))]
            for name, c in choices.items()}
    for journal in journals:
        journal.remove()
    return TuneResult(trials, choices, args, global_batch, cfg.optim.lr, dimension)


def without_tuner_keys(argv: list[str]) -> list[str]:
    """``argv`` without the tuner's own keys and ``--local_batch_size`` (``--key value`` or ``--key=value``):
    the part of a tuner command line that ``train.py`` takes as it is."""
    drop = {f"--{k}" for k in TUNER_ONLY + ("local_batch_size",)}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def summary(result: TuneResult) -> str:
    """The table and, per objective, the choice, its train.py arguments and any learning-rate scaling."""
    lines = [report_table(result.trials, None if result.dimension == "batch" else result.dimension), ""]
    for name in OBJECTIVES:
        choice = result.choices[name]
        setting = "" if result.dimension == "batch" else f", {result.dimension} {choice.setting}"
        lines.append(f"{name}: local batch {choice.local_batch_size} (global {choice.global_batch_size}){setting}, "
                     f"{choice.samples_per_s:.1f} samples/s")
        if choice.global_batch_size != result.base_global:
            lines.append(f"  lr {result.base_lr:.6g} -> {result.lr(name):.6g}: scaled by sqrt({choice.global_batch_size}"
                         f" / {result.base_global}), the square-root rule of the config ladder")
        lines.append("  python train.py " + " ".join(result.args[name]))
    retried = [t for t in result.trials if t.alloc_retries and not t.ooms]
    if retried and result.dimension == "batch":
        lines.append(f"cudaMalloc retries from local batch {min(t.local_batch_size for t in retried)} on, "
                     "before any OOM: the allocator frees its cache and synchronizes there")
    return "\n".join(lines)


def write_outputs(result: TuneResult, out: Path) -> list[Path]:
    """``out`` (the JSON of :func:`utils.batch_tuner.save_json`, with ``tune``: what was searched) and, for a
    batch search, the PNG of the curve beside it; returns the files written."""
    save_json(out, result.trials, result.choices, result.args, {"tune": result.dimension})
    if result.dimension != "batch":  # settings at one global batch: the table is the picture
        return [out]
    png = out.with_suffix(".png")
    plot(png, result.trials)
    return [out, png]


def out_path(cfg: Config) -> Path:
    """``--out``, or ``<expdir>/<config>/tune_batch_size.json``."""
    return Path(cfg.tune.out) if cfg.tune.out else Path(cfg.logging.expdir) / cfg.name / TUNE_FILE


def journal_path(out: Path) -> Path:
    return out.with_name(out.stem + ".journal.jsonl")


# ---------------------------------------------------------------- train.py --local_batch_size auto
def with_batch(cfg: Config, local_batch: int, lr: float | None) -> Config:
    """A copy of ``cfg`` training at ``local_batch``, with learning rate ``lr`` unless None."""
    cfg = copy.deepcopy(cfg)
    cfg.optim.local_batch_size = local_batch
    if lr is not None:
        cfg.optim.lr = lr
    return cfg


def args_lr(args: list[str]) -> float | None:
    """The value of ``--lr`` in ``args`` (the last one), or None."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--lr"]
    return float(values[-1]) if values else None


def recorded_choice(run_dir: Path | None) -> tuple[int, float | None] | None:
    """(local batch, learning rate or None when unscaled) that ``--local_batch_size auto`` chose for the
    run in ``run_dir`` (its ``tune_batch_size.json``), so a resumed run keeps them; None without that
    record."""
    if run_dir is None:
        return None
    try:
        choice = json.loads((run_dir / TUNE_FILE).read_text())["choice"][AUTO_OBJECTIVE]
        return int(choice["local_batch_size"]), args_lr(choice["args"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
