"""Tensor/context parallel training through the real loop (train_mp.py path) against single-process training."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train_utils import assert_state_close, tiny_params, train_checkpoint, train_on_ranks

# 32x64 grid, patch 4 -> 128 tokens; max_grad_norm exercises the tensor-parallel global norm
STEPS = {"num_iters": 3, "global_batch_size": 8, "max_grad_norm": 0.5}


def last_metrics(run_dir):
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    expdir = tmp_path_factory.mktemp("single")
    state = train_checkpoint(tiny_params(tiny_data, expdir, **STEPS))
    return state, last_metrics(expdir / "tiny" / "1CPU" / "00")


@pytest.mark.parametrize("world_size,overrides", [
    (2, {"tensor_parallel": 2}),
    (2, {"context_parallel": 2}),
    (4, {"tensor_parallel": 2, "fsdp": "zero3"}),
    (4, {"tensor_parallel": 2, "context_parallel": 2}),
    (4, {"tensor_parallel": 2, "context_parallel": 2, "sequence_parallel": True}),
])
def test_model_parallel_training_matches_single_process(tiny_data, tmp_path, single, world_size, overrides):
    run_distributed(train_on_ranks, world_size, str(tiny_data), str(tmp_path), {**STEPS, **overrides})
    run_dir = tmp_path / "tiny" / f"{world_size}CPU" / "00"
    state, metrics = single
    assert_state_close(state, torch.load(run_dir / "checkpoints" / "model.pt")["model"], atol=1e-5)
    # reported losses are averaged over data-parallel ranks only, never summed over tp/cp peers
    got = last_metrics(run_dir)
    assert got["loss/train"] == pytest.approx(metrics["loss/train"], rel=1e-5)
    if world_size == overrides.get("tensor_parallel", 1) * overrides.get("context_parallel", 1):
        # one data-parallel rank sees every validation sample (dp > 1 keeps equal shards: drops the remainder)
        assert got["valid_samples"] == metrics["valid_samples"]
        assert got["loss/valid"] == pytest.approx(metrics["loss/valid"], rel=1e-5)


def test_world_size_not_divisible_by_tp_cp_is_a_clear_error():
    from utils.core.errors import UserError
    from utils.config.schema import ParallelConfig
    from utils.config.validate import data_parallel_size
    with pytest.raises(UserError, match="not divisible by tensor_parallel x context_parallel x ensemble_parallel = 2 x 2 x 1"):
        data_parallel_size(6, ParallelConfig(tensor_parallel=2, context_parallel=2))
    assert data_parallel_size(8, ParallelConfig(tensor_parallel=2, context_parallel=2)) == 2
