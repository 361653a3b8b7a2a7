"""Helpers to run the real training loop in-process (single rank or inside run_distributed)."""

from __future__ import annotations

from pathlib import Path

import torch

from distributed.world import init_distributed
from utils.config.loading import load_config
from training.loop.trainer import Trainer


def tiny_params(data_path, expdir, **overrides):
    """The ``tiny`` config on ``data_path`` with string/typed overrides, writing under ``expdir``; no TensorBoard
    figures unless ``figure_every`` is given (matplotlib's ~0.5 s a validation); fused Adam unless
    ``enable_fused`` is given (as ``tests/jobs.py``'s ``RUN``: the for-loop Adam is slower on DTensors)."""
    base = {"data_path": str(data_path), "expdir": str(expdir), "log_every": "1000", "figure_every": "0",
            "enable_fused": "true"}
    base.update({k: str(v) for k, v in overrides.items()})
    return load_config("config/ViT.yaml", "tiny", base)


def train_checkpoint(cfg) -> dict[str, torch.Tensor]:
    """Train with ``cfg`` on the current world and return the saved full-layout state dict."""
    torch.use_deterministic_algorithms(True)
    world = init_distributed(cfg.parallel)
    trainer = Trainer(cfg, world)
    trainer.train()
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return torch.load(trainer.run_dir / "checkpoints" / "model.pt", map_location="cpu")["model"]


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
    from distributed.checkpoint.export import save_full_model
    from distributed.checkpoint.sharded import load_sharded, save_sharded
    from networks.vit import build_model

    cfg = tiny_params(data_path, expdir, **overrides)
    world = init_distributed(cfg.parallel)
    trained = Trainer(cfg, world)
    trained.train()
    trained.close()
    x = torch.randn(2, cfg.data.n_in_channels, *cfg.data.img_size, generator=torch.Generator().manual_seed(1))
    trained.model.eval()
    with torch.no_grad():
        want = trained.model(x)
    save_sharded(trained.model, trained.optimizer, Path(expdir) / "dcp")
    save_full_model(trained.model, Path(expdir) / "full.pt")

    cfg.optim.seed = 123  # a differently initialized model must become identical after loading
    fresh = Trainer(cfg, world)
    load_sharded(fresh.model, fresh.optimizer, Path(expdir) / "dcp")
    fresh.model.eval()
    with torch.no_grad():
        got = fresh.model(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.distributed.barrier()
    plain = build_model(cfg.model, cfg.data)
    plain.load_state_dict(torch.load(Path(expdir) / "full.pt")["model"])  # no torch.distributed needed
    with torch.no_grad():
        torch.testing.assert_close(plain(x), want, atol=1e-5, rtol=0)
