"""NVIDIA DALI data loader (``--data_loader_config dali``): the same batches as the native loader.

Each data-parallel rank runs one DALI pipeline per split (train, valid), built lazily on first
iteration::

    fn.external_source(parallel=True, batch=False)   per-sample callback in py_num_workers spawned
        |  raw float32 (C, H, W) input, (k, C, H, W) targets,   processes, reading HDF5 with h5py
        |  int64 index, uint8 read error (empty: none)
        |  .gpu()                                        on CUDA only
        v  (x - mean) / std                              DALI arithmetic, mean/std (C, 1, 1) constants
    torch tensors via DLPack (no copy: the dynamic executor gives every batch its own buffers)

Read errors: DALI re-raises an exception of a parallel callback as a plain ``Exception`` whose
message is the worker's traceback, so the callback returns a read error (the ``UserError``
message, UTF-8) as a fourth output instead, and the loader raises it as a one-line ``UserError``.

Equality with the native loader holds by construction: the callback takes the sample order
from the native loader's sampler (``utils.data.dataset.make_sampler``: same seed, ``set_epoch``),
splits it into batches with the same last-batch policy, and reads samples with the same
``ERA5Dataset.read_sample``. Batches are ``(inp (B, C, H, W), tar (B, k, C, H, W), idx (B,))`` as
the native loader's, ``k`` the dataset's ``target_steps``.

Last batch: DALI pipelines run fixed-size batches, so an epoch is always a whole number of
batches. Training drops the incomplete last batch (as the native ``drop_last=True``); validation
pads it with zero samples (index -1, nothing is read) and trims them off before yielding, so
its last batch is short, like the native loader's.

Epochs: the worker processes cannot see ``set_epoch``, and DALI starts a new epoch only after a
``reset``, which empties its prefetch queues. So a pipeline runs one DALI epoch without end: the
callback maps its running sample position to an epoch and a position in it (counted from the epoch
asked for when it was built), and the workers read the next epoch's first batches while this
epoch's last ones are used. A pipeline is reused while the epochs asked for follow each other; one whose
epoch was not iterated to the end runs on to the batch asked for when at most ``DRAIN_LIMIT`` batches
lie before it (e.g. under gradient accumulation; those batches are dropped), else it is rebuilt (new
workers). Without shuffling every epoch has the same order, so validation passes run on as well.

Starting mid-epoch (``set_epoch(epoch, start_batch)``, exact resume): a pipeline is built whose
running position starts ``start_batch`` batches into ``epoch`` (the skipped samples are never read).
A pipeline already built is reused only if that batch is at most ``DRAIN_LIMIT`` batches ahead of it.
"""

from __future__ import annotations

import gc
import math
import os
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from utils.core.errors import UserError
from utils.data.dataset import ERA5Dataset, check_start_batch
from utils.data.stats import Stats

# run on past at most this many unused batches to reach the one asked for; rebuild the pipeline otherwise
DRAIN_LIMIT = 4
PREFETCH_DEPTH = 2  # batches prepared ahead, by the workers and by the pipeline
NO_ERROR = np.zeros(0, np.uint8)  # the error output of a sample that was read
INSTALL_HINT = ("--data_loader_config dali needs NVIDIA DALI: pip install '.[dali]' (nvidia-dali-cuda120; "
                "on CUDA 13 systems pip install nvidia-dali-cuda130), or use --data_loader_config pytorch")


def _import_dali():
    """Import DALI lazily (an optional dependency). Raises UserError with an install hint."""
    try:
        import nvidia.dali  # noqa: F401
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline
    except ImportError as exc:
        raise UserError(f"{INSTALL_HINT} ({exc})") from None
    return Pipeline, fn, types


class SampleSource:
    """Per-sample ``fn.external_source`` callback: ``SampleInfo`` -> ``(inp, tar, index, error)``.

    ``inp`` float32 ``(C, H, W)`` and ``tar`` float32 ``(k, C, H, W)`` are raw fields of
    ``sampler.dataset`` (an ERA5Dataset with ``k = target_steps``; cropped, not normalized),
    ``index`` a 0-d int64 array, ``error`` uint8 ``(n,)``: empty, or
    the UTF-8 message of the UserError that reading the sample raised (``inp``/``tar`` are then
    zeros). The pipeline's DALI epoch never ends: its sample position ``p`` is position
    ``s = start_batch * batch_size + p`` from the start of ``epoch``, that is position ``s % L`` of
    epoch ``epoch + s // L`` (``L = n_batches * batch_size``), in the sampler's order of that epoch;
    positions ``[len(sampler), L)`` of an epoch are padding: zeros with index -1.

    Picklable for ``py_start_method="spawn"``: HDF5 handles are opened lazily in each worker
    and dropped when pickling.
    """

    def __init__(self, sampler: DistributedSampler, *, batch_size: int, n_batches: int, epoch: int,
                 start_batch: int):
        self.sampler = sampler
        self.epoch_len = n_batches * batch_size
        self.epoch = epoch
        self.skip = start_batch * batch_size  # samples of ``epoch`` before the first one
        self._order: list[int] = []
        self._order_epoch: int | None = None

    def __getstate__(self):
        # the dataset pickles without its HDF5 handles (ERA5Dataset.__getstate__): workers open their own
        return {**self.__dict__, "_order": [], "_order_epoch": None}

    def order(self, epoch: int) -> list[int]:
        """This rank's global sample indices for ``epoch``, in the native loader's order."""
        if epoch != self._order_epoch:
            self.sampler.set_epoch(epoch)
            self._order, self._order_epoch = list(self.sampler), epoch
        return self._order

    def __call__(self, info):
        epoch, pos = divmod(self.skip + info.idx_in_epoch, self.epoch_len)
        order = self.order(self.epoch + epoch)
        if pos >= len(order):  # padding of the last validation batch
            return self._blank(-1, b"")
        ds = self.sampler.dataset
        index = order[pos]
        try:
            inp, tar = ds.read_sample(index)
        except UserError as exc:
            return self._blank(index, str(exc).encode())
        return inp, tar, np.array(index, np.int64), NO_ERROR

    def _blank(self, index: int, error: bytes):
        """Zero fields for sample ``index`` with read ``error`` (see the class docstring)."""
        ds = self.sampler.dataset
        shape = (ds.n_channels, *ds.img_size)
        return (np.zeros(shape, np.float32), np.zeros((ds.target_steps, *shape), np.float32),
                np.array(index, np.int64), np.frombuffer(error, np.uint8))


class DaliBatches:
    """Normalized ``(inp, tar, index)`` batches from a DALI pipeline; a drop-in for ``DeviceBatches``.

    ``sampler`` orders and shards the samples of ``dataset`` (the native loader's, see
    ``make_sampler``); ``train`` drops the incomplete last batch, otherwise it is kept. Yields
    ``inp`` float32 ``(B, C, H, W)`` and ``tar`` float32 ``(B, k, C, H, W)`` (``k`` the dataset's
    ``target_steps``) on ``device`` (normalized with ``stats``) and ``index`` int64 ``(B,)`` on the
    CPU; ``B`` is ``batch_size`` except for the last validation batch. On CUDA the pipeline runs on
    ``device`` (``.gpu()``, normalization there); on the CPU it is a CPU-only pipeline
    (``device_id=None``). Only the newest iterator of a loader may be used.
    After ``set_epoch(epoch, start_batch)`` the next iteration yields only the batches
    ``start_batch, ..., len - 1`` of the epoch.

    Raises:
        UserError: DALI is not installed; while iterating, a sample cannot be read (the message
            names the file and time index; the pipeline is closed).
    """

    def __init__(self, dataset: ERA5Dataset, sampler: DistributedSampler, *, batch_size: int, train: bool,
                 num_workers: int, device: torch.device, stats: Stats):
        self._dali = _import_dali()
        self.dataset, self.sampler, self.batch_size, self.train = dataset, sampler, batch_size, train
        self.num_workers = max(1, num_workers)  # the parallel source needs at least one worker
        self.device = device
        n_channels = stats.mean.shape[1]
        # constants baked into the pipeline, shape (C, 1, 1) to broadcast over (C, H, W) samples
        self._mean, self._std = (t.detach().to("cpu", torch.float32).numpy().reshape(n_channels, 1, 1)
                                 for t in (stats.mean, stats.std))
        self.n_real = len(sampler)
        self.n_batches = self.n_real // batch_size if train else math.ceil(self.n_real / batch_size)
        self.epoch = 0
        self.start = 0  # first batch of the next iteration
        self._pipe = None
        self._pipe_epoch = 0  # epoch of the pipeline's current DALI epoch
        self._pos = 0  # number in its epoch of the pipeline's next batch (> 0: mid-epoch)
        self._token = 0  # identifies the newest iterator

    def __len__(self) -> int:
        return self.n_batches

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Iterate ``epoch`` next; that iteration (only) starts at batch ``start_batch``.

        Raises:
            ValueError: ``start_batch`` is not in ``[0, len(self)]``.
        """
        check_start_batch(start_batch, self.n_batches)
        self.epoch, self.start = epoch, start_batch

    # ------------------------------------------------------------------ pipeline
    def _build(self, epoch: int, start_batch: int):
        Pipeline, fn, types = self._dali
        cuda = self.device.type == "cuda"
        device_id = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if cuda else None
        c, (h, w), k = self.dataset.n_channels, self.dataset.img_size, self.dataset.target_steps
        source = SampleSource(self.sampler, batch_size=self.batch_size, n_batches=self.n_batches, epoch=epoch,
                              start_batch=start_batch)
        pipe = Pipeline(batch_size=self.batch_size, num_threads=max(1, min(4, os.cpu_count() or 1)),
                        device_id=device_id, prefetch_queue_depth=PREFETCH_DEPTH, exec_dynamic=True,
                        py_num_workers=self.num_workers, py_start_method="spawn")
        with pipe:
            inp, tar, idx, error = fn.external_source(source, num_outputs=4, batch=False, parallel=True,
                                                      prefetch_queue_depth=PREFETCH_DEPTH,
                                                      bytes_per_sample_hint=(1 + k) * 4 * c * h * w + 64)
            where = "gpu" if cuda else "cpu"
            if cuda:
                inp, tar = inp.gpu(), tar.gpu()
            mean = types.Constant(self._mean, device=where)
            std = types.Constant(self._std, device=where)
            # same float32 operations, in the same order, as DeviceBatches: (x - mean) / std
            pipe.set_outputs((inp - mean) / std, (tar - mean) / std, idx, error)
        pipe.build()  # spawns the workers
        self._pipe, self._pipe_epoch, self._pos = pipe, epoch, start_batch

    def close(self) -> None:
        """Shut the pipeline down and end its worker processes (a later iteration builds a new one)."""
        self._token += 1  # iterators made before cannot go on
        self._release()

    def _release(self) -> None:
        if self._pipe is not None:
            self._pipe = None
            # DALI ends the workers when the Pipeline object is collected; it may sit in a cycle
            gc.collect()

    def _run(self):
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        return self._pipe.run(stream)  # CUDA outputs are ordered on the consumer's stream

    def _advance(self) -> None:
        self._pos += 1
        if self._pos == self.n_batches:
            self._pipe_epoch, self._pos = self._pipe_epoch + 1, 0

    def _prepare(self, epoch: int, start_batch: int) -> None:
        """Leave a pipeline whose next batch is batch ``start_batch`` of ``epoch``: the running one, after
        dropping at most ``DRAIN_LIMIT`` batches before it, or a new one."""
        if self._pipe is not None:
            if not self.sampler.shuffle:  # every epoch has the same order: the next one serves too
                epoch = self._pipe_epoch + (start_batch < self._pos)
            skip = (epoch - self._pipe_epoch) * self.n_batches + start_batch - self._pos
            if 0 <= skip <= DRAIN_LIMIT:
                for _ in range(skip):
                    self._run()  # a batch nobody uses: its read error, if any, does not matter
                    self._advance()
                return
            self._release()
        self._build(epoch, start_batch)

    # ------------------------------------------------------------------ iteration
    def _to_torch(self, outputs, n: int):
        """``(inp, tar, index)`` pipeline outputs as torch tensors, trimmed to ``n`` samples (the padding of the
        last validation batch off)."""
        inp, tar, idx = (torch.from_dlpack(out.as_tensor()) for out in outputs)
        if n < self.batch_size:
            inp, tar, idx = inp[:n], tar[:n], idx[:n]
        return inp, tar, idx

    def _batches(self, token: int, epoch: int, start: int) -> Iterator:
        for batch_no in range(start, self.n_batches):
            if token != self._token:
                raise RuntimeError("this DALI batch iterator was superseded: the loader was iterated again "
                                   "or closed since")
            if batch_no == start:
                self._prepare(epoch, start)
            try:
                outputs = self._run()
            except StopIteration:
                self.close()
                raise RuntimeError(f"DALI pipeline ended at batch {self._pos} of {self.n_batches}") from None
            except BaseException:
                self.close()  # e.g. a bug in the callback: the pipeline's state is unknown
                raise
            n = min(self.batch_size, self.n_real - self._pos * self.batch_size)
            self._advance()
            *batch, errors = outputs
            error = read_error(errors)
            if error is not None:
                self.close()  # the pipeline's workers are past this batch: the epoch cannot be completed
                raise UserError(error)
            yield self._to_torch(batch, n)

    def __iter__(self) -> Iterator:
        self._token += 1
        start, self.start = self.start, 0
        return self._batches(self._token, self.epoch, start)


def read_error(errors) -> str | None:
    """The first read error of a batch's uint8 error output (a CPU ``TensorList``), or None."""
    for i, shape in enumerate(errors.shape()):
        if shape[0]:
            return np.asarray(errors[i]).tobytes().decode()
    return None


def dali_batches(dataset: ERA5Dataset, sampler: DistributedSampler, batch_size: int, train: bool,
                 num_workers: int, device: torch.device, stats: Stats) -> DaliBatches:
    """The DALI counterpart of the native ``DeviceBatches`` for one split of one data-parallel rank.

    ``sampler`` orders the samples (``utils.data.dataset.make_sampler``, shared with the native
    loader); ``stats`` holds the mean/std ``(1, C, 1, 1)`` used to normalize; ``num_workers`` 0
    means 1 worker.

    Raises:
        UserError: DALI is not installed.
    """
    return DaliBatches(dataset, sampler, batch_size=batch_size, train=train, num_workers=num_workers,
                       device=device, stats=stats)
