"""The batch-size tuner on the real setup: one trial per local batch, in this process, on every rank.

A trial builds the training step exactly as training does (``training/loop/step.py``: DDP, FSDP,
TP/CP, AC, AMP, compile), runs ``tune_warmup_steps`` steps (compilation happens there), then times
``tune_steps`` steps and reads the allocator's counters over those steps only. The search, the
agreement of all ranks on each verdict and the report are ``search.py``'s and ``report.py``'s.

Out of memory. With one process (also a simulated rank of a larger job, ``distributed/simulate.py``: it has no
peers), an OOM is caught: the trial is recorded as failed, the model,
optimizer, compiled graphs and cached blocks are freed, and the search goes on. With several, the
other ranks are inside the step's collectives waiting for the failed one, which nothing in PyTorch
can cancel short of aborting the communicators, so the job stops instead: the OOM is written to the
tuner's journal (``<out>.journal.jsonl``, which every finished trial is also written to) and every
rank exits with status 3. Running the same command again continues from the journal with that batch
marked OOM; ``torchrun --max-restarts N`` does so by itself.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Iterator

import torch

from distributed.simulate import is_simulated
from distributed.world import World, broadcast_from_main
from training.loop.rollout import max_rollout_steps
from training.loop.step import build_training_step, set_attention_backend
from training.monitor.flops import peak_flops, vit_flops_per_sample
from training.monitor.memory import (GIB, allocator_counters, map_large_host_buffers, peak_rss_bytes, reset_peak_rss,
                                     trim_host_heap)
from training.tuner.search import Trial
from utils.config.schema import Config
from utils.config.validate import batch_sizes
from utils.core.errors import OutOfMemory
from utils.core.files import check_in_place, open_append, read_jsonl, write_text_atomic
from utils.data.loaders import build_data
from utils.precision.amp import AMP_DTYPES

log = logging.getLogger(__name__)


def trial_config(cfg: Config, local_batch: int) -> Config:
    """``cfg`` training at ``local_batch``, with the synthetic loader unless ``tune_data`` is ``real``."""
    cfg = copy.deepcopy(cfg)
    cfg.optim.local_batch_size = local_batch
    if cfg.tune.tune_data == "synthetic":
        cfg.data.data_loader_config = "synthetic"
    return cfg


def endless(batches) -> Iterator[tuple]:
    """The loader's batches, epoch after epoch (a trial may need more steps than an epoch has)."""
    epoch = 0
    while True:
        batches.set_epoch(epoch)
        yield from batches
        epoch += 1


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what a trial left: compiled graphs (each trial compiles for its own shapes, as training
    does), unreachable objects, and the allocator's cached blocks (on CPU, the heap's free pages); reset the
    peak statistics. On CPU the next trial's peak RSS then starts from what is really in use, and with each
    tensor buffer mapped on its own (:func:`map_large_host_buffers`) it grows with the trial's live tensors
    alone, not with how the heap was left by the trials before."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        map_large_host_buffers()
        trim_host_heap()
        reset_peak_rss()


class _Counters:
    """Peak memory and the allocator's retry and OOM counts from :meth:`start` on (CPU: peak RSS)."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, {}

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = allocator_counters(self.device)
        else:
            reset_peak_rss()

    def read(self) -> dict:
        """Trial fields: peaks in bytes, fragmentation, retries and OOMs since :meth:`start`."""
        if self.device.type != "cuda":
            return {"peak_reserved_bytes": peak_rss_bytes()}
        stats = torch.cuda.memory_stats(self.device)
        counts = {k: v - self.base[k] for k, v in allocator_counters(self.device).items()}
        return {"peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
                "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
                "inactive_split_bytes": stats.get("inactive_split_bytes.all.peak", 0), **counts}


class BatchTrials:
    """``run_trial`` for :func:`training.tuner.search.search`: measures one local batch on this rank.

    Trials found in ``journal`` (a previous attempt of the same tuning) are returned as recorded;
    every other one is measured and then recorded there by rank 0.
    """

    def __init__(self, cfg: Config, world: World, journal: Journal, warmup: int, steps: int):
        self.cfg, self.world, self.journal = cfg, world, journal
        self.warmup, self.steps = warmup, steps
        self.budget = None if cfg.tune.memory_budget_gib is None else cfg.tune.memory_budget_gib * GIB
        # a sample is K model applications at the run's largest K, which the trials step
        self.flops_per_sample = vit_flops_per_sample(cfg.model, cfg.data) * max_rollout_steps(cfg.optim)
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
        release(device)
        counters.start()
        try:
            elapsed = self._run(cfg, counters)
        except torch.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0]
            elapsed = None
        if elapsed is None:  # the peaks first: the release resets them
            self._read(trial, counters)
            trial.ooms = max(1, trial.ooms)
            release(device)  # after the except block: its traceback no longer holds the step's tensors
            self._out_of_memory(trial, message)
        else:
            trial.step_time_s = elapsed / self.steps
            trial.samples_per_s = global_batch / trial.step_time_s
            if self.peak_flops:
                trial.mfu = trial.samples_per_s * self.flops_per_sample / (self.peak_flops * self.world.world_size)
            self._read(trial, counters)
        release(device)
        trial.over_budget = self.budget is not None and trial.peak_reserved_bytes > self.budget
        return trial

    def _run(self, cfg: Config, counters: _Counters) -> float:
        """Warm up, then time ``steps`` steps (seconds); counters restart after the warm-up."""
        world = self.world
        data = build_data(cfg.data, cfg.optim.local_batch_size, world.dp_rank, world.dp, world.device,
                          cfg.optim.seed, train_target_steps=max_rollout_steps(cfg.optim))
        try:
            step = build_training_step(cfg, world, forcing=data.train_forcings)
            batches = endless(data.train)
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
        """Log the OOM and go on (one process, or a simulated rank), or journal it and raise (several)."""
        if self.world.world_size == 1 or is_simulated(self.world.env):
            log.info("batch tuner: local batch %d ran out of memory (%s); freed, going on", trial.local_batch_size,
                     message)
            return
        self.journal.out_of_memory(trial, self.world.rank)
        raise OutOfMemory(f"rank {self.world.rank} ran out of {self.world.device} memory at local batch "
                          f"{trial.local_batch_size} during tuning ({message}); with several processes the tuner "
                          f"cannot recover in-process: run the same command again to continue from "
                          f"{self.journal.path} (torchrun --max-restarts N does it by itself)")


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
        self._new_dirs = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
        if world.is_main and not self.trials:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps({"fingerprint": fingerprint}) + "\n")

    def _read(self, fingerprint: dict) -> dict[int, Trial]:
        check_in_place(self.path)  # appended to: a hard link is refused before any trial runs
        try:
            lines = [line for _, line in read_jsonl(self.path)]
        except (OSError, ValueError):
            return {}
        if not all(isinstance(line, dict) for line in lines):
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
        fd = open_append(self.path)
        try:
            os.write(fd, (json.dumps(entry) + "\n").encode())  # one write per line: appends of ranks do not interleave
        finally:
            os.close(fd)

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

    def discard_if_unused(self) -> None:
        """Delete the journal, and the folders made for it, when it holds nothing to continue from (no trial
        finished, no OOM recorded): a bad input (unreadable data, say) stopped the tuning before it measured."""
        if not self.world.is_main:
            return
        try:
            lines = [line for _, line in read_jsonl(self.path)]
        except (OSError, ValueError):
            return
        if any(not isinstance(line, dict) or "trial" in line or "oom" in line for line in lines):
            return
        self.path.unlink(missing_ok=True)
        for directory in self._new_dirs:  # innermost first; a folder something else wrote to stays
            with contextlib.suppress(OSError):
                directory.rmdir()


def _fields(trial: Trial) -> dict:
    return {f.name: getattr(trial, f.name) for f in fields(Trial)}


def _trial(entry: dict) -> Trial:
    return Trial(**{f.name: entry[f.name] for f in fields(Trial) if f.name in entry})


def _stopped_trial(batch: int, global_batch: int, oom: bool) -> Trial:
    if oom:
        return Trial(batch, global_batch, ooms=1)
    return Trial(batch, global_batch, error="the job stopped during this trial")

