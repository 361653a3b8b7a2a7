"""The native loader: DataLoader workers read samples straight into page-locked shared batch slots, and
the next batch is copied to the GPU and normalized there on a side stream while the current one is used."""

from __future__ import annotations

import gc
import math
import resource
from typing import Iterator, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from utils.core.errors import UserError, free_space
from utils.data.dataset import ERA5Dataset, check_start_batch
from utils.data.stats import Stats


def shared_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor of ``shape`` in shared memory (a file of ``/dev/shm``, which the workers map).

    Raises:
        UserError: the file cannot be made that large: the process's file-size limit (``ulimit -f``) is below it,
            or ``/dev/shm`` is full; naming the sizes and what to do.
    """
    buf = torch.empty(shape, dtype=torch.float32)
    try:
        return buf.share_memory_()
    except RuntimeError as exc:  # torch's "unable to resize file ...: File too large (27)" / "No space left"
        if not any(word in str(exc) for word in ("File too large", "No space left", "unable to resize")):
            raise
        size = f"{buf.nbytes / 2**20:.1f} MiB"
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and limit < buf.nbytes:
            raise UserError(f"the loader's shared-memory batch buffers ({size}) exceed this process's file-size "
                            f"limit ({limit / 2**10:.0f} KiB, ulimit -f); raise it (ulimit -f unlimited), which "
                            "checkpoints and logs need too") from None
        raise UserError(f"the loader's shared-memory batch buffers ({size}) do not fit in /dev/shm "
                        f"({free_space('/dev/shm')}); free space there, or lower --local_batch_size or "
                        "--num_data_workers") from None


class BatchSlots:
    """``K`` host buffers, each holding one batch ``(1 + k, B, C, H, W)`` float32: the input, then
    the ``k = target_steps`` targets (time first, so each state of the batch is contiguous).

    The buffers live in shared memory so DataLoader workers (forked or spawned) write samples
    straight into them with h5py ``read_direct``; with ``pin=True`` they are also page-locked
    (``cudaHostRegister``) so the host-to-device copy is a direct, asynchronous DMA. No other
    host copy of a batch is made (no collate, no pin-memory thread).
    """

    def __init__(self, k: int, batch_size: int, n_channels: int, img_size, pin: bool, *, target_steps: int):
        self.k, self.pinned = k, False  # pinned first: __del__ of a half-built object reads it
        self.buf = shared_buffer((k, 1 + target_steps, batch_size, n_channels, *img_size))
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
    """Batch ``batch_no`` of its epoch, read into host slot ``slot``: its sample ``indices`` (int64 ``(B,)``) and,
    if a sample could not be read, the one-line ``error`` message (the slot's content is then undefined)."""

    slot: int
    batch_no: int
    indices: torch.Tensor
    error: str | None


class SlotFiller(Dataset):
    """Reads one batch per item into its slot: ``(slot, batch_no, indices)`` -> :class:`FilledBatch`.

    Runs in DataLoader workers (or inline without workers). A read error is returned, not raised:
    DataLoader re-raises a worker's exception with the worker's traceback in its message, which would
    break the one-line ``error:`` report.
    """

    def __init__(self, dataset: ERA5Dataset, slots: BatchSlots):
        self.dataset, self.slots = dataset, slots

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item) -> FilledBatch:
        slot_no, batch_no, indices = item
        slot = self.slots.buf[slot_no]
        error = None
        try:
            for j, index in enumerate(indices):
                self.dataset.read_sample(index, inp=slot[0, j].numpy(), tar=slot[1:, j].numpy())
        except UserError as exc:
            error = str(exc)
        return FilledBatch(slot_no, batch_no, torch.as_tensor(indices, dtype=torch.int64), error)


class NumberedBatches(Sampler):
    """The batches of a sampler's epochs, one epoch after another without end.

    ``len`` is the number of batches of one epoch. An iteration yields ``(slot, batch_no, indices)`` for the
    batches ``start, ..., len - 1`` of ``epoch`` (:attr:`origin`), then every batch of ``epoch + 1``,
    ``epoch + 2``, ...; ``batch_no`` numbers a batch in its epoch, ``slot`` is the item's position in the
    iteration modulo ``k``. The DataLoader iterating it hands its workers the next epoch's first batches
    while this epoch's last ones are in use.
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool, k: int):
        self.sampler, self.batch_size, self.drop_last, self.k = sampler, batch_size, drop_last, k
        self.origin = (0, 0)  # (epoch, first batch) of the next iteration

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The sample indices of every batch of ``epoch``."""
        self.sampler.set_epoch(epoch)
        indices = list(self.sampler)
        return [indices[b * self.batch_size:(b + 1) * self.batch_size] for b in range(len(self))]

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        return self._items(*self.origin)

    def _items(self, epoch: int, start: int) -> Iterator[tuple[int, int, list[int]]]:
        position = 0
        while len(self):
            for batch_no, indices in enumerate(self.epoch_batches(epoch)[start:], start):
                yield position % self.k, batch_no, indices
                position += 1
            epoch, start = epoch + 1, 0


class _Stream:
    """A running iteration of the DataLoader over :class:`NumberedBatches`: ``position`` counts the items
    received, ``epoch`` and ``batch`` say which batch comes next."""

    def __init__(self, iterator: Iterator[FilledBatch], epoch: int, batch: int, n_batches: int):
        self.iterator, self.epoch, self.batch, self.n_batches = iterator, epoch, batch, n_batches
        self.position = 0

    def advance(self) -> None:
        self.position += 1
        self.batch += 1
        if self.batch == self.n_batches:
            self.epoch, self.batch = self.epoch + 1, 0

    def distance(self, epoch: int, batch: int, same_order: bool) -> int:
        """Items until batch ``batch`` of ``epoch`` comes next (negative: it was passed). With ``same_order``
        (no shuffling) every epoch is the same, so the next epoch's batch serves too."""
        if same_order:
            epoch = self.epoch + (batch < self.batch)
        return (epoch - self.epoch) * self.n_batches + batch - self.batch


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
    Only the newest iterator of a loader may be used (an older one raises RuntimeError).

    The workers never wait for an epoch to start: one DataLoader iteration runs on from epoch to
    epoch (:class:`NumberedBatches`), so while an epoch's last batches are used the workers read the
    next epoch's first ones, and the iteration for the next epoch takes them. An iteration asked for
    another place restarts the workers there, unless it lies at most ``P`` batches ahead (an epoch
    whose last few batches were not used, e.g. under gradient accumulation): those batches, already
    handed to the workers, are received and dropped. Without shuffling every epoch has the same order,
    so validation passes run on from one to the next as well.

    A slot is rewritten only after its copy has finished: a DataLoader with ``P`` batches in
    flight hands out item ``j + P`` of its iteration while item ``j`` is returned, so with
    ``K = P + 2`` slots the slot of ``j + P`` last held item ``j - 2``, whose copy is waited for
    first. A new iteration starts after every copy has finished, so its first ``P`` items find
    their slots free.
    """

    def __init__(self, dataset: ERA5Dataset, sampler: DistributedSampler, batch_size: int, drop_last: bool,
                 num_workers: int, *, device: torch.device, stats: Stats, ring: DeviceRing | None = None):
        self.sampler, self.device, self.stats = sampler, device, stats
        self.cuda = device.type == "cuda"
        self.in_flight = 2 * num_workers  # DataLoader prefetch_factor 2
        self.slots = BatchSlots(self.in_flight + 2 if num_workers else 2, batch_size, dataset.n_channels,
                                dataset.img_size, pin=self.cuda, target_steps=dataset.target_steps)
        self.batches = NumberedBatches(sampler, batch_size, drop_last, self.slots.k)
        self.filler = SlotFiller(dataset, self.slots)
        self.loader = (DataLoader(self.filler, batch_size=None, sampler=self.batches, num_workers=num_workers,
                                  persistent_workers=True, prefetch_factor=2) if num_workers else None)
        self.copied: list = [None] * self.slots.k  # per slot: CUDA event of its last host-to-device copy
        self.ring = ring if ring is not None or not self.cuda else DeviceRing(device)
        self.wanted = (0, 0)  # (epoch, first batch) of the next iteration
        self.stream: _Stream | None = None  # the workers' running iteration
        self.token = 0  # identifies the newest iterator

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Order the samples for ``epoch``; the next iteration (only) starts at batch ``start_batch``.

        Raises:
            ValueError: ``start_batch`` is not in ``[0, len(self)]``.
        """
        check_start_batch(start_batch, len(self))
        self.wanted = (epoch, start_batch)

    def close(self) -> None:
        """End the loader's worker processes and unpin its buffers; the object cannot iterate again."""
        self.token += 1
        self._copies_done()  # no copy may still read a buffer being unpinned
        if self.loader is not None:
            self.stream = self.loader = None
            gc.collect()  # the persistent workers end when their iterator is collected
        self.slots.close()

    def _copies_done(self) -> None:
        for event in filter(None, self.copied):
            event.synchronize()

    def _wait_slot(self, slot: int) -> None:
        event = self.copied[slot % self.slots.k]
        if event is not None:
            event.synchronize()

    def _receive(self) -> FilledBatch:
        """The stream's next item; receiving it hands item ``position + P`` to a worker, into the slot of
        ``position - 2``, whose copy is waited for first."""
        self._wait_slot(self.stream.position - 2)
        filled = next(self.stream.iterator)
        self.stream.advance()
        return filled

    def _stream_at(self, epoch: int, start: int) -> None:
        """Leave a stream whose next item is batch ``start`` of ``epoch``: the running one, after dropping
        at most ``P`` batches before it, or a new one."""
        if self.stream is not None:
            skip = self.stream.distance(epoch, start, same_order=not self.sampler.shuffle)
            if 0 <= skip <= self.in_flight:
                for _ in range(skip):
                    self._receive()  # a batch nobody uses: its read error, if any, does not matter
                return
        self._copies_done()  # an earlier iteration may still be copying out of the slots
        self.batches.origin = (epoch, start)
        self.stream = _Stream(iter(self.loader), epoch, start, len(self))  # (re)starts the workers there

    def _source(self, epoch: int, start: int, token: int):
        """``(slot, indices)`` of the batches ``start, ..., len - 1`` of ``epoch``, read."""
        batches = self.batches.epoch_batches(epoch) if self.loader is None else None
        for batch_no in range(start, len(self)):
            if token != self.token:
                raise RuntimeError("this batch iterator was superseded: the loader was iterated again or closed since")
            if batches is not None:  # no workers: read here
                slot = batch_no % self.slots.k
                self._wait_slot(slot)
                yield self._checked(self.filler[(slot, batch_no, batches[batch_no])])
                continue
            if batch_no == start:
                self._stream_at(epoch, start)
            yield self._checked(self._receive())

    @staticmethod
    def _checked(filled: FilledBatch) -> tuple[int, torch.Tensor]:
        """``(slot, indices)`` of a filled batch; raises UserError with its read error."""
        if filled.error is not None:
            raise UserError(filled.error)
        return filled.slot, filled.indices

    def _to_device(self, slot: int, indices: torch.Tensor, out: torch.Tensor | None = None):
        """Copy a batch out of its slot (into ``out`` on CUDA) and normalize it: ``(inp, tar, indices)``."""
        n = len(indices)
        host = self.slots.buf[slot, :, :n]
        if out is None:  # CPU: normalization writes a new tensor, so the slot is free at once
            data = (host - self.stats.mean) / self.stats.std
        else:
            data = out[:, :n]
            data.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.copied[slot] = event
            data.sub_(self.stats.mean).div_(self.stats.std)
        return data[0], data[1:].transpose(0, 1), indices

    def __iter__(self) -> Iterator:
        (epoch, start), self.wanted = self.wanted, (self.wanted[0], 0)
        self.token += 1
        source = self._source(epoch, start, self.token)
        if not self.cuda:
            return (self._to_device(*item) for item in source)
        return self._device_batches(source)

    def _device_batches(self, source) -> Iterator:
        # Batch j + 1 is copied while step j runs, into the buffer of batch j - 2, which the
        # compute stream has finished with once it gets past step j - 1.
        ring = self.ring.buffers(tuple(self.slots.buf.shape[1:]))
        stream = self.ring.stream
        compute = torch.cuda.current_stream(self.device)

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
