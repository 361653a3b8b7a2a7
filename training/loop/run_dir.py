"""The run directory ``<expdir>/<config>/<N>GPU/<run_num>/``: which one a command trains in (a new one, or
the run it continues), and the record of what produced the run (``run.json``'s first content).

A run directory belongs to one run: it is claimed atomically, and one that already holds a run is
continued only by a command with the same settings (up to :data:`CONTINUATION_KEYS`); which run a command
continues is never a guess (:func:`open_run_dir`, docs/checkpoints.md#which-run-a-command-trains-in).
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

from distributed.checkpoint.folder import folder_step
from training.monitor.reporter import mark_if_dead, now, read_run_record
from utils.config.schema import LoggingConfig
from utils.core.component import Component
from utils.core.errors import NothingToDo, UserError
from utils.core.files import check_in_place, check_own_folder
from utils.core.lock import LOCK_FILE, DirectoryLock, Held, is_held, owner

REPO = Path(__file__).resolve().parents[2]


def run_parent(logging_cfg: LoggingConfig, config_name: str, world_size: int, cuda: bool = True) -> Path:
    """``<expdir>/<config>/<N>GPU`` (``<N>CPU`` for a job without GPUs): the folder of this config's runs at this
    world size."""
    return Path(logging_cfg.expdir) / config_name / f"{world_size}{'GPU' if cuda else 'CPU'}"


# keys that may differ between a run and the command that continues it: none changes what a step computes
# (``num_iters`` changes the schedule's length: it extends a complete run, or re-plans an unfinished one;
# ``expdir``: a runs folder moved or copied elsewhere holds the same runs)
CONTINUATION_KEYS = ("run_num", "expdir", "description", "num_iters", "resume", "checkpoint_every_steps",
                     "checkpoint_every_minutes", "keep_checkpoints", "async_checkpoint", "checkpoint_checksums",
                     "log_every", "num_data_workers", "rendezvous_timeout_s", "collective_timeout_s")
NEW_RUN_HINT = "--resume never starts a new run instead"


@dataclass
class RunDir(Component):
    """This run's directory; ``resume``: continue the run already in it from its latest checkpoint; ``note``: what
    the command decided and why, for the log; ``lock``: the directory's lock, held by rank 0 until :meth:`close`."""

    path: Path
    resume: bool = False
    note: str = ""
    lock: DirectoryLock | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "lock": None}  # sent to the other ranks without rank 0's lock

    def close(self, error: BaseException | None) -> None:
        if self.lock is not None:
            self.lock.release()


@dataclass
class Match:
    """A run with the command's settings: ``done`` when complete at the command's ``num_iters`` or beyond;
    ``state`` says where it stands and what the command would do with it."""

    path: Path
    done: bool
    state: str


def open_run_dir(logging_cfg: LoggingConfig, resume: str, config_name: str, world_size: int, flat_config: dict,
                 cuda: bool = True) -> RunDir:
    """The directory of this run, locked: a new one, or the run this command continues (rank 0 only). The rule
    (docs/checkpoints.md#which-run-a-command-trains-in):

    ``--run_num auto`` compares the command's config with the recorded config of each run of this config name at
    this world size; a run matches when they are equal up to :data:`CONTINUATION_KEYS` (:func:`same_config`).
    Of the matching runs no live process holds, those the command has work for are an unfinished one and a
    complete one whose ``num_iters`` the command raises. Exactly one is continued; two or more are an error
    naming the ``--run_num`` of each; none ends the command when a matching run is complete (nothing to do), else
    the next free number is a new run. ``--resume never`` always takes the next free number. An explicit
    ``--run_num`` is that directory: a new run there, or its run when the settings match. A run found
    ``running`` with no live owner died without a word (SIGKILL, a lost node): it is marked ``killed``. The
    note names the run, the reason and the flag for the alternative.

    Raises:
        NothingToDo: the matching run is complete (``num_iters`` reached): nothing to do.
        UserError: two runs with work left match; the explicit run directory is in use by a live run (naming its
            host and pid), holds a run of other settings, or holds a run and ``--resume never`` was given; or
            the directory cannot be created.
    """
    parent = run_parent(logging_cfg, config_name, world_size, cuda)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if logging_cfg.run_num != "auto":
            path = parent / logging_cfg.run_num
            path.mkdir(exist_ok=True)
            return _take(path, resume, flat_config, explicit=True)
        skipped: list[str] = []
        while resume == "auto":
            path, why = pick_run(parent, flat_config, config_name, skipped)
            if path is None:
                break
            try:
                run = _take(path, resume, flat_config, explicit=False)
            except Held as held:  # taken between the scan and the lock
                skipped.append(f"run {path.name} (the same settings) is in use by {held.owner}")
                continue
            run.note = "; ".join([*skipped, f"{run.note}: {why}; {NEW_RUN_HINT}"])
            return run
        run = _take(_claim_next(parent), resume, flat_config, explicit=False)
        why = "--resume never" if resume == "never" else _why_new(parent, run.path, flat_config, config_name)
        run.note = "; ".join([*skipped, f"{run.note}: a new run ({why})"])
        return run
    except OSError as exc:
        raise UserError(f"cannot create run directory under {parent} ({exc.strerror or exc}); "
                        "pass a writable --expdir") from None


def pick_run(parent: Path, flat_config: dict, config_name: str, skipped: list[str]) -> tuple[Path | None, str]:
    """The run ``--run_num auto`` continues and why (see :func:`open_run_dir`), or ``(None, "")`` for a new run;
    ``skipped`` gets a line for each matching run a live process holds. Changes nothing.

    Raises:
        NothingToDo: no matching run has work left and one is complete.
        UserError: two or more matching runs have work left (naming the ``--run_num`` of each).
    """
    matches = []
    for path in matching_runs(parent, flat_config) if parent.is_dir() else []:
        if is_held(path):
            line = f"run {path.name} (the same settings) is in use by {owner(path)}"
            skipped += [] if line in skipped else [line]
        else:
            matches.append(describe(path, flat_config["num_iters"]))
    work = [m for m in matches if not m.done]
    if len(work) > 1:
        raise UserError(f"{len(work)} runs of config {config_name} in {parent} have this command's settings and work "
                        f"left: {', '.join(f'run {m.path.name} ({m.state})' for m in work)}; pick one with "
                        f"{' or '.join(f'--run_num {m.path.name}' for m in work)}, or start a new run with "
                        "--resume never")
    if work:
        done = [m.path.name for m in matches if m.done]
        others = f" (complete: run {', '.join(done)})" if done else ""
        return work[0].path, f"{work[0].state}, the only run of these settings with work left{others}"
    if matches:
        newest = matches[0].path
        raise NothingToDo(f"run {newest} is complete ({recorded_iters(newest)} iterations); raise --num_iters to "
                          "continue it, or pass --resume never (or a new --run_num) for another run")
    return None, ""


def describe(path: Path, num_iters: int) -> Match:
    """Where the run in ``path`` stands, for a command of ``num_iters`` iterations."""
    record, recorded = read_run_record(path), recorded_iters(path)
    if record.get("status") == "completed":
        if recorded >= num_iters:
            return Match(path, True, f"complete at {recorded} iterations")
        return Match(path, False, f"complete at {recorded} iterations, to be extended to {num_iters}")
    step = checkpoint_step(path)
    where = f"iteration {step} of {recorded}" if step is not None else f"no checkpoint yet, of {recorded} iterations"
    plan = "" if recorded == num_iters else f", re-planned for {num_iters}"
    return Match(path, False, f"unfinished: {where}{plan}")


def recorded_iters(path: Path) -> int:
    """The ``num_iters`` of the run in ``path`` (0 when its record lacks one)."""
    return int(read_run_record(path).get("config", {}).get("num_iters", 0))


def checkpoint_step(path: Path) -> int | None:
    """The step of the run's latest checkpoint, None without a readable ``checkpoints/latest``."""
    try:
        return folder_step(Path((path / "checkpoints" / "latest").read_text().strip()))
    except (OSError, UnicodeDecodeError):
        return None


def _why_new(parent: Path, new: Path, flat_config: dict, config_name: str) -> str:
    """Why a new run: no earlier run of this config name, those of these settings in use (named before this),
    or the keys in which the earlier runs differ; and the named runs of the folder, which only a command that
    names them continues."""
    return _why_new_numbered(parent, new, flat_config, config_name) + _named_note(parent)


def _named_note(parent: Path) -> str:
    named = sorted(p.name for p in parent.iterdir() if p.is_dir() and not re.fullmatch(r"\d+", p.name)
                   and holds_run(p))
    if not named:
        return ""
    shown = ", ".join(named[:3]) + (", ..." if len(named) > 3 else "")
    return f"; named runs ({shown}) are continued only by naming them with --run_num"


def _why_new_numbered(parent: Path, new: Path, flat_config: dict, config_name: str) -> str:
    runs = [p for p in numbered_runs(parent) if p != new]
    if not runs:
        return f"no earlier run of config {config_name} in {parent}"
    other = [p for p in runs if not same_config(read_run_record(p).get("config", {}), flat_config)]
    if not other:
        return "the runs of these settings are in use"
    keys = sorted({k for p in other for k, v in flat_config.items() if k not in CONTINUATION_KEYS
                   and read_run_record(p).get("config", {}).get(k) != v})
    shown = ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
    verb = "differ" if len(other) > 1 else "differs"
    return f"run{'s' * (len(other) > 1)} {', '.join(p.name for p in other)} of config {config_name} {verb} from " \
        f"this command in {shown}; to continue a run, repeat its settings (its config.yaml)"


def _take(path: Path, resume: str, flat_config: dict, explicit: bool) -> RunDir:
    """``path`` locked, and what this command does with the run in it (see :func:`open_run_dir`).

    Raises:
        Held: ``path`` is in use (not ``explicit``); as :func:`open_run_dir` otherwise.
    """
    for folder in (path, path / "checkpoints"):  # ours to make: never a link to somewhere else
        check_own_folder(folder)
    for name in (LOCK_FILE, "out.log"):  # written in place: checked before the lock writes anything
        check_in_place(path / name)
    try:
        lock = DirectoryLock(path).acquire()
    except Held as held:
        if not explicit:
            raise
        raise UserError(f"run directory {path} is in use by a live run ({held.owner}); wait for it to end, or pass "
                        "another --run_num (--run_num auto takes the next free one)") from None
    try:
        run = _decide(path, resume, flat_config, lock)
    except BaseException:
        lock.release()
        raise
    if explicit:
        run.note += f": named by --run_num {path.name}" + ("; without --run_num, --resume never starts a new run "
                                                           "instead" if run.resume else "")
    return run


def _decide(path: Path, resume: str, flat_config: dict, lock: DirectoryLock) -> RunDir:
    """What to do with the run in ``path``, which this process has locked."""
    if not holds_run(path):
        return RunDir(path, False, f"starting run {path.name}", lock)
    record = mark_if_dead(path, locked=True)
    if resume != "auto":
        raise UserError(f"run directory {path} already holds a run; continue it with --resume auto, or pass a new "
                        "--run_num (--run_num auto takes the next free one)")
    differ = [k for k, v in flat_config.items() if k not in CONTINUATION_KEYS and record.get("config", {}).get(k) != v]
    if differ:
        shown = ", ".join(f"{k} {record.get('config', {}).get(k)!r} (this command: {flat_config[k]!r})"
                          for k in differ[:3])
        raise UserError(f"run {path} was trained with other settings: {shown}; repeat its settings to continue it "
                        f"(--yaml_config {path / 'config.yaml'} --config {record.get('config_name', 'NAME')}), or "
                        "drop --run_num for a run of this command's own")
    if record.get("status") == "completed" and recorded_iters(path) >= flat_config["num_iters"]:
        raise NothingToDo(f"run {path} is complete ({recorded_iters(path)} iterations); raise --num_iters to "
                          "continue it, or pass --resume never (or a new --run_num) for another run")
    if has_checkpoint(path):
        return RunDir(path, True, f"continuing run {path.name} from its latest checkpoint{_after_kill(record)}", lock)
    if record.get("status") == "completed":
        raise UserError(f"run directory {path} holds a complete run with no complete checkpoint to resume from; "
                        "pass a new --run_num (--run_num auto takes the next free one)")
    _clear(path)
    return RunDir(path, False, f"run directory {path} held a run that stopped before its first checkpoint: starting "
                               "it again", lock)


def _after_kill(record: dict) -> str:
    """For the resume's first line: the run died without a word (marked ``killed`` by :func:`mark_if_dead`), which
    only run.json said until now, and the checkpoint it goes on from."""
    if record.get("status") != "killed":
        return ""
    checkpoint = record.get("last_checkpoint")
    return (f" {checkpoint}" if checkpoint else "") + " (its previous attempt was killed: run.json still said running " \
        "and no process held the run)"


def find_run(logging_cfg: LoggingConfig, resume: str, config_name: str, world_size: int, flat_config: dict,
             cuda: bool = True) -> Path | None:
    """The run directory :func:`open_run_dir` would continue from a checkpoint, without locking or changing
    anything; None for a new run (also when the run found is in use).

    Raises:
        NothingToDo: the run is complete. UserError: as :func:`pick_run`.
    """
    parent = run_parent(logging_cfg, config_name, world_size, cuda)
    if resume != "auto":
        return None
    if logging_cfg.run_num != "auto":
        path = parent / logging_cfg.run_num
        if not holds_run(path) or is_held(path):
            return None
        if describe(path, flat_config["num_iters"]).done:
            raise NothingToDo(f"run {path} is complete ({recorded_iters(path)} iterations)")
    else:
        path, _ = pick_run(parent, flat_config, config_name, [])
    return path if path is not None and has_checkpoint(path) else None


def holds_run(path: Path) -> bool:
    """Whether ``path`` holds anything of a run (its lock file aside)."""
    return path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir())


def numbered_runs(parent: Path) -> list[Path]:
    """This parent's numbered run directories that hold a run, newest first."""
    return sorted((p for p in parent.iterdir() if re.fullmatch(r"\d+", p.name) and holds_run(p)),
                  key=lambda p: -int(p.name))


def matching_runs(parent: Path, flat_config: dict) -> list[Path]:
    """This parent's numbered runs whose recorded config is ``flat_config`` (up to :data:`CONTINUATION_KEYS`),
    newest first."""
    return [p for p in numbered_runs(parent) if same_config(read_run_record(p).get("config", {}), flat_config)]


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
