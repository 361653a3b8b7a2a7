"""End-to-end training on CPU: the tiny run learns, logs and checkpoints; DDP, accumulation, compile and
the NaN check agree with a single process."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from networks.vit import build_model
from tests.dist_utils import run_distributed
from tests.train_utils import assert_state_close, tiny_params, train_checkpoint, train_on_ranks


def test_tiny_run_learns_and_logs(tiny_data, tmp_path):
    params = tiny_params(tiny_data, tmp_path, num_iters=60, valid_every=1, figure_every=4)
    sd = train_checkpoint(params)
    run_dir = tmp_path / "tiny" / "1CPU" / "00"
    log_text = (run_dir / "out.log").read_text()
    assert "memory: peak RSS" in log_text and "samples/s" in log_text
    assert (run_dir / "config.yaml").is_file()
    acc = EventAccumulator(str(run_dir)).Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("loss/train", "loss/valid", "rmse/u10m", "acc/t2m", "rmse_persistence/u10m",
                "lr", "perf/samples_per_s", "memory/peak_rss"):
        assert tag in tags, tag
    valid = [e.value for e in acc.Scalars("loss/valid")]
    assert len(valid) >= 3 and valid[-1] < 0.7 * valid[0], valid
    # the figures of every 4th epoch's validation and of the last (6 epochs: the 4th and 6th)
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drawn = [r["iteration"] for r in epochs if r["epoch"] % 4 == 0 or r is epochs[-1]]
    assert acc.Tags()["images"] == ["prediction(u10m)/valid"]
    assert [image.step for image in acc.Images("prediction(u10m)/valid")] == drawn and len(drawn) == 2, drawn
    model = build_model(params.model, params.data)
    model.load_state_dict(sd)  # the checkpoint is the plain single-device layout


def test_grad_accumulation_equals_larger_batch(tiny_data, tmp_path):
    one = train_checkpoint(tiny_params(tiny_data, tmp_path / "a", num_iters=4, global_batch_size=8))
    accum = train_checkpoint(tiny_params(tiny_data, tmp_path / "b", num_iters=4, global_batch_size=8,
                                         grad_accum_steps=2))
    assert_state_close(one, accum, atol=1e-5)


def test_bf16_and_fused_and_clipping_run(tiny_data, tmp_path):
    sd = train_checkpoint(tiny_params(tiny_data, tmp_path, num_iters=6, amp_mode="bf16", enable_fused="true",
                                      max_grad_norm=1.0))
    assert all(torch.isfinite(v).all() for v in sd.values())


def test_after_step_hook_runs_once_per_optimizer_step_after_adam(tmp_path):
    """TrainingStep's ``after_step`` (fp8's float8 weight scales under FSDP) sees the updated weights."""
    from distributed.world import init_distributed
    from training.loop.step import build_training_step
    cfg = tiny_params(tmp_path, tmp_path, grad_accum_steps=2)
    step = build_training_step(cfg, init_distributed(cfg.parallel))
    seen = []
    step.after_step = lambda: seen.append(len(step.optimizer.state))  # Adam's state exists after its step
    x = torch.randn(2, 4, 32, 64)
    step(iter([(x, x[:, None], torch.arange(2))] * 2))
    assert seen == [len(list(step.model.parameters()))]


@pytest.mark.parametrize("gc_freeze", ["true", "false"])
def test_python_garbage_is_frozen_after_the_first_step_and_at_each_later_epoch(tiny_data, tmp_path, monkeypatch,
                                                                              gc_freeze):
    freeze, frozen = gc.freeze, []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True) or freeze())
    gc.unfreeze()
    # 3 epochs of 2 steps: after step 1, at the starts of epochs 2 and 3
    train_checkpoint(tiny_params(tiny_data, tmp_path, num_iters=6, limit_nsamples=16, gc_freeze=gc_freeze))
    assert len(frozen) == (3 if gc_freeze == "true" else 0)
    assert gc.get_freeze_count() == 0  # close unfroze


DDP_STEPS = {"num_iters": 5, "global_batch_size": 8}


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    """The one-process run both DDP cases compare with (the same ``DDP_STEPS``: trained once)."""
    return train_checkpoint(tiny_params(tiny_data, tmp_path_factory.mktemp("single"), **DDP_STEPS))


@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_two_ranks_matches_single_process(tiny_data, tmp_path, single, accum):
    run_distributed(train_on_ranks, 2, str(tiny_data), str(tmp_path / "ddp"), {**DDP_STEPS, "grad_accum_steps": accum})
    ddp = torch.load(tmp_path / "ddp" / "tiny" / "2CPU" / "00" / "checkpoints" / "model.pt")["model"]
    assert_state_close(single, ddp, atol=1e-5)


def test_compiled_model_and_loss_train_like_eager(tiny_data, tmp_path, monkeypatch):
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config.triton, "enable_pdl", False)
    eager = train_checkpoint(tiny_params(tiny_data, tmp_path / "eager", num_iters=4))
    compiled = train_checkpoint(tiny_params(tiny_data, tmp_path / "jit", num_iters=4, enable_jit="true",
                                            compile_pdl="true"))
    assert inductor_config.triton.enable_pdl is True  # --compile_pdl reached Inductor (a no-op on CPU)
    assert_state_close(eager, compiled, atol=1e-5)


def _nan_report_on_ranks(rank: int, world_size: int, data_path: str, expdir: str) -> None:
    from utils.core.errors import NonFiniteError
    try:
        train_on_ranks(rank, world_size, data_path, expdir, {"num_iters": 40, "global_batch_size": 8})
    except NonFiniteError as exc:
        (Path(expdir) / f"rank{rank}.txt").write_text(str(exc))


def test_nan_in_data_stops_every_rank_at_the_same_step(tiny_data, tmp_path):
    bad = _copy_data(tiny_data, tmp_path / "nan")
    name = sorted((bad / "train").glob("*.h5"))[1].name
    with h5py.File(bad / "train" / name, "r+") as f:
        f["fields"][3, 0, 5, 5] = np.nan
    run_distributed(_nan_report_on_ranks, 2, str(bad), str(tmp_path))
    reports = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    steps = {r.split(" at step ")[1].split(":")[0] for r in reports}
    assert len(steps) == 1 and all("NaN/Inf in the training data" in r for r in reports), reports
    assert sum(f"train/{name} time" in r for r in reports) >= 1, reports


def _copy_data(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst
