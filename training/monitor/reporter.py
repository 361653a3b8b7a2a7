"""Rank 0's outputs of a run: one flat record per epoch -> console, TensorBoard (+ HParams), ``metrics.jsonl``,
and the run record ``run.json`` it keeps up to date (``training/loop/run_dir.py`` makes the directory).

* ``run.json``: what produced the run (command line, git commit and dirty flag, versions, devices,
  world size and mesh, launcher, resolved config) and its status, rewritten atomically at the end;
* ``config.yaml``: the resolved config, loadable with ``--yaml_config``;
* ``metrics.jsonl``: one flat JSON record per epoch (``loss/train``, ``rmse/<channel>``,
  ``memory/peak_allocated``, ``samples_per_s``, ...);
* TensorBoard events: every numeric record key as a scalar, plus an HParams entry (the resolved
  config and the final metrics) so the HParams tab compares runs, and the validation's figures, drawn on a
  thread of their own while the next epoch trains (``training/monitor/drawing.py``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from distributed.checkpoint.folder import read_latest
from training.monitor.drawing import FigureDrawer
from training.monitor.memory import format_memory
from utils.config.schema import LoggingConfig
from utils.core.component import Component
from utils.core.errors import Preempted, UserError, free_space
from utils.core.files import open_append, read_bounded, read_jsonl, write_json_atomic, write_text_atomic
from utils.core.lock import is_held

log = logging.getLogger(__name__)
# record keys that are not scalars of the run (axes, or which rank had a maximum; the K an epoch started with is
# for the epoch line's range: train/rollout_steps is the curve)
NOT_SCALARS = ("epoch", "iteration", "elapsed_s", "train/rollout_steps_first")


def now() -> str:
    """The local time as ISO 8601, to the second (``run.json``'s times)."""
    return datetime.datetime.now().isoformat(timespec="seconds")


def read_run_record(run_dir: Path) -> dict:
    """``run_dir/run.json`` as a dict (read bounded, never through a link); empty when it is missing or not JSON.

    Raises:
        NotOurs: ``run.json`` is a link, not a regular file, or larger than any run record.
    """
    try:
        record = json.loads(read_bounded(Path(run_dir) / "run.json"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


DIED = "stopped without a word (killed, or its node was lost): no live process holds its directory"


def mark_if_dead(run_dir: Path, locked: bool = False) -> dict:
    """``run_dir``'s record; one that says ``running`` while no live process holds the directory (``locked``: the
    caller holds it itself) is a run that died without a word (SIGKILL, a lost node): it is marked ``killed``
    in ``run.json``, with the name of its last complete checkpoint (``last_checkpoint``, null without one), when
    the file can be written, and returned so. A resume keeps this in its entry of ``resumes`` (``after``)."""
    record = read_run_record(run_dir)
    if record.get("status") == "running" and (locked or not is_held(run_dir)):
        record.update(status="killed", error=DIED, last_checkpoint=last_checkpoint(run_dir))
        try:
            write_json_atomic(Path(run_dir) / "run.json", record)
        except OSError:
            pass  # a read-only copy of the run: reported as killed all the same
    return record


def last_checkpoint(run_dir: Path) -> str | None:
    """The name of the newest complete checkpoint of the run in ``run_dir`` (the step folder ``latest`` names), or
    None without one (a damaged or linked ``latest`` included: the resume names it)."""
    try:
        folder = read_latest(Path(run_dir) / "checkpoints")
    except UserError:
        return None
    return folder.name if folder is not None else None


# run.json's status -> the HParams tab's: a preempted run goes on when requeued; an interrupted one may not
HPARAMS_STATUS = {"completed": "STATUS_SUCCESS", "failed": "STATUS_FAILURE", "preempted": "STATUS_RUNNING",
                  "interrupted": "STATUS_UNKNOWN"}


def session_end(status: str):
    """The HParams session-end summary for ``status`` (a key of :data:`HPARAMS_STATUS`), built from TensorBoard's
    protocol buffers as ``torch.utils.tensorboard.summary.hparams`` builds its always-successful one."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.metadata import PLUGIN_DATA_VERSION, PLUGIN_NAME, SESSION_END_INFO_TAG
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo
    content = HParamsPluginData(session_end_info=SessionEndInfo(status=Status.Value(HPARAMS_STATUS[status]),
                                                                end_time_secs=time.time()),
                                version=PLUGIN_DATA_VERSION)
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME,
                                                                      content=content.SerializeToString()))
    return Summary(value=[Summary.Value(tag=SESSION_END_INFO_TAG, metadata=metadata)])


def tensorboard_tag(key: str) -> str:
    """TensorBoard tag of a record key: sectioned keys as they are, throughput under ``perf/``."""
    return key if "/" in key or key == "lr" else f"perf/{key}"


def rollout_range(record: dict[str, Any]) -> str:
    """The K of an epoch record: ``2``, or ``1-2`` when the curriculum raised it during the epoch."""
    last = record["train/rollout_steps"]
    first = record.get("train/rollout_steps_first", last)
    return f"{last}" if first == last else f"{first}-{last}"


def hparam_value(value: Any) -> bool | int | float | str:
    """HParams accept numbers, booleans and strings: lists and null become text."""
    if value is None or isinstance(value, (list, tuple)):
        return json.dumps(value)
    return value


class Reporter(Component):
    """Rank 0's outputs for one run: ``run.json``, ``config.yaml`` and HParams at :meth:`start`, a progress bar
    (on a terminal) or a progress line every ``log_every`` steps, the epoch report, and the run's status at
    :meth:`close` (on success and on error).

    Other ranks get a Reporter with ``run_dir=None``: every hook is then a no-op.

    Args:
        cfg: the ``logging`` config section.
        run_dir: the run directory (rank 0), or None.
        key_channels: channels the epoch line shows.
        record: the first ``run.json`` (``training/loop/run_dir.py``'s ``run_record``).
        config_yaml: the resolved config as YAML, written as ``config.yaml``.
        metric_tags: the metrics the HParams tab shows.
        n_epochs: epochs of the whole run (the epoch line's ``epoch 3/40``).
        last_loss: ``(iteration, loss)`` of the newest step whose loss was read back (one step late: the
            progress line never waits for the GPU), or None.
        rollout_steps: rollout training: ``(step, epoch) -> K`` of that optimizer step (0-based), shown on the
            progress line; None: one-step training.
    """

    def __init__(self, cfg: LoggingConfig, run_dir: Path | None, key_channels: list[str], record: dict[str, Any],
                 config_yaml: str, metric_tags: list[str], n_epochs: int,
                 last_loss: Callable[[], tuple[int, float] | None],
                 rollout_steps: Callable[[int, int], int] | None = None):
        self.cfg, self.run_dir, self.key_channels = cfg, run_dir, key_channels
        self.first_record, self.config_yaml, self.metric_tags = record, config_yaml, metric_tags
        self.n_epochs, self.last_loss, self.rollout_steps = n_epochs, last_loss, rollout_steps
        self.printed = 0  # the iteration of the last progress line
        self.writer = None
        self.drawer: FigureDrawer | None = None
        self.figures_due: tuple[dict[str, Any], int] | None = None  # the last validation's, and its iteration
        self.bar = None
        self.record: dict[str, Any] = {}
        self.t0, self.elapsed_before = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        """Training wall-clock seconds of this run, resumed parts included."""
        return self.elapsed_before + time.perf_counter() - self.t0

    def start(self, state) -> None:
        """Write ``run.json``, ``config.yaml`` and the HParams entry (the resolved config, with the metric tags
        as the metrics the HParams tab shows).

        A run resumed at ``state.resumed_step`` keeps its first start time, lists each resume in
        ``run.json``, drops the epochs after that step from ``metrics.jsonl`` (renumbering from 1 the records of a
        version that counted epochs from 0) and has TensorBoard purge its events from that step on, so no point
        appears twice.
        """
        self.t0, self.elapsed_before = time.perf_counter(), state.elapsed_s
        if self.run_dir is None:
            return
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
        record, resumed_step = self.first_record, state.resumed_step
        if resumed_step is not None:
            record = self._resumed_record(record, resumed_step)
            self._truncate_metrics(resumed_step)
        self.record = record
        write_json_atomic(self.run_dir / "run.json", record)
        write_text_atomic(self.run_dir / "config.yaml", self.config_yaml)
        purge = None if resumed_step is None else resumed_step + 1
        self.writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge)
        self.drawer = FigureDrawer(self.writer)
        hp = {k: hparam_value(v) for k, v in record["config"].items()}
        hp.update(world_size=record["world_size"], **{f"mesh_{k}": v for k, v in record["mesh"].items()})
        experiment, session_start, _ = hparams(hp, {tag: 0.0 for tag in self.metric_tags})
        for summary in (experiment, session_start):  # the session's end, with its real status, comes at close
            self.writer.file_writer.add_summary(summary)

    def _resumed_record(self, record: dict[str, Any], step: int) -> dict[str, Any]:
        first = read_run_record(self.run_dir)
        # how the run stopped before this resume (killed, preempted, ...), which the new status replaces
        after = {k: first[k] for k in ("status", "error", "last_checkpoint") if first.get(k) is not None}
        resumes = first.get("resumes", []) + [{"time": now(), "step": step, "command": record["command"],
                                               "after": after}]
        return {**record, "started": first.get("started", record["started"]), "resumes": resumes}

    def _truncate_metrics(self, step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not os.path.lexists(path):
            return
        try:
            records = read_jsonl(path)
            kept = [r for _, r in records if int(r["iteration"]) <= step]
            if any(r.get("epoch") == 0 for r in kept):  # written when epochs counted from 0: one numbering
                kept = [{**r, "epoch": int(r["epoch"]) + 1} for r in kept]
        except (ValueError, TypeError, KeyError) as exc:
            raise UserError(f"{path} is damaged ({type(exc).__name__}: {exc}); move it away to resume without "
                            "the earlier epochs' records") from None
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))

    def epoch_start(self, state) -> None:
        """Hand the last validation's figures to the drawing thread (:meth:`_draw_due`); start the progress bar."""
        self._draw_due()
        # batch jobs (SLURM) get plain lines even when srun hands them a terminal
        if self.run_dir is not None and sys.stdout.isatty() and "SLURM_JOB_ID" not in os.environ:
            self.bar = tqdm(total=state.epoch_end - state.epoch_step, desc=f"epoch {state.epoch_number}", leave=False,
                            dynamic_ncols=True)

    def step_end(self, state) -> None:
        """The bar, or a progress line for each ``log_every``-th step of the epoch (and its last) once that
        step's loss has been read back."""
        if self.bar is not None:
            self.bar.update(1)
            return
        newest = self.last_loss() if self.run_dir is not None else None
        if newest is None or newest[0] == self.printed:
            return
        iteration, loss = newest
        step = state.epoch_step - (state.step - iteration)  # that iteration's step of this epoch
        if step > 0 and (step % self.cfg.log_every == 0 or step == state.epoch_end):
            k = f" K {self.rollout_steps(iteration - 1, state.epoch)}" if self.rollout_steps else ""
            log.info("epoch %d step %d/%d loss %.4f%s", state.epoch_number, step, state.epoch_end, loss, k)
            self.printed = iteration

    def epoch_end(self, state, record: dict[str, Any]) -> None:
        """Report one epoch: the console line, TensorBoard scalars and a ``metrics.jsonl`` line; its figures are
        drawn from the next epoch's start on (:meth:`_draw_due`).

        Raises:
            UserError: the logs could not be written.
        """
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        figures = record.pop("figures", {})
        if self.run_dir is None:
            return
        record = {**record, "elapsed_s": round(self.elapsed(), 3)}
        log.info(self.epoch_line(record, self.n_epochs))
        log.info(format_memory({k[len("memory/"):]: v for k, v in record.items() if k.startswith("memory/")}))
        self.figures_due = (figures, record["iteration"]) if figures else None
        try:
            for key, value in record.items():
                if key not in NOT_SCALARS and not key.endswith("_rank") and isinstance(value, (int, float)):
                    self.writer.add_scalar(tensorboard_tag(key), value, record["iteration"])
            self.writer.flush()
            fd = open_append(self.run_dir / "metrics.jsonl")
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())  # one write: a kill tears at most this line
            finally:
                os.close(fd)
        except OSError as exc:  # TensorBoard's writer thread re-raises its own write errors here
            self.writer = None  # it cannot be flushed or closed any more
            raise self._write_failed(exc) from None

    def _draw_due(self) -> None:
        """Hand the last validation's figures to the drawing thread. This waits for the epoch's start, after
        FrozenHeap's freeze (the components' first hook): objects that the drawing makes are then young, and
        Python's collector frees them as usual. Figures drawn across a freeze would stay, frozen garbage, until
        its next full pass (``training/loop/garbage.py``).

        Raises:
            UserError: the previous validation's figures could not be written.
        """
        due, self.figures_due = self.figures_due, None
        if due is not None:
            try:
                self.drawer.submit(*due)
            except OSError as exc:
                raise self._write_failed(exc) from None

    def _write_failed(self, exc: OSError) -> UserError:
        return UserError(f"writing the run's logs in {self.run_dir} failed: {exc.strerror or exc} "
                         f"({free_space(self.run_dir)}); free space or pass --expdir on a larger filesystem")

    def _close_drawer(self) -> BaseException | None:
        """Hand the last validation's figures over (:meth:`_draw_due`), wait for them and end the drawing thread;
        what drawing them raised (a failed write as :meth:`_write_failed`'s error), or None."""
        drawer = self.drawer
        if drawer is None:
            return None
        try:
            try:
                self._draw_due()
            finally:
                self.drawer = None
                drawer.close()
        except OSError as exc:
            return self._write_failed(exc)
        except Exception as exc:  # that error, or a bug in drawing: it fails the run, as it did on the main thread
            return exc
        return None

    def epoch_line(self, r: dict[str, Any], n_epochs: int) -> str:
        line = (f"epoch {r['epoch']}/{n_epochs} | {r['epoch_time_s']:.2f} s | {r['samples_per_s']:.1f} samples/s"
                + (f" | MFU {100 * r['mfu']:.1f}%" if "mfu" in r else "")
                + f" | data wait {100 * r['data_wait_share']:.0f}% | train loss {r['loss/train']:.4f}"
                + (f" (K {rollout_range(r)})" if self.rollout_steps else ""))
        if "loss/valid" in r:
            line += f" | valid loss {r['loss/valid']:.4f} | RMSE " + " ".join(
                f"{k} {r[f'rmse/{k}']:.4g} (persistence {r[f'rmse_persistence/{k}']:.4g})" for k in self.key_channels)
        return line

    def close(self, error: BaseException | None) -> None:
        """Wait for the last figures, flush and close the writer; mark ``run.json`` completed, preempted,
        interrupted or failed (with the error).

        Raises:
            UserError, or what drawing the last figures raised, after a run that had no error of its own.
        """
        if self.bar is not None:
            self.bar.close()
        if self.run_dir is None or not self.record:
            return
        drawing = self._close_drawer()
        error = drawing if error is None else error
        status = ("completed" if error is None else "interrupted" if isinstance(error, KeyboardInterrupt)
                  else "preempted" if isinstance(error, Preempted) else "failed")
        if self.writer is not None:
            self.writer.file_writer.add_summary(session_end(status))
            self.writer.close()
            self.writer = None
        self.record.update(finished=now(), status=status, wall_s=round(self.elapsed(), 1),
                           error=None if error is None else str(error) or type(error).__name__)
        try:
            write_json_atomic(self.run_dir / "run.json", self.record)
        except OSError as exc:  # e.g. the disk that failed the run is still full: keep the run's own error
            if error is None:
                raise UserError(f"cannot update {self.run_dir / 'run.json'} ({exc.strerror}); free space there") from None
            log.warning("could not mark %s as %s: %s", self.run_dir / "run.json", status, exc.strerror)
        if drawing is not None and drawing is error:
            raise drawing
        if drawing is not None:
            log.warning("the last figures were not drawn: %s", drawing)
