"""Run train.py, but SIGKILL this process right after optimizer step STEP (a test helper).

    python tests/kill_at_step.py STEP [train.py arguments ...]

A real SIGKILL at a known place: mid-epoch, some steps after the last checkpoint, the worst case for
exact resume. Every rank of a job run this way kills itself at the same step.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from utils.trainer import Trainer  # noqa: E402

STEP = int(sys.argv.pop(1))
_train_step = Trainer.train_step


def train_step_then_die(self, batches):
    out = _train_step(self, batches)
    if self.state.step + 1 == STEP:  # the step just taken (state.step counts it after this returns)
        os.kill(os.getpid(), signal.SIGKILL)
    return out


Trainer.train_step = train_step_then_die
sys.exit(train.cli())
