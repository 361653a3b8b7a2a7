"""CRPS ensemble training through the real loop on gloo ranks against a single-process reference: members spread
over 2 ranks, DDP at 3 ranks, ensemble x data parallel under ZeRO-3 and HSDP at 4, ensemble x tensor and x context parallel at 4;
with forcings and rollout training (K = 2: each member rolled out with its own noise)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.jobs import final_state
from tests.train_utils import tiny_params, train_checkpoint, train_on_ranks

MEMBERS = 4


def steps() -> dict:
    return {"num_iters": 3, "global_batch_size": 6, "train_rollout_steps": 2, "valid_rollout_steps": 2,
            "forcings": "[cos_solar_zenith_angle,sin_local_time]", "residual": "true", "noise_channels": 2,
            "loss": "crps", "ensemble_members": MEMBERS}


def last_metrics(run_dir):
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    expdir = tmp_path_factory.mktemp("single")
    train_checkpoint(tiny_params(tiny_data, expdir, **steps()))
    run_dir = expdir / "tiny" / "1CPU" / "00"
    return final_state(run_dir, expdir), last_metrics(run_dir)


@pytest.mark.parametrize("world_size,overrides", [
    (2, {"ensemble_parallel": 2}),
    (3, {}),
    (4, {"ensemble_parallel": 2, "fsdp": "zero3", "global_batch_size": 6}),
    (4, {"ensemble_parallel": 2, "tensor_parallel": 2}),
    (4, {"ensemble_parallel": 2, "context_parallel": 2}),
    (4, {"ensemble_parallel": 2, "fsdp": "hsdp", "hsdp_shard_size": 1}),
], ids=["ens2", "ddp3", "ens2-dp2-zero3", "ens2-tp2", "ens2-cp2", "ens2-hsdp"])
def test_ensembles_train_alike_in_every_parallel_mode(tiny_data, tmp_path, single, world_size, overrides):
    run_distributed(train_on_ranks, world_size, str(tiny_data), str(tmp_path), {**steps(), **overrides})
    run_dir = tmp_path / "tiny" / f"{world_size}CPU" / "00"
    state, metrics = single
    assert state["/model/patch_embed.proj.weight"].shape[1] == 4 + 2 + 2  # prognostic, forcings, noise
    got_state = final_state(run_dir, tmp_path)
    assert got_state.keys() == state.keys() and any("exp_avg" in k for k in state)
    # Adam's moments too: they keep the gradients' scale, which Adam's step hides. The tolerance is relative to each
    # tensor's largest value: the attention's key bias has no true gradient (softmax ignores it), so Adam moves it
    # by rounding noise, 1e-8 where the query and value biases are 1e-3
    for key, want in state.items():
        torch.testing.assert_close(got_state[key], want, rtol=1e-3, atol=1e-4 * float(want.abs().max()), msg=key)
    got = last_metrics(run_dir)
    assert got["loss/train"] == pytest.approx(metrics["loss/train"], rel=1e-5)
    if world_size == 2 * overrides.get("tensor_parallel", 1) * overrides.get("context_parallel", 1):  # one data-parallel rank: the whole validation split,
        assert got["valid_samples"] == metrics["valid_samples"]  # each rank of the group drawing every member
        for key in ("loss/valid", "crps/t2m", "spread/t2m", "rmse/t2m"):
            assert got[key] == pytest.approx(metrics[key], rel=1e-4), key

