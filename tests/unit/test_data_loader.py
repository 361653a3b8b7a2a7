"""Tests of the data loaders (utils/data/loaders.py, native.py) on small HDF5 files whose values encode where they came from."""

from __future__ import annotations

import io
import multiprocessing
import os
import re
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from utils.config.loading import load_config
from utils.data import dataset
from utils.data.dataset import ERA5Dataset
from utils.data.loaders import Data, build_data, split_batches
from utils.data.native import NumberedBatches
from utils.data.metadata import equiangular_latitudes, read_metadata
from utils.data.stats import Stats
from utils.data.synthetic_loader import SyntheticBatches
from utils.core.errors import UserError

REPO = Path(__file__).resolve().parents[2]
C = 4  # channels of the `tiny` config
IMG = (32, 64)  # img_size of the `tiny` config
GRID = (34, 67)  # stored grid, larger than IMG so that cropping matters
TRAIN_LENGTHS = (5, 3)  # time steps of train/2000.h5 and train/2001.h5
VALID_LENGTHS = (4,)
CPU = torch.device("cpu")


def encode(file_no: int, t: int, shape=(C, *GRID)) -> np.ndarray:
    """fields[t] of file ``file_no``: every (file, t, c, h, w) has its own exactly-representable value."""
    c, h, w = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
    value = (((file_no * 10 + t) * shape[0] + c) * shape[1] + h) * shape[2] + w
    assert value.max() < 2 ** 24  # exact in float32
    return value.astype(np.float32)


def write_file(path: Path, file_no: int, n_times: int, grid=GRID, channels=C, lat=True):
    fields = np.stack([encode(file_no, t, (channels, *grid)) for t in range(n_times)])
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("fields", data=fields)
        ds.attrs["channel_names"] = [f"var{i}" for i in range(channels)]
        if lat:
            f.create_dataset("latitude", data=np.linspace(89.0, -89.0, grid[0]))
    return fields


def write_stats(root: Path, rng=None):
    rng = rng or np.random.default_rng(0)
    stats = root / "stats"
    stats.mkdir(parents=True, exist_ok=True)
    mean = rng.uniform(1e4, 1e5, (1, C, 1, 1)).astype(np.float32)
    std = rng.uniform(1e3, 1e4, (1, C, 1, 1)).astype(np.float32)
    clim = rng.uniform(0, 1e5, (1, C, *GRID)).astype(np.float32)
    np.save(stats / "global_means.npy", mean)
    np.save(stats / "global_stds.npy", std)
    np.save(stats / "time_means.npy", clim)
    return mean, std, clim


def make_layout(root: Path, train_lengths=TRAIN_LENGTHS, valid_lengths=VALID_LENGTHS):
    """Write a complete data folder; returns {split: [fields per file]} and the stats."""
    files = {}
    for split, lengths, first in (("train", train_lengths, 0), ("valid", valid_lengths, 5)):
        files[split] = [write_file(root / split / f"{2000 + first + i}.h5", first + i, n)
                        for i, n in enumerate(lengths)]
    return files, write_stats(root)


def corrupt_chunk(path: Path, t: int) -> None:
    """Rewrite ``fields`` of ``path`` with checksummed chunks, then damage the chunk of time step
    ``t``: the file still opens and inspects fine, but reading step ``t`` raises OSError."""
    with h5py.File(path, "r+") as f:
        fields = f["fields"][:]
        del f["fields"]
        ds = f.create_dataset("fields", data=fields, chunks=(1, *fields.shape[1:]), fletcher32=True)
        offset = ds.id.get_chunk_info_by_coord((t, 0, 0, 0)).byte_offset
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 16)


def expected_pairs(fields_list, dt):
    """Reference list of (file number, t) for each global sample index."""
    return [(f, t) for f, fields in enumerate(fields_list) for t in range(fields.shape[0] - dt)]


def crop(a):
    return a[..., :IMG[0], :IMG[1]]


def build(root: Path, batch_size: int = 1, dp_rank: int = 0, dp_size: int = 1, valid_target_steps: int = 1,
          **overrides) -> Data:
    """``build_data`` for the `tiny` config on ``root`` with config ``overrides`` (as on the command line)."""
    ov = {"data_path": str(root), "num_data_workers": "0"}
    ov.update({k: str(v) for k, v in overrides.items()})
    cfg = load_config(REPO / "config" / "ViT.yaml", "tiny", ov)
    return build_data(cfg.data, batch_size, dp_rank, dp_size, CPU, seed=cfg.optim.seed,
                      valid_target_steps=valid_target_steps)


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    root = tmp_path_factory.mktemp("era5")
    files, stats = make_layout(root)
    return root, files, stats


# ---------------------------------------------------------------- ERA5Dataset
@pytest.mark.parametrize("dt", [1, 2])
def test_dataset_returns_the_right_pairs(layout, dt):
    root, files, _ = layout
    ds = ERA5Dataset(root / "train", C, IMG, dt)
    pairs = expected_pairs(files["train"], dt)
    assert len(pairs) == sum(n - dt for n in TRAIN_LENGTHS)
    assert len(ds) == len(pairs)
    for index, (f, t) in enumerate(pairs):
        inp, tar, idx = ds[index]
        assert idx == index
        assert inp.dtype == tar.dtype == torch.float32 and inp.shape == (C, *IMG) and tar.shape == (1, C, *IMG)
        np.testing.assert_array_equal(inp.numpy(), crop(files["train"][f][t]))
        np.testing.assert_array_equal(tar[0].numpy(), crop(files["train"][f][t + dt]))
        assert ds.locate(index) == (f, t)
    with pytest.raises(IndexError):
        ds[len(pairs)]
    with pytest.raises(IndexError):
        ds.locate(-1)


def test_dataset_limit_nsamples(layout):
    root, files, _ = layout
    ds = ERA5Dataset(root / "train", C, IMG, 1, limit_nsamples=3)
    assert len(ds) == 3
    np.testing.assert_array_equal(ds[2][1][0].numpy(), crop(files["train"][0][3]))
    with pytest.raises(IndexError):
        ds[3]
    # a limit above the number of samples changes nothing
    assert len(ERA5Dataset(root / "train", C, IMG, 1, limit_nsamples=100)) == 6
    assert len(ERA5Dataset(root / "train", C, IMG, 1, limit_nsamples=None)) == 6


def test_dataset_describe(layout):
    root, _, _ = layout
    ds = ERA5Dataset(root / "train", C, IMG, 1)
    assert ds.describe(0) == "train/2000.h5 time 0 -> 1"
    assert ds.describe(3) == "train/2000.h5 time 3 -> 4"
    assert ds.describe(4) == "train/2001.h5 time 0 -> 1"
    assert ds.describe(5) == "train/2001.h5 time 1 -> 2"
    ds2 = ERA5Dataset(root / "train", C, IMG, 2)
    assert ds2.describe(3) == "train/2001.h5 time 0 -> 2"


# ---------------------------------------------------------------- build_data
def test_build_data_valid_batches_are_normalized_pairs(layout):
    root, files, (mean, std, clim) = layout
    data = build(root, 2)
    assert data.channel_names == [f"var{i}" for i in range(C)]
    np.testing.assert_allclose(data.latitude, np.linspace(89.0, -89.0, GRID[0])[:IMG[0]])
    np.testing.assert_array_equal(data.stats.mean.numpy(), mean)
    np.testing.assert_array_equal(data.stats.std.numpy(), std)
    np.testing.assert_allclose(data.stats.clim.numpy(), (crop(clim) - mean) / std, rtol=1e-5, atol=1e-5)
    assert data.train_samples == 6 and data.train_dataset is not None and data.valid_dataset is not None

    pairs = expected_pairs(files["valid"], 1)
    seen = []
    for inp, tar, idx in data.valid:
        assert inp.shape[1:] == (C, *IMG) and inp.dtype == torch.float32 and tar.shape[1:] == (1, C, *IMG)
        for k, i in enumerate(idx.tolist()):
            f, t = pairs[i]
            fields = files["valid"][f]
            np.testing.assert_allclose(inp[k].numpy(), (crop(fields[t]) - mean[0]) / std[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(tar[k, 0].numpy(), (crop(fields[t + 1]) - mean[0]) / std[0], rtol=1e-5,
                                       atol=1e-6)
            seen.append(i)
    assert seen == list(range(len(pairs)))  # validation: in order, every sample, last partial batch kept


def test_build_data_train_batches_are_normalized_pairs(layout):
    root, files, (mean, std, _) = layout
    data = build(root, 2, dt=2)
    pairs = expected_pairs(files["train"], 2)
    n = 0
    for inp, tar, idx in data.train:
        assert inp.shape == (2, C, *IMG) and tar.shape == (2, 1, C, *IMG)  # drop_last: full batches only
        for k, i in enumerate(idx.tolist()):
            f, t = pairs[i]
            fields = files["train"][f]
            np.testing.assert_allclose(inp[k].numpy(), (crop(fields[t]) - mean[0]) / std[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(tar[k, 0].numpy(), (crop(fields[t + 2]) - mean[0]) / std[0], rtol=1e-5,
                                       atol=1e-6)
            n += 1
    assert n == 4 == data.train_samples


def epoch_indices(batches, epoch):
    batches.set_epoch(epoch)
    return [i for _, _, idx in batches for i in idx.tolist()]


@pytest.mark.parametrize("batch_size,per_rank", [(1, 3), (2, 2)])
def test_train_shards_are_disjoint_across_ranks(layout, batch_size, per_rank):
    root, _, _ = layout
    shards = []
    for rank in range(2):
        data = build(root, batch_size, rank, 2)
        assert len(data.train) == 3 // batch_size
        shards.append(epoch_indices(data.train, 0))
        assert data.train_samples == (6 // 2 // batch_size) * batch_size * 2
    a, b = shards
    assert len(a) == len(b) == per_rank
    assert not set(a) & set(b)
    if batch_size == 1:
        assert sorted(a + b) == list(range(6))  # every sample covered once per epoch
    # validation is sharded as well: disjoint, equal shares (the sampler drops the odd sample out)
    v = [epoch_indices(build(root, 1, r, 2).valid, 0) for r in range(2)]
    assert not set(v[0]) & set(v[1])
    assert len(v[0]) == len(v[1]) == 1 and set(v[0] + v[1]) <= {0, 1, 2}


def test_set_epoch_changes_the_order(layout):
    root, _, _ = layout
    data = build(root)
    orders = [epoch_indices(data.train, e) for e in range(4)]
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert len({tuple(o) for o in orders}) > 1
    assert epoch_indices(data.train, 2) == orders[2]  # same epoch, same order
    # same seed in a fresh build: same order; a different seed: a different one (for some epoch)
    again = build(root)
    assert epoch_indices(again.train, 3) == orders[3]
    other = build(root, seed=123)
    assert [epoch_indices(other.train, e) for e in range(4)] != orders


def test_workers_give_the_same_batches(layout):
    root, _, _ = layout
    got = {}
    for workers in (0, 2):
        data = build(root, 2, num_data_workers=workers)
        data.train.set_epoch(1)
        got[workers] = [(i.clone(), t.clone(), idx.clone()) for i, t, idx in data.train]
        del data
    assert len(got[0]) == len(got[2]) == 3
    for (i0, t0, x0), (i2, t2, x2) in zip(got[0], got[2]):
        assert torch.equal(x0, x2)
        assert torch.equal(i0, i2) and torch.equal(t0, t2)


def take(batches) -> list:
    """One iteration of ``batches`` as copies ``(inp, tar, idx)``."""
    return [(inp.clone(), tar.clone(), idx.clone()) for inp, tar, idx in batches]


def assert_batches_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for b, ((inp, tar, idx), (w_inp, w_tar, w_idx)) in enumerate(zip(got, want)):
        assert torch.equal(idx, w_idx), f"batch {b}: indices {idx} vs {w_idx}"
        assert torch.equal(inp, w_inp) and torch.equal(tar, w_tar), f"batch {b}"


def assert_resumes_mid_epoch(batches, epoch: int, start: int) -> None:
    """``set_epoch(epoch, start)`` yields the tail of the full epoch from batch ``start``, for one
    iteration only; ``epoch + 1`` then comes whole; a start outside ``[0, len]`` is refused."""
    n = len(batches)
    assert 0 < start < n
    full = {}
    for e in (epoch, epoch + 1):
        batches.set_epoch(e)
        full[e] = take(batches)
    batches.set_epoch(epoch, start)
    assert len(batches) == n  # still the full epoch's length
    assert_batches_equal(take(batches), full[epoch][start:])
    assert_batches_equal(take(batches), full[epoch])  # the next iteration starts at 0 again
    batches.set_epoch(epoch + 1)
    assert_batches_equal(take(batches), full[epoch + 1])
    batches.set_epoch(epoch, n)
    assert take(batches) == []
    for bad in (-1, n + 1):
        with pytest.raises(ValueError, match=rf"start_batch must be in \[0, {n}\]"):
            batches.set_epoch(epoch, bad)


@pytest.fixture(scope="module")
def long_layout(tmp_path_factory):
    """15 training samples: with batch size 1, more batches than a loader with 2 workers has slots."""
    root = tmp_path_factory.mktemp("era5_long")
    make_layout(root, train_lengths=(9, 8))
    return root


@pytest.mark.parametrize("workers", [0, 2])
def test_start_batch_yields_the_rest_of_the_epoch(long_layout, workers):
    data = build(long_layout, 1, num_data_workers=workers)
    train = data.train
    assert len(train) == 15 > 2 * workers + 2  # slot numbers wrap around
    # an epoch left early (workers still busy with its batches) before the resumed one
    train.set_epoch(0)
    it = iter(train)
    next(it), next(it)
    assert_resumes_mid_epoch(train, 3, 7)


@pytest.fixture
def handed_out(monkeypatch) -> list[list[int]]:
    """The sample indices of every batch the loaders hand to their workers, in order (the DataLoader takes
    them from ``NumberedBatches`` in this process)."""
    log = []
    items = NumberedBatches._items

    def logged(self, epoch, start):
        for item in items(self, epoch, start):
            log.append(item[2])
            yield item

    monkeypatch.setattr(NumberedBatches, "_items", logged)
    return log


def epoch_orders(root: Path, epochs) -> dict[int, list]:
    """Each epoch's batches, each epoch read by a fresh loader without workers: the reference."""
    return {e: take_epoch(build(root, 1).train, e) for e in epochs}


def take_epoch(batches, epoch: int, start: int = 0, limit: int | None = None) -> list:
    """The trainer's pattern: ``set_epoch``, then ``next`` for each batch, never exhausting the iterator."""
    batches.set_epoch(epoch, start)
    it = iter(batches)
    return [tuple(t.clone() for t in next(it)) for _ in range((limit or len(batches)) - start)]


def test_workers_read_the_next_epoch_while_this_one_ends(long_layout, handed_out):
    """Consecutive epochs come from one running DataLoader iteration: its workers got the next epoch's first
    batches before that epoch was asked for, and the batches equal those of separate iterations."""
    want = epoch_orders(long_layout, range(3))
    handed_out.clear()
    train = build(long_layout, 1, num_data_workers=2).train
    n, in_flight = len(train), 4  # 2 workers x prefetch 2
    got = take_epoch(train, 0)
    stream = train.stream
    assert [indices for indices in handed_out[n:]] == [[i.item() for i in b[2]] for b in want[1][:in_flight]]
    for e in (1, 2):
        assert_batches_equal(got, want[e - 1])
        got = take_epoch(train, e)
    assert_batches_equal(got, want[2])
    assert train.stream is stream and len(handed_out) == 3 * n + in_flight


def test_resumed_and_abandoned_epochs_run_on_exactly(long_layout):
    """A resumed epoch runs on into the next; an epoch left a few batches short (gradient accumulation) too, its
    rest dropped; one left early, or a jump, restarts the workers; a superseded iterator refuses to go on."""
    want = epoch_orders(long_layout, range(3, 8))
    train = build(long_layout, 1, num_data_workers=2).train
    n = len(train)
    assert_batches_equal(take_epoch(train, 3, start=7), want[3][7:])
    stream = train.stream
    assert_batches_equal(take_epoch(train, 4, limit=n - 3), want[4][:n - 3])  # 3 batches unused
    assert_batches_equal(take_epoch(train, 5), want[5])
    assert train.stream is stream  # resumed, then run on past the unused batches
    assert_batches_equal(take_epoch(train, 6, limit=2), want[6][:2])
    assert_batches_equal(take_epoch(train, 7), want[7])
    assert train.stream is not stream  # 13 batches left: restarted at epoch 7
    train.set_epoch(3, n - 3)
    old = iter(train)
    assert_batches_equal([tuple(t.clone() for t in next(old))], want[3][n - 3:n - 2])
    train.set_epoch(4)
    new = iter(train)
    with pytest.raises(RuntimeError, match="superseded"):
        next(old)
    assert_batches_equal([tuple(t.clone() for t in next(new))], want[4][:1])


def test_a_read_error_of_the_next_epoch_waits_for_its_batch(tmp_path):
    """The workers read the next epoch's first batches while this epoch ends: a sample they cannot read fails
    only the epoch that uses it, with one line naming file and time."""
    make_layout(tmp_path, train_lengths=(9, 8))
    train = build(tmp_path, 1, num_data_workers=2).train
    ds, n = train.filler.dataset, len(train)
    # the last sample of a file is the only one to read the file's last time step (as its target): find
    # epochs e, e + 1 where it comes early in e + 1 (read ahead) and before the last two batches of e
    found = [(e, s, order.index([s]), following.index([s])) for e in range(40) for s in (7, 14)
             for order, following in [(train.batches.epoch_batches(e), train.batches.epoch_batches(e + 1))]
             if following.index([s]) < 4 and order.index([s]) < n - 2]
    epoch, sample, position, position_next = found[0]
    file_no, t = ds.locate(sample)
    corrupt_chunk(ds.files[file_no].path, t + 1)
    assert len(take_epoch(train, epoch, position + 1)) == n - position - 1  # the bad batch read meanwhile
    path = re.escape(str(ds.files[file_no].path))
    train.set_epoch(epoch + 1)
    it = iter(train)
    for _ in range(position_next):
        next(it)
    with pytest.raises(UserError, match=rf"^cannot read time {t + 1} of {path} [^\n]*\Z"):
        next(it)


@pytest.fixture
def reads(monkeypatch) -> list[tuple[int, int]]:
    """Every ``(file, time)`` that ``ERA5Dataset.read`` reads in this process, in order."""
    log = []
    read = ERA5Dataset.read

    def counted(self, file_no, t, out=None):
        log.append((file_no, t))
        return read(self, file_no, t, out)

    monkeypatch.setattr(ERA5Dataset, "read", counted)
    return log


def test_start_batch_does_not_read_skipped_samples(long_layout, reads):
    data = build(long_layout, 2)  # no workers: every read happens in this process
    data.train.set_epoch(2, 4)
    indices = [i for _, _, idx in data.train for i in idx.tolist()]
    assert len(indices) == (len(data.train) - 4) * 2 == 6
    ds = data.train_dataset
    assert reads == [(f, t + d) for f, t in map(ds.locate, indices) for d in (0, ds.dt)]


def test_synthetic_start_batch(tmp_path):
    data = build(tmp_path / "nothing_here", 4, data_loader_config="synthetic", limit_nsamples=64)
    assert_resumes_mid_epoch(data.train, 1, 5)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_synthetic_loader_shapes(tmp_path, dp_size):
    data = build(tmp_path / "nothing_here", 4, 0, dp_size, data_loader_config="synthetic", limit_nsamples=64)
    steps = 64 // (4 * dp_size)
    assert len(data.train) == steps
    batches = list(data.train)
    assert len(batches) == steps
    for inp, tar, idx in batches:
        assert inp.shape == (4, C, *IMG) and tar.shape == (4, 1, C, *IMG)
        assert inp.dtype == tar.dtype == torch.float32
        assert len(idx) == 4
    assert not torch.equal(batches[0][0], batches[0][1][:, 0])
    assert len(data.valid) == -(-128 // (4 * dp_size))  # limit_nsamples_val null -> 128
    assert data.train_samples == steps * 4 * dp_size
    assert data.channel_names == [f"c{i}" for i in range(C)]
    assert data.latitude.shape == (IMG[0],) and data.latitude[0] == 90.0 and data.latitude[-1] == -90.0
    assert data.stats.clim.shape == (1, C, *IMG)
    assert data.find_nonfinite([0, 1]) == data.find_nonfinite([0, 1], "valid") == []  # nothing to look up


# ---------------------------------------------------------------- bad input
def test_missing_data_path(tmp_path):
    with pytest.raises(UserError, match="does not exist") as exc:
        build(tmp_path / "missing")
    assert str(tmp_path / "missing") in str(exc.value) and "--data_path" in str(exc.value)


def test_empty_directory(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(UserError, match=r"no \.h5 files in") as exc:
        build(tmp_path)
    assert "train" in str(exc.value)


def test_file_without_fields(tmp_path):
    make_layout(tmp_path)
    with h5py.File(tmp_path / "train" / "2002.h5", "w") as f:
        f.create_dataset("temperature", data=np.zeros((3, C, *GRID), np.float32))
    with pytest.raises(UserError, match="has no 'fields' dataset") as exc:
        build(tmp_path)
    assert "2002.h5" in str(exc.value) and "temperature" in str(exc.value)


def test_file_that_is_not_hdf5(tmp_path):
    make_layout(tmp_path)
    (tmp_path / "train" / "2002.h5").write_text("not hdf5")
    with pytest.raises(UserError, match="cannot read .*2002.h5 as HDF5"):
        build(tmp_path)


def test_wrong_dtype(tmp_path):
    make_layout(tmp_path)
    with h5py.File(tmp_path / "train" / "2002.h5", "w") as f:
        f.create_dataset("fields", data=np.zeros((3, C, *GRID), np.float64))
    with pytest.raises(UserError, match="must be float32"):
        build(tmp_path)


def test_wrong_channel_count(tmp_path):
    make_layout(tmp_path)
    write_file(tmp_path / "valid" / "2005.h5", 5, 4, channels=3)
    with pytest.raises(UserError, match="has 3 channels but the config has n_in_channels=4") as exc:
        build(tmp_path)
    assert "--n_in_channels 3" in str(exc.value)


def test_img_size_larger_than_grid(tmp_path):
    make_layout(tmp_path)
    with pytest.raises(UserError, match="larger than the 34x67 grid") as exc:
        build(tmp_path, img_size="[64,64]")
    assert "--img_size [34,67]" in str(exc.value)


def test_too_few_time_steps_for_dt(tmp_path):
    make_layout(tmp_path)
    with pytest.raises(UserError, match="has 3 time steps, too few for dt=3") as exc:
        build(tmp_path, dt=3)
    assert "2001.h5" in str(exc.value) and "--dt" in str(exc.value)


def test_fewer_samples_than_one_batch(tmp_path):
    make_layout(tmp_path)
    with pytest.raises(UserError, match="fewer than one global batch"):
        build(tmp_path, 4, 0, 2)


@pytest.mark.parametrize("name", ["global_means", "global_stds", "time_means"])
def test_missing_stats_file(tmp_path, name):
    make_layout(tmp_path)
    (tmp_path / "stats" / f"{name}.npy").unlink()
    with pytest.raises(UserError, match=f"missing .*{name}.npy"):
        build(tmp_path)


@pytest.mark.parametrize("name,shape,pattern", [
    ("global_means", (C,), r"global_means.npy has shape \(4,\), expected \(1, 4, 1, 1\)"),
    ("global_stds", (1, C + 1, 1, 1), r"global_stds.npy has shape \(1, 5, 1, 1\)"),
    ("time_means", (1, C, 8, 8), r"time_means.npy has shape \(1, 4, 8, 8\), expected \(1, 4, >=32, >=64\)"),
    ("time_means", (C, *GRID), r"time_means.npy has shape"),
])
def test_wrong_stats_shape(tmp_path, name, shape, pattern):
    make_layout(tmp_path)
    np.save(tmp_path / "stats" / f"{name}.npy", np.ones(shape, np.float32))
    with pytest.raises(UserError, match=pattern):
        build(tmp_path)


@pytest.mark.parametrize("value,words", [(0.0, "a zero standard deviation"), (-1.0, "a negative standard deviation"),
                                         (1e-9, "a near-zero standard deviation")])
def test_zero_negative_and_near_zero_stds_are_named(tmp_path, value, words):
    make_layout(tmp_path)
    std = np.ones((1, C, 1, 1), np.float32)
    std[0, 2] = value
    np.save(tmp_path / "stats" / "global_stds.npy", std)
    with pytest.raises(UserError, match=f"global_stds.npy: channel 2 has {words}"):
        build(tmp_path)


def test_a_grid_larger_than_the_crop_is_named_once(tmp_path, caplog):
    make_layout(tmp_path)
    dataset._CROPS_WARNED.clear()  # other tests of this process may have warned about this grid already
    ERA5Dataset(tmp_path / "train", C, IMG, 1)
    ERA5Dataset(tmp_path / "valid", C, IMG, 1)
    warnings = [r.getMessage() for r in caplog.records if "training sees only its north-west corner" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"drops 2 rows and 3 columns; pass --img_size [{GRID[0]},{GRID[1]}]" in warnings[0]
    ERA5Dataset(tmp_path / "train", C, (GRID[0] - 1, GRID[1] - 1), 1)  # one row and column, as 721 -> 720
    assert len([r for r in caplog.records if "north-west" in r.getMessage()]) == 1


def npy_bytes(array: np.ndarray, **kwargs) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, **kwargs)
    return buf.getvalue()


def npz_bytes() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, global_means=np.ones((1, C, 1, 1), np.float32))
    return buf.getvalue()


@pytest.mark.parametrize("name,content,problem", [
    ("global_means", b"", "cannot read"),
    ("global_stds", npy_bytes(np.ones((1, C, 1, 1), np.float32))[:-4], "not fully written"),  # truncated
    ("time_means", b"mean values", "cannot read"),
    ("global_means", npz_bytes(), "magic string is not correct"),
    ("global_stds", npy_bytes(np.array([{}], object), allow_pickle=True), "Object arrays cannot be loaded"),
    ("global_means", npy_bytes(np.array(list("abcd")).reshape(1, C, 1, 1)), "holds <U1 values, not numbers"),
])
def test_unreadable_stats_file(tmp_path, name, content, problem):
    write_stats(tmp_path)
    path = tmp_path / "stats" / f"{name}.npy"
    path.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(str(path))) as exc:
        Stats.load(tmp_path / "stats", C, IMG, CPU)
    message = str(exc.value)
    assert problem in message and "recompute the statistics" in message and "\n" not in message


@pytest.mark.parametrize("name,bad", [("global_stds", np.nan), ("global_stds", np.inf), ("global_means", np.nan),
                                      ("time_means", -np.inf)])
def test_nonfinite_stats(tmp_path, name, bad):
    """Caught at start-up: a NaN std would otherwise show up as a diverging loss."""
    mean, std, clim = write_stats(tmp_path)
    arr = {"global_means": mean, "global_stds": std, "time_means": clim}[name]
    arr.flat[2] = bad
    np.save(tmp_path / "stats" / f"{name}.npy", arr)
    first = tuple(int(i) for i in np.unravel_index(2, arr.shape))
    with pytest.raises(UserError, match=re.escape(f"{name}.npy holds 1 NaN/Inf value(s), first at index {first}")):
        Stats.load(tmp_path / "stats", C, IMG, CPU)


# ---------------------------------------------------------------- metadata
def one_file(tmp_path: Path, **attrs) -> Path:
    """A field file without ``latitude``; ``attrs`` set on ``fields``."""
    path = tmp_path / "2000.h5"
    write_file(path, 0, 2, lat=False)
    with h5py.File(path, "r+") as f:
        f["fields"].attrs.update(attrs)
    return path


@pytest.mark.parametrize("names", ["abcd", [1, 2, 3, 4], ["x", "y"]])
def test_metadata_falls_back_to_generic_names(tmp_path, names):
    """Channel names only label logs: unusable ones give c0.. (a string of C letters is not C names)."""
    got, lat = read_metadata(one_file(tmp_path, channel_names=names), C, IMG[0])
    assert got == [f"c{i}" for i in range(C)]
    np.testing.assert_array_equal(lat, equiangular_latitudes(IMG[0]))  # no latitude dataset


@pytest.mark.parametrize("lat,problem", [
    (np.zeros((GRID[0], 2)), r"must be a 1-D numeric array of at least 32 values .* float64 of shape \(34, 2\)"),
    (np.linspace(80.0, -80.0, IMG[0] - 1), r"at least 32 values .* shape \(31,\)"),
    (np.array([b"N"] * GRID[0]), r"must be a 1-D numeric array"),
    (np.where(np.arange(GRID[0]) == 3, np.nan, np.linspace(89.0, -89.0, GRID[0])), r"holds 1 NaN/Inf value"),
    (np.linspace(0.0, 180.0, GRID[0]), r"runs from 0 to 180, outside \[-90, 90\] degrees"),
])
def test_bad_latitude(tmp_path, lat, problem):
    path = one_file(tmp_path)
    with h5py.File(path, "r+") as f:
        f["latitude"] = lat
    with pytest.raises(UserError, match=problem) as exc:
        read_metadata(path, C, IMG[0])
    assert str(exc.value).startswith(f"{path}: 'latitude'") and "re-create the file" in str(exc.value)


def test_metadata_of_unreadable_file(tmp_path):
    path = tmp_path / "2000.h5"
    path.write_text("not HDF5")
    with pytest.raises(UserError, match=f"cannot read the metadata of {re.escape(str(path))} "):
        read_metadata(path, C, IMG[0])


# ---------------------------------------------------------------- damaged files while reading batches
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("damage,first_bad", [("chunk", 2), ("truncate", 0)])
def test_unreadable_sample_is_a_one_line_error(tmp_path, workers, damage, first_bad):
    """A file damaged after start-up: one line naming file and time, also when a worker read it
    (DataLoader would re-raise a worker's exception with its traceback in the message)."""
    make_layout(tmp_path)
    path = tmp_path / "valid" / "2005.h5"
    if damage == "chunk":
        corrupt_chunk(path, first_bad)
    data = build(tmp_path, 2, num_data_workers=workers)
    if damage == "truncate":  # after build_data, which rejects a file HDF5 cannot open
        os.truncate(path, path.stat().st_size // 2)
    # one line; no `as excinfo`: its traceback would keep the loader's workers alive in a reference
    # cycle, and collecting that later makes DataLoader wait 5 s per worker for them to stop
    with pytest.raises(UserError, match=rf"^cannot read time {first_bad} of {re.escape(str(path))} [^\n]*\Z"):
        list(data.valid)


# ---------------------------------------------------------------- validation split size
@pytest.mark.parametrize("valid_lengths,overrides,fix", [
    ((2,), {}, "; add validation files"),
    (VALID_LENGTHS, {"limit_nsamples_val": 1}, "raise --limit_nsamples_val or add validation files"),
])
def test_validation_split_smaller_than_ranks(tmp_path, valid_lengths, overrides, fix):
    """The sampler drops the tail, so one sample for two ranks would leave a rank nothing to validate."""
    make_layout(tmp_path, valid_lengths=valid_lengths)
    with pytest.raises(UserError, match=r"validation split .*valid has 1 sample\(s\) for 2 data-parallel ranks") as exc:
        build(tmp_path, 1, 0, 2, **overrides)
    assert fix in str(exc.value) and "at most 1 data-parallel rank" in str(exc.value)


# ---------------------------------------------------------------- find_nonfinite
def test_find_nonfinite_names_file_and_time(tmp_path):
    make_layout(tmp_path)
    with h5py.File(tmp_path / "train" / "2001.h5", "r+") as f:
        f["fields"][1, 2, 5, 7] = np.nan
        f["fields"][2, 0, IMG[0] + 1, 0] = np.inf  # outside the crop: never read, so harmless
    with h5py.File(tmp_path / "valid" / "2005.h5", "r+") as f:
        f["fields"][3, 1, 0, 0] = -np.inf
    data = build(tmp_path)
    assert data.find_nonfinite(range(6)) == ["train/2001.h5 time 0 -> 1", "train/2001.h5 time 1 -> 2"]
    assert data.find_nonfinite([0, 1, 2, 3]) == []
    assert data.find_nonfinite([5], split="train") == ["train/2001.h5 time 1 -> 2"]
    assert data.find_nonfinite(range(3), split="valid") == ["valid/2005.h5 time 2 -> 3"]
    assert data.find_nonfinite([0, 1], split="valid") == []
    with pytest.raises(ValueError, match="split"):
        data.find_nonfinite([0], split="test")
    # the NaN/Inf does reach the batches that contain those samples, and only those
    for inp, tar, idx in data.valid:
        assert bool((~torch.isfinite(torch.cat([inp.flatten(), tar.flatten()]))).any()) == (idx.item() == 2)
    data.train.set_epoch(0)
    for inp, tar, idx in data.train:
        has_nan = bool(torch.isnan(inp).any() or torch.isnan(tar).any())
        assert has_nan == (idx.item() in (4, 5))


def test_close_ends_the_worker_processes(tiny_data):
    data = build(tiny_data, batch_size=2, num_data_workers=2)
    next(iter(data.train))
    next(iter(data.valid))
    assert len(multiprocessing.active_children()) == 4  # persistent workers of both splits
    data.close()
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert multiprocessing.active_children() == []


# ---------------------------------------------------------------- several target steps (rollout evaluation)
ROLLOUT_VALID = (7, 6)  # time steps of valid/2005.h5 and valid/2006.h5 in `rollout_layout`


@pytest.fixture(scope="module")
def rollout_layout(tmp_path_factory):
    root = tmp_path_factory.mktemp("era5_rollout")
    _, stats = make_layout(root, train_lengths=(9, 8), valid_lengths=ROLLOUT_VALID)
    return root, stats


def h5_state(path: Path, t: int) -> np.ndarray:
    """The cropped state at time ``t`` of ``path``, read with h5py (independently of the loader)."""
    with h5py.File(path, "r") as f:
        return f["fields"][t, :, :IMG[0], :IMG[1]]


@pytest.mark.parametrize("dt,init_every,times", [
    # (file, input time) of every sample of train/ (9 and 8 time steps) with 3 targets
    (1, 1, [(0, t) for t in range(6)] + [(1, t) for t in range(5)]),
    (2, 1, [(0, t) for t in range(3)] + [(1, t) for t in range(2)]),
    (1, 4, [(0, 0), (0, 4), (1, 0), (1, 4)]),  # 6 and 5 initial times, every 4th
    (1, 6, [(0, 0), (1, 0)]),
])
def test_dataset_with_three_target_steps(rollout_layout, dt, init_every, times):
    root, _ = rollout_layout
    ds = ERA5Dataset(root / "train", C, IMG, dt, target_steps=3, init_every=init_every)
    assert len(ds) == len(times)
    paths = [f.path for f in ds.files]
    for index, (f, t) in enumerate(times):
        assert ds.locate(index) == (f, t)
        inp, tar, idx = ds[index]
        assert idx == index and inp.dtype == tar.dtype == torch.float32
        assert inp.shape == (C, *IMG) and tar.shape == (3, C, *IMG)
        np.testing.assert_array_equal(inp.numpy(), h5_state(paths[f], t))
        for j in range(1, 4):  # tar[j - 1] is j*dt after the input
            np.testing.assert_array_equal(tar[j - 1].numpy(), h5_state(paths[f], t + j * dt))
    with pytest.raises(IndexError):
        ds[len(times)]


def test_dataset_limit_applies_after_init_every(rollout_layout):
    root, _ = rollout_layout
    ds = ERA5Dataset(root / "train", C, IMG, 1, limit_nsamples=3, target_steps=2, init_every=3)
    assert len(ds) == 3 and [ds.locate(i) for i in range(3)] == [(0, 0), (0, 3), (0, 6)]


def test_describe_with_several_targets(rollout_layout):
    root, _ = rollout_layout
    ds = ERA5Dataset(root / "valid", C, IMG, 1, target_steps=4, init_every=2)
    assert ds.describe(1) == "valid/2005.h5 time 2 -> 3..6"
    assert ds.describe(2) == "valid/2006.h5 time 0 -> 1..4"
    ds2 = ERA5Dataset(root / "train", C, IMG, 2, target_steps=3)
    assert ds2.describe(1) == "train/2000.h5 time 1 -> 3..7 every 2"


@pytest.mark.parametrize("kwargs", [{"target_steps": 0}, {"init_every": 0}, {"target_steps": -1}])
def test_dataset_rejects_bad_counts(rollout_layout, kwargs):
    root, _ = rollout_layout
    with pytest.raises(ValueError, match="must be >= 1"):
        ERA5Dataset(root / "train", C, IMG, 1, **kwargs)


@pytest.mark.parametrize("dt,steps,fix", [(1, 3, "use at most 2 rollout steps"), (2, 2, "use at most 1 rollout steps"),
                                          (3, 2, "lower --dt")])
def test_files_too_short_for_the_rollout(layout, dt, steps, fix):
    root, _, _ = layout  # train/2001.h5 has 3 time steps
    with pytest.raises(UserError, match=rf"2001\.h5 has 3 time steps, too few for {steps} rollout steps of "
                                        rf"dt={dt} \({steps * dt + 1} needed\); {fix}\Z"):
        ERA5Dataset(root / "train", C, IMG, dt, target_steps=steps)


def normalized(x, stats: Stats) -> torch.Tensor:
    """``(x - mean) / std`` in float32, the loaders' own arithmetic."""
    return (torch.as_tensor(x) - stats.mean[0]) / stats.std[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_device_batches_with_three_targets_match_the_dataset(rollout_layout, workers):
    root, _ = rollout_layout
    data = build(root, 2, num_data_workers=workers, valid_target_steps=3)
    ds = data.valid_dataset
    assert ds.target_steps == 3 and len(ds) == 4 + 3 and data.train_dataset.target_steps == 1
    seen = []
    for inp, tar, idx in data.valid:
        assert inp.shape[1:] == (C, *IMG) and tar.shape == (len(idx), 3, C, *IMG) and tar.dtype == torch.float32
        for b, i in enumerate(idx.tolist()):
            x, y, _ = ds[i]
            assert torch.equal(inp[b], normalized(x, data.stats))
            assert torch.equal(tar[b], normalized(y, data.stats))
            seen.append(i)
    assert seen == list(range(7))
    inp, tar, _ = next(iter(data.train))
    assert tar.shape == (2, 1, C, *IMG)
    data.close()


def test_training_batches_are_unchanged_with_one_target(rollout_layout, reads):
    """k = 1 (training): the slot holds input and one target only, each read once, and the batch
    values are today's ``(x_t - mean) / std`` and ``(x_{t+dt} - mean) / std``, exactly."""
    root, _ = rollout_layout
    data = build(root, 2, dt=2, valid_target_steps=2)
    assert data.train.slots.buf.shape[1:] == (2, 2, C, *IMG)  # (1 + k, B, C, H, W): nothing extra
    ds = data.train_dataset
    paths = [f.path for f in ds.files]
    data.train.set_epoch(1)
    n = 0
    for inp, tar, idx in data.train:
        assert tar.shape == (2, 1, C, *IMG) and tar[:, 0].is_contiguous()
        for b, i in enumerate(idx.tolist()):
            f, t = ds.locate(i)
            assert torch.equal(inp[b], normalized(h5_state(paths[f], t), data.stats))
            assert torch.equal(tar[b, 0], normalized(h5_state(paths[f], t + 2), data.stats))
            n += 1
    assert n == 12 and len(reads) == 2 * n  # 13 samples, the incomplete last batch dropped


def test_synthetic_batches_with_several_targets(tmp_path):
    data = build(tmp_path / "nothing_here", 4, data_loader_config="synthetic", limit_nsamples=16,
                 valid_target_steps=3)
    inp, tar, idx = next(iter(data.valid))
    assert inp.shape == (4, C, *IMG) and tar.shape == (4, 3, C, *IMG) and tar.dtype == torch.float32
    assert idx.dtype == torch.int64 and idx.shape == (4,)
    assert not torch.equal(tar[:, 0], tar[:, 1]) and not torch.equal(tar[:, 1], tar[:, 2])
    assert next(iter(data.train))[1].shape == (4, 1, C, *IMG)
    with pytest.raises(ValueError, match="target_steps"):
        SyntheticBatches(1, 4, C, IMG, CPU, target_steps=0)


def test_synthetic_training_batches_are_unchanged_with_one_target():
    """The single target is the second tensor drawn from the seed, as before targets had a step axis."""
    inp, tar, _ = next(iter(SyntheticBatches(1, 2, C, IMG, CPU, seed=5)))
    gen = torch.Generator().manual_seed(5)
    want_inp, want_tar = (torch.randn((2, C, *IMG), generator=gen) for _ in range(2))
    assert torch.equal(inp, want_inp) and torch.equal(tar[:, 0], want_tar)


def data_config(root: Path, **overrides):
    ov = {"data_path": str(root), "num_data_workers": "0", **{k: str(v) for k, v in overrides.items()}}
    return load_config(REPO / "config" / "ViT.yaml", "tiny", ov).data


def test_split_batches_shards_in_a_fixed_order(rollout_layout):
    root, _ = rollout_layout
    cfg = data_config(root)
    stats = Stats.load(root / "stats", C, IMG, CPU)
    got = {}
    for rank in range(2):
        batches, ds = split_batches(cfg, "valid", 3, rank, 2, CPU, target_steps=2, stats=stats)
        assert len(ds) == 5 + 4 and ds.target_steps == 2
        passes = [take(batches) for _ in range(2)]
        batches.set_epoch(3)  # the epoch does not change the order
        passes.append(take(batches))
        for other in passes[1:]:
            assert_batches_equal(other, passes[0])
        got[rank] = [i for _, _, idx in passes[0] for i in idx.tolist()]
        assert [len(idx) for _, _, idx in passes[0]] == [3, 1]  # the last incomplete batch is kept
        for inp, tar, idx in passes[0]:
            assert tar.shape == (len(idx), 2, C, *IMG)
            for b, i in enumerate(idx.tolist()):
                x, y, _ = ds[i]
                assert torch.equal(inp[b], normalized(x, stats)) and torch.equal(tar[b], normalized(y, stats))
        batches.close()
    assert got == {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}  # interleaved, the odd sample 8 dropped: equal counts


def test_split_batches_init_every(rollout_layout):
    root, _ = rollout_layout
    cfg = data_config(root)
    batches, ds = split_batches(cfg, "train", 4, 0, 1, CPU, target_steps=1, init_every=3,
                                stats=Stats.identity(C, IMG, CPU))
    assert [ds.locate(i) for i in range(len(ds))] == [(0, 0), (0, 3), (0, 6), (1, 0), (1, 3), (1, 6)]
    assert [idx.tolist() for _, _, idx in batches] == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("dp_size,steps,problem", [
    (1, 6, r"valid/2006\.h5 has 6 time steps, too few for 6 rollout steps of dt=1 \(7 needed\); "
           r"use at most 5 rollout steps"),
    (4, 5, r"the valid split .*valid has 3 sample\(s\) for 4 data-parallel ranks"),
])
def test_split_batches_errors(rollout_layout, dp_size, steps, problem):
    root, _ = rollout_layout
    with pytest.raises(UserError, match=problem):
        split_batches(data_config(root), "valid", 1, 0, dp_size, CPU, target_steps=steps,
                      stats=Stats.identity(C, IMG, CPU))


def test_find_nonfinite_checks_every_target_step(rollout_layout, tmp_path):
    make_layout(tmp_path, valid_lengths=ROLLOUT_VALID)
    with h5py.File(tmp_path / "valid" / "2005.h5", "r+") as f:
        f["fields"][5, 1, 0, 0] = np.nan  # the third target of time 2, the second of time 3
    data = build(tmp_path, valid_target_steps=3)
    assert data.find_nonfinite(range(7), split="valid") == ["valid/2005.h5 time 2 -> 3..5",
                                                            "valid/2005.h5 time 3 -> 4..6"]


def test_a_config_of_another_grid_is_stopped_naming_the_config_for_the_data():
    """``--config tiny --data_path data/era5_sample``: tiny's [32,64] keeps 28% of the 60x120 grid."""
    from utils.config.loading import DEFAULT_YAML, configs_for_data, load_config
    from utils.data.dataset import check_crop
    made_for = configs_for_data(DEFAULT_YAML, "./data/era5_sample")
    assert made_for == ["era5_sample"]
    with pytest.raises(UserError) as err:
        check_crop((60, 120), (32, 64), "data/era5_sample", "tiny", lambda: made_for)
    assert str(err.value) == ("the data at data/era5_sample are on a 60x120 grid but config tiny trains on img_size "
                              "[32,64], 28% of it: they are not this config's data; pass --config era5_sample (made "
                              "for these data), or --img_size [60,120] for the whole grid (a multiple of "
                              "--patch_size; --img_size crops as asked when given)")
    # most of the grid: a crop, warned about by the dataset; the config file is not read
    check_crop((34, 67), (32, 64), "d", "tiny", lambda: pytest.fail("read the configs for a crop that passes"))
    assert load_config(DEFAULT_YAML, "tiny", {"img_size": "[8,16]"}).overrides == ("img_size",)  # asked for
