"""Search core of the batch-size tuner: the largest local batch that runs clean on every rank, the
samples/s curve up to it, and the choices made from that curve.

Throughput is best just below the batch where the CUDA caching allocator starts retrying a failed
``cudaMalloc`` (each retry frees the cache and synchronizes the device), not just below OOM, so a
trial counts as clean only with no OOM, no retry, no error and peak reserved memory within the
budget, on every rank.

The measurement of one local batch is injected (``run_trial``: build the model, warm up, time K
steps, read the allocator's counters); this module decides which batches to measure, makes all ranks
agree on every verdict, and reports.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from distributed.world import World, all_reduce
from training.monitor.memory import GIB
from utils.core.errors import UserError

log = logging.getLogger(__name__)

OBJECTIVES = ("max-throughput", "min-batch-at-peak")


@dataclass
class Trial:
    """One measured local batch size.

    ``samples_per_s`` is the whole job's rate (global batch / step time) and ``step_time_s`` the
    mean measured step in seconds; both None when the steps did not finish (OOM, error). ``mfu`` is a
    fraction of peak FLOP/s (None where unknown). Memory in bytes: peaks of allocated and reserved
    memory (on CPU peak RSS stands in for reserved), ``inactive_split_bytes`` the peak of cached
    but unusable split blocks (fragmentation; None where unknown). ``alloc_retries`` and ``ooms``
    count the allocator's retries and OOMs over the measured steps; ``over_budget``: peak reserved
    exceeded the memory budget; ``error``: any other failure, as text.

    After :func:`agree`, every field holds the worst rank's value (the slowest for rates).
    """

    local_batch_size: int
    global_batch_size: int
    samples_per_s: float | None = None
    step_time_s: float | None = None
    mfu: float | None = None
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    inactive_split_bytes: int | None = None
    alloc_retries: int = 0
    ooms: int = 0
    over_budget: bool = False
    error: str | None = None
    setting: int | None = None  # the second dimension's value (ac_blocks, fsdp_prefetch) of a combined tuning

    def _failures(self) -> list[str]:
        return [name for name, failed in (("OOM", self.ooms), ("retries", self.alloc_retries),
                                          ("over budget", self.over_budget), ("error", self.error is not None))
                if failed]

    @property
    def clean(self) -> bool:
        """No OOM, no allocator retry, within the memory budget, no error."""
        return not self._failures()

    @property
    def verdict(self) -> str:
        """``"clean"`` or the failures joined by ``+`` (``"OOM+retries"``)."""
        return "+".join(self._failures()) or "clean"

    def to_dict(self) -> dict:
        """The fields plus ``clean`` and ``verdict``, JSON-ready."""
        return {**asdict(self), "clean": self.clean, "verdict": self.verdict}


# Fields combined by one all-reduce MAX; sign -1 turns it into a MIN (min x = -max -x). Rates take the
# slowest rank (a synchronous data-parallel step waits for it), everything else the worst rank.
_AGREED = (("samples_per_s", -1, float), ("step_time_s", 1, float), ("mfu", -1, float),
           ("peak_allocated_bytes", 1, int), ("peak_reserved_bytes", 1, int), ("inactive_split_bytes", 1, int),
           ("alloc_retries", 1, int), ("ooms", 1, int), ("over_budget", 1, bool))


def agree(trial: Trial, world: World, out_of_time: bool = False) -> tuple[Trial, bool]:
    """This rank's ``trial`` combined with every rank's, and whether any rank is ``out_of_time``.

    One all-reduce over all ranks (none for one process); a second one (gathering the messages)
    only when some rank reports an error, which every rank learns from the first. Every rank
    returns the same trial, so all take the same next step. Must be called by every rank.
    """
    # None is sent as -inf, the identity of MAX: a field only some ranks know keeps their value
    values = [-math.inf if getattr(trial, name) is None else sign * float(getattr(trial, name))
              for name, sign, _ in _AGREED]
    packed = torch.tensor(values + [float(trial.error is not None), float(out_of_time)], dtype=torch.float64,
                          device=world.device)  # on the GPU under NCCL
    reduced = all_reduce(packed, world, op=dist.ReduceOp.MAX).tolist()
    fields = {name: None if value == -math.inf else cast(sign * value)
              for (name, sign, cast), value in zip(_AGREED, reduced)}
    error = _gathered_error(trial.error, world) if reduced[-2] else None
    return replace(trial, **fields, error=error), bool(reduced[-1])


def _gathered_error(error: str | None, world: World) -> str | None:
    if world.world_size == 1 or not dist.is_initialized():
        return error
    errors: list[str | None] = [None] * world.world_size
    dist.all_gather_object(errors, error)
    return "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(errors) if text is not None)


class _Trials:
    """The agreed trials by local batch, in measurement order; runs each batch at most once."""

    def __init__(self, run_trial: Callable[[int], Trial], world: World, deadline: float | None,
                 clock: Callable[[], float]):
        self.run_trial, self.world, self.deadline, self.clock = run_trial, world, deadline, clock
        self.by_batch: dict[int, Trial] = {}
        self.out_of_time = False

    def measure(self, batch: int) -> Trial:
        if batch not in self.by_batch:
            started = self.clock()
            trial = self.run_trial(batch)
            now = self.clock()
            # stop before a next trial as long as this one would end past the deadline
            late = self.deadline is not None and now + (now - started) > self.deadline
            trial, self.out_of_time = agree(trial, self.world, late)
            self.by_batch[batch] = trial
            log.info("batch tuner: local batch %d (global %d): %s samples/s, %.2f GiB reserved, %s",
                     batch, trial.global_batch_size, fmt(trial.samples_per_s, ".1f"),
                     trial.peak_reserved_bytes / GIB, trial.verdict)
        return self.by_batch[batch]


def _grow(trials: _Trials, start: int, max_batch: int) -> tuple[int, int | None]:
    """Double from ``start`` up to ``max_batch``: (largest clean batch or 0, first failed batch or None)."""
    clean, batch = 0, start
    while trials.measure(batch).clean:
        clean = batch
        if batch == max_batch or trials.out_of_time:
            return clean, None
        batch = min(2 * batch, max_batch)
    return clean, batch


def _midpoint(clean: int, failed: int, resolution: int) -> int | None:
    """The multiple of ``resolution`` strictly between ``clean`` and ``failed`` nearest their middle;
    with none there and nothing clean yet, half of ``failed`` (any batch that fits beats none);
    None when the boundary is resolved."""
    first, last = clean // resolution + 1, (failed - 1) // resolution
    if first <= last:
        return resolution * min(max((clean + failed) // (2 * resolution), first), last)
    if clean == 0 and failed > 1:
        return failed // 2
    return None


def _bisect(trials: _Trials, clean: int, failed: int, resolution: int) -> int:
    """Narrow (clean, failed) to adjacent multiples of ``resolution``; returns the largest clean batch (0: none)."""
    while not trials.out_of_time and (batch := _midpoint(clean, failed, resolution)) is not None:
        if trials.measure(batch).clean:
            clean = batch
        else:
            failed = batch
    return clean


def _below(trials: _Trials, clean: int, resolution: int, count: int) -> None:
    """Measure up to ``count`` batches ``resolution`` apart below ``clean``: the curve near the boundary,
    where the best rate or a nearly-as-good smaller batch often lies."""
    for k in range(1, count + 1):
        if trials.out_of_time or clean - k * resolution < 1:
            return
        trials.measure(clean - k * resolution)


def search(run_trial: Callable[[int], Trial], world: World, *, start: int = 8, resolution: int = 8,
           max_batch: int = 4096, below: int = 2, deadline: float | None = None,
           clock: Callable[[], float] = time.monotonic) -> list[Trial]:
    """Measure local batch sizes up to the largest that runs clean on every rank; return the agreed
    trials in measurement order (identical on every rank). Every rank must call it.

    1. Double from ``start`` (capped at ``max_batch``) until a trial is not clean on some rank.
    2. Bisect between the last clean and that batch on multiples of ``resolution``, until they are
       adjacent multiples. While nothing is clean yet and no multiple lies below the failure
       (``start`` failed and is at most ``resolution``), halve instead, down to 1.
    3. Measure ``below`` more batches at ``resolution`` steps under the largest clean one.

    ``run_trial(local_batch)`` measures one batch on this rank and returns its :class:`Trial`
    (failures such as OOM recorded in it, not raised). No batch is measured twice. With ``start``
    and ``max_batch`` multiples of ``resolution``, every batch measured is one.

    Trial count: with L the last clean doubling (``start * 2**k``) and a failure at 2L, at most
    ``log2(L / start) + 2`` doublings, ``max(0, ceil(log2(L / resolution)))`` bisections and
    ``below`` more; when ``start`` itself fails, at most ``1 + ceil(log2(start)) + below``.

    ``deadline`` is a ``clock()`` value in seconds (``time.monotonic`` unless given): the search stops,
    keeping what it measured, once some rank expects the next trial (as long as the last) to end
    past it. The first trial always runs.

    Raises:
        ValueError: ``start`` not in [1, max_batch], ``resolution`` < 1 or ``below`` < 0.
        Whatever ``run_trial`` raises.
    """
    if not 1 <= start <= max_batch or resolution < 1 or below < 0:
        raise ValueError(f"need 1 <= start <= max_batch, resolution >= 1, below >= 0; got start={start}, "
                         f"max_batch={max_batch}, resolution={resolution}, below={below}")
    trials = _Trials(run_trial, world, deadline, clock)
    clean, failed = _grow(trials, start, max_batch)
    if failed is not None:
        clean = _bisect(trials, clean, failed, resolution)
    if clean:
        _below(trials, clean, resolution, below)
    return list(trials.by_batch.values())


def combine(run_trial: Callable[[int, int], Trial], world: World, *, settings: list[int], local_batches: list[int],
            monotone: bool, deadline: float | None = None, clock: Callable[[], float] = time.monotonic) -> list[Trial]:
    """For each of ``settings`` (values of a second dimension such as the number of checkpointed blocks),
    the largest of ``local_batches`` (descending; the global batch is fixed, so smaller ones accumulate
    more micro-batches) that runs clean on every rank; returns the agreed trials in measurement order,
    each with its ``setting``. Every rank must call it.

    ``run_trial(setting, local_batch)`` measures one combination on this rank. With ``monotone``
    (later settings only save memory at a compute cost, as more activation checkpointing does), the
    search stops after a setting that runs clean at the largest batch: later ones cannot be faster.
    ``deadline`` (a ``clock()`` value) stops it after the trial that passes it.

    Raises:
        ValueError: no settings or local batches.
    """
    if not settings or not local_batches:
        raise ValueError(f"need settings and local batches, got {settings} and {local_batches}")
    out: list[Trial] = []
    for setting in settings:
        for batch in local_batches:
            trial, late = agree(run_trial(setting, batch), world, deadline is not None and clock() > deadline)
            out.append(replace(trial, setting=setting))
            log.info("batch tuner: setting %d, local batch %d (global %d): %s samples/s, %.2f GiB reserved, %s",
                     setting, batch, trial.global_batch_size, fmt(trial.samples_per_s, ".1f"),
                     trial.peak_reserved_bytes / GIB, trial.verdict)
            if late:
                return out
            if trial.clean:
                break
        if monotone and out[-1].clean and out[-1].local_batch_size == local_batches[0]:
            break
    return out


class NoCleanTrial(UserError):
    """No measured batch ran clean, so there is nothing to choose."""


def choose(trials: list[Trial], tolerance: float = 0.02, samples: int | None = None) -> dict[str, Trial]:
    """The choice for each objective among the clean trials below every failed batch of their ``setting`` (a
    batch that ran clean above one that failed lies where the memory boundary is not sharp: retries or peaks
    near the limit vary from run to run, so a long run there may fail) and whose global batch fits in
    ``samples`` (the training samples of an epoch, when known: a larger global batch measures memory but
    cannot train):

    * ``max-throughput``: the highest samples/s (the smaller batch on a tie);
    * ``min-batch-at-peak``: the smallest local batch within ``tolerance`` (a fraction: 0.02 is 2 %)
      of that rate; the closest to the batch the learning rate was tuned at for nearly the same speed.

    Raises:
        ValueError: ``tolerance`` not in [0, 1).
        NoCleanTrial: no trial is clean (the message says how the smallest one failed), every clean one lies
            above a failed one, or every clean one's global batch exceeds ``samples``.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance is a fraction in [0, 1), got {tolerance}")
    clean = [t for t in trials if t.clean]
    if not clean:
        raise NoCleanTrial(_no_clean_message(trials))
    clean = _below_failures(clean, trials)
    if samples is not None:
        smallest = min(t.global_batch_size for t in clean)
        clean = [t for t in clean if t.global_batch_size <= samples]
        if not clean:
            raise NoCleanTrial(f"every batch that ran clean needs more than the {samples} training samples (the "
                               f"smallest a global batch of {smallest}); train on more samples (--limit_nsamples) "
                               "or lower --tune_start")
    best = max(clean, key=lambda t: (t.samples_per_s, -t.local_batch_size))
    near = [t for t in clean if t.samples_per_s >= (1 - tolerance) * best.samples_per_s]
    return {"max-throughput": best, "min-batch-at-peak": min(near, key=lambda t: t.local_batch_size)}


def _below_failures(clean: list[Trial], trials: list[Trial]) -> list[Trial]:
    """The ``clean`` trials below the smallest failed batch of their setting; NoCleanTrial when none is."""
    by_size = sorted((t for t in trials if not t.clean), key=lambda t: -t.local_batch_size)
    failed = {t.setting: t for t in by_size}  # the smallest failure of each setting comes last and stays
    below = [t for t in clean if t.setting not in failed or t.local_batch_size < failed[t.setting].local_batch_size]
    if not below:
        f = min(failed.values(), key=lambda t: t.local_batch_size)
        raise NoCleanTrial(f"every batch that ran clean lies above one that failed (local batch {f.local_batch_size}: "
                           f"{f.verdict}), so the memory boundary is not sharp; tune again with a lower --tune_start, "
                           "or save memory (activation checkpointing, FSDP, bf16)")
    return below


def _no_clean_message(trials: list[Trial]) -> str:
    if not trials:
        return "no batch size was measured"
    t = min(trials, key=lambda t: t.local_batch_size)
    return (f"no local batch size ran clean on every rank; the smallest tried, {t.local_batch_size}, gave "
            f"{t.verdict}{f' ({t.error})' if t.error else ''}: save memory (activation checkpointing, FSDP, "
            "bf16) or raise the memory budget")


def scaled_lr(lr: float, old_global: int, new_global: int) -> float:
    """``lr`` scaled to a new global batch by the square-root rule, lr x sqrt(new / old).

    The rule of the data-parallel ladder in config/ViT.yaml (``bs16_opt`` ... ``bs2048_opt``: lr
    x sqrt(B / 16)). It keeps the variance of the update per sample constant (Krizhevsky 2014,
    "One weird trick for parallelizing convolutional neural networks", arXiv:1404.5997; Hoffer et al.
    2017, "Train longer, generalize better", arXiv:1705.08741), and is the scaling rule derived for
    Adam (Malladi et al. 2022, "On the SDEs and scaling rules for adaptive gradient algorithms",
    arXiv:2205.10287).

    Raises:
        ValueError: ``lr`` <= 0 or a batch size < 1.
    """
    if lr <= 0 or old_global < 1 or new_global < 1:
        raise ValueError(f"need lr > 0 and batch sizes >= 1; got lr={lr}, {old_global} -> {new_global}")
    return lr * math.sqrt(new_global / old_global)


def choice_args(choice: Trial, base_args: list[str], lr: float, base_global: int, num_iters: int | None = None) -> list[str]:
    """The ``train.py`` arguments that train with ``choice``: ``base_args`` then ``--local_batch_size N``,
    and, when the global batch changes, ``--lr X`` (:func:`scaled_lr` of ``lr``, the resolved learning rate at
    global batch ``base_global``) and ``--num_iters`` scaled so the run sees as many samples as ``num_iters``
    steps at ``base_global`` did (the config ladder's iterations x 16 / B). Appended last, they override
    ``base_args`` (a key given twice takes its last value)."""
    args = [*base_args, "--local_batch_size", str(choice.local_batch_size)]
    if choice.global_batch_size != base_global:
        args += ["--lr", f"{scaled_lr(lr, base_global, choice.global_batch_size):.6g}"]
        if num_iters is not None:
            args += ["--num_iters", str(scaled_iterations(num_iters, base_global, choice.global_batch_size))]
    return args


def scaled_iterations(num_iters: int, base_global: int, global_batch: int) -> int:
    """Optimizer steps at ``global_batch`` that see the samples of ``num_iters`` steps at ``base_global``."""
    return max(1, round(num_iters * base_global / global_batch))


def fmt(value, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` for None."""
    return "-" if value is None else format(value, spec)
