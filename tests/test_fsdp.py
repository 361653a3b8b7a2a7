"""FSDP2 (ZeRO-2, ZeRO-3, HSDP), prefetch, activation checkpointing and checkpoints against single-process training."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train_utils import assert_state_close, tiny_params, train_checkpoint, train_on_ranks

STEPS = {"num_iters": 4, "global_batch_size": 8}


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    return train_checkpoint(tiny_params(tiny_data, tmp_path_factory.mktemp("single"), **STEPS))


def _distributed(tiny_data, tmp_path, world_size, **overrides):
    run_distributed(train_on_ranks, world_size, str(tiny_data), str(tmp_path), {**STEPS, **overrides})
    return torch.load(tmp_path / "tiny" / f"{world_size}GPU" / "00" / "checkpoints" / "model.pt")["model"]


@pytest.mark.parametrize("mode,prefetch", [("zero3", 1), ("zero2", 0), ("zero3", 2)])
def test_fsdp_matches_single_process(tiny_data, tmp_path, single, mode, prefetch):
    sharded = _distributed(tiny_data, tmp_path, 2, fsdp=mode, fsdp_prefetch=prefetch)
    assert_state_close(single, sharded, atol=1e-5)


def test_hsdp_four_ranks_matches_single_process(tiny_data, tmp_path, single):
    sharded = _distributed(tiny_data, tmp_path, 4, fsdp="hsdp", hsdp_shard_size=2)
    assert_state_close(single, sharded, atol=1e-5)


@pytest.mark.parametrize("mode,every", [("full", 1), ("selective", 2), ("selective", 0)])
def test_activation_checkpointing_is_exact(tiny_data, tmp_path, single, mode, every):
    ckpt = train_checkpoint(tiny_params(tiny_data, tmp_path, activation_checkpointing=mode, ac_every=every, **STEPS))
    assert_state_close(single, ckpt, atol=1e-6)


def test_zero3_with_activation_checkpointing_and_accumulation(tiny_data, tmp_path, single):
    sharded = _distributed(tiny_data, tmp_path, 2, fsdp="zero3", activation_checkpointing="full",
                           grad_accum_steps=2)
    assert_state_close(single, sharded, atol=1e-5)


@pytest.mark.parametrize("mode", ["zero3", "none"])
def test_sharded_and_full_checkpoints_round_trip(tiny_data, tmp_path, mode):
    from tests.train_utils import checkpoint_round_trip
    run_distributed(checkpoint_round_trip, 2, str(tiny_data), str(tmp_path), {**STEPS, "fsdp": mode})
