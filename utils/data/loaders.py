"""Everything the training loop needs from the data side, built from the ``data`` config section.

Every loader (:class:`~utils.data.native.DeviceBatches`, :class:`~utils.data.dali.DaliBatches`,
:class:`~utils.data.synthetic_loader.SyntheticBatches`) follows one protocol, :class:`Batches`: ``len`` is the
batches of an epoch, ``set_epoch(epoch, start_batch)`` orders the next iteration, iterating yields
``(inp, tar, idx)``: ``inp`` float32 ``(B, C, H, W)``, ``tar`` float32 ``(B, k, C, H, W)`` (``tar[:, j - 1]``
is ``j*dt`` after the input), both normalized, ``idx`` int64 ``(B,)``; ``close`` releases workers and buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import numpy as np
import torch

from utils.config.schema import DataConfig
from utils.core.component import Component
from utils.core.errors import UserError
from utils.data.dataset import ERA5Dataset, check_split_size, make_sampler
from utils.data.forcing_source import InputForcings, dataset_forcings, nominal_forcings
from utils.data.layout import DEFAULT_STEP_HOURS, SPLITS
from utils.data.metadata import equiangular_latitudes, read_metadata, read_time_axis
from utils.data.native import DeviceBatches, DeviceRing
from utils.data.stats import Stats
from utils.data.synthetic_loader import SyntheticBatches


class Batches(Protocol):
    """What every loader provides (see the module docstring)."""

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None: ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]: ...

    def close(self) -> None: ...


@dataclass
class Data(Component):
    """Everything the training loop needs from the data side.

    ``train``/``valid`` iterate normalized device batches ``(inp (B, C, H, W), tar (B, k, C, H, W),
    idx (B,))``, ``k`` 1 for training and ``valid_target_steps`` of :func:`build_data` for
    validation; ``train_dataset``/``valid_dataset`` read their raw samples (None for synthetic
    data); ``latitude`` is ``(H,)`` degrees.
    """

    train: Batches
    valid: Batches
    stats: Stats
    channel_names: list[str]
    latitude: np.ndarray
    train_samples: int
    train_dataset: ERA5Dataset | None = None
    valid_dataset: ERA5Dataset | None = None
    step_hours: float = DEFAULT_STEP_HOURS  # hours between a file's time steps
    # (sample indices, rollout step) -> (B, F + S, H, W) input-only channels of each split (forcing_source.py)
    train_forcings: InputForcings | None = None
    valid_forcings: InputForcings | None = None

    def close(self, error: BaseException | None = None) -> None:
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


def build_data(cfg: DataConfig, batch_size: int, dp_rank: int, dp_size: int, device: torch.device,
               seed: int = 0, *, valid_target_steps: int = 1, valid_init_every: int = 1,
               train_target_steps: int = 1) -> Data:
    """Build the train/valid iterables selected by ``cfg.data_loader_config``.

    ``batch_size`` is the local (per data-parallel rank) batch size; each data-parallel rank
    sees a disjoint shard of the samples (DistributedSampler, order from ``seed``),
    tensor/context-parallel peers the same one. Training samples have ``train_target_steps`` targets (rollout
    training: initial times whose targets would run past the end of a run of files are not samples); validation
    samples ``valid_target_steps`` (batches' ``tar`` ``(B, k, C, H, W)``), starting at every
    ``valid_init_every``-th time step of each validation file. Raises UserError for
    bad data or paths (also a split too short for its target steps, naming the largest that fits).
    """
    c, img = cfg.n_in_channels, tuple(cfg.img_size)
    if cfg.data_loader_config == "synthetic":
        n_train = cfg.limit_nsamples or 512
        n_valid = (cfg.limit_nsamples_val or 128) // valid_init_every
        steps = max(1, n_train // (batch_size * dp_size))
        train = SyntheticBatches(steps, batch_size, c, img, device, seed, target_steps=train_target_steps)
        valid = SyntheticBatches(max(1, math.ceil(n_valid / (batch_size * dp_size))), batch_size, c, img, device,
                                 seed + 1, target_steps=valid_target_steps)
        forcings = nominal_forcings(cfg, DEFAULT_STEP_HOURS, device, seed)
        return Data(train, valid, Stats.identity(c, img, device), [f"c{i}" for i in range(c)],
                    equiangular_latitudes(img[0]), steps * batch_size * dp_size,
                    train_forcings=forcings, valid_forcings=forcings)
    root = Path(cfg.data_path)
    train_ds = ERA5Dataset(root / "train", c, img, cfg.dt, cfg.limit_nsamples, target_steps=train_target_steps,
                           steps_flag="train_rollout_steps")
    valid_ds = ERA5Dataset(root / "valid", c, img, cfg.dt, cfg.limit_nsamples_val, target_steps=valid_target_steps,
                           init_every=valid_init_every, steps_flag="valid_rollout_steps")
    if len(train_ds) < batch_size * dp_size:
        raise UserError(f"{len(train_ds)} training samples are fewer than one global batch "
                        f"({batch_size} x {dp_size} ranks); lower --global_batch_size")
    check_split_size(valid_ds, dp_size, cfg.limit_nsamples_val)
    stats = Stats.load(root / "stats", c, img, device)
    names, lat = read_metadata(train_ds.files[0].path, c, img[0])
    forcings = [dataset_forcings(cfg, ds, lat, device) for ds in (train_ds, valid_ds)]  # bad input stops here
    if cfg.data_loader_config == "dali":
        from utils.data.dali import dali_batches
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
                read_time_axis(train_ds.files[0].path, img[1]).step_hours, *forcings)


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
