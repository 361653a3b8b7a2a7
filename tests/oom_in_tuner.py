"""Run the batch-size tuner, but raise ``torch.OutOfMemoryError`` in the forward pass of every training
batch of at least ``OOM_FROM`` samples (a test helper).

    OOM_FROM=64 [OOM_RANKS=1] python tests/oom_in_tuner.py [tools.tune_batch_size arguments ...]

``OOM_RANKS`` (``1``, ``0,2``) limits it to those ranks, else every rank fails. The error is PyTorch's
own type with a message shaped like a real one, raised where a real allocation would fail, so the
tuner's handling is what a GPU run gets.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from networks.vit import VisionTransformer  # noqa: E402
from utils.core.errors import run_cli  # noqa: E402
from training.tuner.command import main  # noqa: E402

OOM_FROM = int(os.environ["OOM_FROM"])
CHOSEN = os.environ.get("OOM_RANKS") is None or os.environ.get("RANK", "0") in os.environ["OOM_RANKS"].split(",")
MESSAGE = "CUDA out of memory. Tried to allocate 9.30 GiB. GPU 0 has a total capacity of 79.19 GiB"
_forward = VisionTransformer.forward


def forward(self, x):
    if self.training and CHOSEN and x.shape[0] >= OOM_FROM:
        raise torch.OutOfMemoryError(MESSAGE)
    return _forward(self, x)


VisionTransformer.forward = forward
sys.exit(run_cli(main))
