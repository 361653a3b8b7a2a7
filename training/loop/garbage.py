"""Python's garbage collector in a training run.

Compiling leaves about half a million long-lived Python objects behind (Dynamo's and Inductor's graphs, guards
and generated code for ``short_opt``). Each automatic full collection walks all of them: on an H200's host one
took 0.53-0.74 s after the compile, and one step stopped about that long (0.68 s instead of 0.09 s) made a timed
epoch of 32 steps 17 % slower (docs/speed.md, round 5s). :class:`FrozenHeap` collects once at moments of its
choosing and freezes what survives (``gc.freeze``, https://docs.python.org/3/library/gc.html#gc.freeze): the
automatic collections go on, but only over the objects made since, and took 0.00-0.10 s (rounds 5s, 5t).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from utils.core.component import Component


FULL_EVERY_S = 600.0  # a full pass over the frozen objects too, once per this many seconds of the wall clock


class FrozenHeap(Component):
    """Collect, then freeze the survivors, after the first optimizer step this process runs (the training step is
    compiled by then) and at the start of every later epoch (the validation's graphs and any recompilation are
    made by then). The first time only the young generations (0 and 1) are collected: a full collection would walk
    the whole heap that is about to be frozen, at about the cost of one automatic full collection. Later, every
    generation is collected, which holds only what was made since the last freeze, except at the first epoch's
    start after the wall clock (``time.time``) passes a multiple of ``full_every_s`` seconds: then what was frozen
    is unfrozen and walked too. Garbage among the frozen objects (a reference cycle that was alive at a freeze, or
    was already old at the first) waits at most that long and one epoch. ``close`` unfreezes, before the
    components after it (the loaders, whose workers end when their cyclic iterators are collected) close. Every
    rank collects at the same steps, and makes its full passes at the same epoch starts as the others: the wall
    clock's marks are common to hosts kept in time by NTP, where each rank's time since its own first freeze is
    not (their hosts can end the first step, which compiles, seconds apart). So the pauses coincide instead of
    each stalling the others' collectives.

    ``enabled``: ``--gc_freeze``; False leaves Python's collector as it is.
    """

    def __init__(self, enabled: bool, full_every_s: float = FULL_EVERY_S):
        self.enabled, self.full_every_s = enabled, full_every_s
        self.first_step = 1  # the first step this process runs (after a resume: the one after the resumed step)
        self.last_full: int | None = None  # the wall clock's full_every_s period of the first freeze or last full pass

    def start(self, state: Any) -> None:
        self.first_step = state.step + 1

    def step_end(self, state: Any) -> None:
        if state.step == self.first_step:
            self.refreeze()

    def epoch_start(self, state: Any) -> None:
        if state.step >= self.first_step and self.last_full is not None:
            self.refreeze(full=self._period() != self.last_full)

    def close(self, error: BaseException | None) -> None:
        if self.enabled:
            gc.unfreeze()

    def refreeze(self, full: bool = False) -> None:
        """Collect and freeze what survives (when enabled): the first time the young generations only, later every
        generation, and with ``full`` the frozen objects too. Benchmarks that drive the trainer's steps
        themselves call it after their warm-up, as the first step's end does here."""
        if not self.enabled:
            return
        first = self.last_full is None
        if full:
            gc.unfreeze()
        if first or full:
            self.last_full = self._period()
        gc.collect(1 if first and not full else 2)
        gc.freeze()

    def _period(self) -> int:
        return int(time.time() // self.full_every_s)
