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
    return torch.load(tmp_path / "tiny" / f"{world_size}CPU" / "00" / "checkpoints" / "model.pt")["model"]


@pytest.mark.parametrize("mode,prefetch", [("zero3", 1), ("zero2", 0), ("zero3", 2)])
def test_fsdp_matches_single_process(tiny_data, tmp_path, single, mode, prefetch):
    sharded = _distributed(tiny_data, tmp_path, 2, fsdp=mode, fsdp_prefetch=prefetch)
    assert_state_close(single, sharded, atol=1e-5)


def test_hsdp_four_ranks_matches_single_process(tiny_data, tmp_path, single):
    sharded = _distributed(tiny_data, tmp_path, 4, fsdp="hsdp", hsdp_shard_size=2)
    assert_state_close(single, sharded, atol=1e-5)


@pytest.mark.parametrize("mode,every,blocks", [("full", 1, 0), ("selective", 2, 0), ("selective", 0, 0),
                                               ("selective", 0, 1)])
def test_activation_checkpointing_is_exact(tiny_data, tmp_path, single, mode, every, blocks):
    ckpt = train_checkpoint(tiny_params(tiny_data, tmp_path, activation_checkpointing=mode, ac_every=every,
                                        ac_blocks=blocks, **STEPS))
    assert_state_close(single, ckpt, atol=1e-6)


@pytest.mark.parametrize("mode,every,blocks,want", [
    ("full", 1, 0, ["full", "full"]), ("selective", 2, 0, ["full", None]),
    ("selective", 0, 0, ["op", "op"]), ("selective", 2, 1, ["full", None]), ("selective", 0, 2, ["full", "full"]),
])
def test_activation_checkpointing_wraps_the_chosen_blocks(mode, every, blocks, want):
    from distributed.parallelize import apply_activation_checkpointing
    from networks.vit import VisionTransformer
    model = VisionTransformer(img_size=(8, 8), patch_size=4, in_chans=2, out_chans=2, embed_dim=8, depth=2,
                              num_heads=2)
    apply_activation_checkpointing(model, mode, every, blocks)
    got = [None if not hasattr(b, "_checkpoint_wrapped_module") else
           "op" if b.checkpoint_fn.keywords.get("context_fn") else "full" for b in model.blocks]
    assert got == want


def test_zero3_with_activation_checkpointing_and_accumulation(tiny_data, tmp_path, single):
    sharded = _distributed(tiny_data, tmp_path, 2, fsdp="zero3", activation_checkpointing="full",
                           grad_accum_steps=2)
    assert_state_close(single, sharded, atol=1e-5)


@pytest.mark.parametrize("mode", ["zero3", "none"])
def test_sharded_and_full_checkpoints_round_trip(tiny_data, tmp_path, mode):
    from tests.train_utils import checkpoint_round_trip
    run_distributed(checkpoint_round_trip, 2, str(tiny_data), str(tmp_path), {**STEPS, "fsdp": mode})
