"""The native loader: DataLoader workers read samples straight into page-locked shared batch slots, and
the next batch is copied to the GPU and normalized there on a side stream while the current one is used."""

from __future__ import annotations

import gc
import math
from typing import Iterator, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from utils.core.errors import UserError
from utils.data.dataset import ERA5Dataset, check_start_batch
from utils.data.stats import Stats


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
