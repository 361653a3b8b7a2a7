"""Forcings and static fields through the real loop on gloo ranks against a single-process reference: DDP at 3
ranks, ZeRO-3 at 4, tensor x context parallel at 4, with rollout training (K = 2: each step its own forcings)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train_utils import assert_state_close, tiny_params, train_checkpoint, train_on_ranks

FORCINGS = "[cos_solar_zenith_angle,sin_local_time,cos_local_time,sin_julian_day,cos_julian_day,sin_latitude]"


def write_static(path, data_path) -> None:
    """A ``static.h5`` on the tiny data's grid: a land-sea mask and an orography, with their statistics."""
    with h5py.File(next((data_path / "train").glob("*.h5")), "r") as f:
        lat, lon = f["latitude"][:], f["longitude"][:]
    rng = np.random.default_rng(0)
    fields = {"lsm": (rng.random((lat.size, lon.size)) > 0.6).astype(np.float32),
              "z": rng.gamma(2.0, 2000.0, (lat.size, lon.size)).astype(np.float32)}
    with h5py.File(path, "w") as f:
        f["latitude"], f["longitude"] = lat, lon
        for name, values in fields.items():
            f[name] = values
            f[name].attrs.update(mean=float(values.mean()), std=float(values.std()), units="1")


def steps(static) -> dict:
    return {"num_iters": 3, "global_batch_size": 12, "train_rollout_steps": 2, "valid_rollout_steps": 2,
            "forcings": FORCINGS, "static_fields": "[lsm,z]", "static_path": str(static), "residual": "true"}


def last_metrics(run_dir):
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def static(tiny_data, tmp_path_factory):
    path = tmp_path_factory.mktemp("static") / "static.h5"
    write_static(path, tiny_data)
    return path


@pytest.fixture(scope="module")
def single(tiny_data, static, tmp_path_factory):
    expdir = tmp_path_factory.mktemp("single")
    state = train_checkpoint(tiny_params(tiny_data, expdir, **steps(static)))
    return state, last_metrics(expdir / "tiny" / "1CPU" / "00")


@pytest.mark.parametrize("world_size,overrides", [
    (3, {}),
    (4, {"fsdp": "zero3"}),
    (4, {"tensor_parallel": 2, "context_parallel": 2}),
], ids=["ddp3", "zero3", "tp2-cp2"])
def test_forcings_train_alike_in_every_parallel_mode(tiny_data, static, tmp_path, single, world_size, overrides):
    run_distributed(train_on_ranks, world_size, str(tiny_data), str(tmp_path), {**steps(static), **overrides})
    run_dir = tmp_path / "tiny" / f"{world_size}CPU" / "00"
    state, metrics = single
    assert state["patch_embed.proj.weight"].shape[1] == 4 + 6 + 2  # prognostic, forcings, static
    assert_state_close(state, torch.load(run_dir / "checkpoints" / "model.pt")["model"], atol=1e-5)
    got = last_metrics(run_dir)
    assert got["loss/train"] == pytest.approx(metrics["loss/train"], rel=1e-5)
    if "tensor_parallel" in overrides:  # one data-parallel rank: the whole validation split, scored with forcings
        assert got["valid_samples"] == metrics["valid_samples"]
        assert got["rmse/t2m"] == pytest.approx(metrics["rmse/t2m"], rel=1e-4)
