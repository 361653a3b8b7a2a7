"""Helpers to run the real training loop in-process (single rank or inside run_distributed)."""

from __future__ import annotations

from pathlib import Path

import torch

from distributed.env import init_distributed
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


def checkpoint_round_trip(rank: int, world_size: int, data_path: str, expdir: str, overrides: dict) -> None:
    """run_distributed target: a sharded (DCP) and a full save reproduce the trained model's outputs."""
    from distributed.checkpoint import load_sharded, save_full_model, save_sharded
    from networks.vit import build_model

    params = tiny_params(data_path, expdir, **overrides)
    world = init_distributed(params)
    trained = Trainer(params, world)
    trained.train()
    x = torch.randn(2, params.n_in_channels, *params.img_size, generator=torch.Generator().manual_seed(1))
    trained.model.eval()
    with torch.no_grad():
        want = trained.model(x)
    save_sharded(trained.model, trained.optimizer, Path(expdir) / "dcp")
    save_full_model(trained.model, Path(expdir) / "full.pt")

    params.seed = 123  # a differently initialized model must become identical after loading
    fresh = Trainer(params, world)
    load_sharded(fresh.model, fresh.optimizer, Path(expdir) / "dcp")
    fresh.model.eval()
    with torch.no_grad():
        got = fresh.model(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.distributed.barrier()
    plain = build_model(params)
    plain.load_state_dict(torch.load(Path(expdir) / "full.pt")["model"])  # no torch.distributed needed
    with torch.no_grad():
        torch.testing.assert_close(plain(x), want, atol=1e-5, rtol=0)
