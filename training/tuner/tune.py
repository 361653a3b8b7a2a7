"""The whole tuning on the real setup: the batch search of ``search.py`` over trials of ``trials.py``, or a
second dimension (activation checkpointing, FSDP prefetch) at a fixed global batch; the choices, their
``train.py`` arguments and the outputs; and ``train.py --local_batch_size auto``.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from distributed.world import World
from training.tuner.report import plot, report_table, save_json
from training.tuner.search import OBJECTIVES, Trial, choice_args, choose, combine, scaled_iterations, search
from training.tuner.trials import BatchTrials, Journal
from utils.config.schema import Config, TuneConfig
from utils.config.types import AUTO
from utils.config.validate import batch_sizes
from utils.core.errors import UserError
from utils.core.files import read_bounded
from utils.data.dataset import ERA5Dataset

TUNE_FILE = "tune_batch_size.json"  # the tuner's JSON; also in the run directory of --local_batch_size auto


AUTO_OBJECTIVE = "max-throughput"  # what --local_batch_size auto trains with


# keys that steer the tuner but not the training it measures: left out of the printed train.py arguments
# and of the journal's fingerprint
TUNER_ONLY = tuple(f.name for f in fields(TuneConfig))


# keys of a simulated job (distributed/simulate.py): left out of the printed arguments, which launch the real one
SIMULATION_KEYS = ("simulate_world_size", "simulate_rank")


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
    notes: list[str] = field(default_factory=list)  # what the printed arguments cannot promise
    budget_bytes: float | None = None  # the memory budget the verdicts used
    device: str = "cuda"  # where the trials ran: "cuda", or "cpu" (peak RSS stands for reserved memory)

    def lr(self, objective: str) -> float:
        """The learning rate ``args[objective]`` trains with (the scaled one when it sets ``--lr``)."""
        return args_lr(self.args[objective]) or self.base_lr


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
    runner = BatchTrials(cfg, world, journal, warmup, steps)
    try:
        trials = search(runner, world, start=t.tune_start, resolution=t.resolution, max_batch=t.tune_max_batch,
                        below=below, deadline=deadline)
    except UserError:
        journal.discard_if_unused()
        raise
    choices = choose(trials, t.tolerance, training_samples(cfg))
    base = base_batch(cfg, world.dp)
    args = {name: choice_args(choice, base_args, cfg.optim.lr, base, cfg.optim.num_iters)
            for name, choice in choices.items()}
    journal.remove()
    notes = short_epochs(cfg, choices) + short_runs(cfg.optim.num_iters, base, choices)
    return TuneResult(trials, choices, args, base, cfg.optim.lr, notes=notes,
                      budget_bytes=runner.budget, device=world.device.type)


# an epoch of fewer optimizer steps than this validates and checkpoints too often to train as the config meant
MIN_EPOCH_STEPS = 4


def short_epochs(cfg: Config, choices: dict[str, Trial]) -> list[str]:
    """Notes for the choices whose global batch leaves an epoch of the training data fewer than
    :data:`MIN_EPOCH_STEPS` steps (and drops the samples short of a whole batch)."""
    samples = training_samples(cfg)
    notes = []
    for name, choice in choices.items():
        steps = samples // choice.global_batch_size if samples else None
        if steps is not None and steps < MIN_EPOCH_STEPS:
            notes.append(f"{name}: global batch {choice.global_batch_size} leaves {steps} step(s) per epoch of "
                         f"{samples} training samples ({samples - steps * choice.global_batch_size} unused each "
                         f"epoch); train on more samples, or pass a smaller --local_batch_size")
    return notes


def short_runs(num_iters: int, base_global: int, choices: dict[str, Trial]) -> list[str]:
    """Notes for the choices whose command, scaled to the config's samples, trains fewer than
    :data:`MIN_EPOCH_STEPS` steps: a benchmark config's few iterations at a large global batch."""
    notes = []
    for name, choice in choices.items():
        steps = scaled_iterations(num_iters, base_global, choice.global_batch_size)
        if steps < MIN_EPOCH_STEPS:
            notes.append(f"{name}: the config's {num_iters} iterations at global batch {base_global} are "
                         f"{steps} step(s) at global batch {choice.global_batch_size}; pass a larger --num_iters "
                         "for a real run")
    return notes


def training_samples(cfg: Config) -> int | None:
    """Training samples an epoch of ``cfg`` holds (None when the data cannot be opened here)."""
    d = cfg.data
    if d.data_loader_config == "synthetic":
        return d.limit_nsamples or 512
    try:
        return len(ERA5Dataset(Path(d.data_path) / "train", d.n_in_channels, tuple(d.img_size), d.dt,
                               d.limit_nsamples))
    except UserError:
        return None


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
    """``argv`` without the tuner's own keys, the simulation's and ``--local_batch_size`` (``--key value`` or
    ``--key=value``): the part of a tuner command line that ``train.py`` takes as it is for the real job."""
    drop = {f"--{k}" for k in TUNER_ONLY + SIMULATION_KEYS + ("local_batch_size",)}
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
    lines += [f"note: {note}" for note in result.notes]
    retried = [t for t in result.trials if t.alloc_retries and not t.ooms]
    if retried and result.dimension == "batch":
        lines.append(f"cudaMalloc retries from local batch {min(t.local_batch_size for t in retried)} on, "
                     "before any OOM: the allocator frees its cache and synchronizes there")
    return "\n".join(lines)


def write_outputs(result: TuneResult, out: Path, extra: dict | None = None) -> list[Path]:
    """``out`` (the JSON of :func:`training.tuner.report.save_json`, with ``tune``: what was searched, and the keys of
    ``extra``) and, for a batch search, the PNG of the curve beside it; returns the files written."""
    save_json(out, result.trials, result.choices, result.args,
              {"tune": result.dimension, "notes": result.notes, **(extra or {})})
    if result.dimension != "batch":  # settings at one global batch: the table is the picture
        return [out]
    png = out.with_suffix(".png")
    plot(png, result.trials, result.choices, result.budget_bytes, result.device)
    return [out, png]


def out_path(cfg: Config) -> Path:
    """``--out``, or ``<expdir>/<config>/tune_batch_size.json``."""
    return Path(cfg.tune.out) if cfg.tune.out else Path(cfg.logging.expdir) / cfg.name / TUNE_FILE


def journal_path(out: Path) -> Path:
    return out.with_name(out.stem + ".journal.jsonl")


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
        choice = json.loads(read_bounded(run_dir / TUNE_FILE))["choice"][AUTO_OBJECTIVE]
        return int(choice["local_batch_size"]), args_lr(choice["args"])
    except (OSError, ValueError, KeyError, TypeError):
        return None

