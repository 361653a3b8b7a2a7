"""The one training loop, shared by every mode (single GPU, DDP, FSDP, tensor/context parallel).

``train.py`` and ``train_mp.py`` parse and validate the config and call :func:`run`. Parallelism is applied
from outside (``distributed/parallelize.py``): the loop only sees a model, an optimizer and device batches.
Everything else is a component with the same hooks (``utils/core/component.py``), called in the order
of :attr:`Trainer.components`:

* :class:`~training.loop.garbage.FrozenHeap`: Python's garbage collected and the survivors frozen after the first
  step and at each later epoch's start;
* :class:`~training.monitor.profiling.ProfilerWindow`: the Nsight capture window;
* :class:`~training.monitor.memory_profile.MemoryProfiler`: the ``--memory_profile`` window;
* :class:`~training.monitor.memory.MemoryTracker`: peaks, retries and OOMs of each epoch;
* :class:`~training.evaluation.evaluator.Evaluator`: validation at its epochs;
* :class:`~training.monitor.reporter.Reporter`: progress, the epoch line, TensorBoard, ``metrics.jsonl``, ``run.json``;
* :class:`~distributed.checkpoint.manager.CheckpointManager`: checkpoints at its cadence, on preemption and
  at the end;
* the out-of-memory handler and the data loaders, which only close.

Resume is "load every ``state_dict``": the checkpoint manager restores model, optimizer, schedule, GradScaler
and :class:`~training.loop.state.TrainState`, and every component starts from that state.
"""

from __future__ import annotations

import copy
import logging
import math
import platform
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from distributed.checkpoint.folder import resolve_checkpoint
from distributed.checkpoint.manager import CheckpointManager
from distributed.checkpoint.staging import register_pinned_memory
from distributed.checkpoint.storage import check_model_shapes
from distributed.simulate import is_simulated, notice
from distributed.world import World, all_reduce, main_decides
from networks.model_file import package_meta, read_init_weights
from training.evaluation.evaluator import Evaluator, nonfinite_samples
from training.evaluation.scoring import lead_hours
from training.loop.ensemble import validation_members
from training.loop.garbage import FrozenHeap
from training.loop.rollout import max_rollout_steps, rollout_steps_at
from training.loop.run_dir import RunDir, open_run_dir, run_record
from training.loop.state import TrainState
from training.loop.step import (build_training_step, check_host_memory, count_parameters, plain_shapes,
                                set_attention_backend)
from training.monitor.flops import peak_flops, vit_flops_per_sample
from training.monitor.memory import MemoryTracker
from training.monitor.memory_profile import MemoryProfiler
from training.monitor.oom import OutOfMemoryHandler
from training.monitor.profiling import ProfilerWindow, nvtx_range
from training.monitor.reporter import Reporter, read_run_record, tensorboard_tag
from utils.config.loading import configs_for_data, to_yaml
from utils.config.schema import Config
from utils.config.validate import batch_sizes
from utils.core.component import Component
from utils.core.errors import EXIT_PREEMPTED, NonFiniteError, NothingToDo, Preempted, UserError
from utils.core.logs import setup_logging
from utils.core.signals import install, signal_name
from utils.data.dataset import check_crop
from utils.data.forcing_source import input_roles
from utils.data.loaders import build_data
from utils.precision.amp import AMP_DTYPES

log = logging.getLogger(__name__)

# makes the components a run adds of its own (the tuner's report of --local_batch_size auto) for its directory
ExtraComponents = Callable[[Path], list[Component]]


class Trainer:
    """Owns model, optimizer, data and the components of one run; :meth:`train` runs it, :meth:`close` ends it.

    Construction checks everything that depends on the data, the device and the world (channels,
    split sizes, attention kernel) before the run directory is created, so bad input leaves
    nothing on disk.

    Args:
        cfg: the resolved config the run trains with.
        world: this process's place in the job.
        command_cfg: the config as the command gave it (``local_batch_size: auto`` kept), which the run
            record keeps so that the same command finds this run again; default ``cfg``.
        extra: components of the run's own (see :data:`ExtraComponents`).
    """

    def __init__(self, cfg: Config, world: World, command_cfg: Config | None = None,
                 extra: ExtraComponents | None = None):
        self.world, self.device = world, world.device
        register_pinned_memory()  # before the loaders page-lock their buffers
        self.preemption = install()  # train.py installed it first thing; in-process use installs it here
        self.local_bs, self.global_bs = batch_sizes(cfg.optim, world.dp)
        self.accum = cfg.optim.grad_accum_steps
        self.data = build_data(cfg.data, self.local_bs, world.dp_rank, world.dp, self.device, cfg.optim.seed,
                               valid_target_steps=cfg.evaluation.valid_rollout_steps,
                               valid_init_every=cfg.evaluation.valid_init_every,
                               train_target_steps=max_rollout_steps(cfg.optim))
        self.evaluator = Evaluator(cfg.evaluation, self.data, world,
                                   lead_hours(cfg.data.dt, self.data.step_hours, cfg.evaluation.valid_rollout_steps),
                                   validation_members(cfg))
        self._check_crop(cfg)
        self.steps_per_epoch = self._steps_per_epoch()
        self.amp_dtype = AMP_DTYPES[cfg.precision.amp_mode]
        set_attention_backend(cfg.precision.attention_backend, self.device, cfg.model.embed_dim // cfg.model.num_heads,
                              self.amp_dtype or torch.float32)
        check_host_memory(cfg, world)
        self._check_resume_source(cfg, world)
        self._stop_if_signalled("during start-up")
        # nothing above leaves anything on disk: a bad input stops the run before its directory exists
        recorded = copy.deepcopy(command_cfg or cfg)
        run = self._open_run_dir(recorded, world)
        self.run_dir = run.path
        self.cfg = cfg = copy.deepcopy(cfg)
        recorded.logging.run_num = cfg.logging.run_num = self.run_dir.name
        if run.resume:
            self._check_same_data(read_run_record(run.path).get("data"))
        setup_logging(self.run_dir / "out.log" if world.is_main else None, world.rank)
        log.info("%s", run.note)
        self._log_world()
        # first, so the allocator history an OOM snapshot holds covers the model's construction
        self.oom = OutOfMemoryHandler(cfg.memory, self.run_dir / "memory", world.rank, self.device, self.local_bs)
        self._build_model(None if run.resume else cfg.checkpoint.init_from)
        self.state = TrainState(data_parallel=world.dp, total_steps=cfg.optim.num_iters)
        self.read_back: tuple[int, float] | None = None  # (iteration, loss) of the newest step read back
        self.data_wait = 0.0  # host seconds of this epoch spent waiting for the loader
        self.pending = None  # the last step's finiteness check, read one step late to avoid a sync per step
        self.loss_sum = torch.zeros((), device=self.device)  # this epoch's summed loss, on the device
        self._build_components(run, recorded, extra)

    # ---------------------------------------------------------------- construction
    @staticmethod
    def _open_run_dir(recorded: Config, world: World) -> RunDir:
        """The run directory (new, or the run this command continues), chosen by rank 0."""
        c = recorded
        return main_decides(lambda: open_run_dir(c.logging, c.checkpoint.resume, c.name, world.world_size, c.flat(),
                                                 world.device.type == "cuda"), world, (UserError, NothingToDo))

    def _check_crop(self, cfg: Config) -> None:
        """A named config's ``img_size`` that keeps less than half of the data's grid: another config's data."""
        if self.data.train_dataset is not None and "img_size" not in cfg.overrides:
            check_crop(self.data.train_dataset.grid, cfg.data.img_size, cfg.data.data_path, cfg.name,
                       lambda: configs_for_data(cfg.yaml_config, cfg.data.data_path))

    @staticmethod
    def _check_resume_source(cfg: Config, world: World) -> None:
        """``--resume PATH``: a complete checkpoint of this model; ``--init_from``: a model file of this model
        (read by rank 0, its verdict on every rank)."""
        if cfg.checkpoint.init_from is not None:
            def check_init() -> None:  # the verdict, not the weights, goes to every rank
                read_init_weights(Path(cfg.checkpoint.init_from), plain_shapes(cfg))
            main_decides(check_init, world, (UserError,))
        if cfg.checkpoint.resume in ("auto", "never"):
            return
        main_decides(lambda: check_model_shapes(resolve_checkpoint(Path(cfg.checkpoint.resume)), plain_shapes(cfg)),
                     world, (UserError,))

    def _log_world(self) -> None:
        w = self.world
        ens = f" ens={w.ens}" if w.ens > 1 else ""
        members = self.cfg.optim.ensemble_members
        per_rank = f" x {members // w.ens} of {members} members" if self.cfg.model.noise_channels else ""
        log.info("rank %d/%d on %s (launcher %s): dp=%d%s cp=%d tp=%d, local batch %d%s, global batch %d",
                 w.rank, w.world_size, self.device, w.env.launcher, w.dp, ens, w.cp, w.tp, self.local_bs, per_rank,
                 self.global_bs)
        if is_simulated(w.env):
            log.warning("%s", notice(self.cfg.parallel))
        if w.world_size > 1 and not w.is_main:
            print(f"rank {w.rank}/{w.world_size} on {self.device} ready", flush=True)

    def _steps_per_epoch(self) -> int:
        steps = len(self.data.train) // self.accum
        if steps == 0:
            raise UserError(f"an epoch has fewer micro-batches ({len(self.data.train)}) than --grad_accum_steps "
                            f"{self.accum}; lower it or use more samples")
        return steps

    def _build_model(self, init_from: str | None) -> None:
        """The model, optimizer and step; a new run with ``--init_from`` starts from that run's weights (a
        continued one from its own checkpoint: the same fine-tune command resumes the fine-tune)."""
        m = self.cfg.model
        log.info("model: %s embed %d depth %d heads %d patch %d, %.2fM parameters", m.nettype, m.embed_dim, m.depth,
                 m.num_heads, m.patch_size, count_parameters(self.cfg) / 1e6)
        if self.data.train_forcings is not None:
            log.info("%s", input_roles(self.cfg.data))
        init = None
        if init_from is not None:
            init = read_init_weights(Path(init_from), plain_shapes(self.cfg))
            log.info("weights from %s (a fine-tune: optimizer, schedule and step start afresh)", init_from)
        try:
            self.step_fn = build_training_step(self.cfg, self.world, init, self.data.train_forcings,
                                               self.data.latitude)
        except RuntimeError as exc:  # the host ran out while building (other processes took memory meanwhile)
            if "DefaultCPUAllocator" not in str(exc):
                raise
            raise UserError(f"out of host memory while building the model ({str(exc).splitlines()[0]}); make the "
                            "model smaller (embed_dim, depth), shard it (--fsdp zero3), or free host memory") from None
        s = self.step_fn
        self.model, self.optimizer, self.scheduler, self.scaler = s.model, s.optimizer, s.scheduler, s.scaler

    def _build_components(self, run: RunDir, recorded: Config, extra: ExtraComponents | None) -> None:
        """The components, in the order the loop calls them; then the resume, which they start from."""
        cfg, world, memory_dir = self.cfg, self.world, self.run_dir / "memory"
        lg = cfg.logging
        self.profiler = ProfilerWindow(lg.profile_epoch, lg.profile_start_step, lg.profile_steps, world.rank)
        self.memory_profile = MemoryProfiler(cfg.memory, memory_dir, world, self.model, self.optimizer, self.local_bs)
        self.memory = MemoryTracker(self.device)
        self.evaluator.attach(self.model, self.step_fn.autocast, self.oom.phase,
                              run_name="/".join(self.run_dir.parts[-3:]))
        # an ensemble's sample is one forecast per member
        self.flops_per_sample = vit_flops_per_sample(cfg.model, cfg.data) * cfg.optim.ensemble_members
        self.peak_flops = peak_flops(self.device, cfg.precision.amp_mode)
        self.reporter = Reporter(lg, self.run_dir if world.is_main else None, self.evaluator.key_channels,
                                 run_record(cfg.name, recorded.flat(), {**self._world_info(), "data": self._data_info()}),
                                 to_yaml(recorded, exclude=("run_num",)),
                                 self._metric_tags(), math.ceil(cfg.optim.num_iters / self.steps_per_epoch),
                                 self.last_loss, partial(rollout_steps_at, cfg.optim)
                                 if max_rollout_steps(cfg.optim) > 1 else None)
        self.checkpoint = CheckpointManager(cfg.checkpoint, self.run_dir / "checkpoints", self.model, self.optimizer,
                                            {"scheduler": self.scheduler, "scaler": self.scaler,
                                             "train_state": self.state}, world, settle=self.settle,
                                            export_meta=package_meta(cfg, self.data))
        self.frozen_heap = FrozenHeap(cfg.precision.gc_freeze)  # first: it unfreezes before the loaders close
        self.components: list[Component] = [self.frozen_heap, self.profiler, self.memory_profile,
                                            self.memory, self.evaluator, *(extra(self.run_dir) if extra else []),
                                            self.reporter, self.checkpoint, self.oom, self.data, run]
        self._resume(run)
        for component in self.components:
            component.start(self.state)

    def _resume(self, run: RunDir) -> None:
        """Load every ``state_dict`` from the checkpoint this run continues from (its own latest, or
        ``--resume PATH`` for a new run)."""
        resume = self.cfg.checkpoint.resume
        source = None if run.resume or resume in ("auto", "never") else Path(resume)
        if not run.resume and source is None:
            return
        step = self.checkpoint.load(source)
        if step is None:
            return
        if step != self.state.step:  # the folder's name is not what it holds: never continue from the wrong step
            raise UserError(f"checkpoint folder step_{step:08d} holds iteration {self.state.step}, not {step}: it "
                            f"was renamed or copied under another name; rename it step_{self.state.step:08d} (and "
                            "its latest file), or pass another --resume")
        log.info("resumed at iteration %d (epoch %d, step %d of it) from %s", step, self.state.epoch_number,
                 self.state.epoch_step, source or self.run_dir / "checkpoints")
        if not run.resume:  # --resume PATH starts a new run from that state: its records start afresh
            self.state.resumed_step = None

    def _data_info(self) -> dict:
        """What run.json records of the data, which a continuation must find unchanged."""
        return {"channels": list(self.data.channel_names), "step_hours": self.data.step_hours}

    def _check_same_data(self, recorded: dict | None) -> None:
        """A continued run trains on the data it started on: the same channels and time step.

        Raises:
            UserError: they differ (naming both), e.g. ``--data_path`` now holds other files.
        """
        now = self._data_info()
        for key, was in (recorded or {}).items():
            if key in now and now[key] != was:
                raise UserError(f"run {self.run_dir} was trained on data with {key} {was}, but the data at "
                                f"{self.cfg.data.data_path} has {key} {now[key]}; point --data_path at the run's data, "
                                "or start another run (--resume never or a new --run_num)")

    def _world_info(self) -> dict:
        """World size, mesh, launcher, and the host and device of every rank (collective)."""
        w = self.world
        mine = (platform.node(), torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu")
        ranks = [mine]
        if dist.is_initialized() and w.world_size > 1:
            ranks = [None] * w.world_size
            dist.all_gather_object(ranks, mine)
        return {"world_size": w.world_size, "mesh": {"dp": w.dp, "ens": w.ens, "cp": w.cp, "tp": w.tp},
                "launcher": w.env.launcher, "hosts": [h for h, _ in ranks], "devices": [d for _, d in ranks],
                **({"simulation": notice(self.cfg.parallel)} if is_simulated(w.env) else {})}

    def _metric_tags(self) -> list[str]:
        memory = "memory/peak_allocated" if self.device.type == "cuda" else "memory/peak_rss"
        tags = ["loss/train", "loss/valid", tensorboard_tag("samples_per_s"), memory]
        if self.peak_flops:
            tags.append(tensorboard_tag("mfu"))
        return tags + [f"rmse/{k}" for k in self.evaluator.key_channels]

    def close(self, error: BaseException | None = None) -> None:
        """End the run, after success or ``error``: every component's ``close``, in order. A component that
        fails to close after success (the final checkpoint on a full disk) makes the later ones close with
        its error, which is then raised."""
        self.preemption.close()
        failure = None
        for component in self.components:
            try:
                component.close(error or failure)
            except Exception as exc:
                if error is not None:
                    raise
                failure = failure or exc
        if failure is not None:
            raise failure

    # ---------------------------------------------------------------- training
    def train(self) -> dict:
        """Run optimizer steps from ``state.step`` to ``num_iters``; returns the last epoch's record."""
        state = self.state
        n_epochs = math.ceil(state.total_steps / self.steps_per_epoch)
        log.info("training %d iterations: %d epoch%s of %d steps (%d samples/epoch%s); run directory %s",
                 state.total_steps, n_epochs, "" if n_epochs == 1 else "s", self.steps_per_epoch,
                 self.steps_per_epoch * self.global_bs, self._rollout_note(), self.run_dir)
        self._stop_if_signalled(f"before iteration {self.state.step + 1}")
        record: dict = {}
        while not state.done:
            state.epoch_end = min(self.steps_per_epoch, state.epoch_step + state.total_steps - state.step)
            record = self.train_epoch()
            for component in self.components:
                component.epoch_end(state, record)
        return record

    def _rollout_note(self) -> str:
        """Rollout training: K (or the curriculum) and how many initial times of the training split K leaves (the
        last ``(K - 1) * dt`` of each run of files have too few targets)."""
        opt, ds = self.cfg.optim, self.data.train_dataset
        k = max_rollout_steps(opt)
        if k == 1:
            return ""
        steps = (f"rollout K {opt.train_rollout_steps} -> {k}, +1 every {opt.rollout_raise_every} "
                 f"{opt.rollout_raise_unit}" if opt.rollout_max_steps else f"rollout K {k}")
        if ds is None:
            return f"; {steps}"
        have = int(ds.offsets[-1])  # before --limit_nsamples
        return f"; {steps}: {have} of {have + (k - 1) * ds.dt * len(ds.runs)} initial times have {k} targets"

    def rollout_steps(self) -> int:
        """K of the next optimizer step (the curriculum's, a function of the step and epoch: a resume continues it)."""
        return rollout_steps_at(self.cfg.optim, self.state.step, self.state.epoch)

    def _stop_if_signalled(self, when: str) -> None:
        """A signal during start-up (every rank agrees): stop (before the run directory, or before the first step);
        nothing was trained, so nothing is lost."""
        flag = torch.tensor(float(self.preemption.signum), device=self.device)
        signum = int(all_reduce(flag, self.world, op=dist.ReduceOp.MAX).item())
        if signum:
            raise Preempted(f"preempted by {signal_name(signum)} {when}: nothing "
                            f"trained since the last checkpoint; exit status {EXIT_PREEMPTED}; run the same command "
                            "to go on" if self.world.is_main else "")

    def _hooks(self, name: str) -> None:
        for component in self.components:
            getattr(component, name)(self.state)

    def train_epoch(self) -> dict:
        """Train the steps ``state.epoch_step`` to ``state.epoch_end`` of ``state.epoch``; returns the epoch's flat
        record (throughput, loss over the whole epoch), with the state moved to the next epoch."""
        state = self.state
        epoch, start, end = state.epoch, state.epoch_step, state.epoch_end
        self.model.train()
        self.data.train.set_epoch(epoch, start_batch=start * self.accum)
        self.loss_sum = torch.tensor(state.epoch_loss_sum, device=self.device)
        self.pending = None
        batches = iter(self.data.train)
        self.data_wait = 0.0  # host seconds blocked waiting for the loader
        self._hooks("epoch_start")
        self._synchronize()
        t0 = time.perf_counter()
        while state.epoch_step < end:
            self._hooks("step_start")
            self.world.note_step(state.step)
            with nvtx_range(f"step {state.step}"):
                check = self.train_step(batches)
            self.loss_sum += check["loss"].detach()
            previous, self.pending = self.pending, check
            if previous is not None:
                self._check_finite(previous)
            state.step += 1
            state.epoch_step += 1
            if state.last_step_of_epoch:  # read at once: a signal seen here stops the run before validation
                self._settle_checks()
            self._hooks("step_end")
        self._synchronize()
        elapsed = time.perf_counter() - t0
        self.settle()
        return self._epoch_record(epoch, end - start, elapsed)

    def _epoch_record(self, epoch: int, steps: int, elapsed: float) -> dict:
        """The finished epoch's record (``epoch`` counted from 1); the state moves on to the next epoch."""
        state = self.state
        samples_per_s = steps * self.global_bs / elapsed if steps else math.nan
        record = {"epoch": state.epoch_number, "iteration": state.step, "epoch_time_s": elapsed,
                  "samples_per_s": samples_per_s, "data_wait_share": self.data_wait / elapsed,
                  "lr": self.optimizer.param_groups[0]["lr"],
                  "loss/train": state.epoch_loss_mean / max(1, state.epoch_step),
                  "train/rollout_steps": self.step_fn.rollout_steps}
        if self.cfg.optim.rollout_max_steps:  # a curriculum may raise K inside the epoch: the K it started with
            first_step = state.step - state.epoch_step  # epoch_step counts the steps before a resume too
            record["train/rollout_steps_first"] = rollout_steps_at(self.cfg.optim, first_step, epoch)
        if self.peak_flops:
            # a sample is K model applications (the K of the epoch's last step)
            record["mfu"] = (samples_per_s * self.flops_per_sample * self.step_fn.rollout_steps
                             / (self.peak_flops * self.world.world_size))
        state.epoch, state.epoch_step, state.epoch_loss_sum, state.epoch_loss_mean = epoch + 1, 0, 0.0, 0.0
        self.loss_sum = torch.zeros((), device=self.device)
        return record

    def settle(self) -> None:
        """Make the train state exact before it is saved or reported: the pending step's loss read back and
        checked, the epoch's losses summed over the data-parallel ranks, the elapsed time (collective)."""
        self._settle_checks()
        self.state.epoch_loss_sum = self.loss_sum.item()
        self.state.epoch_loss_mean = all_reduce(self.loss_sum.clone(), self.world, "dp").item() / self.world.dp
        self.state.elapsed_s = self.reporter.elapsed()

    def _settle_checks(self) -> None:
        if self.pending is not None:
            self._check_finite(self.pending)
            self.pending = None

    def last_loss(self) -> tuple[int, float] | None:
        """``(iteration, loss)`` of the newest step read back (no synchronization: one step late)."""
        return self.read_back

    def train_step(self, batches) -> dict:
        """One optimizer step over ``grad_accum_steps`` micro-batches. Returns tensors for the late check."""
        self.step_fn.rollout_steps = self.rollout_steps()
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
        input or target always makes the loss non-finite, so the data are scanned only then.
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
        """Stop with NonFiniteError if a step's loss was NaN/Inf on any rank, naming bad samples if any; note
        an agreed preemption signal in the state.

        Every rank sees the same (all-reduced) flag, so all of them enter the collective below.
        """
        if check["ready"] is not None:
            check["ready"].synchronize()
        flag, signum, loss = check["host"].tolist()
        self.read_back = (check["step"] + 1, loss)
        self.state.stop_signal = self.state.stop_signal or int(signum)
        if not flag or is_simulated(self.world.env):  # a simulated rank's values are meaningless
            return
        bad = nonfinite_samples(self.data, torch.cat(check["indices"]).tolist(), "train", self.world)
        if bad:
            raise NonFiniteError(f"NaN/Inf in the training data at step {check['step']}: {bad}; "
                                 "fix or exclude that file (re-run the converter, check for missing values)")
        raise NonFiniteError(f"training loss became NaN/Inf at step {check['step']} with finite data; lower --lr, set "
                             "--max_grad_norm 1.0, add --warmup, or use --amp_mode bf16 instead of fp16 or fp8")

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run(cfg: Config, world: World, command_cfg: Config | None = None, extra: ExtraComponents | None = None) -> dict:
    """Build the trainer for ``cfg`` on ``world``, train and close it; returns the last epoch's record."""
    trainer = Trainer(cfg, world, command_cfg, extra)
    try:
        record = trainer.train()
    except BaseException as exc:
        trainer.close(exc)
        raise
    trainer.close()
    return record
