"""Data loading: HDF5 files in the ERA5 layout -> normalized (input, targets) batches on the device.

Layout (written by ``tools/make_synthetic_data.py`` and ``tools/convert_era5.py``)::

    <data_path>/train/*.h5, <data_path>/valid/*.h5   dataset ``fields`` (T, C, H, W) float32,
                                                     attrs ``channel_names``; dataset ``latitude`` (H,)
    <data_path>/stats/global_means.npy, global_stds.npy   (1, C, 1, 1) float32
    <data_path>/stats/time_means.npy                      (1, C, H, W) float32 (climatology)

A sample is ``(fields[t], fields[t + dt], ..., fields[t + k*dt])`` from one file, cropped to
``img_size`` from the top-left (north-west) corner: an input and ``k`` targets (``k = 1`` for
training; more for rollout evaluation, one per lead). Workers read raw float32 fields straight
into page-locked batch buffers; :class:`DeviceBatches` copies the next batch to the GPU on a side
stream (overlapping compute) and normalizes it there, ``(x - mean) / std``.

Every loader (:class:`DeviceBatches`, ``utils.dali_loader.DaliBatches``, :class:`SyntheticBatches`)
yields ``(inp, tar, idx)``: ``inp`` float32 ``(B, C, H, W)``, ``tar`` float32 ``(B, k, C, H, W)``
(``tar[:, j - 1]`` is ``j*dt`` after the input), both normalized, ``idx`` int64 ``(B,)``.
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

from tools.era5_layout import (ATTR_CALENDAR, ATTR_CHANNEL_NAMES, ATTR_DT_HOURS, ATTR_START_TIME, FIELDS, LATITUDE,
                               LONGITUDE)
from utils.errors import UserError
from utils.schema import DataConfig

DEFAULT_STEP_HOURS = 6.0
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
    """Samples ``(x_t, x_{t+dt}, ..., x_{t+k*dt})`` from every ``*.h5`` file in ``directory``.

    ``k`` is ``target_steps`` (training: 1; rollout evaluation: one target per lead). A file of
    ``T`` time steps holds ``T - k*dt`` initial times ``t``; with ``init_every`` n only
    ``t = 0, n, 2n, ...`` of each file are samples (``limit_nsamples`` then caps the total).

    Items are ``(inp, tar, index)``: ``inp`` float32 ``(C, H, W)``, ``tar`` float32
    ``(k, C, H, W)`` (``tar[j - 1]`` is the state ``j*dt`` after the input), both in physical
    units (not normalized), ``index`` the global sample index (for error messages).

    Raises:
        ValueError: ``target_steps`` or ``init_every`` below 1.
        UserError: missing directory or files, a file without ``fields``, wrong rank, dtype
            or channel count, a grid smaller than ``img_size``, or files too short for
            ``target_steps * dt``.
    """

    def __init__(self, directory: str | Path, n_channels: int, img_size: tuple[int, int], dt: int,
                 limit_nsamples: int | None = None, *, target_steps: int = 1, init_every: int = 1):
        if target_steps < 1 or init_every < 1:
            raise ValueError(f"target_steps and init_every must be >= 1, got {target_steps} and {init_every}")
        self.directory = Path(directory)
        self.img_size = tuple(img_size)
        self.dt = dt
        self.n_channels = n_channels
        self.target_steps, self.init_every = target_steps, init_every
        self.files = self._inspect(n_channels)
        self._check_lengths()
        lead = target_steps * dt  # file steps from the input to the last target
        per_file = [-(-(f.n_times - lead) // init_every) for f in self.files]
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
        return FileInfo(path, t)

    def _check_lengths(self) -> None:
        """Raise UserError when the shortest file has no initial time for ``target_steps * dt``."""
        short = min(self.files, key=lambda f: f.n_times)
        k, dt = self.target_steps, self.dt
        if short.n_times > k * dt:
            return
        if k == 1:
            raise UserError(f"{short.path} has {short.n_times} time steps, too few for dt={dt}; lower --dt")
        fits = (short.n_times - 1) // dt
        fix = f"use at most {fits} rollout steps" if fits else "lower --dt"
        raise UserError(f"{short.path} has {short.n_times} time steps, too few for {k} rollout steps of "
                        f"dt={dt} ({k * dt + 1} needed); {fix}")

    def __len__(self) -> int:
        return self.n_samples

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (file number, input time index in that file)."""
        if not 0 <= index < self.n_samples:
            raise IndexError(index)
        file_no = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return file_no, (index - int(self.offsets[file_no])) * self.init_every

    def target_times(self, t: int) -> range:
        """File time indices of the targets of the sample whose input is at time ``t``."""
        return range(t + self.dt, t + self.target_steps * self.dt + 1, self.dt)

    def describe(self, index: int) -> str:
        """Human-readable origin of a sample, e.g. ``train/2000.h5 time 12 -> 13`` (one target),
        ``valid/2001.h5 time 4 -> 5..8`` (four, dt 1) or ``time 4 -> 6..10 every 2`` (three, dt 2)."""
        file_no, t = self.locate(index)
        path = self.files[file_no].path
        times = self.target_times(t)
        leads = str(times[0]) if len(times) == 1 else f"{times[0]}..{times[-1]}"
        every = f" every {self.dt}" if len(times) > 1 and self.dt > 1 else ""
        return f"{path.parent.name}/{path.name} time {t} -> {leads}{every}"

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

    def read_sample(self, index: int, inp: np.ndarray | None = None,
                    tar: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Read sample ``index`` as float32 ``(C, H, W)`` input and ``(k, C, H, W)`` targets (into
        ``inp``/``tar``; each ``tar[j]`` must be contiguous, ``tar`` itself need not be).

        Raises:
            UserError: a state cannot be read (see :meth:`read`).
        """
        file_no, t = self.locate(index)
        if tar is None:
            tar = np.empty((self.target_steps, self.n_channels, *self.img_size), dtype=np.float32)
        inp = self.read(file_no, t, inp)
        for out, time in zip(tar, self.target_times(t)):  # one read per state: nothing beyond the k targets
            self.read(file_no, time, out)
        return inp, tar

    def __getitem__(self, index: int):
        inp, tar = self.read_sample(index)
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
    """``K`` host buffers, each holding one batch ``(1 + k, B, C, H, W)`` float32: the input, then
    the ``k = target_steps`` targets (time first, so each state of the batch is contiguous).

    The buffers live in shared memory so DataLoader workers (forked or spawned) write samples
    straight into them with h5py ``read_direct``; with ``pin=True`` they are also page-locked
    (``cudaHostRegister``) so the host-to-device copy is a direct, asynchronous DMA. No other
    host copy of a batch is made (no collate, no pin-memory thread).
    """

    def __init__(self, k: int, batch_size: int, n_channels: int, img_size, pin: bool, *, target_steps: int):
        self.k = k
        self.buf = torch.empty((k, 1 + target_steps, batch_size, n_channels, *img_size),
                               dtype=torch.float32).share_memory_()
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
                self.dataset.read_sample(index, inp=slot[0, j].numpy(), tar=slot[1:, j].numpy())
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
    each batch into a page-locked shared slot ``(1 + k, B, C, H, W)``; on CUDA the next batch is
    copied to the GPU and normalized ``(x - mean) / std`` on a side stream while the current one
    is used, and the compute stream waits on an event. Yields ``inp`` float32 ``(B, C, H, W)``,
    ``tar`` float32 ``(B, k, C, H, W)`` (``k = dataset.target_steps``; a view of the slot's
    targets, so for ``k = 1`` ``tar[:, 0]`` is contiguous) and int64 indices ``(B,)``; the last
    incomplete batch is dropped when ``drop_last`` (training), kept otherwise.
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
                                dataset.img_size, pin=self.cuda, target_steps=dataset.target_steps)
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
        """Copy a batch out of its slot (into ``out`` on CUDA) and normalize it: ``(inp, tar, indices)``."""
        n = len(indices)
        host = self.slots.buf[batch_no % self.slots.k, :, :n]
        if out is None:  # CPU: normalization writes a new tensor, so the slot is free at once
            data = (host - self.stats.mean) / self.stats.std
        else:
            data = out[:, :n]
            data.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.copied[batch_no % self.slots.k] = event
            data.sub_(self.stats.mean).div_(self.stats.std)
        return data[0], data[1:].transpose(0, 1), indices

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

    Yields ``n_batches`` times the same standard-normal float32 ``inp`` ``(B, C, H, W)`` and
    ``tar`` ``(B, k, C, H, W)`` (``k = target_steps``; made once and reused, so generation costs
    nothing per step) and dummy int64 indices ``(B,)``; ``n_batches - start_batch`` batches after
    ``set_epoch(epoch, start_batch)``.

    Raises:
        ValueError: ``target_steps`` below 1.
    """

    def __init__(self, n_batches: int, batch_size: int, n_channels: int, img_size, device, seed: int = 0, *,
                 target_steps: int = 1):
        if target_steps < 1:
            raise ValueError(f"target_steps must be >= 1, got {target_steps}")
        gen = torch.Generator(device=device).manual_seed(seed)
        self.inp = torch.randn((batch_size, n_channels, *img_size), generator=gen, device=device)
        self.tar = torch.randn((batch_size, target_steps, n_channels, *img_size), generator=gen, device=device)
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

    ``train``/``valid`` iterate normalized device batches ``(inp (B, C, H, W), tar (B, k, C, H, W),
    idx (B,))``, ``k`` 1 for training and ``valid_target_steps`` of :func:`build_data` for
    validation; ``train_dataset``/``valid_dataset`` read their raw samples (None for synthetic
    data); ``latitude`` is ``(H,)`` degrees.
    """

    train: DeviceBatches | SyntheticBatches
    valid: DeviceBatches | SyntheticBatches
    stats: Stats
    channel_names: list[str]
    latitude: np.ndarray
    train_samples: int
    train_dataset: ERA5Dataset | None = None
    valid_dataset: ERA5Dataset | None = None
    step_hours: float = DEFAULT_STEP_HOURS  # hours between a file's time steps

    def close(self) -> None:
        """Release both splits' workers, pinned buffers, DALI pipelines and device tensors."""
        self.train.close()
        self.valid.close()

    def find_nonfinite(self, indices: Iterable[int], split: str = "train") -> list[str]:
        """Origins (e.g. ``valid/2001.h5 time 5 -> 6``) of the samples among ``indices`` (global
        sample indices of ``split``, ``"train"`` or ``"valid"``) whose input or any target step
        holds NaN/Inf; empty for synthetic data.

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
            inp, tar, _ = dataset[idx]  # tar: every target step, (k, C, H, W)
            if not (torch.isfinite(inp).all() and torch.isfinite(tar).all()):
                bad.append(dataset.describe(idx))
        return bad


def equiangular_latitudes(h: int) -> np.ndarray:
    """Latitudes (degrees, north to south) of an ``h``-row grid spanning 90 to -90 inclusive."""
    return np.linspace(90.0, -90.0, h)


@dataclass
class TimeAxis:
    """A file's time coordinate: ``start`` (ISO 8601 time of step 0, or None when the file has none),
    its ``calendar`` (CF name) and ``step_hours``; ``longitude`` ``(W,)`` degrees east (equiangular from 0
    when the file has none)."""

    start: str | None
    calendar: str
    step_hours: float
    longitude: np.ndarray

    def time(self, t: int):
        """Time of step ``t``: a cftime datetime in the file's calendar, or hours since step 0 without a start."""
        if self.start is None:
            return t * self.step_hours
        import cftime
        return cftime.num2date(t * self.step_hours, f"hours since {self.start}", calendar=self.calendar)


def read_time_axis(path: Path, w: int) -> TimeAxis:
    """The :class:`TimeAxis` of one file of the layout (``w``: longitudes wanted). Files without
    ``dt_hours`` (older ones, the tutorial's 6-hourly ERA5) get :data:`DEFAULT_STEP_HOURS`.

    Raises:
        UserError: the file cannot be read, or its ``dt_hours`` is not a positive number.
    """
    try:
        with h5py.File(path, "r") as f:
            attrs = f[FIELDS].attrs
            step, start, calendar = (attrs.get(ATTR_DT_HOURS, DEFAULT_STEP_HOURS), attrs.get(ATTR_START_TIME),
                                     attrs.get(ATTR_CALENDAR, "standard"))
            lon = f[LONGITUDE][:w].astype(np.float64) if LONGITUDE in f else np.linspace(0, 360, w, endpoint=False)
    except OSError as exc:
        raise UserError(f"cannot read the metadata of {path} ({_one_line(exc)}); the file is damaged: "
                        "re-create it with the data tools") from None
    try:
        hours = float(step)
    except (TypeError, ValueError):
        hours = math.nan
    if not hours > 0 or math.isinf(hours):
        raise UserError(f"{path}: attribute {ATTR_DT_HOURS}={step!r} is not a positive number of hours; re-create "
                        "the file with the data tools")
    text = lambda v: v.decode() if isinstance(v, bytes) else None if v is None else str(v)  # noqa: E731
    return TimeAxis(text(start), text(calendar), hours, lon)


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
        names = fields.attrs.get(ATTR_CHANNEL_NAMES)
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


def check_split_size(dataset: ERA5Dataset, dp_size: int, limit: int | None, name: str = "validation") -> None:
    """Raise UserError when some data-parallel rank would get no sample of the ``name`` split.

    The sampler gives each rank ``len // dp_size`` samples (the tail is dropped), so with fewer
    samples than ranks a rank would evaluate nothing and report a meaningless loss.
    """
    n = len(dataset)
    if n >= dp_size:
        return
    more = "raise --limit_nsamples_val or add" if n == limit else "add"
    raise UserError(f"the {name} split {dataset.directory} has {n} sample(s) for {dp_size} data-parallel "
                    f"ranks, so some ranks would get no sample; {more} {name} files, or use at most "
                    f"{n} data-parallel rank(s)")


def build_data(cfg: DataConfig, batch_size: int, dp_rank: int, dp_size: int, device: torch.device,
               seed: int = 0, *, valid_target_steps: int = 1, valid_init_every: int = 1) -> Data:
    """Build the train/valid iterables selected by ``cfg.data_loader_config``.

    ``batch_size`` is the local (per data-parallel rank) batch size; each data-parallel rank
    sees a disjoint shard of the samples (DistributedSampler, order from ``seed``),
    tensor/context-parallel peers the same one. Training samples have one target; validation
    samples ``valid_target_steps`` (batches' ``tar`` ``(B, k, C, H, W)``), starting at every
    ``valid_init_every``-th time step of each validation file. Raises UserError for
    bad data or paths (also a validation split too short for ``valid_target_steps``).
    """
    c, img = cfg.n_in_channels, tuple(cfg.img_size)
    if cfg.data_loader_config == "synthetic":
        n_train = cfg.limit_nsamples or 512
        n_valid = (cfg.limit_nsamples_val or 128) // valid_init_every
        steps = max(1, n_train // (batch_size * dp_size))
        train = SyntheticBatches(steps, batch_size, c, img, device, seed)
        valid = SyntheticBatches(max(1, math.ceil(n_valid / (batch_size * dp_size))), batch_size, c, img, device,
                                 seed + 1, target_steps=valid_target_steps)
        return Data(train, valid, Stats.identity(c, img, device), [f"c{i}" for i in range(c)],
                    equiangular_latitudes(img[0]), steps * batch_size * dp_size)
    root = Path(cfg.data_path)
    train_ds = ERA5Dataset(root / "train", c, img, cfg.dt, cfg.limit_nsamples)
    valid_ds = ERA5Dataset(root / "valid", c, img, cfg.dt, cfg.limit_nsamples_val, target_steps=valid_target_steps,
                           init_every=valid_init_every)
    if len(train_ds) < batch_size * dp_size:
        raise UserError(f"{len(train_ds)} training samples are fewer than one global batch "
                        f"({batch_size} x {dp_size} ranks); lower --global_batch_size")
    check_split_size(valid_ds, dp_size, cfg.limit_nsamples_val)
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
    return Data(train, valid, stats, names, lat, n_train, train_ds, valid_ds,
                read_time_axis(train_ds.files[0].path, img[1]).step_hours)


def split_batches(cfg: DataConfig, split: str, batch_size: int, dp_rank: int, dp_size: int, device: torch.device,
                  *, target_steps: int, init_every: int = 1, stats: Stats) -> tuple[DeviceBatches, ERA5Dataset]:
    """The native loader over ``<cfg.data_path>/<split>`` for evaluation, and its dataset.

    Samples have ``target_steps`` targets and start every ``init_every``-th time step of each file
    (``cfg.limit_nsamples*`` do not apply). The order is fixed (no shuffle; the same for every
    epoch), sharded over data-parallel ranks as validation is: rank ``r`` gets samples ``r, r +
    dp_size, ...`` and the tail that does not divide over the ranks is dropped, so every rank runs
    the same number of batches; the last incomplete batch is kept. Reads with
    ``cfg.num_data_workers`` workers whatever ``cfg.data_loader_config`` is; ``stats`` normalize.

    Raises:
        UserError: bad data (see :class:`ERA5Dataset`): also a split too short for ``target_steps``
            (the message says how many fit), or fewer samples than data-parallel ranks.
    """
    dataset = ERA5Dataset(Path(cfg.data_path) / split, cfg.n_in_channels, tuple(cfg.img_size), cfg.dt,
                          target_steps=target_steps, init_every=init_every)
    check_split_size(dataset, dp_size, None, split)
    sampler = make_sampler(dataset, 0, False, dp_rank, dp_size)
    batches = DeviceBatches(dataset, sampler, batch_size, False, cfg.num_data_workers, device=device, stats=stats)
    return batches, dataset
