"""NVTX ranges and the Nsight Systems capture window (no-ops without CUDA).

Nsight is switched on from the environment: ``ENABLE_PROFILING=1`` (set by ``submit_pm.sh``,
which wraps the run in ``nsys profile --capture-range=cudaProfilerApi``); the trainer then
calls ``cudaProfilerStart``/``Stop`` around a window of steps so the capture stays small.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from utils.core.component import Component

log = logging.getLogger(__name__)


@contextlib.contextmanager
def nvtx_range(name: str):
    """NVTX range ``name`` on CUDA (visible in Nsight timelines); nothing on CPU."""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


class ProfilerWindow(Component):
    """Start the CUDA profiler at (``epoch``, counted from 1, ``start_step``) and stop it ``steps`` steps later.

    Active only when ``ENABLE_PROFILING=1`` and on the ranks selected by ``PROFILE_ALL_RANKS``
    (default: rank 0). Each transition is logged.
    """

    def __init__(self, epoch: int, start_step: int, steps: int, rank: int):
        enabled = os.environ.get("ENABLE_PROFILING", "0") == "1"
        all_ranks = os.environ.get("PROFILE_ALL_RANKS", "0") == "1"
        self.enabled = enabled and (all_ranks or rank == 0)
        self.epoch, self.first, self.after = epoch, start_step, start_step + steps
        self.rank = rank
        self.running = False

    def step_start(self, state) -> None:
        """Start the window at its first step, stop it at the step after its last (0-based steps of the epoch)."""
        epoch, step = state.epoch_number, state.epoch_step
        if not self.enabled or epoch != self.epoch:
            return
        if step == self.first and not self.running:
            self._switch(True, epoch, step)
        elif step == self.after and self.running:
            self._switch(False, epoch, step)

    def epoch_end(self, state, record: dict) -> None:
        """Stop a window still open at the end of its epoch."""
        if self.running:
            self._switch(False, record["epoch"], self.after)

    def _switch(self, on: bool, epoch: int, step: int) -> None:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            (torch.cuda.profiler.start if on else torch.cuda.profiler.stop)()
        self.running = on
        log.info("rank %d: CUDA profiler %s at epoch %d step %d%s", self.rank, "start" if on else "stop",
                 epoch, step, "" if cuda else " (no CUDA: nothing captured)")
