"""FrozenHeap: the objects alive after the first step and at each later epoch's start are frozen out of Python's
automatic collections; garbage made since is still collected, garbage among the frozen waits for a full pass."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest

from training.loop import garbage
from training.loop.garbage import FrozenHeap


class Node:
    """An object that can sit in a reference cycle (only the cyclic collector frees it)."""

    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def unfrozen():
    gc.unfreeze()  # an in-process run that was never closed may have left objects frozen
    yield
    gc.unfreeze()


def cycle() -> weakref.ref:
    """A reference cycle no name holds: garbage only the collector can free; a weak reference to it."""
    return weakref.ref(Node())


def test_first_step_freezes_and_later_garbage_is_still_collected():
    heap, state = FrozenHeap(True), SimpleNamespace(step=0)
    heap.start(state)
    heap.epoch_start(state)  # nothing compiled before the first step: nothing to freeze yet
    assert gc.get_freeze_count() == 0
    alive = Node()
    state.step = 1
    heap.step_end(state)
    assert gc.get_freeze_count() > 0 and not any(obj is alive for obj in gc.get_objects())  # frozen
    later = cycle()
    gc.collect()
    assert later() is None  # made after the freeze: collected as before


def test_the_first_freeze_collects_only_the_young_generations():
    heap, state = FrozenHeap(True), SimpleNamespace(step=0)
    heap.start(state)
    old = Node()
    gc.collect()  # it survives a full collection: generation 2
    ref = weakref.ref(old)
    del old  # old garbage: a full collection would free it, a young one does not see it
    state.step = 1
    heap.step_end(state)
    assert ref() is not None and not any(obj is ref() for obj in gc.get_objects())  # frozen, not walked
    heap.refreeze(full=True)
    assert ref() is None


def wall_clock(monkeypatch, seconds: float) -> None:
    """Set the wall clock (``time.time``) that FrozenHeap reads."""
    monkeypatch.setattr(garbage.time, "time", lambda: seconds)


@pytest.mark.parametrize("epoch_start_s", [1799.0, 1801.0])
def test_frozen_garbage_waits_for_a_full_pass_and_close_unfreezes(monkeypatch, epoch_start_s):
    heap, state = FrozenHeap(True, 600.0), SimpleNamespace(step=0)
    heap.start(state)
    wall_clock(monkeypatch, 1500.0)
    held = Node()
    state.step = 1
    heap.step_end(state)
    ref = weakref.ref(held)
    del held  # garbage now, but frozen: no collection sees it
    gc.collect()
    assert ref() is not None
    state.step = 8
    heap.step_end(state)  # not the first step: nothing happens
    gc.collect()
    assert ref() is not None
    later = cycle()
    wall_clock(monkeypatch, epoch_start_s)
    heap.epoch_start(state)  # a full pass past the wall clock's next 600 s mark; else only what was made since
    assert later() is None and gc.get_freeze_count() > 0
    assert (ref() is None) == (epoch_start_s > 1800.0)
    heap.close(None)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_ranks_whose_first_steps_end_apart_make_their_full_passes_at_the_same_epoch_start(monkeypatch):
    ranks, passes = [FrozenHeap(True, 600.0), FrozenHeap(True, 600.0)], ([], [])
    for rank, (heap, first_s) in enumerate(zip(ranks, (1250.0, 1290.0))):  # first steps end 40 s apart
        refreeze = heap.refreeze
        monkeypatch.setattr(heap, "refreeze", lambda full=False, log=passes[rank], refreeze=refreeze:
                            log.append(full) or refreeze(full))
        wall_clock(monkeypatch, first_s)
        heap.start(SimpleNamespace(step=0))
        heap.step_end(SimpleNamespace(step=1))
    for start_s in (1790.0, 1810.0, 1870.0, 2410.0):  # epoch starts, which the ranks reach within a few ms
        for rank, heap in enumerate(ranks):
            wall_clock(monkeypatch, start_s + 0.002 * rank)
            heap.epoch_start(SimpleNamespace(step=10))
    assert passes[0] == passes[1] == [False, False, True, False, True]


@pytest.mark.parametrize("epoch_starts_s", [(1790.0, 1810.0, 1870.0, 2410.0), (1260.0, 1500.0), (1799.0, 3700.0)])
def test_the_gc_benchmark_reckons_the_full_passes_the_heap_makes(monkeypatch, epoch_starts_s):
    from benchmarks.gc_pauses import full_passes_due
    heap, passes = FrozenHeap(True, 600.0), []
    refreeze = heap.refreeze
    monkeypatch.setattr(heap, "refreeze", lambda full=False: passes.append(full) or refreeze(full))
    wall_clock(monkeypatch, 1250.0)
    heap.start(SimpleNamespace(step=0))
    heap.step_end(SimpleNamespace(step=1))
    for start_s in epoch_starts_s:
        wall_clock(monkeypatch, start_s)
        heap.epoch_start(SimpleNamespace(step=10))
    assert full_passes_due(1250.0, [1000.0, *epoch_starts_s], 600.0) == passes.count(True) == len(set(
        s // 600 for s in epoch_starts_s) - {1250.0 // 600})  # an epoch start before the first step counts none


def test_resumed_run_freezes_after_its_own_first_step():
    heap, state = FrozenHeap(True), SimpleNamespace(step=100)
    heap.start(state)
    heap.epoch_start(state)  # the resumed epoch: its first step is still to run
    heap.step_end(SimpleNamespace(step=1))
    assert gc.get_freeze_count() == 0
    heap.step_end(SimpleNamespace(step=101))
    assert gc.get_freeze_count() > 0


def test_a_full_pass_walks_everything_even_as_the_first_freeze():
    old = Node()
    gc.collect()
    ref = weakref.ref(old)
    del old
    FrozenHeap(True).refreeze(full=True)
    assert ref() is None and gc.get_freeze_count() > 0


def test_disabled_leaves_the_collector_alone():
    heap, state = FrozenHeap(False), SimpleNamespace(step=0)
    heap.start(state)
    state.step = 1
    heap.step_end(state)
    heap.epoch_start(state)
    assert gc.get_freeze_count() == 0
