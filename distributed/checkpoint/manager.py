"""When a run is checkpointed: the :class:`CheckpointManager` component owns the cadence.

It saves (through :class:`~distributed.checkpoint.sharded.ShardedCheckpoints`) after a step when

* ``checkpoint_every_steps`` steps have passed;
* ``checkpoint_every_minutes`` have passed since the last save (every rank agrees, by a MAX all-reduce
  every :data:`AGREE_EVERY_STEPS` steps, since the ranks' clocks differ);
* every rank has agreed on a preemption signal (``state.stop_signal``): it saves that step, waits until
  the save is committed and stops the run with :class:`~utils.core.errors.Preempted`;
* and at the end of a successful run, followed by the single-file model export.

A periodic save that falls due on the epoch's last step waits until the epoch is reported, so a resumed
run's ``metrics.jsonl`` holds that epoch; a preemption does not wait.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from distributed.checkpoint.export import save_full_model
from distributed.checkpoint.sharded import ShardedCheckpoints
from distributed.world import World, all_reduce
from networks.model_file import FINAL_MODEL
from utils.config.schema import CheckpointConfig
from utils.core.component import Component
from utils.core.errors import EXIT_PREEMPTED, Preempted
from utils.core.signals import signal_name

AGREE_EVERY_STEPS = 10  # steps between the all-reduces that agree on a minutes-based save


class CheckpointManager(Component):
    """The run's checkpoint cadence and its checkpoints (collective at every hook: every rank decides alike).

    Args:
        cfg: the ``checkpoint`` config section.
        directory: the run's ``checkpoints/`` folder.
        model, optimizer: as trained (any parallelism).
        stateful: the other objects whose ``state_dict`` a checkpoint holds (scheduler, GradScaler, train
            state), by name.
        world: this process's place in the job.
        settle: called before each save, so that every saved object is exact (the trainer reads back the
            last step's loss, checks it is finite and sums the epoch's losses).
        export_meta: what the single-file model of the run's end holds besides the weights (step, config).
    """

    def __init__(self, cfg: CheckpointConfig, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 stateful: dict[str, Any], world: World, settle: Callable[[], None] = lambda: None,
                 export_meta: dict | None = None):
        self.cfg, self.world, self.settle = cfg, world, settle
        self.directory = Path(directory)
        self.model, self.export_meta = model, export_meta or {}
        self.sharded = ShardedCheckpoints(cfg, directory, model, optimizer, stateful, world)
        self.saved_step = -1  # the step of the newest save or load
        self.due = False  # a periodic save fell due on an epoch's last step: it is made at the epoch's end
        self.last_save = time.monotonic()
        self.state = None

    def load(self, path: Path | None = None) -> int | None:
        """Restore every object of the checkpoint this run resumes from (``path``, else the run's newest
        loadable one); its step, or None when there is none (collective; see ``ShardedCheckpoints.load``)."""
        step = self.sharded.load(path)
        if step is not None:
            self.saved_step = step
        return step

    def latest(self) -> Path | None:
        """The newest complete checkpoint folder."""
        return self.sharded.latest()

    # ---- hooks
    def start(self, state) -> None:
        self.state = state

    def step_end(self, state) -> None:
        if state.stop_signal:
            self._stop(state)
        if not self.cfg.save_checkpoint:
            return
        self.sharded.prepare()  # host buffers for the saves, allocated in the background from the first step
        self.due = self.due or self._cadence(state)
        if self.due and not state.last_step_of_epoch:
            self.save(state)

    def epoch_end(self, state, record: dict) -> None:
        if self.due:
            self.save(state)

    def close(self, error: BaseException | None) -> None:
        """After success: the final checkpoint, committed, then the single-file model export. After an error
        only the resources are released: a pending save is not committed over a failed run."""
        if error is None and self.cfg.save_checkpoint:
            if self.saved_step != self.state.step:
                self.save(self.state)
            self.sharded.wait()
            save_full_model(self.model, self.directory / FINAL_MODEL, {"step": self.state.step, **self.export_meta})
        self.sharded.close(commit=error is None)

    # ---- cadence
    def _cadence(self, state) -> bool:
        """Whether a periodic save is due after this step; every rank reaches the same answer."""
        c = self.cfg
        if c.checkpoint_every_steps and state.step % c.checkpoint_every_steps == 0:
            return True
        if c.checkpoint_every_minutes and state.step % AGREE_EVERY_STEPS == 0:
            late = time.monotonic() - self.last_save >= 60 * c.checkpoint_every_minutes
            flag = torch.tensor(float(late), device=self.world.device)
            return bool(all_reduce(flag, self.world, op=dist.ReduceOp.MAX).item())
        return False

    def save(self, state) -> None:
        """Checkpoint the state after ``state.step`` (collective)."""
        self.settle()
        self.sharded.save(state.step)
        self.saved_step, self.due, self.last_save = state.step, False, time.monotonic()

    def _resume_hint(self) -> str:
        """How to go on: the same command, unless it starts a new run each time (``--resume never`` or
        ``--resume PATH``): then this run's id instead of that option."""
        resume = self.cfg.resume
        if resume == "auto":
            return "run the same command to resume"
        option = "--resume never" if resume == "never" else "--resume PATH"
        return (f"to resume this run, run the same command with --run_num {self.directory.parent.name} instead of "
                f"{option} (as it is, it starts another new run)")

    def _stop(self, state) -> None:
        """Checkpoint this step (unless just done or checkpoints are off), wait until it is committed, and raise
        Preempted."""
        saved, then = "no checkpoint written (--save_checkpoint false)", "the run cannot continue"
        if self.cfg.save_checkpoint:
            if self.saved_step != state.step:
                self.save(state)
            self.sharded.wait()
            saved, then = f"checkpoint {self.latest()} written", self._resume_hint()
        message = ""
        if self.world.is_main:  # one line for the job
            message = (f"preempted by {signal_name(state.stop_signal)} at iteration {state.step}: {saved}; exit "
                       f"status {EXIT_PREEMPTED}; {then}")
        raise Preempted(message)
