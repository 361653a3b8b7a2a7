"""Sharded checkpoints of a training run: how they are written and read (:class:`ShardedCheckpoints`; when
they are written is the :class:`~distributed.checkpoint.manager.CheckpointManager`'s).

Model, optimizer and the trainer's other ``state_dict`` objects are written with
``torch.distributed.checkpoint`` (DCP), so every rank writes and reads only its own shards and a
checkpoint loads on any number of ranks (DCP reshards). Tensor-parallel parameters held with head axes
are written in the plain shape (``distributed/checkpoint/views.py``), so a checkpoint holds the single-GPU
layout and loads under any tensor/context/data parallelism, FSDP or none, or into the plain model. The
folder layout: ``distributed/checkpoint/folder.py``.
"""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from distributed.checkpoint.folder import (CHECKSUMS, DISK_FIX, LATEST, describe_exception, folder_step, is_complete,
                                           load_candidates, named_latest, os_error, read_latest, resolve_checkpoint,
                                           step_folder, step_folders, write_failed)
from distributed.checkpoint.staging import HostStager
from distributed.checkpoint.storage import (HASH, WRITE_THREADS, CheckedWriter, SafeReader, mismatched_file,
                                            read_manifest, write_hashed)
from distributed.checkpoint.views import ViewLoadPlanner, ViewSavePlanner
from distributed.tensor_parallel import checkpoint_views
from distributed.world import World, main_decides
from utils.config.schema import CheckpointConfig
from utils.core.errors import UnsafeCheckpoint, UserError
from utils.core.files import write_atomic, write_json_atomic
from utils.core.safe_load import load_plain

log = logging.getLogger(__name__)
UNSAFE = "unsafe: "  # marks a rank's load error that must not fall back to an older checkpoint


def _model_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}``: this rank's shards under the plain model's parameter names
    (the same for plain, DDP, FSDP2, compiled and tensor/context-parallel models)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _set_model_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Write model and optimizer shards as one DCP checkpoint in ``directory`` itself, without the
    steps and ``latest`` of :class:`ShardedCheckpoints` (collective).
    """
    dcp.save(_model_state(model, optimizer), checkpoint_id=str(directory),
             planner=ViewSavePlanner(checkpoint_views(model)))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Load a checkpoint written by :func:`save_sharded`, resharded to this model's parallelism
    (collective).
    """
    state = _model_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory), planner=ViewLoadPlanner(checkpoint_views(model)))
    _set_model_state(model, optimizer, state)


class ShardedCheckpoints:
    """Sharded checkpoints of a training run in ``directory`` (layout: ``distributed/checkpoint/folder.py``).

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
        self._pending: tuple[Future, Path, CheckedWriter] | None = None  # an async save staged, not committed
        self._digests: dict[str, str] = {}  # checksums of the files this rank wrote for the save in progress
        self._group: dist.ProcessGroup | None = None  # the gloo group of async saves, made at the first one
        self._stager = HostStager(world.device)  # the host copy of the saved state, reused
        self._prepared = False  # prepare() has started the stager's allocation
        self._current: Path | None = None  # the checkpoint holding the objects' state as saved or loaded
        self._views = checkpoint_views(model)  # parameters held in another shape than the plain model's

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
        self._digests = {}
        if self.per_rank:
            self._raise_any(self._write_per_rank(folder), folder)
        state, writer = self._state(), self._writer(folder)
        try:
            if self.cfg.async_checkpoint:  # async_save returns once the state is copied to host memory
                future = dcp.async_save(state, storage_writer=writer, planner=self._save_planner(),
                                        process_group=self._async_group(), async_stager=self._stager)
                self._pending = future, folder, writer
                return
            # on GPUs, one copy to host memory at full bandwidth; the writer threads then only do I/O
            staged = self._stager.stage(state) if self._stager.pin else state
            dcp.save(staged, storage_writer=writer, planner=self._save_planner())
        except (Exception, CheckpointException) as exc:
            self._save_failed(folder, exc)
        self._commit(folder, writer)

    def prepare(self) -> None:
        """Start allocating the host buffers that saves copy the state into, in the background, so the
        first save does not stall for it (:class:`~distributed.checkpoint.staging.HostStager`). Call once the
        state is complete (after the first optimizer step: Adam's moments exist). Later calls return at
        once, as do calls when nothing is saved or saves need no host copy (sync saves on CPU). Local to
        this rank."""
        if self._prepared or not self.cfg.save_checkpoint or not (self.cfg.async_checkpoint or self._stager.pin):
            return
        self._prepared = True
        self._stager.prepare(self._state())

    def wait(self) -> None:
        """Finish the pending async save and commit it; nothing to do without one (collective: every
        rank has one pending or none).

        Raises:
            UserError: the background write failed (full disk, quota, I/O error); ``latest`` still
                names the previous checkpoint.
        """
        if self._pending is None:
            return
        future, folder, writer = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as exc:
            self._save_failed(folder, exc)
        self._commit(folder, writer)

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
        found = main_decides(lambda: [resolve_checkpoint(path)] if path is not None else self._candidates(), self.world)
        if not found:
            return None
        errors = []
        for folder in found:
            loaded, error = self._read(folder)
            error = self._first_error(error)
            if error is not None and error.startswith(UNSAFE):  # never fall back past a file that runs code
                raise UnsafeCheckpoint(error[len(UNSAFE):])
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

    def close(self, commit: bool = True) -> None:
        """Commit a pending async save (unless not ``commit``: a failed run's pending save is left uncommitted
        and its resources to the process's exit); release the async group and the host buffers (collective)."""
        if self._pending is not None and not commit:
            return
        try:
            self.wait()
        finally:
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
            self._stager.close()

    def _save_planner(self) -> ViewSavePlanner:
        return ViewSavePlanner(self._views)

    def _writer(self, folder: Path) -> dcp.FileSystemWriter:
        """DCP's file writer with WRITE_THREADS threads: one thread writes far below a parallel
        filesystem's (or even a local disk's) bandwidth; its metadata marked as having a manifest when
        checksums are on."""
        return CheckedWriter(folder, manifest=self.cfg.checkpoint_checksums, thread_count=WRITE_THREADS)

    # ---- loading
    def _candidates(self) -> list[Path]:
        """Rank 0: :func:`load_candidates`, empty for a fresh run.

        Raises:
            UserError: ``latest`` names a folder but neither it nor an older one is complete (deleted
                by hand?): starting afresh silently would discard the run.
        """
        found = load_candidates(self.directory)
        named = named_latest(self.directory)
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
            return f"{write_failed(folder, exc)}; the previous checkpoint is kept: free space or fix the permissions"
        return None

    def _write_per_rank(self, folder: Path) -> str | None:
        """Write this rank's ``rank<r>.pt`` (before DCP's save, whose ``.metadata`` then vouches for
        it) and note its checksum. Returns an error message or None."""
        path = folder / f"rank{self.world.rank}.pt"
        state = {name: obj.per_rank_state_dict() for name, obj in self.per_rank.items()}
        try:
            self._digests[path.name] = write_hashed(path, state)
        except (OSError, RuntimeError) as exc:
            cause = os_error(exc)
            if cause is None:
                raise
            return f"{write_failed(folder, cause)}; the previous checkpoint is kept: {DISK_FIX}"
        return None

    def _save_failed(self, folder: Path, exc: BaseException) -> None:
        """Turn a failed write (an OSError on some rank) into a UserError on every rank after rank 0
        removed the partial folder, and a Ctrl-C during the write (a ``KeyboardInterrupt`` that DCP wraps in its
        CheckpointException, tracebacks of every rank included) back into a ``KeyboardInterrupt``: stopped at
        once, as anywhere else (exit 130; the partial folder is a leftover that the next save clears). Re-raise
        anything else."""
        if isinstance(exc, CheckpointException) and any(isinstance(e, KeyboardInterrupt)
                                                        for e, _ in exc.failures.values()):
            raise KeyboardInterrupt from None
        cause = os_error(exc)
        if cause is None:
            raise exc
        if self.world.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        raise UserError(f"{write_failed(folder, cause)}; the previous checkpoint is kept: {DISK_FIX}") from None

    def _commit(self, folder: Path, writer: CheckedWriter) -> None:
        """Write every rank's checksums into the folder, make it the one ``latest`` names and delete what it
        supersedes (rank 0), then agree on the outcome (collective).

        No barrier is needed first: DCP's save returns on a rank only after rank 0 wrote
        ``.metadata``, which it does once every rank reported its shards written (and each
        ``rank<r>.pt`` was written before that rank entered DCP's save).
        """
        digests = self._gathered({**self._digests, **writer.digests}) if self.cfg.checkpoint_checksums else None
        error = None
        if self.world.is_main:
            try:
                if digests is not None:
                    write_json_atomic(folder / CHECKSUMS, {"hash": HASH, "files": digests})
                write_atomic(self.directory / LATEST, lambda f: f.write(f"{folder.name}\n".encode()))
            except OSError as exc:
                error = f"{write_failed(self.directory / LATEST, exc)}; the previous checkpoint is kept: {DISK_FIX}"
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
        (tensor-parallel parameters from their plain shape).

        Returns ``((state, per_rank), None)``, ``per_rank`` None when this rank has no file, or
        ``(None, error message)``. Only the model's and optimizer's tensors change (in place), and
        whichever checkpoint finally loads overwrites all of them.
        """
        state = self._state()
        try:
            self._verify(folder)
            dcp.load(state, storage_reader=SafeReader(folder).checked(), planner=ViewLoadPlanner(self._views))
            return (state, self._read_per_rank(folder)), None
        except UnsafeCheckpoint as exc:
            return None, f"{UNSAFE}{exc}"
        except (Exception, CheckpointException) as exc:
            return None, describe_exception(exc)

    def _read_per_rank(self, folder: Path) -> dict[str, Any] | None:
        if not self.per_rank:
            return {}
        path = folder / f"rank{self.world.rank}.pt"
        if not path.is_file():
            return None
        saved = load_plain(path)
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

    # ---- checksums
    def _gathered(self, mine: dict[str, str]) -> dict[str, str]:
        """Every rank's ``{file: checksum}`` merged (collective)."""
        if self.world.world_size == 1 or not dist.is_initialized():
            return dict(mine)
        every: list[dict[str, str]] = [{}] * self.world.world_size
        dist.all_gather_object(every, mine)
        return {name: digest for part in every for name, digest in part.items()}

    def _verify(self, folder: Path) -> None:
        """Check ``folder``'s files against its checksums before anything is loaded (collective): each rank reads
        its share of the files. Only a checkpoint written before checksums existed (unmarked: ``read_manifest``)
        loads without its manifest, with a warning; a marked one without it is damaged. With
        ``checkpoint_checksums`` off nothing is verified.

        Raises:
            UserError: a file differs from its checksum or is missing (naming it).
        """
        if not self.cfg.checkpoint_checksums:
            return
        manifest = main_decides(lambda: read_manifest(folder), self.world)
        if manifest is None:
            if self.world.is_main:
                log.warning("checkpoint %s has no %s (written before checkpoints were checksummed): its files are "
                            "not verified", folder, CHECKSUMS)
            return
        error = self._first_error(mismatched_file(folder, manifest, self.world.rank, self.world.world_size))
        if error is not None:
            raise UserError(error)

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
