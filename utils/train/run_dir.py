"""The run directory ``<expdir>/<config>/<N>GPU/<run_num>/``: which one a command trains in (a new one, or
the run it continues), and the record of what produced the run (``run.json``'s first content).

A run directory belongs to one run: it is claimed atomically, and one that already holds a run is
continued only by a command with the same config (up to :data:`CONTINUATION_KEYS`).
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.config.schema import LoggingConfig
from utils.core.errors import NothingToDo, UserError
from utils.monitor.reporter import now, read_run_record

REPO = Path(__file__).resolve().parents[2]


def run_parent(logging_cfg: LoggingConfig, config_name: str, world_size: int) -> Path:
    """``<expdir>/<config>/<N>GPU``: the folder of this config's runs at this world size."""
    return Path(logging_cfg.expdir) / config_name / f"{world_size}GPU"


# keys that may differ between a run and the command that continues it
CONTINUATION_KEYS = ("run_num", "description", "num_iters", "resume", "checkpoint_every_steps",
                     "checkpoint_every_minutes", "keep_checkpoints", "async_checkpoint", "log_every",
                     "num_data_workers", "rendezvous_timeout_s", "collective_timeout_s")


@dataclass
class RunDir:
    """This run's directory; ``resume``: continue the run already in it from its latest checkpoint."""

    path: Path
    resume: bool = False


def open_run_dir(logging_cfg: LoggingConfig, resume: str, config_name: str, world_size: int,
                 flat_config: dict) -> RunDir:
    """The directory of this run: a new one, or (``resume`` auto) the unfinished run this command continues.

    ``--run_num auto`` continues the newest run of this config and world size when its config is the
    same (up to :data:`CONTINUATION_KEYS`) and it can go on; otherwise it takes the next free number.
    An explicit ``--run_num`` continues that run, or starts it when the directory is new.

    Raises:
        NothingToDo: the run is complete (``num_iters`` reached): nothing to do.
        UserError: the run cannot be continued (``--resume never``, or no checkpoint to resume
            from), or the directory cannot be created.
    """
    parent = run_parent(logging_cfg, config_name, world_size)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        continued = continued_run(logging_cfg, resume, config_name, world_size, flat_config)
        if continued is not None:
            return RunDir(continued, True)
        if logging_cfg.run_num != "auto":
            return RunDir(_claim(parent / logging_cfg.run_num))
        return RunDir(_claim_next(parent))
    except OSError as exc:
        raise UserError(f"cannot create run directory under {parent} ({exc.strerror or exc}); "
                        "pass a writable --expdir") from None


def continued_run(logging_cfg: LoggingConfig, resume: str, config_name: str, world_size: int,
                  flat_config: dict) -> Path | None:
    """The run directory this command continues (see :func:`open_run_dir`), or None for a new run.
    Reads only: creates nothing.

    Raises:
        NothingToDo, UserError: as :func:`open_run_dir`.
    """
    parent = run_parent(logging_cfg, config_name, world_size)
    if not parent.is_dir():
        return None
    if logging_cfg.run_num != "auto":
        path = parent / logging_cfg.run_num
        return path if _holds_run(path) and _continues(path, resume, flat_config, explicit=True) else None
    newest = _newest_run(parent)
    if resume == "auto" and newest is not None and _same_run(newest, flat_config) and \
            _continues(newest, resume, flat_config, explicit=False):
        return newest
    return None


def _holds_run(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _newest_run(parent: Path) -> Path | None:
    numbered = [p for p in parent.iterdir() if re.fullmatch(r"\d+", p.name) and _holds_run(p)]
    return max(numbered, key=lambda p: int(p.name), default=None)


def _same_run(path: Path, flat_config: dict) -> bool:
    old = read_run_record(path).get("config", {})
    return all(old.get(k) == v for k, v in flat_config.items() if k not in CONTINUATION_KEYS)


def has_checkpoint(path: Path) -> bool:
    """Whether the run directory holds a complete sharded checkpoint (``checkpoints/latest``)."""
    return (path / "checkpoints" / "latest").is_file()


def _continues(path: Path, resume: str, flat_config: dict, explicit: bool) -> bool:
    """Whether this command continues the run in ``path`` (False: start a new run elsewhere).

    Raises NothingToDo or UserError as :func:`open_run_dir` documents."""
    record = read_run_record(path)
    done = record.get("status") == "completed" and \
        record.get("config", {}).get("num_iters", 0) >= flat_config["num_iters"]
    if resume != "auto":
        if explicit:
            raise UserError(f"run directory {path} already holds a run; continue it with --resume auto, or pass "
                            "a new --run_num (--run_num auto takes the next free one)")
        return False
    if done:
        raise NothingToDo(f"run {path} is complete ({record['config']['num_iters']} iterations); raise "
                          "--num_iters to continue it, or pass a new --run_num for another run")
    if has_checkpoint(path):
        return True
    if explicit:
        raise UserError(f"run directory {path} holds a run with no complete checkpoint to resume from; pass a "
                        "new --run_num (--run_num auto takes the next free one), or move that directory away")
    return False


def _claim_next(parent: Path) -> Path:
    while True:  # another job may claim the same number between the scan and mkdir
        taken = [int(p.name) for p in parent.iterdir() if re.fullmatch(r"\d+", p.name)]
        try:
            return _claim(parent / f"{max(taken, default=-1) + 1:02d}", auto=True)
        except FileExistsError:
            continue


def _claim(path: Path, auto: bool = False) -> Path:
    if path.is_dir() and not any(path.iterdir()):
        return path  # made by hand, empty: nothing to mix with
    path.mkdir(exist_ok=not auto)
    return path


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
