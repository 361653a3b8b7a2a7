"""The one training loop, shared by every mode (single GPU, DDP, FSDP, tensor/context parallel).

``train.py`` and ``train_mp.py`` parse and validate the config and call :func:`run`. Reporting
(console, TensorBoard, ``metrics.jsonl``, ``run.json``) lives in ``utils/reporting.py``. Parallelism is
applied from outside (``distributed/parallelize.py``); the loop only sees a model, an
optimizer and device batches, plus two hooks from ``distributed/``: gradient-sync
suppression for accumulation and the reduction of replicated-parameter gradients.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from distributed.checkpoint import CheckpointManager, save_full_model
from distributed.env import World, all_reduce, broadcast_from_main
from distributed.host_staging import register_pinned_memory
from distributed.parallelize import AMP_DTYPES
from utils.config import to_yaml
from utils.data_loader import Data, build_data
from utils.errors import EXIT_PREEMPTED, NonFiniteError, NothingToDo, Preempted, UserError
from utils.flops import peak_flops, vit_flops_per_sample
from utils.logging_utils import setup_logging
from utils.memory import MemoryTracker, OutOfMemoryHandler
from utils.memory_profile import MemoryProfiler
from utils.evaluation import Evaluator, lead_hours, nonfinite_samples
from utils.preemption import PreemptionFlag, signal_name
from utils.profiling import ProfilerWindow, nvtx_range
from utils.reporting import Reporter, RunDir, continued_run, open_run_dir, run_record, tensorboard_tag
from utils.schema import AUTO, Config, batch_sizes
from utils.train_step import build_training_step, count_parameters, set_attention_backend
from utils.train_state import TrainState
from utils.tuning import (AUTO_OBJECTIVE, TUNE_FILE, TuneResult, journal_path, out_path, recorded_choice, summary,
                          tune, with_batch, write_outputs)

log = logging.getLogger(__name__)


class Trainer:
    """Owns model, optimizer, data and reporting for one run; :meth:`train` runs it, :meth:`close` ends it.

    Construction checks everything that depends on the data, the device and the world (channels,
    split sizes, attention kernel) before the run directory is created, so bad input leaves
    nothing on disk.
    """

    def __init__(self, cfg: Config, world: World):
        self.cfg, self.world, self.device = cfg, world, world.device
        register_pinned_memory()  # before the loaders page-lock their buffers
        # from the start, so a signal during startup also ends in a checkpoint; without checkpoints a
        # signal keeps its default action: stop at once
        self.preemption = PreemptionFlag()
        if cfg.checkpoint.save_checkpoint:
            self.preemption.install()
        self.tuned: TuneResult | None = None  # --local_batch_size auto: what the tuner measured
        if cfg.optim.local_batch_size == AUTO:
            cfg = self._resolve_auto_batch(cfg)
        self.local_bs, self.global_bs = batch_sizes(cfg.optim, world.dp)
        self.accum = cfg.optim.grad_accum_steps
        self.data: Data = build_data(cfg.data, self.local_bs, world.dp_rank, world.dp, self.device, cfg.optim.seed,
                                     valid_target_steps=cfg.evaluation.valid_rollout_steps,
                                     valid_init_every=cfg.evaluation.valid_init_every)
        self.evaluator = Evaluator(cfg.evaluation, self.data, world,
                                   lead_hours(cfg.data.dt, self.data.step_hours, cfg.evaluation.valid_rollout_steps))
        self.steps_per_epoch = self._steps_per_epoch()
        self.amp_dtype = AMP_DTYPES[cfg.precision.amp_mode]
        set_attention_backend(cfg.precision.attention_backend, self.device, cfg.model.embed_dim // cfg.model.num_heads,
                              self.amp_dtype or torch.float32)
        # nothing above leaves anything on disk (the tuner removes its journal): a bad input stops the run
        # before its directory exists
        run = self._open_run_dir()
        self.run_dir = run.path
        # the run record keeps the command's config (with `auto` batch, so a rerun continues this run) and
        # the number `auto` picked for the run; the trainer trains with the resolved copy
        recorded = copy.deepcopy(self.cfg)
        self.cfg = cfg = copy.deepcopy(cfg)
        recorded.logging.run_num = cfg.logging.run_num = self.run_dir.name
        setup_logging(self.run_dir / "out.log" if world.is_main else None, world.rank)
        log.info("rank %d/%d on %s (launcher %s): dp=%d cp=%d tp=%d, local batch %d, global batch %d",
                 world.rank, world.world_size, self.device, world.env.launcher, world.dp, world.cp, world.tp,
                 self.local_bs, self.global_bs)
        if world.world_size > 1 and not world.is_main:
            print(f"rank {world.rank}/{world.world_size} on {self.device} ready", flush=True)
        self.reporter = Reporter(cfg.logging, self.run_dir if world.is_main else None,
                                 self.evaluator.key_channels)
        # first, so the allocator history an OOM snapshot holds covers the model's construction
        self.oom = OutOfMemoryHandler(cfg.memory, self.run_dir / "memory", world.rank, self.device, self.local_bs)
        self._build_model()
        self.memory = MemoryTracker(self.device)
        self.memory_profile = MemoryProfiler(cfg.memory, self.run_dir / "memory", world, self.model, self.optimizer,
                                             self.local_bs)
        lg = cfg.logging
        self.profiler = ProfilerWindow(lg.profile_epoch, lg.profile_start_step, lg.profile_steps, world.rank)
        self.flops_per_sample = vit_flops_per_sample(cfg.model, cfg.data)
        self.peak_flops = peak_flops(self.device, cfg.precision.amp_mode)
        self.data_wait = 0.0
        self.last_loss: tuple[int, float] | None = None  # (iteration, loss) of the last step read back
        self.stop_signal = 0  # a preemption signal every rank has agreed on (max over ranks)
        resumed = self._resume(run)
        self._report_tuning()
        self.reporter.start(run_record(cfg.name, recorded.flat(), self._world_info()), to_yaml(recorded),
                            self._metric_tags(),
                            resumed_step=resumed, elapsed_before=self.state.elapsed_s)

    def _main_decides(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` on rank 0, its answer on every rank; a UserError or NothingToDo it raises is
        raised on every rank, so none waits for the others."""
        outcome = None
        if self.world.is_main:
            try:
                outcome = decide()
            except (UserError, NothingToDo) as exc:
                outcome = exc
        outcome = broadcast_from_main(outcome, self.world)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _open_run_dir(self) -> RunDir:
        """The run directory (new, or the run this command continues), chosen by rank 0."""
        c, size = self.cfg, self.world.world_size
        return self._main_decides(lambda: open_run_dir(c.logging, c.checkpoint.resume, c.name, size, c.flat()))

    def _resolve_auto_batch(self, cfg: Config) -> Config:
        """``--local_batch_size auto``: ``cfg`` with the local batch (and scaled lr) the run this command
        continues chose, or else with the tuner's quick ``max-throughput`` choice (collective)."""
        w = self.world
        setup_logging(None, w.rank)  # the trials' progress, before the run's log file exists
        run = cfg.logging, cfg.checkpoint.resume, cfg.name, w.world_size, cfg.flat()
        prior = self._main_decides(lambda: recorded_choice(continued_run(*run)))
        if prior is not None:
            log.info("local batch auto: %d, as tuned when this run started", prior[0])
            return with_batch(cfg, *prior)
        # the data is checked before minutes of tuning (the trials use synthetic batches by default)
        build_data(cfg.data, 1, w.dp_rank, w.dp, self.device, cfg.optim.seed).close()
        self.tuned = tune(cfg, w, [], journal_path(out_path(cfg)), quick=True)
        choice = self.tuned.choices[AUTO_OBJECTIVE]
        return with_batch(cfg, choice.local_batch_size, self.tuned.lr(AUTO_OBJECTIVE))

    def _report_tuning(self) -> None:
        """Log what ``--local_batch_size auto`` measured and chose, and keep its JSON and PNG in the run directory."""
        if self.tuned is None:
            return
        log.info("local batch auto: the tuner's %s choice\n%s", AUTO_OBJECTIVE, summary(self.tuned))
        if self.world.is_main:
            write_outputs(self.tuned, self.run_dir / TUNE_FILE)

    def _resume(self, run: RunDir) -> int | None:
        """Load the checkpoint this run continues from (its own latest, or ``--resume PATH``); returns
        the step it resumed at, or None for a fresh start."""
        c = self.cfg.checkpoint
        self.state = TrainState(data_parallel=self.world.dp)
        self.saved_step, self.checkpoint_due, self.last_checkpoint = -1, False, time.monotonic()
        self.checkpoint = CheckpointManager(c, self.run_dir / "checkpoints", self.model, self.optimizer,
                                            {"scheduler": self.scheduler, "scaler": self.scaler,
                                             "train_state": self.state}, self.world)
        source = None if run.resume or c.resume in ("auto", "never") else Path(c.resume)
        if not run.resume and source is None:
            return None
        step = self.checkpoint.load(source)
        if step is None:
            return None
        self.saved_step = step
        if self.state.data_parallel != self.world.dp:  # the per-rank sums belong to other ranks
            self.state.epoch_loss_sum = self.state.epoch_loss_mean
            self.state.data_parallel = self.world.dp
        log.info("resumed at iteration %d (epoch %d, step %d of it) from %s", step, self.state.epoch + 1,
                 self.state.epoch_step, source or self.run_dir / "checkpoints")
        return step if run.resume else None

    def _steps_per_epoch(self) -> int:
        steps = len(self.data.train) // self.accum
        if steps == 0:
            raise UserError(f"an epoch has fewer micro-batches ({len(self.data.train)}) than --grad_accum_steps "
                            f"{self.accum}; lower it or use more samples")
        return steps

    def _build_model(self) -> None:
        m = self.cfg.model
        log.info("model: %s embed %d depth %d heads %d patch %d, %.2fM parameters", m.nettype, m.embed_dim, m.depth,
                 m.num_heads, m.patch_size, count_parameters(self.cfg) / 1e6)
        self.step_fn = build_training_step(self.cfg, self.world)
        s = self.step_fn
        self.model, self.optimizer, self.scheduler, self.scaler = s.model, s.optimizer, s.scheduler, s.scaler

    def _world_info(self) -> dict:
        """World size, mesh, launcher, and the host and device of every rank (collective)."""
        w = self.world
        mine = (platform.node(), torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu")
        ranks = [mine]
        if dist.is_initialized() and w.world_size > 1:
            ranks = [None] * w.world_size
            dist.all_gather_object(ranks, mine)
        return {"world_size": w.world_size, "mesh": {"dp": w.dp, "cp": w.cp, "tp": w.tp},
                "launcher": w.env.launcher, "hosts": [h for h, _ in ranks], "devices": [d for _, d in ranks]}

    def _metric_tags(self) -> list[str]:
        memory = "memory/peak_allocated" if self.device.type == "cuda" else "memory/peak_rss"
        tags = ["loss/train", "loss/valid", tensorboard_tag("samples_per_s"), memory]
        if self.peak_flops:
            tags.append(tensorboard_tag("mfu"))
        return tags + [f"rmse/{k}" for k in self.evaluator.key_channels]

    def close(self, error: BaseException | None = None) -> None:
        """End the run, after success or ``error``: finish a pending checkpoint write, release the
        loaders (workers, pinned buffers, DALI pipelines), close the writers and mark ``run.json``."""
        self.preemption.close()
        if error is None:
            self.checkpoint.close()
        self.memory_profile.close()
        self.oom.close()
        self.data.close()
        self.reporter.close(error)

    # ---------------------------------------------------------------- training
    def train(self) -> dict:
        """Run optimizer steps from ``state.step`` to ``num_iters``; returns the last epoch's record.

        Checkpoints are written at step boundaries (``--checkpoint_every_steps``/``_minutes``; one due at
        an epoch's last step waits until that epoch is reported) and at the end, followed by the
        single-file model export.
        """
        opt, state = self.cfg.optim, self.state
        steps_per_epoch = self.steps_per_epoch
        n_epochs = math.ceil(opt.num_iters / steps_per_epoch)
        log.info("training %d iterations: %d epochs of %d steps (%d samples/epoch); run directory %s",
                 opt.num_iters, n_epochs, steps_per_epoch, steps_per_epoch * self.global_bs, self.run_dir)
        record: dict = {}
        while state.step < opt.num_iters:
            epoch = state.epoch
            end = min(steps_per_epoch, state.epoch_step + opt.num_iters - state.step)
            record = self.train_epoch(epoch, end)
            if self.stop_signal:  # agreed at the epoch's last step: stop before validating
                self.stop_preempted()
            if (epoch + 1) % self.cfg.evaluation.valid_every == 0 or state.step >= opt.num_iters:
                record.update(self.validate())
            state.epoch, state.epoch_step, state.epoch_loss_sum, state.epoch_loss_mean = epoch + 1, 0, 0.0, 0.0
            self.reporter.epoch(record, n_epochs)
            if self.checkpoint_due:
                self.save_checkpoint()
        self.finish_checkpoints()
        return record

    def train_epoch(self, epoch: int, end: int) -> dict:
        """Train the steps ``state.epoch_step`` to ``end`` of ``epoch``; returns the epoch's flat record
        (throughput, loss over the whole epoch, memory)."""
        self.model.train()
        start = self.state.epoch_step
        self.data.train.set_epoch(epoch, start_batch=start * self.accum)
        self.memory.start_epoch()
        self.loss_sum = torch.tensor(self.state.epoch_loss_sum, device=self.device)
        pending = None  # previous step's finiteness check, read one step late to avoid a sync per step
        batches = iter(self.data.train)
        bar = self._progress(end - start, epoch)
        self.data_wait = 0.0  # host seconds blocked waiting for the loader
        self._synchronize()
        t0 = time.perf_counter()
        for step in range(start, end):
            self.profiler.step(epoch, step)
            self.world.note_step(self.state.step)
            with self.memory_profile.step(epoch, step), nvtx_range(f"step {self.state.step}"):
                check = self.train_step(batches)
            self.loss_sum += check["loss"].detach()
            if pending is not None:
                self._check_finite(pending)
            pending = check
            self.state.step += 1
            self.state.epoch_step += 1
            self.memory.step_end(step)
            if step == start:  # Adam's state exists now: the checkpoint's host buffers are allocated meanwhile
                self.checkpoint.prepare()
            self._progress_update(bar, step, end, epoch)
            self.checkpoint_due = self.checkpoint_due or self._checkpoint_cadence()
            # a periodic checkpoint due at the epoch's end waits for its report; a preemption does not
            if (self.checkpoint_due and step + 1 < end) or self.stop_signal:
                self._check_finite(pending)  # never checkpoint a diverged model
                pending = None
                self._record_epoch_loss()
                self.save_checkpoint()
                if self.stop_signal:
                    self.stop_preempted()
        if pending is not None:
            self._check_finite(pending)
        self.profiler.close(epoch, end)
        self.memory_profile.end_epoch(epoch)
        self._synchronize()
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        self._record_epoch_loss()  # also for a checkpoint before the epoch's report
        loss = self.state.epoch_loss_mean / max(1, end)
        # zero steps: the run was preempted after the epoch's last step, before its report
        samples_per_s = (end - start) * self.global_bs / elapsed if end > start else math.nan
        record = {"epoch": epoch, "iteration": self.state.step, "epoch_time_s": elapsed,
                  "samples_per_s": samples_per_s, "data_wait_share": self.data_wait / elapsed,
                  "lr": self.optimizer.param_groups[0]["lr"], "loss/train": loss}
        if self.peak_flops:
            record["mfu"] = samples_per_s * self.flops_per_sample / (self.peak_flops * self.world.world_size)
        record.update({f"memory/{k}": v for k, v in self.memory.end_epoch().items()})
        return record

    def _record_epoch_loss(self) -> None:
        """Put this rank's sum of the epoch's step losses, and its mean over the data-parallel ranks,
        into the train state (collective over ``dp``)."""
        self.state.epoch_loss_sum = self.loss_sum.item()
        self.state.epoch_loss_mean = all_reduce(self.loss_sum.clone(), self.world, "dp").item() / self.world.dp

    def train_step(self, batches) -> dict:
        """One optimizer step over ``grad_accum_steps`` micro-batches. Returns tensors for the late check."""
        loss, indices = self.step_fn(self._timed(batches), self.oom.phase)
        return {"loss": loss, "indices": indices, "step": self.state.step, **self._queue_readback(loss)}

    def _timed(self, batches):
        """``batches``, adding the host time spent waiting for each to ``data_wait``."""
        while True:
            with nvtx_range("data"):
                t0 = time.perf_counter()
                batch = next(batches, None)
                self.data_wait += time.perf_counter() - t0
            if batch is None:
                return
            yield batch

    def _queue_readback(self, loss: torch.Tensor) -> dict:
        """Enqueue the step's non-finite-loss flag and preemption signal (max over ranks) and its loss,
        and their copy to the host.

        Enqueued at the end of the step and read one step later (:meth:`_check_finite`), so the host
        waits only for a step the GPU has already finished: a read right after enqueueing would
        drain the queue every step and idle the GPU while the next step is launched. NaN/Inf in an
        input or target always makes the loss non-finite, so the data are scanned only then. The
        progress line prints this host copy of the loss, never the just-queued one.
        """
        # torch.full, not torch.tensor: a fill kernel, where a host value would be a blocking copy
        flags = torch.stack([(~torch.isfinite(loss)).float(),
                             torch.full((), float(self.preemption.signum), device=self.device)])
        values = torch.cat([all_reduce(flags, self.world, op=dist.ReduceOp.MAX), loss.float().view(1)])
        if self.device.type != "cuda":
            return {"host": values, "ready": None}
        ready = torch.cuda.Event()
        host = values.to("cpu", non_blocking=True)  # lands in pinned memory
        ready.record()
        return {"host": host, "ready": ready}

    def _check_finite(self, check: dict) -> None:
        """Stop with NonFiniteError if a step's loss was NaN/Inf on any rank, naming bad samples if any.

        Every rank sees the same (all-reduced) flag, so all of them enter the collective below.
        """
        if check["ready"] is not None:
            check["ready"].synchronize()
        flag, signum, loss = check["host"].tolist()
        self.last_loss = (check["step"], loss)
        self.stop_signal = self.stop_signal or int(signum)
        if not flag:
            return
        bad = nonfinite_samples(self.data, torch.cat(check["indices"]).tolist(), "train", self.world)
        if bad:
            raise NonFiniteError(f"NaN/Inf in the training data at step {check['step']}: {bad}; "
                                 "fix or exclude that file (re-run the converter, check for missing values)")
        raise NonFiniteError(f"training loss became NaN/Inf at step {check['step']} with finite data; lower --lr, set "
                             "--max_grad_norm 1.0, add --warmup, or use --amp_mode bf16 instead of fp16 or fp8")

    # ---------------------------------------------------------------- validation
    def validate(self) -> dict:
        """The validation scores (:class:`utils.evaluation.Evaluator`) and ``valid_time_s``, the seconds they
        took; the figures go to TensorBoard."""
        start = time.perf_counter()
        with self.oom.phase("validation"):
            record, figures = self.evaluator.evaluate(self.model, self.step_fn.autocast)
        record["valid_time_s"] = time.perf_counter() - start  # the scores were read back: the GPU is done
        for tag, figure in figures.items():
            self.reporter.figure(tag, figure, self.state.step)
        return record

    # ---------------------------------------------------------------- progress
    def _progress(self, n_steps: int, epoch: int):
        # batch jobs (SLURM) get plain lines even when srun hands them a terminal
        if self.world.is_main and sys.stdout.isatty() and "SLURM_JOB_ID" not in os.environ:
            return tqdm(total=n_steps, desc=f"epoch {epoch + 1}", leave=False, dynamic_ncols=True)
        return None

    def _progress_update(self, bar, step: int, n_steps: int, epoch: int) -> None:
        if bar is not None:
            bar.update(1)
        elif (step + 1) % self.cfg.logging.log_every == 0 or step + 1 == n_steps:
            # the loss already read back for the finiteness check: printing it costs no GPU sync
            text = f"epoch {epoch + 1} step {step + 1}/{n_steps} (iteration {self.state.step})"
            if self.last_loss is not None:
                text += f" loss {self.last_loss[1]:.4f} (iteration {self.last_loss[0] + 1})"
            self.reporter.progress(text)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------- checkpoints
    def _checkpoint_cadence(self) -> bool:
        """Whether a periodic checkpoint is due after this step; every rank reaches the same answer
        (the time-based one is agreed by an all-reduce every ``log_every`` steps)."""
        c = self.cfg.checkpoint
        if not c.save_checkpoint:
            return False
        if c.checkpoint_every_steps and self.state.step % c.checkpoint_every_steps == 0:
            return True
        if c.checkpoint_every_minutes and self.state.step % self.cfg.logging.log_every == 0:
            late = time.monotonic() - self.last_checkpoint >= 60 * c.checkpoint_every_minutes
            flag = torch.tensor(float(late), device=self.device)
            return bool(all_reduce(flag, self.world, op=dist.ReduceOp.MAX).item())
        return False

    def save_checkpoint(self) -> None:
        """A sharded checkpoint of model, optimizer, scheduler, GradScaler and train state (collective)."""
        self.state.elapsed_s = self.reporter.elapsed()
        self.checkpoint.save(self.state.step)
        self.saved_step, self.checkpoint_due = self.state.step, False
        self.last_checkpoint = time.monotonic()

    def stop_preempted(self) -> None:
        """Checkpoint this step (unless just done), wait until it is committed, and raise Preempted.

        Every rank calls it at the same step: the signal was agreed by the per-step all-reduce.
        """
        if self.saved_step != self.state.step:
            self.save_checkpoint()
        self.checkpoint.wait()
        message = ""
        if self.world.is_main:  # one line for the job
            message = (f"preempted by {signal_name(self.stop_signal)} at iteration {self.state.step}: checkpoint "
                       f"{self.checkpoint.latest()} written; exit status {EXIT_PREEMPTED}; run the same command "
                       "to resume")
        raise Preempted(message)

    def finish_checkpoints(self) -> None:
        """At the end: the final sharded checkpoint, then the single-file model export (collective)."""
        if not self.cfg.checkpoint.save_checkpoint:
            return
        if self.saved_step != self.state.step:
            self.save_checkpoint()
        self.checkpoint.wait()
        save_full_model(self.model, self.run_dir / "checkpoints" / "model.pt",
                        {"step": self.state.step, "config": self.cfg.flat()})


def run(cfg: Config, world: World) -> dict:
    """Build the trainer for ``cfg`` on ``world``, train and close it; returns the last epoch's record."""
    trainer = Trainer(cfg, world)
    try:
        record = trainer.train()
    except BaseException as exc:
        trainer.close(exc)
        raise
    trainer.close()
    return record
