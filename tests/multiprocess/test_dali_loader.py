"""The DALI loader (utils/data/dali.py) gives exactly the native loader's batches, on CPU-only pipelines.

DALI worker processes are slow to spawn, so each test builds few pipelines and reuses them over
several epochs.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("nvidia.dali")

from utils.config.loading import load_config  # noqa: E402
from utils.data.loaders import build_data  # noqa: E402
from utils.data.dali import DRAIN_LIMIT  # noqa: E402
from utils.core.errors import UserError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
BATCH = 8  # the tiny_data set has 94 train / 47 valid samples: neither splits into whole batches


def make_data(path, loader: str, dp_rank: int = 0, dp_size: int = 1, valid_target_steps: int = 1, **overrides):
    ov = {"data_path": str(path), "data_loader_config": loader,
          "num_data_workers": "2" if loader == "dali" else "0"}
    ov.update({k: str(v) for k, v in overrides.items()})
    cfg = load_config(REPO / "config" / "ViT.yaml", "tiny", ov)
    return build_data(cfg.data, BATCH, dp_rank, dp_size, CPU, seed=cfg.optim.seed,
                      valid_target_steps=valid_target_steps)


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
        assert inp.shape == n_inp.shape and inp.ndim == 4 and tar.shape == n_tar.shape and tar.ndim == 5
        for name, a, b in (("input", inp, n_inp), ("target", tar, n_tar)):
            assert a.dtype == torch.float32 and a.device == CPU
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what} batch {i} {name}: {m}")


@pytest.fixture(scope="module")
def loaders(tiny_data):
    """``get(dp_size, dp_rank, **overrides)`` -> (DALI Data, native Data), built once per module."""
    made = {}

    def get(dp_size: int = 1, dp_rank: int = 0, **overrides):
        key = (dp_size, dp_rank, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = (make_data(tiny_data, "dali", dp_rank, dp_size, **overrides),
                         make_data(tiny_data, "pytorch", dp_rank, dp_size, **overrides))
        return made[key]

    get.made = made
    get.other_children = set(multiprocessing.active_children())  # not DALI's: other tests' workers
    yield get
    for dali, _ in made.values():
        dali.train.close(), dali.valid.close()


# the last case: a validation shard (6 samples) smaller than one batch, and no worker asked for
@pytest.mark.parametrize("dp_size,dp_rank,overrides", [
    pytest.param(1, 0, {}, id="dp1"),
    pytest.param(2, 0, {}, id="dp2-rank0"),
    pytest.param(2, 1, {"limit_nsamples_val": 13, "num_data_workers": 0}, id="dp2-rank1-small-valid-0-workers")])
def test_dali_batches_equal_native_batches(loaders, dp_size, dp_rank, overrides):
    dali, native = loaders(dp_size, dp_rank, **overrides)
    for split in ("train", "valid"):
        assert len(getattr(dali, split)) == len(getattr(native, split)) > 0
    n_train, n_valid = len(dali.train_dataset), len(dali.valid.dataset)
    # the last-batch policy matters: samples per rank do not fill whole batches
    assert (n_train // dp_size) % BATCH and (n_valid // dp_size) % BATCH

    seen, pipes = [], []
    for epoch in (0, 1):
        got = epoch_batches(dali.train, epoch)
        assert_same(got, epoch_batches(native.train, epoch), f"train epoch {epoch}")
        assert all(len(idx) == BATCH for _, _, idx in got)  # incomplete last batch dropped
        seen.append(torch.cat([idx for _, _, idx in got]))
        pipes.append(dali.train._pipe)
    assert not torch.equal(seen[0], seen[1]), "the order must change between epochs"
    assert pipes[0] is pipes[1], "consecutive epochs must run on in one pipeline"

    got = epoch_batches(dali.valid)
    assert_same(got, epoch_batches(native.valid), "valid")
    assert len(got[-1][2]) == (n_valid // dp_size) % BATCH  # incomplete last batch kept
    assert torch.equal(torch.cat([idx for _, _, idx in got]),
                       torch.arange(n_valid)[dp_rank:n_valid - n_valid % dp_size:dp_size])
    pipe = dali.valid._pipe
    assert_same(epoch_batches(dali.valid), epoch_batches(native.valid), "valid, second pass")
    assert dali.valid._pipe is pipe, "validation passes must run on in one pipeline"


def test_abandoned_and_skipped_epochs(loaders):
    """Epochs left early (gradient accumulation, a break) and non-consecutive epochs (resume)."""
    dali, native = loaders()
    train, n = dali.train, len(dali.train)
    assert n > DRAIN_LIMIT + 2

    # epoch 2 stopped one batch short: the rest is drained and the pipeline reused for epoch 3
    assert_same(epoch_batches(train, 2, limit=n - 1), epoch_batches(native.train, 2, limit=n - 1), "epoch 2")
    pipe = weakref.ref(train._pipe)
    assert_same(epoch_batches(train, 3), epoch_batches(native.train, 3), "epoch 3 after a short epoch 2")
    # the trainer's pattern: every batch taken with next(), the iterator never exhausted
    train.set_epoch(4)
    it = iter(train)
    assert_same([next(it) for _ in range(n)], epoch_batches(native.train, 4), "epoch 4")
    assert_same(epoch_batches(train, 5, limit=2), epoch_batches(native.train, 5, limit=2), "epoch 5")
    assert train._pipe is pipe(), "a pipeline at the right epoch must be reused"

    # most of epoch 5 left, then a jump to epoch 8 (resuming from a checkpoint): a new pipeline
    assert_same(epoch_batches(train, 8), epoch_batches(native.train, 8), "epoch 8 after a jump")
    assert pipe() is None, "the replaced pipeline must be released"

    # a superseded iterator refuses to go on instead of giving batches of another epoch
    train.set_epoch(9)
    old = iter(train)
    for _ in range(n - 1):
        next(old)
    train.set_epoch(10)
    new = iter(train)
    with pytest.raises(RuntimeError, match="superseded"):
        next(old)
    assert_same([next(new)], epoch_batches(native.train, 10, limit=1), "epoch 10")


def test_start_batch_resumes_mid_epoch(loaders):
    """``set_epoch(epoch, start_batch)`` (exact resume): a pipeline whose first epoch starts at that batch."""
    dali, native = loaders()
    train, n = dali.train, len(dali.train)
    k = n // 2
    full = {e: epoch_batches(native.train, e) for e in (6, 7, 8)}

    train.set_epoch(6, k)
    assert len(train) == n
    assert_same(epoch_batches(train), full[6][k:], f"epoch 6 from batch {k}")
    pipe = weakref.ref(train._pipe)
    # the pipeline goes on with whole epochs
    assert_same(epoch_batches(train, 7), full[7], "epoch 7 after a resumed epoch 6")
    assert train._pipe is pipe()
    # a pipeline at the right epoch cannot jump ahead: it is replaced
    train.set_epoch(8, n - 1)
    assert_same(epoch_batches(train), full[8][n - 1:], "epoch 8 from its last batch")
    assert pipe() is None

    # the short last batch of validation, trimmed as in a full pass
    valid = epoch_batches(native.valid)
    dali.valid.set_epoch(0, len(valid) - 2)
    assert_same(epoch_batches(dali.valid), valid[-2:], "valid from its last but one batch")
    assert_same(epoch_batches(dali.valid), valid, "valid, whole again")

    train.set_epoch(9, n)
    assert epoch_batches(train) == []
    for bad in (-1, n + 1):
        with pytest.raises(ValueError, match=rf"start_batch must be in \[0, {n}\]"):
            train.set_epoch(9, bad)


def test_several_target_steps_equal_native_batches(tiny_data):
    """Validation samples with 3 targets: ``(B, 3, C, H, W)`` targets, as the native loader's."""
    dali = make_data(tiny_data, "dali", num_data_workers=1, valid_target_steps=3)
    native = make_data(tiny_data, "pytorch", valid_target_steps=3)
    try:
        got = epoch_batches(dali.valid)
        assert got[0][1].shape == (BATCH, 3, 4, 32, 64)
        assert len(dali.valid.dataset) == 47 - 2  # 48 time steps, 3 targets each
        assert_same(got, epoch_batches(native.valid), "valid, 3 targets")
        assert not torch.equal(got[0][1][:, 0], got[0][1][:, 1])  # distinct lead times
    finally:
        dali.valid.close()


def test_close_ends_the_worker_processes(loaders):
    dali, _ = loaders()
    next(iter(dali.valid))  # a pipeline with running workers, if none was left by the tests above
    assert set(multiprocessing.active_children()) - loaders.other_children
    for dali, _ in loaders.made.values():
        dali.train.close(), dali.valid.close()
    left = set(multiprocessing.active_children()) - loaders.other_children
    assert not left, f"DALI worker processes left after close(): {left}"


def test_missing_dali_is_a_user_error(tiny_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` fail
    with pytest.raises(UserError, match=r"pip install '\.\[dali\]'"):
        make_data(tiny_data, "dali")


def test_unreadable_sample_is_a_one_line_error(tmp_path):
    """DALI re-raises a worker's exception with the worker's traceback as its message, so read
    errors travel as data and come out as a one-line UserError naming file and time."""
    from utils.preprocess.synthetic_dataset import make_synthetic_dataset
    root = make_synthetic_dataset(tmp_path / "data", train_years=1, valid_years=1, steps_per_year=BATCH + 1)
    data = make_data(root, "dali", num_data_workers=1)
    path = root / "valid" / "2001.h5"
    os.truncate(path, path.stat().st_size // 2)  # after build_data, which rejects a file HDF5 cannot open
    with pytest.raises(UserError, match=rf"^cannot read time 0 of {re.escape(str(path))} [^\n]*\Z"):  # one line
        next(iter(data.valid))
    assert data.valid._pipe is None, "the pipeline (and its workers) must be closed"


def test_forcings_of_dali_batches_equal_the_native_loaders(tiny_data):
    """The forcings come from each batch's sample indices: DALI's, indices equal, give the native loader's fields."""
    forcings = "[cos_solar_zenith_angle,sin_local_time,cos_julian_day]"
    dali = make_data(tiny_data, "dali", num_data_workers=1, valid_target_steps=2, forcings=forcings)
    native = make_data(tiny_data, "pytorch", valid_target_steps=2, forcings=forcings)
    try:
        for (_, _, idx), (_, _, n_idx) in zip(epoch_batches(dali.valid, limit=2), epoch_batches(native.valid, limit=2)):
            for step in (0, 1):
                got = dali.valid_forcings(idx, step)
                assert got.shape == (len(idx), 3, 32, 64)
                assert torch.equal(got, native.valid_forcings(n_idx, step))
    finally:
        dali.valid.close()
