"""The DALI loader (utils/dali_loader.py) gives exactly the native loader's batches, on CPU-only pipelines.

DALI worker processes are slow to spawn, so each test builds few pipelines and reuses them over
several epochs.
"""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("nvidia.dali")

from utils.config import load_params  # noqa: E402
from utils.data_loader import build_data  # noqa: E402
from utils.errors import UserError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
BATCH = 8  # the tiny_data set has 94 train / 47 valid samples: neither splits into whole batches


def make_data(path, loader: str, dp_rank: int = 0, dp_size: int = 1, **overrides):
    ov = {"data_path": str(path), "data_loader_config": loader,
          "num_data_workers": "2" if loader == "dali" else "0"}
    ov.update({k: str(v) for k, v in overrides.items()})
    params = load_params(REPO / "config" / "ViT.yaml", "tiny", ov)
    return build_data(params, BATCH, dp_rank, dp_size, CPU)


def epoch_batches(batches, epoch: int | None = None, limit: int | None = None) -> list:
    if epoch is not None:
        batches.set_epoch(epoch)
    out = []
    for batch in batches:
        out.append(batch)
        if limit is not None and len(out) == limit:
            break
    return out


def assert_same(dali: list, native: list, what: str) -> None:
    assert len(dali) == len(native), f"{what}: {len(dali)} DALI batches, {len(native)} native"
    for i, ((inp, tar, idx), (n_inp, n_tar, n_idx)) in enumerate(zip(dali, native)):
        assert idx.dtype == torch.int64 and idx.device == CPU
        assert torch.equal(idx, torch.as_tensor(n_idx)), f"{what} batch {i}: indices {idx} vs {n_idx}"
        for name, a, b in (("input", inp, n_inp), ("target", tar, n_tar)):
            assert a.dtype == torch.float32 and a.device == CPU
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what} batch {i} {name}: {m}")


def dali_workers() -> list:
    return [p for p in multiprocessing.active_children() if p.is_alive()]


@pytest.mark.parametrize("dp_size,dp_rank", [(1, 0), (2, 0), (2, 1)])
def test_dali_batches_equal_native_batches(tiny_data, dp_size, dp_rank):
    dali = make_data(tiny_data, "dali", dp_rank, dp_size)
    native = make_data(tiny_data, "pytorch", dp_rank, dp_size)
    for split in ("train", "valid"):
        assert len(getattr(dali, split)) == len(getattr(native, split)) > 0
    n_train, n_valid = len(dali.train_dataset), len(native.valid.loader.dataset)
    # the last-batch policy matters: samples per rank do not fill whole batches
    assert (n_train // dp_size) % BATCH and (n_valid // dp_size) % BATCH

    seen = []
    for epoch in (0, 1):
        got = epoch_batches(dali.train, epoch)
        assert_same(got, epoch_batches(native.train, epoch), f"train epoch {epoch}")
        assert all(len(idx) == BATCH for _, _, idx in got)  # incomplete last batch dropped
        seen.append(torch.cat([idx for _, _, idx in got]))
    assert not torch.equal(seen[0], seen[1]), "the order must change between epochs"

    got = epoch_batches(dali.valid)
    assert_same(got, epoch_batches(native.valid), "valid")
    assert len(got[-1][2]) == (n_valid // dp_size) % BATCH  # incomplete last batch kept
    assert torch.equal(torch.cat([idx for _, _, idx in got]),
                       torch.arange(n_valid)[dp_rank:n_valid - n_valid % dp_size:dp_size])
    assert_same(epoch_batches(dali.valid), epoch_batches(native.valid), "valid, second pass")

    dali.train.close(), dali.valid.close()
    assert not dali_workers(), "DALI worker processes left after close()"


def test_abandoned_and_skipped_epochs(tiny_data):
    """Epochs left early (gradient accumulation, a break) and non-consecutive epochs (resume)."""
    dali = make_data(tiny_data, "dali")
    native = make_data(tiny_data, "pytorch")
    n = len(dali.train)
    assert n > 4

    # epoch 0 stopped one batch short: the rest is drained and the pipeline reused for epoch 1
    assert_same(epoch_batches(dali.train, 0, limit=n - 1), epoch_batches(native.train, 0, limit=n - 1), "epoch 0")
    pipe = dali.train._pipe
    assert_same(epoch_batches(dali.train, 1), epoch_batches(native.train, 1), "epoch 1 after a short epoch 0")
    assert dali.train._pipe is pipe

    # the trainer's pattern: the next iter() comes before the finished iterator is exhausted
    it = iter(dali.train)  # epoch 1 again: rebuilt, since the pipeline has moved on to epoch 2
    got = [next(it) for _ in range(n)]
    assert_same(got, epoch_batches(native.train, 1), "epoch 1 again")

    # most of epoch 2 left, then a jump to epoch 5 (resuming from a checkpoint)
    assert_same(epoch_batches(dali.train, 2, limit=2), epoch_batches(native.train, 2, limit=2), "epoch 2")
    assert_same(epoch_batches(dali.train, 5), epoch_batches(native.train, 5), "epoch 5 after a jump")

    # a superseded iterator refuses to go on instead of giving batches of another epoch
    old = iter(dali.train)
    next(old)
    new = iter(dali.train)
    with pytest.raises(RuntimeError, match="superseded"):
        next(old)
    del new
    dali.train.close()
    assert not dali_workers()


def test_valid_shard_smaller_than_a_batch(tiny_data):
    dali = make_data(tiny_data, "dali", limit_nsamples_val=5)
    native = make_data(tiny_data, "pytorch", limit_nsamples_val=5)
    got = epoch_batches(dali.valid)
    assert len(dali.valid) == 1 and len(got[0][2]) == 5
    assert_same(got, epoch_batches(native.valid), "valid of 5 samples")
    dali.valid.close()


def test_missing_dali_is_a_user_error(tiny_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` fail
    with pytest.raises(UserError, match=r"pip install '\.\[dali\]'"):
        make_data(tiny_data, "dali")
