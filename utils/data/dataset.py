"""The dataset of one split: samples ``(x_t, x_{t+dt}, ..., x_{t+k*dt})`` read from the ``.h5`` files of the
layout (``utils/data/layout.py``), the sample order shared by every loader, and checks of split sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from utils.core.errors import UserError, one_line
from utils.data.layout import FIELDS


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

    def __getstate__(self) -> dict:
        # open HDF5 handles cannot be pickled: a copy sent to a worker process opens its own
        return {**self.__dict__, "_handles": {}}

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
            raise UserError(f"cannot read time {t} of {path} ({one_line(exc)}); the file is damaged or was changed "
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


def check_start_batch(start_batch: int, n_batches: int) -> None:
    """Raise ValueError unless ``0 <= start_batch <= n_batches`` (``n_batches``: an empty remainder)."""
    if not 0 <= start_batch <= n_batches:
        raise ValueError(f"start_batch must be in [0, {n_batches}] (the batches of an epoch), got {start_batch}")


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
