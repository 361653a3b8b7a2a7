"""Saving and loading models however they are parallelized.

* :func:`save_full_model`: one plain ``torch.save`` file with the single-GPU layout and names
  (DDP/FSDP gathered, tensor/context-parallel slices reassembled), loadable with
  ``VisionTransformer.load_state_dict(torch.load(path)["model"])`` without torch.distributed.
* :class:`CheckpointManager`: periodic sharded checkpoints to resume a run from: model, optimizer
  and the trainer's other ``state_dict`` objects, written with ``torch.distributed.checkpoint``
  (DCP), so every rank writes and reads only its own shards and a checkpoint loads on any number
  of ranks (DCP reshards). Tensor-parallel slices are written as blocks of the dense tensors
  (``distributed/dense_shards.py``), so a checkpoint holds the single-GPU layout and loads under any
  tensor/context/data parallelism, FSDP or none, or into the plain model.

A checkpoint directory (a run's ``checkpoints/``)::

    step_00000050/   one DCP checkpoint: __<rank>_0.distcp (each rank's shards), rank<r>.pt (state
                     that differs per rank), .metadata (written last: all files above are complete)
    latest           the name of the newest complete step folder, replaced atomically

A checkpoint counts once ``latest`` names it: a save interrupted at any point leaves the previous
one named, and the next committed save deletes the leftovers. Single files are written to a
temporary name and renamed, so an interrupted write never replaces a good file with a truncated one.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from distributed.dense_shards import DenseLoadPlanner, DenseSavePlanner, dense_view, plain_view
from distributed.env import World, broadcast_from_main
from distributed.host_staging import HostStager
from utils.errors import UserError, free_space
from utils.schema import CheckpointConfig

log = logging.getLogger(__name__)
# DCP warns on every save and load of one process that it runs without torch.distributed: intended here
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

LATEST = "latest"
WRITE_THREADS = 8  # per rank
METADATA = ".metadata"  # DCP's global metadata: rank 0 writes it once every rank's shards are written
# the fix of a failed checkpoint write
DISK_FIX = "free space or pass --expdir on a larger filesystem (or --save_checkpoint false)"


# ---------------------------------------------------------------- single files
def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict with the plain model's keys; collective: call on every rank."""
    from distributed.parallelize import is_tensor_context_parallel, unwrap
    if is_tensor_context_parallel(model):
        from distributed.tensor_parallel import full_state_dict
        return full_state_dict(unwrap(model))
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_full_model(model: nn.Module, path: str | Path, extra: dict | None = None) -> None:
    """Gather the full model and write ``{"model": state_dict, **extra}`` to ``path`` on rank 0.

    Raises:
        UserError: the write failed (full disk, quota, I/O error); the previous file at ``path``
            is kept and the partial one removed.
    """
    state = full_model_state_dict(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    save_file({"model": state, **(extra or {})}, Path(path), DISK_FIX)


def save_file(obj: Any, path: Path, fix: str) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary file renamed over it.

    Raises:
        UserError: the write failed (full disk, quota, I/O error), naming ``path``, the free space
            and ``fix``; the previous file at ``path`` is kept and the partial one removed.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # through a Python file, so a full disk raises OSError(ENOSPC) (behind the zip writer's
        # "unexpected pos" RuntimeError) instead of a bare RuntimeError
        _write_atomic(path, lambda f: torch.save(obj, f))
    except (OSError, RuntimeError) as exc:
        cause = _os_error(exc)
        if cause is None:
            raise
        raise UserError(f"{_write_failed(path, cause)}; any previous checkpoint is kept: {fix}") from None


def _write_atomic(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` with ``write(binary file)`` into ``<path>.tmp``, flushed to disk, then renamed
    over ``path``. Raises what ``write`` or the filesystem raises; the temporary file is removed."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc`` (itself, the one it was raised while handling, or for DCP's
    CheckpointException, one of the ranks' failures), if any."""
    while exc is not None and not isinstance(exc, OSError):
        if isinstance(exc, CheckpointException):
            return next(filter(None, (_os_error(e) for e, _ in exc.failures.values())), None)
        exc = exc.__cause__ or exc.__context__
    return exc


def _write_failed(path: Path, cause: OSError) -> str:
    """``writing checkpoint <path> failed: <reason> (<free space>)``."""
    return f"writing checkpoint {path} failed: {cause.strerror or cause} ({free_space(_existing_parent(path))})"


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` on one line (at most 300 characters); for DCP's CheckpointException, the
    first failing rank's."""
    if isinstance(exc, CheckpointException):
        rank, (first, _) = min(exc.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {describe_exception(first)}"
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------- checkpoint folders
def step_folder(directory: Path, step: int) -> Path:
    """The checkpoint folder of optimizer step ``step``: ``<directory>/step_00000050``."""
    return Path(directory) / f"step_{step:08d}"


def folder_step(folder: Path) -> int | None:
    """The step of a ``step_<digits>`` folder, None for another name."""
    m = re.fullmatch(r"step_(\d+)", Path(folder).name)
    return int(m.group(1)) if m else None


def is_complete(folder: Path) -> bool:
    """Whether all of ``folder``'s files were written (DCP writes ``.metadata`` after them)."""
    return (Path(folder) / METADATA).is_file()


def step_folders(directory: Path) -> list[Path]:
    """The ``step_*`` folders of ``directory``, complete or not, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if p.is_dir() and folder_step(p) is not None), key=folder_step)


def _named_latest(directory: Path) -> Path | None:
    """The step folder that ``<directory>/latest`` names (complete or not), None without one."""
    try:
        folder = Path(directory) / (Path(directory) / LATEST).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return folder if folder_step(folder) is not None else None


def read_latest(directory: Path) -> Path | None:
    """The newest complete checkpoint of ``directory``: the folder ``latest`` names, if complete."""
    folder = _named_latest(directory)
    return folder if folder is not None and is_complete(folder) else None


def load_candidates(directory: Path) -> list[Path]:
    """Checkpoints to resume from, best first: the one ``latest`` names, then the older complete ones.

    Folders newer than ``latest`` are leftovers of saves that never committed and are never used;
    without a ``latest`` file every complete folder is a candidate.
    """
    named = _named_latest(directory)
    newest = folder_step(named) if named is not None else math.inf
    return [f for f in reversed(step_folders(directory)) if folder_step(f) <= newest and is_complete(f)]


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint ``path`` means: a step folder itself, or the one a directory's ``latest`` names.

    Raises:
        UserError: no complete checkpoint there.
    """
    path = Path(path)
    folder = read_latest(path) if (path / LATEST).is_file() else path
    if folder is None or not is_complete(folder):
        raise UserError(f"{path} is not a complete checkpoint (a step_* folder holding {METADATA}, or a checkpoint "
                        f"directory whose '{LATEST}' names one); pass another checkpoint or --resume never")
    return folder


# ---------------------------------------------------------------- model and optimizer state
def _model_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}``: this rank's shards under the plain model's parameter names
    (the same for plain, DDP, FSDP2, compiled and tensor/context-parallel models); tensor-parallel
    slices are still plain tensors here (:func:`dense_view` makes them DCP shards)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _set_model_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Write model and optimizer shards as one DCP checkpoint in ``directory`` itself, without the
    steps and ``latest`` of :class:`CheckpointManager` (collective).
    """
    dcp.save(dense_view(model, _model_state(model, optimizer)), checkpoint_id=str(directory),
             planner=DenseSavePlanner())


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Load a checkpoint written by :func:`save_sharded`, resharded to this model's parallelism
    (collective).
    """
    view = dense_view(model, _model_state(model, optimizer))
    dcp.load(view, checkpoint_id=str(directory), planner=DenseLoadPlanner())
    _set_model_state(model, optimizer, plain_view(view))


# ---------------------------------------------------------------- writing with threads
class CheckedWriter(dcp.FileSystemWriter):
    """DCP's ``FileSystemWriter`` that fails when one of its writer threads fails.

    Its threads' exceptions (a full disk, say) only reach ``threading.excepthook``, which prints
    a traceback, and the items they were writing are just missing from the results: DCP would
    then write the metadata of an incomplete checkpoint. Here the thread's exception is kept
    (not printed) and raised from ``write_data``, so the save fails like a one-thread save.

    Raises:
        OSError: a writer thread's failure, or the OSError behind it (a full disk).
    """

    def write_data(self, plan, planner):
        failures: list[BaseException] = []
        previous = threading.excepthook

        def keep(args) -> None:
            if _is_writer_thread(args.thread):
                failures.append(args.exc_value)
            else:
                previous(args)
        threading.excepthook = keep
        try:
            written = super().write_data(plan, planner)
        except (OSError, RuntimeError) as exc:
            failures.insert(0, exc)
        finally:
            # a failure in the calling thread returns before DCP joins its threads: join them here,
            # while their failures are still kept, not printed
            for thread in filter(_is_writer_thread, threading.enumerate()):
                thread.join()
            threading.excepthook = previous
        if failures:
            # DCP pickles each rank's exception to gather them, which drops ``__context__``: raise the
            # OSError behind the zip writer's "unexpected pos" RuntimeError so the reason survives
            raise _os_error(failures[0]) or failures[0]
        if len(written.wait()) != len(plan.items):  # a thread ended without an exception we saw
            raise OSError(f"DCP wrote {len(written.wait())} of {len(plan.items)} items")
        return written


def _is_writer_thread(thread: threading.Thread | None) -> bool:
    """One of the threads ``FileSystemWriter.write_data`` starts (named after their target)."""
    return thread is not None and "_write_files_from_queue" in thread.name


# ---------------------------------------------------------------- the manager
class CheckpointManager:
    """Sharded checkpoints of a training run in ``directory`` (layout in the module docstring).

    ``save``, ``wait``, ``load`` and ``close`` are collective: every rank calls them at the same
    point of the run. Every rank learns the same outcome (success, or the same error), so none
    waits forever in a collective that another rank left.

    Args:
        cfg: ``keep_checkpoints`` (complete checkpoints kept) and ``async_checkpoint``.
        directory: the run's checkpoint folder, on a filesystem every rank sees.
        model: the model being trained: plain, DDP, FSDP2 ``fully_shard`` (HSDP too), compiled,
            and/or tensor/context parallel.
        optimizer: its optimizer.
        stateful: other objects by name (``model`` and ``optim`` excepted) with ``state_dict`` /
            ``load_state_dict`` (LR scheduler, GradScaler, train state), whose values may be any
            picklable objects and must be equal on every rank. One that also has
            ``per_rank_state_dict`` / ``load_per_rank_state_dict`` keeps a per-rank part (random
            streams) in ``rank<r>.pt``.
        world: this process's rank and world size.
    """

    def __init__(self, cfg: CheckpointConfig, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 stateful: dict[str, Any], world: World):
        if {"model", "optim"} & set(stateful):
            raise ValueError("stateful names 'model' and 'optim' are taken by the model and optimizer")
        self.cfg, self.directory, self.world = cfg, Path(directory), world
        self.model, self.optimizer, self.stateful = model, optimizer, dict(stateful)
        self.per_rank = {name: obj for name, obj in self.stateful.items() if hasattr(obj, "per_rank_state_dict")}
        self._pending: tuple[Future, Path] | None = None  # an async save staged but not committed
        self._group: dist.ProcessGroup | None = None  # the gloo group of async saves, made at the first one
        self._stager = HostStager(world.device)  # the host copy of the saved state, reused
        self._prepared = False  # prepare() has started the stager's allocation
        self._current: Path | None = None  # the checkpoint holding the objects' state as saved or loaded

    # ---- public
    def latest(self) -> Path | None:
        """The newest complete checkpoint folder (the one ``latest`` names), or None."""
        return read_latest(self.directory)

    def save(self, step: int) -> None:
        """Checkpoint the state after optimizer step ``step`` into ``step_<step>`` (collective).

        Synchronous: returns once the checkpoint is complete and named by ``latest``. With
        ``async_checkpoint``: returns once the state is copied to host memory (the parameters may
        change again); a background thread writes it and :meth:`wait` (called by the next ``save``,
        by ``close``, or by the trainer) commits it. A checkpoint of this very state (just saved or
        loaded at ``step``) is not written again.

        Raises:
            UserError: the write failed (full disk, quota, I/O error): the partial folder is removed
                and ``latest`` still names the previous one.
        """
        self.wait()
        folder = step_folder(self.directory, step)
        if folder == self._current:
            return
        self._raise_any(self._make_folder(folder) if self.world.is_main else None)
        if self.per_rank:
            self._raise_any(self._write_per_rank(folder), folder)
        state = dense_view(self.model, self._state())
        try:
            if self.cfg.async_checkpoint:  # async_save returns once the state is copied to host memory
                self._pending = dcp.async_save(state, storage_writer=self._writer(folder), planner=DenseSavePlanner(),
                                               process_group=self._async_group(), async_stager=self._stager), folder
                return
            # on GPUs, one copy to host memory at full bandwidth; the writer threads then only do I/O
            staged = self._stager.stage(state) if self._stager.pin else state
            dcp.save(staged, storage_writer=self._writer(folder), planner=DenseSavePlanner())
        except (Exception, CheckpointException) as exc:
            self._save_failed(folder, exc)
        self._commit(folder)

    def prepare(self) -> None:
        """Start allocating the host buffers that saves copy the state into, in the background, so the
        first save does not stall for it (:class:`~distributed.host_staging.HostStager`). Call once the
        state is complete (after the first optimizer step: Adam's moments exist). Later calls return at
        once, as do calls when nothing is saved or saves need no host copy (sync saves on CPU). Local to
        this rank."""
        if self._prepared or not self.cfg.save_checkpoint or not (self.cfg.async_checkpoint or self._stager.pin):
            return
        self._prepared = True
        self._stager.prepare(dense_view(self.model, self._state()))

    def wait(self) -> None:
        """Finish the pending async save and commit it; nothing to do without one (collective: every
        rank has one pending or none).

        Raises:
            UserError: the background write failed (full disk, quota, I/O error); ``latest`` still
                names the previous checkpoint.
        """
        if self._pending is None:
            return
        future, folder = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as exc:
            self._save_failed(folder, exc)
        self._commit(folder)

    def load(self, path: Path | None = None) -> int | None:
        """Restore every object from a checkpoint (collective); returns its step, None if there is none.

        Without ``path``: the newest loadable of :func:`load_candidates` (``directory``'s ``latest``,
        then older complete ones); one that does not load (truncated or corrupt file, missing shard,
        another model) is skipped with a warning. ``path``: that step folder, or the one a
        checkpoint directory's ``latest`` names. Every rank loads the same checkpoint. A rank
        without a ``rank<r>.pt`` (more ranks than saved) keeps its per-rank state, with a warning.

        Raises:
            UserError: ``path`` is not a complete checkpoint or does not load; no candidate loads.
        """
        self.wait()
        found = None
        if self.world.is_main:
            try:
                found = [resolve_checkpoint(path)] if path is not None else self._candidates()
            except UserError as exc:
                found = str(exc)
        found = broadcast_from_main(found, self.world)
        if isinstance(found, str):
            raise UserError(found)
        if not found:
            return None
        errors = []
        for folder in found:
            loaded, error = self._read(folder)
            error = self._first_error(error)
            if error is None:
                self._apply(folder, *loaded)
                return folder_step(folder)
            errors.append(error)
            log.warning("checkpoint %s does not load (%s)%s", folder, error,
                        "; trying the previous one" if folder != found[-1] else "")
        if path is not None:
            raise UserError(f"checkpoint {found[0]} does not load ({errors[0]}); pass another checkpoint or "
                            "--resume never")
        raise UserError(f"no checkpoint in {self.directory} loads (newest {found[0].name}: {errors[0]}); pass "
                        "another checkpoint with --resume, or --resume never to start afresh")

    def close(self) -> None:
        """Commit a pending async save; release the async group and the host buffers (collective)."""
        try:
            self.wait()
        finally:
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
            self._stager.close()

    @staticmethod
    def _writer(folder: Path) -> dcp.FileSystemWriter:
        """DCP's file writer with WRITE_THREADS threads: one thread writes far below a parallel
        filesystem's (or even a local disk's) bandwidth."""
        return CheckedWriter(folder, thread_count=WRITE_THREADS)

    # ---- loading
    def _candidates(self) -> list[Path]:
        """Rank 0: :func:`load_candidates`, empty for a fresh run.

        Raises:
            UserError: ``latest`` names a folder but neither it nor an older one is complete (deleted
                by hand?): starting afresh silently would discard the run.
        """
        found = load_candidates(self.directory)
        named = _named_latest(self.directory)
        if not found and named is not None:
            raise UserError(f"{self.directory / LATEST} names {named.name}, but neither it nor an older checkpoint "
                            f"is complete; delete {self.directory / LATEST} to start afresh, or pass --resume never")
        return found

    # ---- saving
    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds: ``model``, ``optim`` and each stateful's ``state_dict``."""
        return {**_model_state(self.model, self.optimizer),
                **{name: obj.state_dict() for name, obj in self.stateful.items()}}

    def _make_folder(self, folder: Path) -> str | None:
        """Rank 0: an empty ``folder`` (a leftover of a save that never committed is deleted first, so
        none of its files mixes into the new one). Returns an error message or None."""
        try:
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
        except OSError as exc:
            return f"{_write_failed(folder, exc)}; the previous checkpoint is kept: free space or fix the permissions"
        return None

    def _write_per_rank(self, folder: Path) -> str | None:
        """Write this rank's ``rank<r>.pt`` (before DCP's save, whose ``.metadata`` then vouches for
        it). Returns an error message or None."""
        path = folder / f"rank{self.world.rank}.pt"
        state = {name: obj.per_rank_state_dict() for name, obj in self.per_rank.items()}
        try:
            _write_atomic(path, lambda f: torch.save(state, f))
        except (OSError, RuntimeError) as exc:
            cause = _os_error(exc)
            if cause is None:
                raise
            return f"{_write_failed(folder, cause)}; the previous checkpoint is kept: {DISK_FIX}"
        return None

    def _save_failed(self, folder: Path, exc: BaseException) -> None:
        """Turn a failed write (an OSError on some rank) into a UserError on every rank after rank 0
        removed the partial folder; re-raise anything else."""
        cause = _os_error(exc)
        if cause is None:
            raise exc
        if self.world.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        raise UserError(f"{_write_failed(folder, cause)}; the previous checkpoint is kept: {DISK_FIX}") from None

    def _commit(self, folder: Path) -> None:
        """Make ``folder`` the one ``latest`` names and delete what it supersedes (rank 0), then agree
        on the outcome (collective).

        No barrier is needed first: DCP's save returns on a rank only after rank 0 wrote
        ``.metadata``, which it does once every rank reported its shards written (and each
        ``rank<r>.pt`` was written before that rank entered DCP's save).
        """
        error = None
        if self.world.is_main:
            try:
                _write_atomic(self.directory / LATEST, lambda f: f.write(f"{folder.name}\n".encode()))
            except OSError as exc:
                error = f"{_write_failed(self.directory / LATEST, exc)}; the previous checkpoint is kept: {DISK_FIX}"
            else:
                self._delete_superseded(folder)
        self._raise_any(error)
        self._current = folder

    def _delete_superseded(self, newest: Path) -> None:
        """Rank 0: keep the newest ``keep_checkpoints`` complete checkpoints up to ``newest``; delete
        older ones and every other step folder (leftovers of crashed saves, and folders newer than
        ``newest`` left by a run that resumed from an older checkpoint), none of which a load uses."""
        folders = step_folders(self.directory)
        complete = [f for f in folders if folder_step(f) <= folder_step(newest) and is_complete(f)]
        keep = set(complete[-self.cfg.keep_checkpoints:])
        for folder in folders:
            if folder not in keep:
                try:
                    shutil.rmtree(folder)
                except OSError as exc:
                    log.warning("could not delete the old checkpoint %s: %s", folder, exc)

    def _async_group(self) -> dist.ProcessGroup | None:
        """The gloo group that async saves coordinate over, made at the first one (collective then).

        DCP's background thread runs collectives while the training loop runs its own: sharing a
        group, the two would interleave in a different order on different ranks. DCP also needs a
        CPU backend, which NCCL is not. None without torch.distributed (DCP's no-dist mode).
        """
        if not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _read(self, folder: Path) -> tuple[tuple[dict, dict | None] | None, str | None]:
        """Read ``folder`` into fresh state dicts, DCP loading model and optimizer shards in place
        (tensor-parallel slices from their blocks of the dense tensors).

        Returns ``((state, per_rank), None)``, ``per_rank`` None when this rank has no file, or
        ``(None, error message)``. Only the model's and optimizer's tensors change (in place), and
        whichever checkpoint finally loads overwrites all of them.
        """
        view = dense_view(self.model, self._state())
        try:
            dcp.load(view, checkpoint_id=folder, planner=DenseLoadPlanner())
            return (plain_view(view), self._read_per_rank(folder)), None
        except (Exception, CheckpointException) as exc:
            return None, describe_exception(exc)

    def _read_per_rank(self, folder: Path) -> dict[str, Any] | None:
        if not self.per_rank:
            return {}
        path = folder / f"rank{self.world.rank}.pt"
        if not path.is_file():
            return None
        saved = torch.load(path, map_location="cpu", weights_only=False)  # our own file: numpy/Python RNG states
        return {name: saved[name] for name in self.per_rank}

    def _apply(self, folder: Path, state: dict[str, Any], per_rank: dict[str, Any] | None) -> None:
        """Load what :meth:`_read` read into the model, optimizer and stateful objects."""
        _set_model_state(self.model, self.optimizer, state)
        for name, obj in self.stateful.items():
            obj.load_state_dict(state[name])
        if per_rank is None:
            log.warning("checkpoint %s has no rank%d.pt (saved on fewer ranks): this rank's %s state starts afresh",
                        folder, self.world.rank, ", ".join(self.per_rank))
        else:
            for name, obj in self.per_rank.items():
                obj.load_per_rank_state_dict(per_rank[name])
        self._current = folder

    # ---- agreement
    def _first_error(self, error: str | None) -> str | None:
        """The first rank's error message of all ranks' ``error`` (collective; a no-op for one process)."""
        if self.world.world_size == 1 or not dist.is_initialized():
            return error
        errors: list[str | None] = [None] * self.world.world_size
        dist.all_gather_object(errors, error)
        return next((e for e in errors if e is not None), None)

    def _raise_any(self, error: str | None, partial: Path | None = None) -> None:
        """Raise UserError on every rank if any rank has an ``error`` (collective); rank 0 then removes
        the ``partial`` folder."""
        error = self._first_error(error)
        if error is None:
            return
        if partial is not None and self.world.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        raise UserError(error)
