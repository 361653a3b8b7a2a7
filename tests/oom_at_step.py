"""Run train.py, but raise ``torch.OutOfMemoryError`` in one phase (a test helper).

    python tests/oom_at_step.py STEP [train.py arguments ...]

``OOM_PHASE``: ``forward`` (default; the forward pass of 0-based optimizer step STEP) or
``validation`` (the first validation). ``OOM_RANKS`` (``1``, ``0,2``) limits it to those ranks, else
every rank fails. The error is PyTorch's own type with a message shaped like a real one, raised where
a real allocation would fail, so the trainer's handling is what a GPU run gets.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from networks.vit import VisionTransformer  # noqa: E402
from training.evaluation.evaluator import Evaluator  # noqa: E402

STEP = int(sys.argv.pop(1))
PHASE = os.environ.get("OOM_PHASE", "forward")
CHOSEN = os.environ.get("OOM_RANKS") is None or os.environ.get("RANK", "0") in os.environ["OOM_RANKS"].split(",")
MESSAGE = "CUDA out of memory. Tried to allocate 9.30 GiB. GPU 0 has a total capacity of 139.81 GiB"
_forward, _evaluate = VisionTransformer.forward, Evaluator.evaluate
calls = [0]


def forward(self, x):
    if self.training:
        calls[0] += 1
        if calls[0] == STEP + 1 and CHOSEN and PHASE == "forward":
            raise torch.OutOfMemoryError(MESSAGE)
    return _forward(self, x)


def evaluate(self, *args, **kwargs):
    if CHOSEN and PHASE == "validation":
        raise torch.OutOfMemoryError(MESSAGE)
    return _evaluate(self, *args, **kwargs)


VisionTransformer.forward, Evaluator.evaluate = forward, evaluate
sys.exit(train.cli())
