"""The lifecycle every component of a run shares: the hooks the training loop calls, and when.

The loop (``training/loop/trainer.py``) holds its components in one list, in the order written there, and
calls each hook on every component in that order::

    start(state)                          once, after resume, before the first step
    epoch_start(state)                    before the first step of each epoch (also a resumed one)
        step_start(state)                 before each optimizer step
        step_end(state)                   after it: ``state.step`` counts it
    epoch_end(state, record)              after the epoch's last step; ``state`` is at the next epoch
    close(error)                          once, at the end: ``error`` is None after success

A component decides for itself whether a hook acts: the checkpoint manager its cadence (steps, minutes,
preemption, the end), the evaluator its validation epochs, the profilers their windows. ``state`` is the
run's ``TrainState`` (``training/loop/state.py``); ``record`` is the epoch's flat record, which components
extend in order (memory figures, validation scores) and the reporter writes.
"""

from __future__ import annotations

from typing import Any


class Component:
    """A part of a run with the loop's hooks; every hook does nothing unless a subclass overrides it."""

    def start(self, state: Any) -> None:
        """Once, before the first step (after a resume, at the resumed step)."""

    def epoch_start(self, state: Any) -> None:
        """Before the first step of each epoch this process runs."""

    def step_start(self, state: Any) -> None:
        """Before each optimizer step."""

    def step_end(self, state: Any) -> None:
        """After each optimizer step (``state.step`` includes it)."""

    def epoch_end(self, state: Any, record: dict) -> None:
        """After each epoch: ``record`` is its flat record, which a component may extend."""

    def close(self, error: BaseException | None) -> None:
        """Once, at the end of the run (``error``: what stopped it, None after success). Must not raise over
        ``error``."""
