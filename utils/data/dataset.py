"""The dataset of one split: samples ``(x_t, x_{t+dt}, ..., x_{t+k*dt})`` read from the ``.h5`` files of the
layout (``utils/data/layout.py``), the sample order shared by every loader, and checks of split sizes.

Files of one series (``layout.series_key``: the same name after the year) where each starts one time step after
the previous one ends (checked in the files' calendar and time-step unit: hours, days, calendar months or
years) are one run of time steps: a sample may start in one file and end in the next. A gap, another series
or a file without ``start_time`` starts a new run. So monthly data (twelve steps a file) and annual data (one
step a file) give samples like hourly data, and hourly data gain the samples across each new year.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from utils.core.errors import UserError, one_line
from utils.data.layout import FIELDS, series_key
from utils.data.metadata import TimeAxis, read_time_axis
from utils.data.timestep import TimeStep

log = logging.getLogger(__name__)


@dataclass
class FileInfo:
    """One file of a split: its ``path``, ``n_times`` steps, time ``axis`` and ``grid`` (H, W)."""

    path: Path
    n_times: int
    axis: TimeAxis
    grid: tuple[int, int] = (0, 0)


@dataclass
class Run:
    """Files that continue each other in time: ``files`` (file numbers, in time order) and ``starts`` (the run
    position of each file's step 0, then the run's length)."""

    files: list[int]
    starts: np.ndarray

    @property
    def length(self) -> int:
        return int(self.starts[-1])


_CROPS_WARNED: set[tuple] = set()


def warn_crop(grid: tuple[int, int], img_size: tuple[int, int], path: Path) -> None:
    """Warn once per grid and crop when training sees only the north-west ``img_size`` corner of a larger grid,
    at least half of it, and more than one row or column is dropped (one is ERA5's usual 721 -> 720 rows)."""
    (h, w), (ch, cw) = grid, img_size
    # below half the grid: asked for on the command line, or refused by check_crop with a line of its own
    if (h - ch <= 1 and w - cw <= 1) or 2 * ch * cw < h * w or (grid, tuple(img_size)) in _CROPS_WARNED:
        return
    _CROPS_WARNED.add((grid, tuple(img_size)))
    log.warning("the data's %dx%d grid (%s) is larger than img_size [%d,%d]: training sees only its north-west "
                "corner and drops %d rows and %d columns; pass --img_size [%d,%d] (multiples of patch_size) to use "
                "the whole grid", h, w, path.parent, ch, cw, h - ch, w - cw, h, w)


def check_crop(grid: tuple[int, int], img_size: tuple[int, int], data_path: str, config_name: str,
               made_for: Callable[[], list[str]]) -> None:
    """Stop when a config's ``img_size`` keeps less than half of the data's grid points: the data are not the
    config's (``--config tiny --data_path data/era5_sample``), and training a corner of them, with an epoch
    count made for other data, is no run anyone meant. ``made_for()``: the named configs whose ``data_path`` is
    these data, called only to word the error (it parses the config file). An ``--img_size`` given on the
    command line is a crop asked for, and is not checked here.

    Raises:
        UserError: naming the configs made for these data and the overrides that use the whole grid.
    """
    (h, w), (ch, cw) = grid, img_size
    if 2 * ch * cw >= h * w:
        return
    names = made_for()
    configs = f"--config {' or --config '.join(names)} (made for these data), or " if names else ""
    raise UserError(f"the data at {data_path} are on a {h}x{w} grid but config {config_name} trains on img_size "
                    f"[{ch},{cw}], {100 * ch * cw / (h * w):.0f}% of it: they are not this config's data; pass "
                    f"{configs}--img_size [{h},{w}] for the whole grid (a multiple of --patch_size; --img_size "
                    "crops as asked when given)")


class ERA5Dataset(Dataset):
    """Samples ``(x_t, x_{t+dt}, ..., x_{t+k*dt})`` from every ``*.h5`` file in ``directory``.

    ``k`` is ``target_steps`` (training: 1; rollout evaluation: one target per lead). A run of files
    continuing each other in time (see the module docstring; a single file without ``start_time``) of ``T``
    time steps holds ``T - k*dt`` initial times ``t``; with ``init_every`` n only ``t = 0, n, 2n, ...`` of
    each run are samples (``limit_nsamples`` then caps the total).

    Items are ``(inp, tar, index)``: ``inp`` float32 ``(C, H, W)``, ``tar`` float32
    ``(k, C, H, W)`` (``tar[j - 1]`` is the state ``j*dt`` after the input), both in physical
    units (not normalized), ``index`` the global sample index (for error messages).

    ``steps_flag``, when given, is the option that set ``target_steps``: the error for runs too short names it.

    Raises:
        ValueError: ``target_steps`` or ``init_every`` below 1.
        UserError: missing directory or files, a file without ``fields``, wrong rank, dtype
            or channel count, a grid smaller than ``img_size``, unreadable time attributes, or runs
            too short for ``target_steps * dt``.
    """

    def __init__(self, directory: str | Path, n_channels: int, img_size: tuple[int, int], dt: int,
                 limit_nsamples: int | None = None, *, target_steps: int = 1, init_every: int = 1,
                 steps_flag: str | None = None):
        if target_steps < 1 or init_every < 1:
            raise ValueError(f"target_steps and init_every must be >= 1, got {target_steps} and {init_every}")
        self.directory = Path(directory)
        self.img_size = tuple(img_size)
        self.dt = dt
        self.n_channels = n_channels
        self.target_steps, self.init_every = target_steps, init_every
        self.steps_flag = steps_flag  # the option that set target_steps, named by the too-short error
        self.files = self._inspect(n_channels)
        self.runs = chain_files(self.files)
        self._check_lengths()
        lead = target_steps * dt  # steps from the input to the last target
        per_run = [-(-(run.length - lead) // init_every) for run in self.runs]
        self.offsets = np.cumsum([0] + per_run)
        total = int(self.offsets[-1])
        self.n_samples = min(total, limit_nsamples) if limit_nsamples else total
        self._handles: dict[int, h5py.Dataset] = {}

    @property
    def grid(self) -> tuple[int, int]:
        """The (H, W) grid of the split's (first) file, before the ``img_size`` crop."""
        return self.files[0].grid

    @property
    def time_step(self) -> TimeStep:
        """The time step of the split's (first) file, in its own unit."""
        return self.files[0].axis.step

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
                if not isinstance(f[FIELDS], h5py.Dataset):
                    raise UserError(f"{path}: '{FIELDS}' is an HDF5 group, not a dataset; convert the data with "
                                    "python -m tools.convert_era5")
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
        warn_crop((h, w), self.img_size, path)
        return FileInfo(path, t, read_time_axis(path, self.img_size[1]), (h, w))

    def _check_lengths(self) -> None:
        """Raise UserError when the shortest run has no initial time for ``target_steps * dt``."""
        short = min(self.runs, key=lambda r: r.length)
        k, dt, n = self.target_steps, self.dt, short.length
        if n > k * dt:
            return
        first = self.files[short.files[0]].path
        what = (f"{first} has {n} time steps" if len(short.files) == 1 else
                f"{first} and the {len(short.files) - 1} file(s) continuing it have {n} time steps")
        if k == 1:
            raise UserError(f"{what}, too few for dt={dt}; lower --dt{self._gap_hint(short)}")
        fits = (n - 1) // dt
        fix = f"use at most {fits} rollout steps" if fits else "lower --dt"
        if fits and self.steps_flag:
            fix += f" (--{self.steps_flag} {fits})"
        raise UserError(f"{what}, too few for {k} rollout steps of dt={dt} ({k * dt + 1} needed); "
                        f"{fix}{self._gap_hint(short)}")

    def _gap_hint(self, run: Run) -> str:
        """Why a run of dated files ends: the next file of its series does not continue it in time."""
        last = self.files[run.files[-1]]
        later = [f for f in self.files[run.files[-1] + 1:] if series_key(f.path) == series_key(last.path)]
        if last.axis.start is None or not later:
            return ""
        return (f" ({later[0].path.name} does not start one {last.axis.step} step after {last.path.name} ends, so "
                "samples cannot run on into it)")

    def __len__(self) -> int:
        return self.n_samples

    def position(self, index: int) -> tuple[int, int]:
        """Global sample index -> (run number, input position in that run)."""
        if not 0 <= index < self.n_samples:
            raise IndexError(index)
        run_no = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return run_no, (index - int(self.offsets[run_no])) * self.init_every

    def file_time(self, run_no: int, p: int) -> tuple[int, int]:
        """(file number, time index in that file) of position ``p`` of run ``run_no``."""
        run = self.runs[run_no]
        i = int(np.searchsorted(run.starts, p, side="right") - 1)
        return run.files[i], p - int(run.starts[i])

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (file number, input time index in that file)."""
        return self.file_time(*self.position(index))

    def sample_times(self, index: int) -> list[tuple[int, int]]:
        """(file number, time index) of the input and then of each target of sample ``index``."""
        run_no, p = self.position(index)
        return [self.file_time(run_no, p + j * self.dt) for j in range(self.target_steps + 1)]

    def times(self, index: int) -> list:
        """The times of the input and of each target of sample ``index`` (:meth:`TimeAxis.time`: cftime
        datetimes in the files' calendar, or hours since the file's step 0 for files without ``start_time``)."""
        return [self.files[f].axis.time(t) for f, t in self.sample_times(index)]

    def describe(self, index: int) -> str:
        """Human-readable origin of a sample, e.g. ``train/2000.h5 time 12 -> 13`` (one target),
        ``valid/2001.h5 time 4 -> 5..8`` (four, dt 1), ``time 4 -> 6..10 every 2`` (three, dt 2) or
        ``valid/2001.h5 time 1458 -> 1459, 2002.h5 time 0..1`` (across files)."""
        (file_no, t), *targets = self.sample_times(index)
        path = self.files[file_no].path
        groups: list[tuple[int, list[int]]] = []
        for f, time in targets:
            if groups and groups[-1][0] == f:
                groups[-1][1].append(time)
            else:
                groups.append((f, [time]))
        parts = [("" if f == file_no else f"{self.files[f].path.name} time ")
                 + (str(ts[0]) if len(ts) == 1 else f"{ts[0]}..{ts[-1]}") for f, ts in groups]
        every = f" every {self.dt}" if len(targets) > 1 and self.dt > 1 else ""
        return f"{path.parent.name}/{path.name} time {t} -> {', '.join(parts)}{every}"

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
        (file_no, t), *targets = self.sample_times(index)
        if tar is None:
            tar = np.empty((self.target_steps, self.n_channels, *self.img_size), dtype=np.float32)
        inp = self.read(file_no, t, inp)
        for out, (f, time) in zip(tar, targets):  # one read per state: nothing beyond the k targets
            self.read(f, time, out)
        return inp, tar

    def __getitem__(self, index: int):
        inp, tar = self.read_sample(index)
        return torch.from_numpy(inp), torch.from_numpy(tar), index


def chain_files(files: list[FileInfo]) -> list[Run]:
    """Runs of ``files`` (sorted by name) that continue each other in time: a file joins the run of the previous
    file of its series when both have a ``start_time``, share calendar and time step, and it starts exactly
    one step after that file ends (:meth:`TimeStep.steps_between`: calendar months for monthly and annual
    data, so mid-month and mid-year stamps chain). Runs are ordered by their first file."""
    runs: list[Run] = []
    last: dict[str, tuple[int, Run]] = {}  # series -> (its newest file, its open run)
    for i, info in enumerate(files):
        key = series_key(info.path)
        prev = last.get(key)
        if prev is not None and _continues(files[prev[0]], info):
            run = prev[1]
            run.files.append(i)
            run.starts = np.append(run.starts, run.starts[-1] + info.n_times)
        else:
            run = Run([i], np.array([0, info.n_times]))
            runs.append(run)
        last[key] = (i, run)
    return runs


def _continues(prev: FileInfo, info: FileInfo) -> bool:
    a, b = prev.axis, info.axis
    if a.start is None or b.start is None or a.calendar != b.calendar or a.step != b.step:
        return False
    return a.step.steps_between(a.time(0), b.time(0)) == prev.n_times


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
