"""TensorBoard figures drawn beside the training (:class:`FigureDrawer`).

Drawing a validation's figures with matplotlib takes 0.1-0.9 s. Drawn by rank 0 between two epochs, they held every
other rank at its next step's gradient all-reduce, and the GPUs idle, for that long (docs/speed.md, round 5u). One
worker thread now draws them while the next epoch trains: the reporter hands them over at that epoch's start, after
the garbage collector's freeze (``training/monitor/reporter.py``). What the figures still cost is the training
thread's wait for the interpreter's lock while this one lays out axes, a fraction of an epoch's time (a shorter
switch interval does not help: docs/speed.md, round 5y); docs/evaluation.md gives the measured cost on one and two
GPUs. It is the only thread of the run that uses matplotlib, whose pyplot keeps global state. A validation's figures
wait for the previous validation's, so at most one set is pending, and the run's end waits for the last.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

# a figure's maker: draws and returns a matplotlib Figure (which TensorBoard's add_figure renders and closes)
Maker = Callable[[], Any]


class FigureDrawer:
    """Draws figures into a TensorBoard ``SummaryWriter`` on a thread of its own.

    ``writer``: the run's ``SummaryWriter`` (its event queue is thread-safe: the epoch's scalars go in beside).
    """

    def __init__(self, writer):
        self.writer = writer
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="figures")
        self.pending: Future | None = None

    def submit(self, makers: dict[str, Maker], step: int) -> None:
        """Draw each ``makers[tag]()`` as TensorBoard image ``tag`` at ``step``, after the previous figures.

        Raises:
            whatever drawing the previous figures raised (OSError: the writer could not write them).
        """
        self.wait()
        self.pending = self.pool.submit(self._draw, makers, step)

    def _draw(self, makers: dict[str, Maker], step: int) -> None:
        for tag, make in makers.items():
            self.writer.add_figure(tag, make(), global_step=step)

    def wait(self) -> None:
        """Wait until the pending figures are drawn.

        Raises:
            whatever drawing them raised.
        """
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the pending figures and end the thread.

        Raises:
            whatever drawing them raised.
        """
        try:
            self.wait()
        finally:
            self.pool.shutdown(wait=True)
