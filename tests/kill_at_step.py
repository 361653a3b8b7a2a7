"""Run train.py, but send this process a signal right after optimizer step STEP (a test helper).

    python tests/kill_at_step.py STEP [train.py arguments ...]

A real signal at a known place: mid-epoch, some steps after the last checkpoint, the worst case for
exact resume. The signal is SIGKILL unless ``KILL_SIGNAL`` names another (``USR1``, ``TERM``,
``STOP``); ``KILL_RANKS`` (``0,2``) limits it to those ranks, else every rank of the job signals
itself at the same step.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from training.loop.trainer import Trainer  # noqa: E402

STEP = int(sys.argv.pop(1))
SIGNAL = getattr(signal, "SIG" + os.environ.get("KILL_SIGNAL", "KILL"))
RANKS = os.environ.get("KILL_RANKS")
_train_step = Trainer.train_step


def train_step_then_signal(self, batches):
    out = _train_step(self, batches)
    chosen = RANKS is None or str(self.world.rank) in RANKS.split(",")
    if self.state.step + 1 == STEP and chosen:  # the step just taken (state.step counts it after this returns)
        os.kill(os.getpid(), SIGNAL)
    return out


Trainer.train_step = train_step_then_signal
sys.exit(train.cli())
