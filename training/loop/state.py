"""Where a run is: the trainer's progress counters and this rank's random-number streams.

Saved with every checkpoint (``distributed/checkpoint/manager.py``), so a resumed run continues at the same
optimizer step, the same batch of the same epoch (the data order is a function of seed and epoch),
with the same learning rate and the same random streams. The components read it at their hooks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

PER_RANK = {"per_rank": True}  # saved in rank<r>.pt: differs between ranks
TRANSIENT = {"transient": True}  # this process's view of the run, never saved


@dataclass
class TrainState:
    """Progress of a run: ``state_dict`` is identical on every rank, ``per_rank_state_dict`` is not.

    Saved: ``step``: optimizer steps done; ``epoch``: the epoch in progress, 0-based (the data order's
    argument; users see :attr:`epoch_number`); ``epoch_step``: optimizer steps
    of ``epoch`` done; ``elapsed_s``: training wall-clock seconds before this process started
    (``metrics.jsonl``'s ``elapsed_s`` continues from it); ``data_parallel``: the data-parallel
    ranks of the run that saved it; ``epoch_loss_mean``: the mean over those ranks of
    ``epoch_loss_sum``, where each rank starts from when resumed on another number of ranks.

    Transient (the loop sets them for the components): ``total_steps``: the run's optimizer steps
    (``num_iters``); ``epoch_end``: the step of the running epoch at which it ends; ``stop_signal``: a
    preemption signal every rank has agreed on (0: none); ``resumed_step``: the step this process
    resumed at (None: a fresh start).
    """

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    elapsed_s: float = 0.0
    data_parallel: int = 1
    epoch_loss_mean: float = 0.0
    # this rank's sum of the losses of epoch_step steps (its own: restored exactly, summed at epoch end)
    epoch_loss_sum: float = field(default=0.0, metadata=PER_RANK)
    total_steps: int = field(default=0, metadata=TRANSIENT)
    epoch_end: int = field(default=0, metadata=TRANSIENT)
    stop_signal: int = field(default=0, metadata=TRANSIENT)
    resumed_step: int | None = field(default=None, metadata=TRANSIENT)
    resharded: bool = field(default=False, metadata=TRANSIENT)  # loaded from another number of dp ranks

    @property
    def done(self) -> bool:
        """Whether the run has made all its optimizer steps."""
        return self.step >= self.total_steps

    @property
    def epoch_number(self) -> int:
        """The epoch in progress counted from 1, as every output counts it (the console's ``epoch 1/13``,
        ``metrics.jsonl``, the profiling windows' epoch keys)."""
        return self.epoch + 1

    @property
    def last_step_of_epoch(self) -> bool:
        """Whether the step just made ends the running epoch."""
        return self.epoch_step == self.epoch_end

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the saved counters. Saved on another number of data-parallel ranks, each rank's epoch
        loss sum restarts from the saved mean (the per-rank sums belong to other ranks)."""
        own_dp = self.data_parallel
        for name, value in state.items():
            setattr(self, name, type(getattr(self, name))(value))
        self.resharded = self.data_parallel != own_dp
        if self.resharded:
            self.epoch_loss_sum, self.data_parallel = self.epoch_loss_mean, own_dp
        self.resumed_step = self.step

    def per_rank_state_dict(self) -> dict[str, Any]:
        """This rank's part: its epoch loss sum and random streams (torch CPU and CUDA, NumPy, Python), as plain
        data (tensors, numbers, lists) that ``torch.load(weights_only=True)`` reads without running code."""
        state = {"epoch_loss_sum": self.epoch_loss_sum, "torch": torch.get_rng_state(),
                 "numpy": numpy_rng_state(), "python": python_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_per_rank_state_dict(self, state: dict[str, Any]) -> None:
        if not self.resharded:
            self.epoch_loss_sum = float(state["epoch_loss_sum"])
        torch.set_rng_state(state["torch"])
        set_numpy_rng_state(state["numpy"])
        set_python_rng_state(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def numpy_rng_state() -> dict[str, Any]:
    """NumPy's legacy global generator state (``np.random.get_state``) as plain data."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def set_numpy_rng_state(state: dict[str, Any] | tuple) -> None:
    """Restore what :func:`numpy_rng_state` returned (or ``np.random.get_state()``'s tuple, as older checkpoints
    hold it)."""
    if isinstance(state, tuple):
        np.random.set_state(state)
        return
    np.random.set_state((state["name"], state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                         state["cached_gaussian"]))


def python_rng_state() -> dict[str, Any]:
    """Python's ``random`` state as plain data."""
    version, internal, gauss_next = random.getstate()
    return {"version": version, "internal": list(internal), "gauss_next": gauss_next}


def set_python_rng_state(state: dict[str, Any] | tuple) -> None:
    """Restore what :func:`python_rng_state` returned (or ``random.getstate()``'s tuple, as older checkpoints hold
    it)."""
    if isinstance(state, tuple):
        random.setstate(state)
        return
    random.setstate((state["version"], tuple(state["internal"]), state["gauss_next"]))
