"""Python's garbage collector in a training run.

Compiling leaves about half a million long-lived Python objects behind (Dynamo's and Inductor's graphs, guards
and generated code for ``short_opt``). Each automatic full collection walks all of them: on an H200's host one
took 0.53-0.74 s after the compile, and one step stopped about that long (0.68 s instead of 0.09 s) made a timed
epoch of 32 steps 17 % slower (docs/speed.md, round 5s). :class:`FrozenHeap` collects once at moments of its choosing and freezes what
survives (``gc.freeze``, https://docs.python.org/3/library/gc.html#gc.freeze): the automatic collections go on,
but only over the objects made since, and took 0.00-0.06 s.
"""

from __future__ import annotations

import gc
from typing import Any

from utils.core.component import Component


class FrozenHeap(Component):
    """Collect, then freeze the survivors, after the first optimizer step this process runs (the training step is
    compiled by then) and at the start of every later epoch (the validation's graphs and any recompilation are
    made by then). Each time, what was frozen before is unfrozen first, so garbage among it (a reference cycle
    that was alive at the last freeze) is freed at most one epoch late. Every rank acts at the same steps, so
    their pauses coincide instead of each stalling the others' collectives. ``close`` unfreezes, before the
    components after it (the loaders, whose workers end when their cyclic iterators are collected) close.

    ``enabled``: ``--gc_freeze``; False leaves Python's collector as it is.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.first_step = 1  # the first step this process runs (after a resume: the one after the resumed step)

    def start(self, state: Any) -> None:
        self.first_step = state.step + 1

    def step_end(self, state: Any) -> None:
        if state.step == self.first_step:
            self.refreeze()

    def epoch_start(self, state: Any) -> None:
        if state.step >= self.first_step:
            self.refreeze()

    def close(self, error: BaseException | None) -> None:
        if self.enabled:
            gc.unfreeze()

    def refreeze(self) -> None:
        """Unfreeze, collect every generation, freeze what survives (when enabled)."""
        if self.enabled:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
