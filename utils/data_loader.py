"""Data loading: HDF5 files in the ERA5 layout -> normalized (input, target) batches on the device.

Layout (written by ``tools/make_synthetic_data.py`` and ``tools/convert_era5.py``)::

    <data_path>/train/*.h5, <data_path>/valid/*.h5   dataset ``fields`` (T, C, H, W) float32,
                                                     attrs ``channel_names``; dataset ``latitude`` (H,)
    <data_path>/stats/global_means.npy, global_stds.npy   (1, C, 1, 1) float32
    <data_path>/stats/time_means.npy                      (1, C, H, W) float32 (climatology)

A sample is ``(fields[t], fields[t + dt])`` from one file, cropped to ``img_size`` from the
top-left (north-west) corner. Workers read raw float32 fields straight into page-locked
batch buffers; :class:`DeviceBatches` copies the next batch to the GPU on a side stream
(overlapping compute) and normalizes it there, ``(x - mean) / std``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from utils.errors import UserError

FIELDS = "fields"


@dataclass
class FileInfo:
    path: Path
    n_times: int


class ERA5Dataset(Dataset):
    """(input at t, target at t + dt) pairs from every ``*.h5`` file in ``directory``.

    Items are ``(inp, tar, index)``: ``inp`` and ``tar`` float32 ``(C, H, W)`` in physical
    units (not normalized), ``index`` the global sample index (for error messages).

    Raises:
        UserError: missing directory or files, a file without ``fields``, wrong rank, dtype
            or channel count, a grid smaller than ``img_size``, or files too short for ``dt``.
    """

    def __init__(self, directory: str | Path, n_channels: int, img_size: tuple[int, int], dt: int,
                 limit_nsamples: int | None = None):
        self.directory = Path(directory)
        self.img_size = tuple(img_size)
        self.dt = dt
        self.n_channels = n_channels
        self.files = self._inspect(n_channels)
        per_file = [f.n_times - dt for f in self.files]
        self.offsets = np.cumsum([0] + per_file)
        total = int(self.offsets[-1])
        self.n_samples = min(total, limit_nsamples) if limit_nsamples else total
        self._handles: dict[int, h5py.Dataset] = {}

    def _inspect(self, n_channels: int) -> list[FileInfo]:
        if not self.directory.is_dir():
            raise UserError(f"data directory {self.directory} does not exist; set --data_path to a folder "
                            "with train/, valid/ and stats/ (make one with python -m tools.make_synthetic_data)")
        paths = sorted(self.directory.glob("*.h5"))
        if not paths:
            raise UserError(f"no .h5 files in {self.directory}; expected <year>.h5 files with a "
                            f"'{FIELDS}' dataset of shape (T, C, H, W)")
        return [self._inspect_file(p, n_channels) for p in paths]

    def _inspect_file(self, path: Path, n_channels: int) -> FileInfo:
        try:
            with h5py.File(path, "r") as f:
                if FIELDS not in f:
                    raise UserError(f"{path} has no '{FIELDS}' dataset (it has: {', '.join(f.keys()) or 'nothing'}); "
                                    "convert it with python -m tools.convert_era5")
                shape, dtype = f[FIELDS].shape, f[FIELDS].dtype
        except OSError as exc:
            raise UserError(f"cannot read {path} as HDF5: {exc}") from None
        if len(shape) != 4 or dtype != np.float32:
            raise UserError(f"{path}: '{FIELDS}' must be float32 of shape (T, C, H, W), got {dtype} {shape}")
        t, c, h, w = shape
        if c != n_channels:
            raise UserError(f"{path} has {c} channels but the config has n_in_channels={n_channels}; "
                            f"pass --n_in_channels {c} --n_out_channels {c}")
        if h < self.img_size[0] or w < self.img_size[1]:
            raise UserError(f"img_size {list(self.img_size)} is larger than the {h}x{w} grid of {path}; "
                            f"pass --img_size [{h},{w}] or smaller")
        if t <= self.dt:
            raise UserError(f"{path} has {t} time steps, too few for dt={self.dt}; lower --dt")
        return FileInfo(path, t)

    def __len__(self) -> int:
        return self.n_samples

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (file number, input time index)."""
        if not 0 <= index < self.n_samples:
            raise IndexError(index)
        file_no = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return file_no, index - int(self.offsets[file_no])

    def describe(self, index: int) -> str:
        """Human-readable origin of a sample, e.g. ``train/2000.h5 time 12 -> 13``."""
        file_no, t = self.locate(index)
        path = self.files[file_no].path
        return f"{path.parent.name}/{path.name} time {t} -> {t + self.dt}"

    def _dataset(self, file_no: int) -> h5py.Dataset:
        # opened lazily so that each DataLoader worker has its own HDF5 handle
        if file_no not in self._handles:
            self._handles[file_no] = h5py.File(self.files[file_no].path, "r")[FIELDS]
        return self._handles[file_no]

    def read(self, file_no: int, t: int, out: np.ndarray | None = None) -> np.ndarray:
        """Read the cropped state at time ``t`` of file ``file_no`` as float32 ``(C, H, W)``."""
        h, w = self.img_size
        if out is None:
            out = np.empty((self.n_channels, h, w), dtype=np.float32)
        self._dataset(file_no).read_direct(out, np.s_[t, :, :h, :w])
        return out

    def __getitem__(self, index: int):
        file_no, t = self.locate(index)
        inp = self.read(file_no, t)
        tar = self.read(file_no, t + self.dt)
        return torch.from_numpy(inp), torch.from_numpy(tar), index


@dataclass
class Stats:
    """Normalization statistics on the device: ``mean``/``std`` ``(1, C, 1, 1)``, ``clim`` ``(1, C, H, W)``
    (time-mean climatology, normalized), all float32."""

    mean: torch.Tensor
    std: torch.Tensor
    clim: torch.Tensor

    @classmethod
    def load(cls, stats_dir: Path, n_channels: int, img_size, device) -> "Stats":
        arrays = {}
        for name, want in (("global_means", (1, n_channels, 1, 1)), ("global_stds", (1, n_channels, 1, 1)),
                           ("time_means", None)):
            path = stats_dir / f"{name}.npy"
            if not path.is_file():
                raise UserError(f"missing {path}; the data folder needs stats/global_means.npy, "
                                "global_stds.npy and time_means.npy (written by the tools in tools/)")
            arr = np.load(path).astype(np.float32)
            if want is not None and arr.shape != want:
                raise UserError(f"{path} has shape {arr.shape}, expected {want}")
            arrays[name] = arr
        h, w = img_size
        clim = arrays["time_means"]
        if clim.ndim != 4 or clim.shape[1] != n_channels or clim.shape[2] < h or clim.shape[3] < w:
            raise UserError(f"{stats_dir}/time_means.npy has shape {clim.shape}, expected (1, {n_channels}, >={h}, >={w})")
        if (arrays["global_stds"] <= 0).any():
            raise UserError(f"{stats_dir}/global_stds.npy has non-positive entries; recompute the statistics")
        mean, std = (torch.from_numpy(arrays[k]).to(device) for k in ("global_means", "global_stds"))
        clim = (torch.from_numpy(np.ascontiguousarray(clim[:, :, :h, :w])).to(device) - mean) / std
        return cls(mean, std, clim)

    @classmethod
    def identity(cls, n_channels: int, img_size, device) -> "Stats":
        ones = torch.ones(1, n_channels, 1, 1, device=device)
        return cls(ones * 0, ones, torch.zeros(1, n_channels, *img_size, device=device))


class BatchSlots:
    """``K`` host buffers, each holding one batch ``(2, B, C, H, W)`` float32 (input, target).

    The buffers live in shared memory so DataLoader workers (forked or spawned) write samples
    straight into them with h5py ``read_direct``; with ``pin=True`` they are also page-locked
    (``cudaHostRegister``) so the host-to-device copy is a direct, asynchronous DMA. No other
    host copy of a batch is made (no collate, no pin-memory thread).
    """

    def __init__(self, k: int, batch_size: int, n_channels: int, img_size, pin: bool):
        self.k = k
        self.buf = torch.empty((k, 2, batch_size, n_channels, *img_size), dtype=torch.float32).share_memory_()
        self.pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.nbytes, 0)
            if int(err) != 0:
                raise UserError(f"cudaHostRegister of {self.buf.nbytes / 2**30:.1f} GiB of loader buffers failed "
                                f"(error {int(err)}); lower --num_data_workers or --local_batch_size")
            self.pinned = True

    def __del__(self):
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())


class SlotFiller(Dataset):
    """Reads one batch per item into its slot: ``(batch_no, indices)`` -> ``(batch_no, indices)``.

    Runs in DataLoader workers (or inline without workers); batch ``b`` goes to slot ``b % K``.
    """

    def __init__(self, dataset: ERA5Dataset, slots: BatchSlots):
        self.dataset, self.slots = dataset, slots

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item):
        batch_no, indices = item
        slot = self.slots.buf[batch_no % self.slots.k]
        for j, index in enumerate(indices):
            file_no, t = self.dataset.locate(index)
            self.dataset.read(file_no, t, out=slot[0, j].numpy())
            self.dataset.read(file_no, t + self.dataset.dt, out=slot[1, j].numpy())
        return batch_no, torch.as_tensor(indices, dtype=torch.int64)


class NumberedBatches(Sampler):
    """Batches of a sampler's indices, numbered: yields ``(batch_no, [indices])``."""

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool):
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self):
        indices = list(self.sampler)
        for b in range(len(self)):
            yield b, indices[b * self.batch_size:(b + 1) * self.batch_size]


class DeviceRing:
    """Three reusable device buffers per batch shape plus the one side stream that fills them.

    Shared by the train and validation loaders (never iterated at the same time): one stream
    orders every copy, so a batch prefetched by an abandoned iterator (a partial epoch) is
    written before the next loader's first copy into the same buffer. Fixed buffers also keep
    the side stream from growing the caching allocator's reserved pool.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._buffers: dict[tuple, torch.Tensor] = {}

    def buffers(self, batch_shape: tuple) -> torch.Tensor:
        """``(3, *batch_shape)`` float32 device buffers (made on first use)."""
        if batch_shape not in self._buffers:
            self._buffers[batch_shape] = torch.empty((3, *batch_shape), dtype=torch.float32, device=self.device)
        return self._buffers[batch_shape]


class DeviceBatches:
    """Normalized ``(inp, tar, index)`` batches on ``device`` from an :class:`ERA5Dataset`.

    Pipeline: a DistributedSampler orders the samples (shuffled per epoch with ``set_epoch``,
    disjoint per data-parallel rank); DataLoader workers (``num_workers``; none: inline) read
    each batch into a page-locked shared slot; on CUDA the next batch is copied to the GPU and
    normalized ``(x - mean) / std`` on a side stream while the current one is used, and the
    compute stream waits on an event. Yields float32 ``(B, C, H, W)`` tensors and int64 indices;
    the last incomplete batch is dropped when ``drop_last`` (training), kept otherwise.

    A slot is rewritten only after its copy has finished: a DataLoader with ``P`` batches in
    flight hands out batch ``j + P`` while batch ``j`` is returned, so with ``K = P + 2`` slots
    the slot of ``j + P`` last held batch ``j - 2``, whose copy is waited for first.
    """

    def __init__(self, dataset: ERA5Dataset, sampler: DistributedSampler, batch_size: int, drop_last: bool,
                 num_workers: int, *, device: torch.device, stats: Stats, ring: DeviceRing | None = None):
        self.batches = NumberedBatches(sampler, batch_size, drop_last)
        self.sampler, self.device, self.stats = sampler, device, stats
        self.cuda = device.type == "cuda"
        in_flight = 2 * num_workers  # DataLoader prefetch_factor 2
        self.slots = BatchSlots(in_flight + 2 if num_workers else 2, batch_size, dataset.n_channels,
                                dataset.img_size, pin=self.cuda)
        self.filler = SlotFiller(dataset, self.slots)
        self.loader = (DataLoader(self.filler, batch_size=None, sampler=self.batches, num_workers=num_workers,
                                  persistent_workers=True, prefetch_factor=2) if num_workers else None)
        self.copied: list = [None] * self.slots.k  # per slot: CUDA event of its last host-to-device copy
        self.ring = ring if ring is not None or not self.cuda else DeviceRing(device)

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _wait_slot(self, batch_no: int) -> None:
        event = self.copied[batch_no % self.slots.k]
        if event is not None:
            event.synchronize()

    def _source(self):
        if self.loader is not None:
            for event in filter(None, self.copied):  # a previous, abandoned epoch may still be copying
                event.synchronize()
            it = iter(self.loader)
            for j in range(len(self.batches)):
                self._wait_slot(j - 2)  # receiving batch j releases batch j + P to a worker
                yield next(it)
        else:
            for batch_no, indices in self.batches:
                self._wait_slot(batch_no)
                yield self.filler[(batch_no, indices)]

    def _to_device(self, batch_no: int, indices: torch.Tensor, out: torch.Tensor | None = None):
        """Copy a batch out of its slot (into ``out`` on CUDA) and normalize it."""
        n = len(indices)
        host = self.slots.buf[batch_no % self.slots.k, :, :n]
        if out is None:  # CPU: normalization writes a new tensor, so the slot is free at once
            data = (host - self.stats.mean) / self.stats.std
            return data[0], data[1], indices
        data = out[:, :n]
        data.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.copied[batch_no % self.slots.k] = event
        data.sub_(self.stats.mean).div_(self.stats.std)
        return data[0], data[1], indices

    def __iter__(self) -> Iterator:
        if not self.cuda:
            yield from (self._to_device(*item) for item in self._source())
            return
        # Batch j + 1 is copied while step j runs, into the buffer of batch j - 2, which the
        # compute stream has finished with once it gets past step j - 1.
        ring = self.ring.buffers(tuple(self.slots.buf.shape[1:]))
        stream = self.ring.stream
        compute = torch.cuda.current_stream(self.device)
        source = self._source()

        def prefetch(j: int):
            item = next(source, None)
            if item is None:
                return None
            released = torch.cuda.Event()
            released.record(compute)
            with torch.cuda.stream(stream):
                stream.wait_event(released)
                out = self._to_device(*item, out=ring[j % len(ring)])
                ready = torch.cuda.Event()
                ready.record(stream)
            return out, ready

        j = 0
        pending = prefetch(j)
        while pending is not None:
            batch, ready = pending
            compute.wait_event(ready)
            j += 1
            pending = prefetch(j)
            yield batch


class SyntheticBatches:
    """Random normalized batches made on the device: the compute ceiling, no I/O.

    Yields ``n_batches`` pairs of float32 ``(B, C, H, W)`` standard-normal tensors (made once
    and reused, so generation costs nothing per step) and dummy indices.
    """

    def __init__(self, n_batches: int, batch_size: int, n_channels: int, img_size, device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        shape = (batch_size, n_channels, *img_size)
        self.inp = torch.randn(shape, generator=gen, device=device)
        self.tar = torch.randn(shape, generator=gen, device=device)
        self.idx = torch.arange(batch_size)
        self.n_batches = n_batches

    def __len__(self) -> int:
        return self.n_batches

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        for _ in range(self.n_batches):
            yield self.inp, self.tar, self.idx


@dataclass
class Data:
    """Everything the training loop needs from the data side.

    ``train``/``valid`` iterate normalized device batches; ``train_dataset`` reads raw samples
    (None for synthetic data); ``latitude`` is ``(H,)`` degrees.
    """

    train: DeviceBatches | SyntheticBatches
    valid: DeviceBatches | SyntheticBatches
    stats: Stats
    channel_names: list[str]
    latitude: np.ndarray
    train_samples: int
    train_dataset: ERA5Dataset | None = None

    def find_nonfinite(self, indices: Iterable[int]) -> list[str]:
        """Origins (file and time) of the training samples among ``indices`` holding NaN/Inf."""
        if self.train_dataset is None:
            return []
        bad = []
        for idx in indices:
            inp, tar, _ = self.train_dataset[idx]
            if not (torch.isfinite(inp).all() and torch.isfinite(tar).all()):
                bad.append(self.train_dataset.describe(idx))
        return bad


def equiangular_latitudes(h: int) -> np.ndarray:
    """Latitudes (degrees, north to south) of an ``h``-row grid spanning 90 to -90 inclusive."""
    return np.linspace(90.0, -90.0, h)


def read_metadata(path: Path, n_channels: int, h: int) -> tuple[list[str], np.ndarray]:
    """Channel names (attr ``channel_names`` of ``fields``) and the first ``h`` latitudes of one file."""
    with h5py.File(path, "r") as f:
        names = f[FIELDS].attrs.get("channel_names")
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in names] if names is not None else []
        lat = np.asarray(f["latitude"][:h], dtype=np.float64) if "latitude" in f else None
    if len(names) != n_channels:
        names = [f"c{i}" for i in range(n_channels)]
    if lat is None:
        lat = equiangular_latitudes(h)
    return names, lat


def make_sampler(dataset: ERA5Dataset, params, train: bool, dp_rank: int, dp_size: int) -> DistributedSampler:
    """The sample order shared by the native and DALI loaders: shuffled per epoch for training,
    sharded over data-parallel ranks, dropping the tail that does not divide over the ranks."""
    return DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=train,
                              seed=params.seed, drop_last=True)


def build_data(params, batch_size: int, dp_rank: int, dp_size: int, device: torch.device) -> Data:
    """Build the train/valid iterables selected by ``params.data_loader_config``.

    ``batch_size`` is the local (per data-parallel rank) batch size; each data-parallel rank
    sees a disjoint shard of the samples (DistributedSampler), tensor/context-parallel peers
    the same one. Raises UserError for bad data or paths.
    """
    c, img = params.n_in_channels, tuple(params.img_size)
    if params.n_out_channels != c:
        raise UserError(f"n_out_channels={params.n_out_channels} must equal n_in_channels={c}: "
                        "targets are the same fields dt steps later")
    if params.data_loader_config == "synthetic":
        n_train = params.limit_nsamples or 512
        n_valid = params.limit_nsamples_val or 128
        steps = max(1, n_train // (batch_size * dp_size))
        train = SyntheticBatches(steps, batch_size, c, img, device, params.seed)
        valid = SyntheticBatches(max(1, math.ceil(n_valid / (batch_size * dp_size))), batch_size, c, img, device,
                                 params.seed + 1)
        return Data(train, valid, Stats.identity(c, img, device), [f"c{i}" for i in range(c)],
                    equiangular_latitudes(img[0]), steps * batch_size * dp_size)
    root = Path(params.data_path)
    train_ds = ERA5Dataset(root / "train", c, img, params.dt, params.limit_nsamples)
    valid_ds = ERA5Dataset(root / "valid", c, img, params.dt, params.limit_nsamples_val)
    if len(train_ds) < batch_size * dp_size:
        raise UserError(f"{len(train_ds)} training samples are fewer than one global batch "
                        f"({batch_size} x {dp_size} ranks); lower --global_batch_size")
    stats = Stats.load(root / "stats", c, img, device)
    names, lat = read_metadata(train_ds.files[0].path, c, img[0])
    if params.data_loader_config == "dali":
        from utils.dali_loader import dali_batches
        train, valid = (dali_batches(ds, params, batch_size, is_train, dp_rank, dp_size, device, stats)
                        for ds, is_train in ((train_ds, True), (valid_ds, False)))
    else:
        ring = DeviceRing(device) if device.type == "cuda" else None
        train, valid = (DeviceBatches(ds, make_sampler(ds, params, is_train, dp_rank, dp_size), batch_size,
                                      is_train, params.num_data_workers, device=device, stats=stats, ring=ring)
                        for ds, is_train in ((train_ds, True), (valid_ds, False)))
    n_train = (len(train_ds) // dp_size // batch_size) * batch_size * dp_size
    return Data(train, valid, stats, names, lat, n_train, train_ds)

