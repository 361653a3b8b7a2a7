"""Where a run is: the trainer's progress counters and this rank's random-number streams.

Saved with every checkpoint (``distributed/checkpoint.py``), so a resumed run continues at the same
optimizer step, the same batch of the same epoch (the data order is a function of seed and epoch),
with the same learning rate and the same random streams.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch


@dataclass
class TrainState:
    """Progress of a run: ``state_dict`` is identical on every rank, ``per_rank_state_dict`` is not.

    ``step``: optimizer steps done; ``epoch``: the epoch in progress; ``epoch_step``: optimizer steps
    of ``epoch`` done; ``elapsed_s``: training wall-clock seconds before this process started
    (``metrics.jsonl``'s ``elapsed_s`` continues from it); ``data_parallel``: the data-parallel
    ranks of the run that saved it; ``epoch_loss_mean``: the mean over those ranks of
    ``epoch_loss_sum``, where each rank starts from when resumed on another number of ranks.
    """

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    elapsed_s: float = 0.0
    data_parallel: int = 1
    epoch_loss_mean: float = 0.0
    # this rank's sum of the losses of epoch_step steps (its own: restored exactly, summed at epoch end)
    epoch_loss_sum: float = field(default=0.0, metadata={"per_rank": True})

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("per_rank")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, type(getattr(self, name))(value))

    def per_rank_state_dict(self) -> dict[str, Any]:
        """This rank's part: its epoch loss sum and random streams (torch CPU and CUDA, NumPy, Python)."""
        state = {"epoch_loss_sum": self.epoch_loss_sum, "torch": torch.get_rng_state(),
                 "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_per_rank_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch_loss_sum = float(state["epoch_loss_sum"])
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
