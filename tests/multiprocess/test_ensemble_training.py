"""CRPS ensemble training through the real loop on gloo ranks against a single-process reference: members spread
over 2 ranks, DDP at 3 ranks, ensemble x data parallel under ZeRO-3 at 4, ensemble x tensor parallel at 4; with
forcings and rollout training (K = 2: each member rolled out with its own noise)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train_utils import assert_state_close, tiny_params, train_checkpoint, train_on_ranks

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
    state = train_checkpoint(tiny_params(tiny_data, expdir, **steps()))
    return state, last_metrics(expdir / "tiny" / "1CPU" / "00")


@pytest.mark.parametrize("world_size,overrides", [
    (2, {"ensemble_parallel": 2}),
    (3, {}),
    (4, {"ensemble_parallel": 2, "fsdp": "zero3", "global_batch_size": 6}),
    (4, {"ensemble_parallel": 2, "tensor_parallel": 2}),
], ids=["ens2", "ddp3", "ens2-dp2-zero3", "ens2-tp2"])
def test_ensembles_train_alike_in_every_parallel_mode(tiny_data, tmp_path, single, world_size, overrides):
    run_distributed(train_on_ranks, world_size, str(tiny_data), str(tmp_path), {**steps(), **overrides})
    run_dir = tmp_path / "tiny" / f"{world_size}CPU" / "00"
    state, metrics = single
    assert state["patch_embed.proj.weight"].shape[1] == 4 + 2 + 2  # prognostic, forcings, noise
    assert_state_close(state, torch.load(run_dir / "checkpoints" / "model.pt")["model"], atol=2e-5)
    got = last_metrics(run_dir)
    assert got["loss/train"] == pytest.approx(metrics["loss/train"], rel=1e-5)
    assert got["loss/valid"] == pytest.approx(metrics["loss/valid"], rel=1e-4)

