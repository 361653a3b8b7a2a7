"""Run directory and reporting: one flat record per epoch -> console, TensorBoard, ``metrics.jsonl``.

The run directory ``<expdir>/<config>/<N>GPU/<run_num>/`` belongs to one run: :func:`claim_run_dir`
creates it atomically and refuses one that already holds a run. Rank 0 writes everything here:

* ``run.json``: what produced the run (command line, git commit and dirty flag, versions, devices,
  world size and mesh, launcher, resolved config) and its status, rewritten atomically at the end;
* ``config.yaml``: the resolved config, loadable with ``--yaml_config``;
* ``out.log``: the console lines;
* ``metrics.jsonl``: one flat JSON record per epoch (``loss/train``, ``rmse/<channel>``,
  ``memory/peak_allocated``, ``samples_per_s``, ...);
* TensorBoard events: every numeric record key as a scalar, plus an HParams entry (the resolved
  config and the final metrics) so the HParams tab compares runs.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.errors import NothingToDo, Preempted, UserError, free_space
from utils.memory import format_memory
from utils.schema import LoggingConfig

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
# record keys that are not scalars of the run (axes, or which rank had a maximum)
NOT_SCALARS = ("epoch", "iteration", "elapsed_s")


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


def _record(path: Path) -> dict:
    try:
        return json.loads((path / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def _same_run(path: Path, flat_config: dict) -> bool:
    old = _record(path).get("config", {})
    return all(old.get(k) == v for k, v in flat_config.items() if k not in CONTINUATION_KEYS)


def has_checkpoint(path: Path) -> bool:
    """Whether the run directory holds a complete sharded checkpoint (``checkpoints/latest``)."""
    return (path / "checkpoints" / "latest").is_file()


def _continues(path: Path, resume: str, flat_config: dict, explicit: bool) -> bool:
    """Whether this command continues the run in ``path`` (False: start a new run elsewhere).

    Raises NothingToDo or UserError as :func:`open_run_dir` documents."""
    record = _record(path)
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


# ---------------------------------------------------------------- run record
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
            "started": _now(), "finished": None, "status": "running", "error": None,
            "git": git_state(), "versions": versions(), **world_info, "config": flat_config}


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write JSON to a temporary file and rename it, so readers never see half a file.

    Raises:
        OSError: the write failed (the temporary file is removed, ``path`` is untouched).
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- reporter
def tensorboard_tag(key: str) -> str:
    """TensorBoard tag of a record key: sectioned keys as they are, throughput under ``perf/``."""
    return key if "/" in key or key == "lr" else f"perf/{key}"


def hparam_value(value: Any) -> bool | int | float | str:
    """HParams accept numbers, booleans and strings: lists and null become text."""
    if value is None or isinstance(value, (list, tuple)):
        return json.dumps(value)
    return value


class Reporter:
    """Rank 0's outputs for one run. Lifecycle: :meth:`start`, then :meth:`epoch` per epoch and
    :meth:`progress` per step, then :meth:`close` (on success and on error).

    Other ranks get a Reporter with ``run_dir=None``: every method is then a no-op.
    """

    def __init__(self, cfg: LoggingConfig, run_dir: Path | None, key_channels: list[str]):
        self.cfg, self.run_dir, self.key_channels = cfg, run_dir, key_channels
        self.writer = None
        self.record: dict[str, Any] = {}
        self.t0, self.elapsed_before = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        """Training wall-clock seconds of this run, resumed parts included."""
        return self.elapsed_before + time.perf_counter() - self.t0

    def start(self, record: dict[str, Any], config_yaml: str, metric_tags: list[str],
              resumed_step: int | None = None, elapsed_before: float = 0.0) -> None:
        """Write ``run.json``, ``config.yaml`` and the HParams entry (the resolved config, with
        ``metric_tags`` as the metrics the HParams tab shows).

        A run resumed at ``resumed_step`` keeps its first start time, lists each resume in
        ``run.json``, drops the epochs after that step from ``metrics.jsonl`` and has TensorBoard
        purge its events from that step on, so no point appears twice.
        """
        self.t0, self.elapsed_before = time.perf_counter(), elapsed_before
        if self.run_dir is None:
            return
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
        if resumed_step is not None:
            record = self._resumed_record(record, resumed_step)
            self._truncate_metrics(resumed_step)
        self.record = record
        write_json_atomic(self.run_dir / "run.json", record)
        (self.run_dir / "config.yaml").write_text(config_yaml)
        purge = None if resumed_step is None else resumed_step + 1
        self.writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge)
        hp = {k: hparam_value(v) for k, v in record["config"].items()}
        hp.update(world_size=record["world_size"], **{f"mesh_{k}": v for k, v in record["mesh"].items()})
        for summary in hparams(hp, {tag: 0.0 for tag in metric_tags}):
            self.writer.file_writer.add_summary(summary)

    def _resumed_record(self, record: dict[str, Any], step: int) -> dict[str, Any]:
        first = _record(self.run_dir)
        resumes = first.get("resumes", []) + [{"time": _now(), "step": step, "command": record["command"]}]
        return {**record, "started": first.get("started", record["started"]), "resumes": resumes}

    def _truncate_metrics(self, step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if path.is_file():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["iteration"] <= step]
            path.write_text("".join(line + "\n" for line in kept))

    def progress(self, text: str) -> None:
        if self.run_dir is not None:
            log.info(text)

    def epoch(self, record: dict[str, Any], n_epochs: int) -> None:
        """Report one epoch: the console line, TensorBoard scalars and a ``metrics.jsonl`` line."""
        if self.run_dir is None:
            return
        record = {**record, "elapsed_s": round(self.elapsed(), 3)}
        log.info(self.epoch_line(record, n_epochs))
        log.info(format_memory({k[len("memory/"):]: v for k, v in record.items() if k.startswith("memory/")}))
        try:
            for key, value in record.items():
                if key not in NOT_SCALARS and not key.endswith("_rank") and isinstance(value, (int, float)):
                    self.writer.add_scalar(tensorboard_tag(key), value, record["iteration"])
            self.writer.flush()
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:  # TensorBoard's writer thread re-raises its own write errors here
            self.writer = None  # it cannot be flushed or closed any more
            raise UserError(f"writing the run's logs in {self.run_dir} failed: {exc.strerror or exc} "
                            f"({free_space(self.run_dir)}); free space or pass --expdir on a larger "
                            "filesystem") from None

    def epoch_line(self, r: dict[str, Any], n_epochs: int) -> str:
        line = (f"epoch {r['epoch'] + 1}/{n_epochs} | {r['epoch_time_s']:.2f} s | {r['samples_per_s']:.1f} samples/s"
                + (f" | MFU {100 * r['mfu']:.1f}%" if "mfu" in r else "")
                + f" | data wait {100 * r['data_wait_share']:.0f}% | train loss {r['loss/train']:.4f}")
        if "loss/valid" in r:
            line += f" | valid loss {r['loss/valid']:.4f} | RMSE " + " ".join(
                f"{k} {r[f'rmse/{k}']:.4g} (persistence {r[f'rmse_persistence/{k}']:.4g})" for k in self.key_channels)
        return line

    def figure(self, tag: str, fig, step: int) -> None:
        """A matplotlib figure at optimizer step ``step``."""
        if self.writer is not None:
            self.writer.add_figure(tag, fig, global_step=step)

    def close(self, error: BaseException | None = None) -> None:
        """Flush and close the writer; mark ``run.json`` completed, preempted, interrupted or failed (with
        the error)."""
        if self.run_dir is None or not self.record:
            return
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        status = ("completed" if error is None else "interrupted" if isinstance(error, KeyboardInterrupt)
                  else "preempted" if isinstance(error, Preempted) else "failed")
        self.record.update(finished=_now(), status=status, wall_s=round(self.elapsed(), 1),
                           error=None if error is None else str(error) or type(error).__name__)
        try:
            write_json_atomic(self.run_dir / "run.json", self.record)
        except OSError as exc:  # e.g. the disk that failed the run is still full: keep the run's own error
            if error is None:
                raise UserError(f"cannot update {self.run_dir / 'run.json'} ({exc.strerror}); free space there") from None
            log.warning("could not mark %s as %s: %s", self.run_dir / "run.json", status, exc.strerror)
