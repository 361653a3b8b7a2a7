"""Helpers to run the real training loop in-process (single rank or inside run_distributed)."""

from __future__ import annotations

from pathlib import Path

import torch

from distributed.env import init_distributed, shutdown
from utils.config import load_params
from utils.trainer import Trainer


def tiny_params(data_path, expdir, **overrides):
    """The ``tiny`` config on ``data_path`` with string/typed overrides, writing under ``expdir``."""
    base = {"data_path": str(data_path), "expdir": str(expdir), "log_every": "1000"}
    base.update({k: str(v) for k, v in overrides.items()})
    return load_params("config/ViT.yaml", "tiny", base)


def train_checkpoint(params) -> dict[str, torch.Tensor]:
    """Train with ``params`` on the current world and return the saved full-layout state dict."""
    torch.use_deterministic_algorithms(True)
    world = init_distributed(params)
    trainer = Trainer(params, world)
    trainer.train()
    path = Path(params.expdir) / params.config / f"{world.world_size}GPU" / str(params.run_num) / "checkpoints" / "model.pt"
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return torch.load(path, map_location="cpu")["model"]


def train_on_ranks(rank: int, world_size: int, data_path: str, expdir: str, overrides: dict) -> None:
    """run_distributed target: train; rank 0's checkpoint lands under ``expdir``."""
    train_checkpoint(tiny_params(data_path, expdir, **overrides))


def assert_state_close(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for key in a:
        diff = (a[key].float() - b[key].float()).abs().max().item()
        assert diff <= atol, f"{key}: max |diff| {diff:.3g} > {atol}"
