"""Data loading: HDF5 files in the ERA5 layout -> normalized (input, target) batches on the device.

Layout (written by ``tools/make_synthetic_data.py`` and ``tools/convert_era5.py``)::

    <data_path>/train/*.h5, <data_path>/valid/*.h5   dataset ``fields`` (T, C, H, W) float32,
                                                     attrs ``channel_names``; dataset ``latitude`` (H,)
    <data_path>/stats/global_means.npy, global_stds.npy   (1, C, 1, 1) float32
    <data_path>/stats/time_means.npy                      (1, C, H, W) float32 (climatology)

A sample is ``(fields[t], fields[t + dt])`` from one file, cropped to ``img_size`` from the
top-left (north-west) corner. Loaders yield raw float32 fields; normalization
``(x - mean) / std`` happens on the device in :class:`DeviceBatches`, which also prefetches
the next batch on a side CUDA stream so the host-to-device copy overlaps compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

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


class DeviceBatches:
    """Iterate ``(inp, tar, index)`` batches moved to ``device`` and normalized with ``stats``.

    On CUDA the next batch is copied on a side stream while the current one is being used
    (the loader's pinned memory makes the copy asynchronous); the consumer stream waits on
    an event before it touches the batch. Yields float32 ``(B, C, H, W)`` tensors.
    """

    def __init__(self, loader: Iterable, sampler=None, *, device: torch.device, stats: Stats):
        self.loader, self.sampler, self.device, self.stats = loader, sampler, device, stats

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def _to_device(self, batch):
        inp, tar, idx = batch
        inp = inp.to(self.device, non_blocking=True)
        tar = tar.to(self.device, non_blocking=True)
        mean, std = self.stats.mean, self.stats.std
        return (inp - mean) / std, (tar - mean) / std, idx

    def __iter__(self) -> Iterator:
        if self.device.type != "cuda":
            yield from map(self._to_device, self.loader)
            return
        stream = torch.cuda.Stream(self.device)
        it = iter(self.loader)

        def prefetch():
            batch = next(it, None)
            if batch is None:
                return None
            with torch.cuda.stream(stream):
                out = self._to_device(batch)
                event = torch.cuda.Event()
                event.record(stream)
            return out, event

        pending = prefetch()
        while pending is not None:
            (inp, tar, idx), event = pending
            torch.cuda.current_stream(self.device).wait_event(event)
            # memory made on the side stream is now also used on the compute stream
            inp.record_stream(torch.cuda.current_stream(self.device))
            tar.record_stream(torch.cuda.current_stream(self.device))
            pending = prefetch()
            yield inp, tar, idx


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


def _loader(dataset: ERA5Dataset, params, batch_size: int, train: bool, dp_rank: int, dp_size: int, device):
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=train,
                                 seed=params.seed, drop_last=True)
    workers = params.num_data_workers
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=device.type == "cuda", drop_last=train,
                        persistent_workers=workers > 0, prefetch_factor=2 if workers > 0 else None)
    return loader, sampler


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
        train, valid = (DeviceBatches(*_loader(ds, params, batch_size, is_train, dp_rank, dp_size, device),
                                      device=device, stats=stats)
                        for ds, is_train in ((train_ds, True), (valid_ds, False)))
    n_train = (len(train_ds) // dp_size // batch_size) * batch_size * dp_size
    return Data(train, valid, stats, names, lat, n_train, train_ds)

