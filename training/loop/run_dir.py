"""The run directory ``<expdir>/<config>/<N>GPU/<run_num>/``: which one a command trains in (a new one, or
the run it continues), and the record of what produced the run (``run.json``'s first content).

A run directory belongs to one run: it is claimed atomically, and one that already holds a run is
continued only by a command with the same config (up to :data:`CONTINUATION_KEYS`).
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from utils.config.schema import LoggingConfig
from utils.core.component import Component
from utils.core.errors import NothingToDo, UserError
from utils.core.lock import LOCK_FILE, DirectoryLock, Held, is_held
from training.monitor.reporter import mark_if_dead, now, read_run_record

REPO = Path(__file__).resolve().parents[2]


def run_parent(logging_cfg: LoggingConfig, config_name: str, world_size: int, cuda: bool = True) -> Path:
    """``<expdir>/<config>/<N>GPU`` (``<N>CPU`` for a job without GPUs): the folder of this config's runs at this
    world size."""
    return Path(logging_cfg.expdir) / config_name / f"{world_size}{'GPU' if cuda else 'CPU'}"


# keys that may differ between a run and the command that continues it
CONTINUATION_KEYS = ("run_num", "description", "num_iters", "resume", "checkpoint_every_steps",
                     "checkpoint_every_minutes", "keep_checkpoints", "async_checkpoint", "checkpoint_checksums",
                     "log_every", "num_data_workers", "rendezvous_timeout_s", "collective_timeout_s")


@dataclass
class RunDir(Component):
    """This run's directory; ``resume``: continue the run already in it from its latest checkpoint; ``note``: what
    the command decided, for the log; ``lock``: the directory's lock, held by rank 0 until :meth:`close`."""

    path: Path
    resume: bool = False
    note: str = ""
    lock: DirectoryLock | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "lock": None}  # sent to the other ranks without rank 0's lock

    def close(self, error: BaseException | None) -> None:
        if self.lock is not None:
            self.lock.release()


def open_run_dir(logging_cfg: LoggingConfig, resume: str, config_name: str, world_size: int, flat_config: dict,
                 cuda: bool = True) -> RunDir:
    """The directory of this run, locked: a new one, or the run this command continues (rank 0 only).

    ``--run_num auto`` looks at this config's runs at this world size, newest first, for one whose recorded
    config is the command's (up to :data:`CONTINUATION_KEYS`): a run in use by a live process is skipped; a
    complete one ends the command (nothing to do); one with a checkpoint is continued; one that stopped before
    its first checkpoint is started again in its directory. Without such a run (or with ``--resume never``) it
    takes the next free number. An explicit ``--run_num`` is that directory, decided the same way. A run found
    ``running`` with no live owner died without a word (SIGKILL, a lost node): it is marked ``interrupted``.

    Raises:
        NothingToDo: the run is complete (``num_iters`` reached): nothing to do.
        UserError: the explicit run directory is in use by a live run (naming its host and pid) or holds a
            run and ``--resume never`` was given, or the directory cannot be created.
    """
    parent = run_parent(logging_cfg, config_name, world_size, cuda)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if logging_cfg.run_num != "auto":
            path = parent / logging_cfg.run_num
            path.mkdir(exist_ok=True)
            return _take(path, resume, flat_config, explicit=True)
        skipped = []
        for path in _matching_runs(parent, flat_config) if resume == "auto" else []:
            try:
                return _take(path, resume, flat_config, explicit=False)
            except Held as held:
                skipped.append(f"run {path.name} (the same config) is in use by {held.owner}")
        run = _take(_claim_next(parent), resume, flat_config, explicit=False)
        run.note = "; ".join([*skipped, f"starting run {run.path.name}"])
        return run
    except OSError as exc:
        raise UserError(f"cannot create run directory under {parent} ({exc.strerror or exc}); "
                        "pass a writable --expdir") from None


def _take(path: Path, resume: str, flat_config: dict, explicit: bool) -> RunDir:
    """``path`` locked, and what this command does with the run in it (see :func:`open_run_dir`).

    Raises:
        Held: ``path`` is in use (not ``explicit``); as :func:`open_run_dir` otherwise.
    """
    try:
        lock = DirectoryLock(path).acquire()
    except Held as held:
        if not explicit:
            raise
        raise UserError(f"run directory {path} is in use by a live run ({held.owner}); wait for it to end, or pass "
                        "another --run_num (--run_num auto takes the next free one)") from None
    try:
        return _decide(path, resume, flat_config, lock)
    except BaseException:
        lock.release()
        raise


def _decide(path: Path, resume: str, flat_config: dict, lock: DirectoryLock) -> RunDir:
    """What to do with the run in ``path``, which this process has locked."""
    if not holds_run(path):
        return RunDir(path, False, f"starting run {path.name}", lock)
    record = mark_if_dead(path, locked=True)
    if resume != "auto":
        raise UserError(f"run directory {path} already holds a run; continue it with --resume auto, or pass a new "
                        "--run_num (--run_num auto takes the next free one)")
    if record.get("status") == "completed" and record.get("config", {}).get("num_iters", 0) >= flat_config["num_iters"]:
        raise NothingToDo(f"run {path} is complete ({record['config']['num_iters']} iterations); raise --num_iters to "
                          "continue it, or pass --resume never (or a new --run_num) for another run")
    if has_checkpoint(path):
        return RunDir(path, True, f"continuing run {path.name} from its latest checkpoint", lock)
    if record.get("status") == "completed":
        raise UserError(f"run directory {path} holds a complete run with no complete checkpoint to resume from; "
                        "pass a new --run_num (--run_num auto takes the next free one)")
    _clear(path)
    return RunDir(path, False, f"run directory {path} held a run that stopped before its first checkpoint: starting "
                               "it again", lock)


def find_run(logging_cfg: LoggingConfig, resume: str, config_name: str, world_size: int, flat_config: dict,
             cuda: bool = True) -> Path | None:
    """The run directory :func:`open_run_dir` would continue, without locking or changing anything; None for a
    new run (also when the run found is in use).

    Raises:
        NothingToDo: the run is complete.
    """
    parent = run_parent(logging_cfg, config_name, world_size, cuda)
    if logging_cfg.run_num != "auto":
        candidates = [parent / logging_cfg.run_num]
    else:
        candidates = _matching_runs(parent, flat_config) if resume == "auto" and parent.is_dir() else []
    for path in candidates:
        if not holds_run(path) or is_held(path):
            continue
        record = read_run_record(path)
        if record.get("status") == "completed" and record.get("config", {}).get("num_iters", 0) >= flat_config["num_iters"]:
            raise NothingToDo(f"run {path} is complete ({record['config']['num_iters']} iterations)")
        return path if has_checkpoint(path) and resume == "auto" else None
    return None


def holds_run(path: Path) -> bool:
    """Whether ``path`` holds anything of a run (its lock file aside)."""
    return path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir())


def _matching_runs(parent: Path, flat_config: dict) -> list[Path]:
    """This parent's numbered runs whose recorded config is ``flat_config`` (up to :data:`CONTINUATION_KEYS`),
    newest first."""
    numbered = [p for p in parent.iterdir() if re.fullmatch(r"\d+", p.name) and holds_run(p)]
    return sorted((p for p in numbered if same_config(read_run_record(p).get("config", {}), flat_config)),
                  key=lambda p: -int(p.name))


def same_config(recorded: dict, flat_config: dict) -> bool:
    """Whether a run's recorded config is ``flat_config`` in every key a continuation may not change."""
    return all(recorded.get(k) == v for k, v in flat_config.items() if k not in CONTINUATION_KEYS)


def has_checkpoint(path: Path) -> bool:
    """Whether the run directory holds a complete sharded checkpoint (``checkpoints/latest``)."""
    return (path / "checkpoints" / "latest").is_file()


def _clear(path: Path) -> None:
    """Remove a stopped run's files (its lock file aside), so the run started again mixes nothing with them."""
    for item in path.iterdir():
        if item.name == LOCK_FILE:
            continue
        shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()


def _claim_next(parent: Path) -> Path:
    while True:  # another job may claim the same number between the scan and mkdir
        taken = [int(p.name) for p in parent.iterdir() if re.fullmatch(r"\d+", p.name)]
        path = parent / f"{max(taken, default=-1) + 1:02d}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def git_state() -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout holding this code."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def versions() -> dict[str, str | None]:
    """Python, torch, CUDA, cuDNN, NCCL and DALI versions (None where absent)."""
    import torch
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda, "cudnn": None, "nccl": None, "dali": None}
    if torch.backends.cudnn.is_available():
        out["cudnn"] = str(torch.backends.cudnn.version())
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    for dist_name in ("nvidia-dali-cuda120", "nvidia-dali-cuda130"):
        try:
            out["dali"] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def run_record(config_name: str, flat_config: dict, world_info: dict) -> dict[str, Any]:
    """The first ``run.json``: what produced this run. ``world_info`` has world size, mesh,
    launcher and the host and device of each rank."""
    return {"config_name": config_name, "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "started": now(), "finished": None, "status": "running", "error": None,
            "git": git_state(), "versions": versions(), **world_info, "config": flat_config}
