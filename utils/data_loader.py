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

import gc
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from utils.errors import UserError
from utils.schema import DataConfig

FIELDS = "fields"
LATITUDE = "latitude"
CHANNEL_NAMES = "channel_names"
SPLITS = ("train", "valid")
STATS_HINT = "recompute the statistics with the data tools (python -m tools.convert_era5 or tools.make_synthetic_data)"


def _one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (h5py and NumPy messages may hold newlines)."""
    return " ".join(str(exc).split())


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
        """Read the cropped state at time ``t`` of file ``file_no`` as float32 ``(C, H, W)`` (into ``out``).

        Raises:
            UserError: h5py cannot read it (a damaged or truncated file, an I/O error), naming
                the file and the time index.
        """
        h, w = self.img_size
        if out is None:
            out = np.empty((self.n_channels, h, w), dtype=np.float32)
        try:
            self._dataset(file_no).read_direct(out, np.s_[t, :, :h, :w])
        except OSError as exc:
            path = self.files[file_no].path
            raise UserError(f"cannot read time {t} of {path} ({_one_line(exc)}); the file is damaged or was changed "
                            f"after the run started: re-create it with the data tools or move it out of "
                            f"{path.parent}") from None
        return out

    def __getitem__(self, index: int):
        file_no, t = self.locate(index)
        inp = self.read(file_no, t)
        tar = self.read(file_no, t + self.dt)
        return torch.from_numpy(inp), torch.from_numpy(tar), index


def load_stats_array(path: Path) -> np.ndarray:
    """One statistics file as a finite float32 array (any shape).

    Raises:
        UserError: ``path`` is not a ``.npy`` file of numbers (truncated, empty, ``.npz``,
            pickled objects, strings) or holds NaN/Inf; the message names the file.
    """
    try:
        with open(path, "rb") as f:
            arr = np.lib.format.read_array(f)  # .npy only and no pickles: a data file never runs code
    except (OSError, ValueError, EOFError) as exc:
        raise UserError(f"cannot read {path} as a .npy array ({_one_line(exc)}); {STATS_HINT}") from None
    if arr.dtype.kind not in "iuf":
        raise UserError(f"{path} holds {arr.dtype} values, not numbers; {STATS_HINT}")
    arr = arr.astype(np.float32)
    bad = ~np.isfinite(arr)
    if bad.any():
        # caught here, a NaN std would otherwise surface later as a diverging loss
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise UserError(f"{path} holds {int(bad.sum())} NaN/Inf value(s), first at index {first}; {STATS_HINT}")
    return arr


@dataclass
class Stats:
    """Normalization statistics on the device: ``mean``/``std`` ``(1, C, 1, 1)``, ``clim`` ``(1, C, H, W)``
    (time-mean climatology, normalized), all float32."""

    mean: torch.Tensor
    std: torch.Tensor
    clim: torch.Tensor

    @classmethod
    def load(cls, stats_dir: Path, n_channels: int, img_size, device) -> "Stats":
        """Read ``global_means``, ``global_stds``, ``time_means`` ``.npy`` files of ``stats_dir``.

        Raises:
            UserError: a file is missing, is not a numeric ``.npy`` array (truncated, empty,
                pickled, ...), holds NaN/Inf, has the wrong shape, or a std is not positive.
        """
        arrays = {}
        for name, want in (("global_means", (1, n_channels, 1, 1)), ("global_stds", (1, n_channels, 1, 1)),
                           ("time_means", None)):
            path = stats_dir / f"{name}.npy"
            if not path.is_file():
                raise UserError(f"missing {path}; the data folder needs stats/global_means.npy, "
                                "global_stds.npy and time_means.npy (written by the tools in tools/)")
            arr = load_stats_array(path)
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

    def close(self) -> None:
        """Unregister the page-locked buffers (idempotent)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self.pinned = False

    def __del__(self):
        self.close()


class FilledBatch(NamedTuple):
    """A batch read into slot ``batch_no % K``: its sample ``indices`` (int64 ``(B,)``) and, if a
    sample could not be read, the one-line ``error`` message (the slot's content is then undefined)."""

    batch_no: int
    indices: torch.Tensor
    error: str | None


class SlotFiller(Dataset):
    """Reads one batch per item into its slot: ``(batch_no, indices)`` -> :class:`FilledBatch`.

    Runs in DataLoader workers (or inline without workers); batch ``b`` goes to slot ``b % K``.
    A read error is returned, not raised: DataLoader re-raises a worker's exception with the
    worker's traceback in its message, which would break the one-line ``error:`` report.
    """

    def __init__(self, dataset: ERA5Dataset, slots: BatchSlots):
        self.dataset, self.slots = dataset, slots

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item) -> FilledBatch:
        batch_no, indices = item
        slot = self.slots.buf[batch_no % self.slots.k]
        error = None
        try:
            for j, index in enumerate(indices):
                file_no, t = self.dataset.locate(index)
                self.dataset.read(file_no, t, out=slot[0, j].numpy())
                self.dataset.read(file_no, t + self.dataset.dt, out=slot[1, j].numpy())
        except UserError as exc:
            error = str(exc)
        return FilledBatch(batch_no, torch.as_tensor(indices, dtype=torch.int64), error)


def check_start_batch(start_batch: int, n_batches: int) -> None:
    """Raise ValueError unless ``0 <= start_batch <= n_batches`` (``n_batches``: an empty remainder)."""
    if not 0 <= start_batch <= n_batches:
        raise ValueError(f"start_batch must be in [0, {n_batches}] (the batches of an epoch), got {start_batch}")


class NumberedBatches(Sampler):
    """Batches of a sampler's indices, numbered: yields ``(batch_no, [indices])``.

    ``len`` is the number of batches of a full epoch; an iteration yields the batches from
    ``start`` (set with :meth:`set_epoch`) to the end, numbered as in the full epoch.
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool):
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.start = 0  # first batch of the next iteration

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Order the samples for ``epoch``; the next iteration (only) starts at batch ``start_batch``.

        Raises:
            ValueError: ``start_batch`` is not in ``[0, len(self)]``.
        """
        check_start_batch(start_batch, len(self))
        self.sampler.set_epoch(epoch)
        self.start = start_batch

    def __iter__(self):
        # not a generator: the start is taken (and reset) when the iteration begins
        start, self.start = self.start, 0
        indices = list(self.sampler)  # only indices: the skipped batches' samples are never read
        return ((b, indices[b * self.batch_size:(b + 1) * self.batch_size]) for b in range(start, len(self)))


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
    Iterating raises UserError (in this process, also for reads done by workers) when a sample
    cannot be read, naming the file and time index.

    ``set_epoch(epoch, start_batch)`` makes the next iteration yield only the batches
    ``start_batch, ..., len - 1`` of the epoch (exact resume); the skipped samples are not read.

    A slot is rewritten only after its copy has finished: a DataLoader with ``P`` batches in
    flight hands out batch ``j + P`` while batch ``j`` is returned, so with ``K = P + 2`` slots
    the slot of ``j + P`` last held batch ``j - 2``, whose copy is waited for first. Batch numbers
    keep their epoch meaning when an iteration starts at batch ``s > 0``: every copy is waited
    for before it starts, so the first ``P`` batches and the slots of batches ``j - 2 < s`` are free.
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

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Order the samples for ``epoch``; the next iteration (only) starts at batch ``start_batch``.

        Raises:
            ValueError: ``start_batch`` is not in ``[0, len(self)]``.
        """
        self.batches.set_epoch(epoch, start_batch)

    def close(self) -> None:
        """End the loader's worker processes and unpin its buffers; the object cannot iterate again."""
        for event in filter(None, self.copied):  # no copy may still read a buffer being unpinned
            event.synchronize()
        if self.loader is not None:
            self.loader = None
            gc.collect()  # the persistent workers end when their iterator is collected
        self.slots.close()

    def _wait_slot(self, batch_no: int) -> None:
        event = self.copied[batch_no % self.slots.k]
        if event is not None:
            event.synchronize()

    def _source(self):
        if self.loader is not None:
            for event in filter(None, self.copied):  # a previous, abandoned epoch may still be copying
                event.synchronize()
            first = self.batches.start  # iter() takes it from self.batches
            it = iter(self.loader)
            for j in range(first, len(self.batches)):
                self._wait_slot(j - 2)  # receiving batch j releases batch j + P to a worker
                yield self._checked(next(it))
        else:
            for batch_no, indices in self.batches:
                self._wait_slot(batch_no)
                yield self._checked(self.filler[(batch_no, indices)])

    @staticmethod
    def _checked(filled: FilledBatch) -> tuple[int, torch.Tensor]:
        """``(batch_no, indices)`` of a filled batch; raises UserError with its read error."""
        if filled.error is not None:
            raise UserError(filled.error)
        return filled.batch_no, filled.indices

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
    and reused, so generation costs nothing per step) and dummy indices; ``n_batches - start_batch``
    after ``set_epoch(epoch, start_batch)``.
    """

    def __init__(self, n_batches: int, batch_size: int, n_channels: int, img_size, device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        shape = (batch_size, n_channels, *img_size)
        self.inp = torch.randn(shape, generator=gen, device=device)
        self.tar = torch.randn(shape, generator=gen, device=device)
        self.idx = torch.arange(batch_size)
        self.n_batches = n_batches
        self.start = 0  # first batch of the next iteration

    def __len__(self) -> int:
        return self.n_batches

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next iteration (only) starts at batch ``start_batch`` (the batches do not depend on the epoch).

        Raises:
            ValueError: ``start_batch`` is not in ``[0, len(self)]``.
        """
        check_start_batch(start_batch, self.n_batches)
        self.start = start_batch

    def __iter__(self):
        start, self.start = self.start, 0
        return ((self.inp, self.tar, self.idx) for _ in range(start, self.n_batches))

    def close(self) -> None:
        """Free the device tensors; the object cannot iterate again."""
        self.inp = self.tar = None


@dataclass
class Data:
    """Everything the training loop needs from the data side.

    ``train``/``valid`` iterate normalized device batches; ``train_dataset``/``valid_dataset``
    read their raw samples (None for synthetic data); ``latitude`` is ``(H,)`` degrees.
    """

    train: DeviceBatches | SyntheticBatches
    valid: DeviceBatches | SyntheticBatches
    stats: Stats
    channel_names: list[str]
    latitude: np.ndarray
    train_samples: int
    train_dataset: ERA5Dataset | None = None
    valid_dataset: ERA5Dataset | None = None

    def close(self) -> None:
        """Release both splits' workers, pinned buffers, DALI pipelines and device tensors."""
        self.train.close()
        self.valid.close()

    def find_nonfinite(self, indices: Iterable[int], split: str = "train") -> list[str]:
        """Origins (e.g. ``valid/2001.h5 time 5 -> 6``) of the samples among ``indices`` (global
        sample indices of ``split``, ``"train"`` or ``"valid"``) whose input or target holds NaN/Inf;
        empty for synthetic data.

        Raises:
            ValueError: unknown ``split``.
            UserError: a sample cannot be read.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        dataset = self.train_dataset if split == "train" else self.valid_dataset
        if dataset is None:
            return []
        bad = []
        for idx in indices:
            inp, tar, _ = dataset[idx]
            if not (torch.isfinite(inp).all() and torch.isfinite(tar).all()):
                bad.append(dataset.describe(idx))
        return bad


def equiangular_latitudes(h: int) -> np.ndarray:
    """Latitudes (degrees, north to south) of an ``h``-row grid spanning 90 to -90 inclusive."""
    return np.linspace(90.0, -90.0, h)


def read_metadata(path: Path, n_channels: int, h: int) -> tuple[list[str], np.ndarray]:
    """Channel names and the first ``h`` latitudes of one file of the layout.

    Returns:
        ``n_channels`` names from attr ``channel_names`` of ``fields`` (``c0, c1, ...`` when it is
        missing, unreadable or of another length: names only label logs), and float64 ``(h,)``
        degrees from dataset ``latitude`` (equiangular, :func:`equiangular_latitudes`, without one).

    Raises:
        UserError: h5py cannot read the file, or ``latitude`` is not a 1-D numeric array of at
            least ``h`` finite values in [-90, 90] (it weights the metrics); names the file.
    """
    try:
        with h5py.File(path, "r") as f:
            names = _channel_names(f[FIELDS], n_channels)
            lat = _latitudes(f[LATITUDE], path, h) if LATITUDE in f else equiangular_latitudes(h)
    except OSError as exc:
        raise UserError(f"cannot read the metadata of {path} ({_one_line(exc)}); the file is damaged: "
                        "re-create it with the data tools") from None
    return names, lat


def _channel_names(fields: h5py.Dataset, n_channels: int) -> list[str]:
    try:
        names = fields.attrs.get(CHANNEL_NAMES)
    except (OSError, TypeError, ValueError):  # an attribute type h5py cannot read
        names = None
    if (not isinstance(names, np.ndarray) or names.ndim != 1 or len(names) != n_channels
            or names.dtype.kind not in "OSU"):
        return [f"c{i}" for i in range(n_channels)]
    return [n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names]


def _latitudes(node: h5py.Dataset | h5py.Group, path: Path, h: int) -> np.ndarray:
    """The first ``h`` entries of the ``latitude`` dataset ``node``, checked (see :func:`read_metadata`)."""
    fix = "re-create the file with the data tools (python -m tools.convert_era5)"
    if not isinstance(node, h5py.Dataset):
        raise UserError(f"{path}: '{LATITUDE}' is not a dataset; {fix}")
    if node.dtype.kind not in "iuf" or node.ndim != 1 or node.shape[0] < h:
        raise UserError(f"{path}: '{LATITUDE}' must be a 1-D numeric array of at least {h} values (the "
                        f"img_size height), got {node.dtype} of shape {node.shape}; {fix}")
    lat = node[()].astype(np.float64)
    if not np.isfinite(lat).all():
        raise UserError(f"{path}: '{LATITUDE}' holds {int((~np.isfinite(lat)).sum())} NaN/Inf value(s); {fix}")
    if np.abs(lat).max() > 90:
        raise UserError(f"{path}: '{LATITUDE}' runs from {lat.min():g} to {lat.max():g}, outside [-90, 90] "
                        f"degrees; {fix}")
    return lat[:h]


def make_sampler(dataset: ERA5Dataset, seed: int, train: bool, dp_rank: int, dp_size: int) -> DistributedSampler:
    """The sample order shared by the native and DALI loaders: shuffled per epoch for training,
    sharded over data-parallel ranks, dropping the tail that does not divide over the ranks."""
    return DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=train,
                              seed=seed, drop_last=True)


def check_valid_split(valid_ds: ERA5Dataset, dp_size: int, limit: int | None) -> None:
    """Raise UserError when some data-parallel rank would get no validation sample.

    The sampler gives each rank ``len // dp_size`` samples (the tail is dropped), so with fewer
    samples than ranks validation would run on nothing and report a meaningless loss.
    """
    n = len(valid_ds)
    if n >= dp_size:
        return
    more = "raise --limit_nsamples_val or add" if n == limit else "add"
    raise UserError(f"the validation split {valid_ds.directory} has {n} sample(s) for {dp_size} data-parallel "
                    f"ranks, so some ranks would validate on nothing; {more} validation files, or use at most "
                    f"{n} data-parallel rank(s)")


def build_data(cfg: DataConfig, batch_size: int, dp_rank: int, dp_size: int, device: torch.device,
               seed: int = 0) -> Data:
    """Build the train/valid iterables selected by ``cfg.data_loader_config``.

    ``batch_size`` is the local (per data-parallel rank) batch size; each data-parallel rank
    sees a disjoint shard of the samples (DistributedSampler, order from ``seed``),
    tensor/context-parallel peers the same one. Raises UserError for bad data or paths.
    """
    c, img = cfg.n_in_channels, tuple(cfg.img_size)
    if cfg.data_loader_config == "synthetic":
        n_train = cfg.limit_nsamples or 512
        n_valid = cfg.limit_nsamples_val or 128
        steps = max(1, n_train // (batch_size * dp_size))
        train = SyntheticBatches(steps, batch_size, c, img, device, seed)
        valid = SyntheticBatches(max(1, math.ceil(n_valid / (batch_size * dp_size))), batch_size, c, img, device,
                                 seed + 1)
        return Data(train, valid, Stats.identity(c, img, device), [f"c{i}" for i in range(c)],
                    equiangular_latitudes(img[0]), steps * batch_size * dp_size)
    root = Path(cfg.data_path)
    train_ds = ERA5Dataset(root / "train", c, img, cfg.dt, cfg.limit_nsamples)
    valid_ds = ERA5Dataset(root / "valid", c, img, cfg.dt, cfg.limit_nsamples_val)
    if len(train_ds) < batch_size * dp_size:
        raise UserError(f"{len(train_ds)} training samples are fewer than one global batch "
                        f"({batch_size} x {dp_size} ranks); lower --global_batch_size")
    check_valid_split(valid_ds, dp_size, cfg.limit_nsamples_val)
    stats = Stats.load(root / "stats", c, img, device)
    names, lat = read_metadata(train_ds.files[0].path, c, img[0])
    if cfg.data_loader_config == "dali":
        from utils.dali_loader import dali_batches
        train, valid = (dali_batches(ds, make_sampler(ds, seed, is_train, dp_rank, dp_size), batch_size,
                                     is_train, cfg.num_data_workers, device, stats)
                        for ds, is_train in ((train_ds, True), (valid_ds, False)))
    else:
        ring = DeviceRing(device) if device.type == "cuda" else None
        train, valid = (DeviceBatches(ds, make_sampler(ds, seed, is_train, dp_rank, dp_size), batch_size,
                                      is_train, cfg.num_data_workers, device=device, stats=stats, ring=ring)
                        for ds, is_train in ((train_ds, True), (valid_ds, False)))
    n_train = (len(train_ds) // dp_size // batch_size) * batch_size * dp_size
    return Data(train, valid, stats, names, lat, n_train, train_ds, valid_ds)

