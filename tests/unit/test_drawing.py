"""The validation's TensorBoard figures are drawn on a thread of their own while the run goes on; what drawing
them raises comes back to the run, and its end waits for the last figures."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from training.monitor.drawing import FigureDrawer
from utils.core.errors import UserError


class Writer:
    """A SummaryWriter stand-in that notes each figure with the thread that added it."""

    def __init__(self):
        self.figures: list[tuple[str, object, int, str]] = []

    def add_figure(self, tag, figure, global_step):
        self.figures.append((tag, figure, global_step, threading.current_thread().name))


def blocked(until: threading.Event, figure: str = "figure"):
    """A figure's maker that waits for ``until``."""
    return lambda: until.wait(10) and figure


def test_figures_are_drawn_on_their_own_thread_while_the_caller_goes_on():
    writer, release = Writer(), threading.Event()
    drawer = FigureDrawer(writer)
    drawer.submit({"prediction/valid": blocked(release)}, step=16)  # returns with the figure still to draw
    assert writer.figures == []
    release.set()
    drawer.close()
    [(tag, figure, step, thread)] = writer.figures
    assert (tag, figure, step) == ("prediction/valid", "figure", 16)
    assert thread.startswith("figures") and thread != threading.current_thread().name


def test_a_validations_figures_wait_for_the_previous_ones():
    writer, release = Writer(), threading.Event()
    drawer = FigureDrawer(writer)
    drawer.submit({"a": blocked(release, "first")}, step=1)
    second = threading.Thread(target=drawer.submit, args=({"a": lambda: "second"}, 2))
    second.start()
    second.join(0.3)
    assert second.is_alive() and writer.figures == []  # at most one validation's figures pending
    release.set()
    second.join(10)
    drawer.close()
    assert [figure for _, figure, _, _ in writer.figures] == ["first", "second"]


def failing():
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("then", ["submit", "close"])
def test_what_drawing_raised_comes_back_at_the_next_submit_or_the_close(then):
    drawer = FigureDrawer(Writer())
    drawer.submit({"a": failing}, step=1)
    with pytest.raises(OSError, match="No space left"):
        drawer.submit({"b": lambda: "b"}, step=2) if then == "submit" else drawer.close()


def closing_reporter(tmp_path, maker):
    """A Reporter as ``start`` leaves it on rank 0 (run.json written), its last validation's figures (drawn by
    ``maker``) still due."""
    from training.monitor.reporter import Reporter
    reporter = Reporter.__new__(Reporter)
    reporter.bar, reporter.run_dir, reporter.writer = None, tmp_path, None
    reporter.record, reporter.t0, reporter.elapsed_before = {"status": "running"}, time.perf_counter(), 0.0
    reporter.drawer, reporter.figures_due = FigureDrawer(Writer()), ({"a": maker}, 8)
    return reporter


def test_the_runs_end_draws_its_last_figures_and_waits_for_them(tmp_path):
    release = threading.Event()
    reporter = closing_reporter(tmp_path, blocked(release))
    threading.Timer(0.2, release.set).start()
    drawer = reporter.drawer
    reporter.close(None)
    assert [(tag, step) for tag, _, step, _ in drawer.writer.figures] == [("a", 8)]
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), RuntimeError("a bug in a figure")])
def test_last_figures_that_fail_fail_the_run_that_had_no_error(tmp_path, error):
    def maker():
        raise error

    reporter = closing_reporter(tmp_path, maker)
    expected = UserError if isinstance(error, OSError) else RuntimeError
    with pytest.raises(expected, match="No space left on device|a bug in a figure") as raised:
        reporter.close(None)
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "failed"
    if expected is UserError:
        assert "writing the run's logs" in str(raised.value) and "--expdir" in str(raised.value)


def test_a_failed_run_keeps_its_own_error_when_its_last_figures_fail_too(tmp_path):
    reporter = closing_reporter(tmp_path, failing)
    reporter.close(KeyboardInterrupt())
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "interrupted"


class Node:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


EPOCH = {"epoch": 1, "iteration": 4, "epoch_time_s": 1.0, "samples_per_s": 16.0, "data_wait_share": 0.0,
         "loss/train": 1.0, "memory/peak_rss": 0.5, "memory/peak_rss_rank": 0}


def test_figures_are_drawn_after_the_next_epochs_freeze_so_their_garbage_is_collected(tmp_path):
    """Drawn from the epoch's end on, a figure's objects would be frozen with the rest at the next epoch's start
    (FrozenHeap comes first) and kept until a full pass; drawn from the reporter's epoch start, they are young."""
    from training.loop.garbage import FrozenHeap
    from training.monitor.reporter import Reporter
    from utils.config.schema import LoggingConfig
    made, release = [], threading.Event()

    def maker():
        node = Node()  # alive while drawing, garbage after, for the collector only: like a figure's cycles
        made.append(weakref.ref(node))
        release.wait(10)
        return plt_figure()

    reporter = Reporter(LoggingConfig(), tmp_path, [], {"config": {}, "world_size": 1, "mesh": {}}, "", [], 2,
                        lambda: None)
    heap, state = FrozenHeap(True), SimpleNamespace(step=0, elapsed_s=0.0, resumed_step=None)
    try:
        reporter.start(state)
        heap.start(state)
        state.step = 4
        heap.step_end(SimpleNamespace(step=1))
        reporter.epoch_end(state, {**EPOCH, "figures": {"prediction/valid": maker}})
        time.sleep(0.2)
        assert made == []  # nothing drawn between the epochs
        heap.epoch_start(state)  # the freeze at the next epoch's start
        release.set()
        reporter.epoch_start(state)
        reporter.drawer.wait()
        gc.collect()
        assert len(made) == 1 and made[0]() is None  # made after the freeze: collected
    finally:
        release.set()
        heap.close(None)
        reporter.close(None)
    assert "prediction/valid" in EventAccumulator(str(tmp_path)).Reload().Tags()["images"]


def plt_figure():
    """A small matplotlib figure."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    figure, axes = plt.subplots()
    axes.plot([0, 1], [1, 0])
    return figure
