"""The one training loop, shared by every mode (single GPU, DDP, FSDP, tensor/context parallel).

``train.py`` and ``train_mp.py`` parse the config and call :func:`run`. Parallelism is
applied from outside (``distributed/parallelize.py``); the loop only sees a model, an
optimizer and device batches, plus two hooks from ``distributed/``: gradient-sync
suppression for accumulation and the reduction of replicated-parameter gradients.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from distributed.checkpoint import save_full_model
from distributed.env import World
from distributed.parallelize import (AMP_DTYPES, build_parallel_model, clip_grad_norm, gradient_sync,
                                     reduce_replicated_gradients)
from networks.vit import build_model
from utils.data_loader import Data, build_data
from utils.errors import NonFiniteError, UserError
from utils.flops import peak_flops, vit_flops_per_sample
from utils.logging_utils import run_directory, setup_logging
from utils.memory import MemoryTracker, format_memory
from utils.metrics import latitude_weights, relative_l2_loss, weighted_acc_channels, weighted_rmse_channels
from utils.plots import prediction_figure
from utils.profiling import ProfilerWindow, nvtx_range

log = logging.getLogger(__name__)

def batch_sizes(params, dp: int) -> tuple[int, int]:
    """(local micro-batch per data-parallel rank, global batch per optimizer step).

    ``global = local * dp * grad_accum_steps``. ``local_batch_size``, when set, wins.
    Raises UserError when the global batch does not divide over the ranks and micro-steps.
    """
    k = params.grad_accum_steps
    if k < 1:
        raise UserError(f"--grad_accum_steps must be >= 1, got {k}")
    if params.local_batch_size:
        return params.local_batch_size, params.local_batch_size * dp * k
    gbs = params.global_batch_size
    if gbs % (dp * k):
        raise UserError(f"global_batch_size {gbs} is not divisible by data-parallel size {dp} x "
                        f"grad_accum_steps {k}; pick a multiple of {dp * k} or set --local_batch_size")
    return gbs // (dp * k), gbs


def lr_lambda(params):
    """Multiplier of the base lr at optimizer step s: linear warmup, then cosine to 0 (or constant)."""
    warmup, total = params.warmup, max(1, params.num_iters)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if params.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def set_attention_backend(name: str, device: torch.device, head_dim: int) -> None:
    """Restrict ``scaled_dot_product_attention`` to one backend (global, so compiled graphs see it).

    Only CUDA backends are selectable; on CPU PyTorch keeps its own choice. Raises UserError
    when the backend cannot run this head size on this device.
    """
    if name == "auto" or device.type != "cuda":
        return
    flags = {"cudnn": torch.backends.cuda.enable_cudnn_sdp, "flash": torch.backends.cuda.enable_flash_sdp,
             "efficient": torch.backends.cuda.enable_mem_efficient_sdp, "math": torch.backends.cuda.enable_math_sdp}
    for key, enable in flags.items():
        enable(key == name)
    q = torch.zeros(1, 1, 64, head_dim, device=device, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    except RuntimeError:
        raise UserError(f"--attention_backend {name} cannot run head dim {head_dim} on "
                        f"{torch.cuda.get_device_name(device)}; use --attention_backend auto") from None


def _all_reduce(tensor: torch.Tensor, world: World, dim: str | None = None,
                op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce in place over mesh dimension ``dim`` (``dp``, ...) or over all ranks when None."""
    size = world.world_size if dim is None else getattr(world, dim)
    if dist.is_initialized() and size > 1:
        # a size-1 dimension has no group: passing None would reduce over the whole world
        dist.all_reduce(tensor, op=op, group=None if dim is None else world.group(dim))
    return tensor


class Trainer:
    """Owns model, optimizer, data and logging for one run; :meth:`train` runs it."""

    def __init__(self, params, world: World):
        self.params, self.world, self.device = params, world, world.device
        self.local_bs, self.global_bs = batch_sizes(params, world.dp)
        self.accum = params.grad_accum_steps
        self.run_dir = run_directory(params, world.world_size) if world.is_main else None
        setup_logging(self.run_dir / "out.log" if self.run_dir else None, world.rank)
        log.info("rank %d/%d on %s (launcher %s): dp=%d cp=%d tp=%d, local batch %d, global batch %d",
                 world.rank, world.world_size, self.device, world.env.launcher, world.dp, world.cp, world.tp,
                 self.local_bs, self.global_bs)
        if world.world_size > 1 and not world.is_main:
            print(f"rank {world.rank}/{world.world_size} on {self.device} ready", flush=True)
        if self.run_dir:
            (self.run_dir / "config.yaml").write_text(params.to_yaml())
        self.data: Data = build_data(params, self.local_bs, world.dp_rank, world.dp, self.device)
        self._build_model()
        self.writer = SummaryWriter(log_dir=str(self.run_dir)) if self.run_dir else None
        self.memory = MemoryTracker(self.device)
        self.profiler = ProfilerWindow(params.profile_epoch, params.profile_start_step, params.profile_steps,
                                       world.rank)
        self.lat_weights = latitude_weights(self.data.latitude, self.device)
        self.flops_per_sample = vit_flops_per_sample(params)
        self.peak_flops = peak_flops(self.device, params.amp_mode)
        self.step = 0
        self.data_wait = 0.0

    def _build_model(self) -> None:
        p = self.params
        torch.manual_seed(p.seed)  # identical initial weights on every rank
        set_attention_backend(p.attention_backend, self.device, p.embed_dim // p.num_heads)
        with torch.device("meta"):  # counted without allocating
            n_params = sum(t.numel() for t in build_model(p).parameters())
        log.info("model: ViT embed %d depth %d heads %d patch %d, %.2fM parameters", p.embed_dim, p.depth,
                 p.num_heads, p.patch_size, n_params / 1e6)
        self.model = build_parallel_model(p, self.world, build_model)
        fused = p.enable_fused and self.device.type in ("cuda", "cpu")
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=p.lr, betas=tuple(p.betas),
                                          weight_decay=p.weight_decay, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(p))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=p.amp_mode == "fp16")
        self.amp_dtype = AMP_DTYPES[p.amp_mode]
        # Eager, the loss and its backward are ~10 passes over full-resolution fields (~4 % of an
        # H100 step at short_opt); compiled, they fuse into a few kernels.
        self.loss_fn = torch.compile(relative_l2_loss) if p.enable_jit else relative_l2_loss

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # ---------------------------------------------------------------- training
    def train(self) -> dict:
        """Run ``num_iters`` optimizer steps; returns the last epoch's report."""
        p = self.params
        steps_per_epoch = len(self.data.train) // self.accum
        if steps_per_epoch == 0:
            raise UserError(f"an epoch has fewer micro-batches ({len(self.data.train)}) than --grad_accum_steps "
                            f"{self.accum}; lower it or use more samples")
        n_epochs = math.ceil(p.num_iters / steps_per_epoch)
        log.info("training %d iterations: %d epochs of %d steps (%d samples/epoch); run directory %s",
                 p.num_iters, n_epochs, steps_per_epoch, steps_per_epoch * self.global_bs, self.run_dir)
        if p.memory_snapshot and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100000)
        report: dict = {}
        for epoch in range(n_epochs):
            report = self.train_epoch(epoch, min(steps_per_epoch, p.num_iters - self.step))
            if (epoch + 1) % p.valid_every == 0 or epoch == n_epochs - 1:
                report.update(self.validate(epoch))
            self.log_epoch(epoch, n_epochs, report)
            if epoch == 0:
                self._dump_memory_snapshot()
            if p.save_checkpoint:
                self.save_checkpoint(epoch)
        if self.writer:
            self.writer.close()
        return report

    def train_epoch(self, epoch: int, n_steps: int) -> dict:
        self.model.train()
        self.data.train.set_epoch(epoch)
        self.memory.start_epoch()
        loss_sum = torch.zeros((), device=self.device)
        pending = None  # previous step's finiteness check, read one step late to avoid a sync per step
        batches = iter(self.data.train)
        bar = self._progress(n_steps, epoch)
        self.data_wait = 0.0  # host seconds blocked waiting for the loader
        self._synchronize()
        t0 = time.perf_counter()
        for step in range(n_steps):
            self.profiler.step(epoch, step)
            with nvtx_range(f"step {self.step}"):
                check = self.train_step(batches)
            loss_sum += check["loss"].detach()
            if pending is not None:
                self._check_finite(pending)
            pending = check
            self.step += 1
            self._progress_update(bar, step, n_steps, epoch, check["loss"])
        if pending is not None:
            self._check_finite(pending)
        self.profiler.close(epoch, n_steps)
        self._synchronize()
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        loss = _all_reduce(loss_sum, self.world, "dp").item() / max(1, n_steps * self.world.dp)
        samples = n_steps * self.global_bs
        report = {"epoch_time": elapsed, "samples_per_s": samples / elapsed, "train_loss": loss,
                  "data_wait_share": self.data_wait / elapsed,
                  "lr": self.optimizer.param_groups[0]["lr"], "memory": self.memory.end_epoch()}
        if self.peak_flops:
            report["mfu"] = report["samples_per_s"] * self.flops_per_sample / (self.peak_flops * self.world.world_size)
        return report

    def train_step(self, batches) -> dict:
        """One optimizer step over ``grad_accum_steps`` micro-batches. Returns tensors for the late check."""
        loss_total = torch.zeros((), device=self.device)
        indices = []
        for micro in range(self.accum):
            with nvtx_range("data"):
                t0 = time.perf_counter()
                inp, tar, idx = next(batches)
                self.data_wait += time.perf_counter() - t0
            indices.append(idx)
            last = micro == self.accum - 1
            with gradient_sync(self.model, last):
                with nvtx_range("forward"), self.autocast():
                    loss = self.loss_fn(self.model(inp), tar) / self.accum
                with nvtx_range("backward"):
                    self.scaler.scale(loss).backward()
            loss_total += loss.detach()
        with nvtx_range("optimizer"):
            self._optimizer_step()
        return {"loss": loss_total, "indices": indices, "step": self.step, **self._queue_finite_flag(loss_total)}

    def _optimizer_step(self) -> None:
        reduce_replicated_gradients(self.model)
        if self.params.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            clip_grad_norm(self.model, self.params.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _queue_finite_flag(self, loss: torch.Tensor) -> dict:
        """Enqueue the step's non-finite-loss flag, max over ranks, and its copy to the host.

        Enqueued at the end of the step and read one step later (:meth:`_check_finite`), so the host
        waits only for a step the GPU has already finished: a read right after enqueueing would
        drain the queue every step and idle the GPU while the next step is launched. NaN/Inf in an
        input or target always makes the loss non-finite, so the data are scanned only then.
        """
        flag = _all_reduce((~torch.isfinite(loss)).float(), self.world, op=dist.ReduceOp.MAX)
        if self.device.type != "cuda":
            return {"flag": flag, "flag_ready": None}
        ready = torch.cuda.Event()
        host = flag.to("cpu", non_blocking=True)  # lands in pinned memory
        ready.record()
        return {"flag": host, "flag_ready": ready}

    def _check_finite(self, check: dict) -> None:
        """Stop with NonFiniteError if a step's loss was NaN/Inf on any rank, naming bad samples if any.

        Every rank sees the same (all-reduced) flag, so all of them enter the collective below.
        """
        if check["flag_ready"] is not None:
            check["flag_ready"].synchronize()
        if not check["flag"].item():
            return
        step = check["step"]
        local = self.data.find_nonfinite(torch.cat(check["indices"]).tolist())
        anywhere = _all_reduce(torch.tensor(float(len(local)), device=self.device), self.world,
                               op=dist.ReduceOp.MAX).item()
        if anywhere:
            where = "; ".join(local) or "a sample on another rank"
            raise NonFiniteError(f"NaN/Inf in the training data at step {step}: {where}; "
                                 "fix or exclude that file (re-run the converter, check for missing values)")
        raise NonFiniteError(f"training loss became NaN/Inf at step {step} with finite data; lower --lr, set "
                             "--max_grad_norm 1.0, add --warmup, or use --amp_mode bf16 instead of fp16")

    # ---------------------------------------------------------------- validation
    @torch.no_grad()
    def validate(self, epoch: int) -> dict:
        """Validation loss and lat-weighted RMSE (physical units) / ACC per channel, plus persistence RMSE."""
        self.model.eval()
        std, clim = self.data.stats.std.view(1, -1), self.data.stats.clim
        c = std.shape[1]
        sums = torch.zeros(4 * c + 2, device=self.device)  # rmse, acc, persistence rmse, persistence acc, loss, n
        first = None
        for inp, tar, _ in self.data.valid:
            with nvtx_range("validation"), self.autocast():
                pred = self.model(inp)
            pred = pred.float()
            b = inp.shape[0]
            sums[:c] += (weighted_rmse_channels(pred, tar, self.lat_weights) * std).sum(0)
            sums[c:2 * c] += weighted_acc_channels(pred, tar, clim, self.lat_weights).sum(0)
            sums[2 * c:3 * c] += (weighted_rmse_channels(inp, tar, self.lat_weights) * std).sum(0)
            sums[3 * c:4 * c] += weighted_acc_channels(inp, tar, clim, self.lat_weights).sum(0)
            sums[-2] += relative_l2_loss(pred, tar) * b
            sums[-1] += b
            if first is None:
                first = (pred[0].clone(), tar[0].clone())  # loader buffers are reused
        _all_reduce(sums, self.world, "dp")
        n = max(1.0, sums[-1].item())
        values = (sums / n).tolist()
        names = self.data.channel_names
        out = {"valid_loss": values[-2], "valid_samples": int(sums[-1].item()),
               "rmse": dict(zip(names, values[:c])), "acc": dict(zip(names, values[c:2 * c])),
               "persistence_rmse": dict(zip(names, values[2 * c:3 * c])),
               "persistence_acc": dict(zip(names, values[3 * c:4 * c]))}
        if self.writer and first is not None:
            self._log_figure(epoch, *first)
        return out

    def _log_figure(self, epoch: int, pred: torch.Tensor, tar: torch.Tensor) -> None:
        names = self.data.channel_names
        ch = names.index(self.params.plot_channel) if self.params.plot_channel in names else 0
        mean, std = self.data.stats.mean[0, ch], self.data.stats.std[0, ch]
        to_np = lambda x: (x[ch] * std + mean).float().cpu().numpy()  # noqa: E731
        fig = prediction_figure(to_np(pred), to_np(tar), names[ch])
        self.writer.add_figure(f"prediction({names[ch]})/valid", fig, global_step=epoch)

    # ---------------------------------------------------------------- reporting
    def log_epoch(self, epoch: int, n_epochs: int, r: dict) -> None:
        if not self.world.is_main:
            return
        keys = self.params.key_channels or self.data.channel_names[:4]
        line = (f"epoch {epoch + 1}/{n_epochs} | {r['epoch_time']:.2f} s | {r['samples_per_s']:.1f} samples/s"
                + (f" | MFU {100 * r['mfu']:.1f}%" if "mfu" in r else "")
                + f" | data wait {100 * r['data_wait_share']:.0f}% | train loss {r['train_loss']:.4f}")
        if "valid_loss" in r:
            line += f" | valid loss {r['valid_loss']:.4f}"
            line += " | RMSE " + " ".join(f"{k} {r['rmse'][k]:.4g} (persistence {r['persistence_rmse'][k]:.4g})"
                                          for k in keys if k in r["rmse"])
        log.info(line)
        log.info(format_memory(r["memory"]))
        self._tensorboard(epoch, r)
        with open(self.run_dir / "metrics.jsonl", "a") as f:  # machine-readable, for benchmarks and run comparison
            f.write(json.dumps({"epoch": epoch, "iteration": self.step, **r}) + "\n")

    def _tensorboard(self, epoch: int, r: dict) -> None:
        w, step = self.writer, self.step
        w.add_scalar("loss/train", r["train_loss"], step)
        w.add_scalar("lr", r["lr"], step)
        w.add_scalar("perf/samples_per_s", r["samples_per_s"], step)
        w.add_scalar("perf/epoch_time_s", r["epoch_time"], step)
        w.add_scalar("perf/data_wait_share", r["data_wait_share"], step)
        if "mfu" in r:
            w.add_scalar("perf/mfu", r["mfu"], step)
        for key, value in r["memory"].items():
            if not key.endswith("_rank"):
                w.add_scalar(f"memory/{key}", value, step)
        if "valid_loss" in r:
            w.add_scalar("loss/valid", r["valid_loss"], step)
            for name in r["rmse"]:
                w.add_scalar(f"RMSE({name})/valid", r["rmse"][name], step)
                w.add_scalar(f"ACC({name})/valid", r["acc"][name], step)
                w.add_scalar(f"RMSE({name})/persistence", r["persistence_rmse"][name], step)
                w.add_scalar(f"ACC({name})/persistence", r["persistence_acc"][name], step)
        w.flush()

    def _progress(self, n_steps: int, epoch: int):
        # batch jobs (SLURM) get plain lines even when srun hands them a terminal
        if self.world.is_main and sys.stdout.isatty() and "SLURM_JOB_ID" not in os.environ:
            return tqdm(total=n_steps, desc=f"epoch {epoch + 1}", leave=False, dynamic_ncols=True)
        return None

    def _progress_update(self, bar, step: int, n_steps: int, epoch: int, loss: torch.Tensor) -> None:
        if bar is not None:
            bar.update(1)
        elif self.world.is_main and ((step + 1) % self.params.log_every == 0 or step + 1 == n_steps):
            log.info("epoch %d step %d/%d (iteration %d) loss %.4f", epoch + 1, step + 1, n_steps, self.step,
                     loss.item())

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _dump_memory_snapshot(self) -> None:
        if not (self.params.memory_snapshot and self.device.type == "cuda"):
            return
        path = Path(self.params.expdir) / f"memory_snapshot_rank{self.world.rank}.pickle"
        if self.run_dir:
            path = self.run_dir / path.name
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        log.info("memory snapshot written to %s (open at https://pytorch.org/memory_viz)", path)

    def save_checkpoint(self, epoch: int) -> None:
        """Full-layout model (loadable on one device) at ``<run_dir>/checkpoints/model.pt``; collective."""
        path = (self.run_dir or Path(".")) / "checkpoints" / "model.pt"
        save_full_model(self.model, path, {"epoch": epoch, "iteration": self.step, "params": dict(self.params)})


def run(params, world: World) -> dict:
    """Build the trainer for ``params`` on ``world`` and train; returns the last epoch's report."""
    return Trainer(params, world).train()
