"""Rollout training (K = 2) on 2 and 4 gloo ranks against a single-process reference: DDP, ZeRO-3, tensor and
context parallel, with and without activation checkpointing per rollout step."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train_utils import assert_state_close, tiny_params, train_checkpoint, train_on_ranks

STEPS = {"num_iters": 3, "global_batch_size": 8, "train_rollout_steps": 2, "rollout_step_weights": "[1.0,0.5]"}


def last_metrics(run_dir):
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    expdir = tmp_path_factory.mktemp("single")
    run_dir = expdir / "tiny" / "1CPU" / "00"
    return train_checkpoint(tiny_params(tiny_data, expdir, **STEPS)), last_metrics(run_dir), run_dir


@pytest.mark.parametrize("world_size,overrides", [
    (2, {"rollout_checkpointing": "true"}),
    (4, {"fsdp": "zero3", "rollout_checkpointing": "true"}),
    (2, {"tensor_parallel": 2}),
    (4, {"context_parallel": 2, "grad_accum_steps": 2}),
], ids=["ddp", "zero3", "tp2", "cp2-dp2-accum"])
def test_rollout_training_matches_single_process(tiny_data, tmp_path, single, world_size, overrides):
    run_distributed(train_on_ranks, world_size, str(tiny_data), str(tmp_path), {**STEPS, **overrides})
    run_dir = tmp_path / "tiny" / f"{world_size}CPU" / "00"
    state, metrics, _ = single
    assert_state_close(state, torch.load(run_dir / "checkpoints" / "model.pt")["model"], atol=1e-5)
    got = last_metrics(run_dir)
    assert got["train/rollout_steps"] == 2
    assert got["loss/train"] == pytest.approx(metrics["loss/train"], rel=1e-5)


def test_compiled_bf16_accumulated_rollout_trains_like_the_reference(tiny_data, tmp_path, single):
    """One process: torch.compile with per-step checkpointing and gradient accumulation against the eager reference
    (fp32), and bf16_pure close to it."""
    state, _, _ = single
    # 16 validation samples: whole batches, so validation compiles one graph, not a second for a partial batch
    compiled = train_checkpoint(tiny_params(tiny_data, tmp_path / "jit", **STEPS, enable_jit="true",
                                            rollout_checkpointing="true", grad_accum_steps=2, limit_nsamples_val=16))
    assert_state_close(state, compiled, atol=1e-5)
    bf16 = train_checkpoint(tiny_params(tiny_data, tmp_path / "bf16", **STEPS, amp_mode="bf16_pure"))
    assert_state_close(state, bf16, atol=2e-2)


def test_init_from_starts_from_the_runs_weights_not_its_optimizer_or_step(tiny_data, tmp_path, single):
    from distributed.world import init_distributed
    from training.loop.trainer import Trainer
    source = single[2]
    cfg = tiny_params(tiny_data, tmp_path, **{**STEPS, "init_from": str(source), "train_rollout_steps": 3,
                                              "rollout_step_weights": "[]"})
    trainer = Trainer(cfg, init_distributed(cfg.parallel))
    try:
        want = torch.load(source / "checkpoints" / "model.pt")["model"]
        assert_state_close(want, trainer.model.state_dict(), atol=0)
        assert trainer.state.step == 0 and not trainer.optimizer.state
    finally:
        trainer.close()


def test_synthetic_loader_feeds_k_targets(tmp_path):
    """The synthetic loader's batches carry the run's K targets (no data read)."""
    train_checkpoint(tiny_params(tmp_path / "none", tmp_path, num_iters=2, global_batch_size=8, train_rollout_steps=3,
                                 data_loader_config="synthetic", limit_nsamples=16, limit_nsamples_val=8))
    metrics = last_metrics(tmp_path / "tiny" / "1CPU" / "00")
    assert metrics["train/rollout_steps"] == 3 and metrics["loss/train"] > 0
