"""The checkpoint folder of a run and its files: step folders, the ``latest`` pointer, which checkpoints a
load may use, and one-line descriptions of failed writes.

A checkpoint directory (a run's ``checkpoints/``)::

    step_00000050/   one DCP checkpoint: __<rank>_<i>.distcp (each rank's shards), rank<r>.pt (state
                     that differs per rank), .metadata (written last: all files above are complete),
                     checksums.json (every file's checksum, written before ``latest`` names the folder)
    latest           the name of the newest complete step folder, replaced atomically
    model.pt         the single-file model of the run's end (``distributed/checkpoint/export.py``)

A checkpoint counts once ``latest`` names it: a save interrupted at any point leaves the previous
one named, and the next committed save deletes the leftovers. Single files are written to a
temporary name and renamed, so an interrupted write never replaces a good file with a truncated one.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

from utils.core.errors import UserError, free_space
from utils.core.files import read_bounded, write_atomic

LATEST = "latest"
METADATA = ".metadata"  # DCP's global metadata: rank 0 writes it once every rank's shards are written
CHECKSUMS = "checksums.json"  # {file name: checksum} of every file of the folder, written before latest moves
# the fix of a failed checkpoint write
DISK_FIX = "free space or pass --expdir on a larger filesystem (or --save_checkpoint false)"


def save_file(obj: Any, path: Path, fix: str, overwrite: bool = True) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary file renamed over it (``overwrite``: also over an
    existing regular file; never over anything else).

    Raises:
        NotOurs: ``path`` is not replaceable (``utils.core.files.check_replaceable``); nothing is written.
        UserError: the write failed (full disk, quota, I/O error), naming ``path``, the free space
            and ``fix``; the previous file at ``path`` is kept and the partial one removed.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # through a Python file, so a full disk raises OSError(ENOSPC) (behind the zip writer's
        # "unexpected pos" RuntimeError) instead of a bare RuntimeError
        write_atomic(path, lambda f: torch.save(obj, f), overwrite)
    except (OSError, RuntimeError) as exc:
        cause = os_error(exc)
        if cause is None:
            raise
        raise UserError(f"{write_failed(path, cause)}; any previous checkpoint is kept: {fix}") from None


def os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc`` (itself, the one it was raised while handling, or for DCP's
    CheckpointException, one of the ranks' failures), if any."""
    while exc is not None and not isinstance(exc, OSError):
        if isinstance(exc, CheckpointException):
            return next(filter(None, (os_error(e) for e, _ in exc.failures.values())), None)
        exc = exc.__cause__ or exc.__context__
    return exc


def write_failed(path: Path, cause: OSError) -> str:
    """``writing checkpoint <path> failed: <reason> (<free space>)``."""
    return f"writing checkpoint {path} failed: {cause.strerror or cause} ({free_space(existing_parent(path))})"


def existing_parent(path: Path) -> Path:
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


def named_latest(directory: Path) -> Path | None:
    """The step folder that ``<directory>/latest`` names (complete or not), None without one.

    Raises:
        UserError: ``latest`` is not the name of a step folder (binary content, a path, another name).
    """
    path = Path(directory) / LATEST
    if path.is_symlink():
        raise UserError(f"{path} is a symbolic link, not the file saves write: it is never followed; delete it to "
                        f"resume from the newest complete checkpoint, or pass --resume <step folder>")
    try:
        name = read_bounded(path, 4096).decode("ascii").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError, UserError):  # a link, a FIFO, a huge file: damaged all the same
        name = None
    if name is None or "/" in name or folder_step(Path(name)) is None:
        raise UserError(f"{path} is damaged: it must hold the name of a step_* folder; delete it to resume from "
                        f"the newest complete checkpoint, or pass --resume <step folder>")
    return Path(directory) / name


def read_latest(directory: Path) -> Path | None:
    """The newest complete checkpoint of ``directory``: the folder ``latest`` names, if complete."""
    folder = named_latest(directory)
    return folder if folder is not None and is_complete(folder) else None


def load_candidates(directory: Path) -> list[Path]:
    """Checkpoints to resume from, best first: the one ``latest`` names, then the older complete ones.

    Folders newer than ``latest`` are leftovers of saves that never committed and are never used;
    without a ``latest`` file every complete folder is a candidate.
    """
    directory = Path(directory)
    if directory.is_dir():
        for entry in sorted(directory.iterdir()):
            if folder_step(entry) is not None and entry.is_symlink():
                raise UserError(f"{entry} is a symbolic link, not a checkpoint folder this run wrote: it is never "
                                f"followed; remove it (to start from the checkpoint it points at, pass --resume "
                                f"<that folder> for a new run)")
    named = named_latest(directory)
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


def read_checksums(folder: Path) -> dict[str, str] | None:
    """``{file name: checksum}`` of ``folder``'s ``checksums.json`` (read bounded, never through a link); None when
    the folder has none (whether it must have one: ``storage.read_manifest``).

    Raises:
        UserError: the file is not the JSON that saves write (damaged, or written by another tool).
    """
    path = Path(folder) / CHECKSUMS
    if not os.path.lexists(path):
        return None
    try:
        content = json.loads(read_bounded(path))
        files = content["files"]
        if not (isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())):
            raise TypeError("not a map of file names to checksums")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is damaged ({type(exc).__name__}: {exc}); the checkpoint cannot be verified") from None
    return files
