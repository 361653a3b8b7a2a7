"""Memory profiling over a window of training steps (``--memory_profile``): where every byte goes, per rank.

The window is steps ``memory_profile_start_step .. + memory_profile_steps - 1`` of epoch
``memory_profile_epoch`` (counted from 1, as the console counts epochs; steps 0-based, like the Nsight window of
``training/monitor/profiling.py``). Outside it
:meth:`MemoryProfiler.step` returns a ``contextlib.nullcontext``: no hooks, no allocator history,
no synchronization. Inside it every rank writes, under ``<run_dir>/memory/rank<r>/``:

* ``snapshot_e<epoch>_s<step>_start.pickle`` / ``_end.pickle`` (CUDA only): the caching allocator's
  state and its alloc/free history since the window opened
  (``torch.cuda.memory._record_memory_history``, a ring buffer of ``memory_profile_max_entries``
  events; ``memory_profile_stacks none`` records no stack traces). Open them by dragging onto
  https://pytorch.org/memory_viz (https://pytorch.org/docs/stable/torch_cuda_memory.html).
* ``memory_stats.yaml``: ``torch.cuda.memory_stats()`` (CUDA; keys as PyTorch names them) and the host
  ``host_rss_bytes``/``host_vms_bytes`` (``/proc/self/statm``, Linux) at the start and end of each
  profiled step, with ``end_minus_start``.
* ``module_table.txt`` / ``module_table.json``: per-module memory at each module's peak over the
  window's first step, by category, from PyTorch's ``FSDPMemTracker`` (FSDP2 models: sharded and
  unsharded parameters and gradients, activations, temporaries, optimizer state, all-gather and
  reduce-scatter buffers) or ``MemTracker`` (otherwise), modules down to ``memory_profile_depth``.
* ``summary.json``: this rank's bytes of activations (:class:`ActivationCounter`; per step, per sample,
  per block), parameters and optimizer state (local shards), gradients (as the optimizer step finds
  them), the peak (CUDA: ``allocated_bytes.all.peak``/``reserved_bytes.all.peak``, the allocator's
  peak since the last ``reset_peak_memory_stats``, which the epoch's memory report does at each epoch
  start; CPU: ``peak_rss_bytes``, the process's RSS high-water mark), the module table's peak, and
  the names of the files above.

Rank 0 logs a summary over all ranks when the window ends (a collective all ranks reach at the same
step).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from ruamel.yaml import YAML
from torch import nn

from distributed.world import World, all_reduce
from training.monitor.activations import (ActivationCounter, gradient_bytes, optimized_parameters,
                                          optimizer_state_bytes, tensor_bytes)
from training.monitor.memory import peak_rss_bytes, size_unit
from training.monitor.module_table import STEP_PEAK, ModuleTable, format_table, load_trackers
from training.monitor.oom import record_history, snapshot_on_oom
from utils.config.schema import MemoryConfig
from utils.core.component import Component
from utils.core.files import write_atomic, write_text_atomic

log = logging.getLogger(__name__)


SUMMARY_FILE = "summary.json"


STATS_FILE = "memory_stats.yaml"


TABLE_FILE = "module_table.txt"


TABLE_JSON_FILE = "module_table.json"


TOP_MODULES = 5


def host_memory() -> dict[str, int]:
    """Resident and virtual size of this process in bytes (``/proc/self/statm``, Linux); empty elsewhere."""
    try:
        vms_pages, rss_pages = Path("/proc/self/statm").read_text().split()[:2]
    except OSError:
        return {}
    page = os.sysconf("SC_PAGE_SIZE")
    return {"host_rss_bytes": int(rss_pages) * page, "host_vms_bytes": int(vms_pages) * page}


class MemoryProfiler(Component):
    """The ``--memory_profile`` window (see the module docstring for what it writes).

    Args:
        cfg: the ``memory`` config section.
        directory: ``<run_dir>/memory``; this rank writes to ``directory/rank<r>/``.
        world: this process's place in the job (rank, device; the summary is reduced over all ranks).
        model: the model as trained (DDP, FSDP2 or plain).
        optimizer: its optimizer.
        local_batch_size: samples per micro-batch on this rank (for activation bytes per sample).

    Raises:
        UserError: ``memory_profile`` is on and PyTorch lacks the memory trackers.
    """

    def __init__(self, cfg: MemoryConfig, directory: Path, world: World, model: nn.Module,
                 optimizer: torch.optim.Optimizer, local_batch_size: int):
        self.cfg, self.world, self.model, self.optimizer = cfg, world, model, optimizer
        self.directory = Path(directory) / f"rank{world.rank}"
        self.local_batch_size = local_batch_size
        self.cuda = world.device.type == "cuda"
        self.first = cfg.memory_profile_start_step
        self.last = cfg.memory_profile_start_step + cfg.memory_profile_steps - 1
        if cfg.memory_profile:
            load_trackers()  # fail before training, not at the window
        self.steps: list[dict] = []  # one record per profiled step
        self.snapshots: list[str] = []
        self.counter: ActivationCounter | None = None
        self.table: ModuleTable | None = None
        self.recording = False
        self.done = False
        self.active: contextlib.AbstractContextManager | None = None  # the profiled step in progress

    def step_start(self, state) -> None:
        self.active = self.step(state.epoch_number, state.epoch_step)
        self.active.__enter__()

    def step_end(self, state) -> None:
        active, self.active = self.active, None
        active.__exit__(None, None, None)

    def epoch_end(self, state, record: dict) -> None:
        self.end_epoch(record["epoch"])

    def step(self, epoch: int, step: int) -> contextlib.AbstractContextManager:
        """Context for one whole training step (0-based ``step`` within ``epoch``, which counts from 1; forward
        and backward of every micro-batch, optimizer step, ``zero_grad``): profiled inside the window, a
        ``contextlib.nullcontext()`` outside it. A run resumed inside the window profiles the window's
        remaining steps. After the window's last step every rank writes its files and rank 0 logs the
        summary (collective)."""
        if (not self.cfg.memory_profile or self.done or epoch != self.cfg.memory_profile_epoch
                or not self.first <= step <= self.last):
            return contextlib.nullcontext()
        return self._profiled_step(epoch, step)

    def end_epoch(self, epoch: int) -> None:
        """Close a window still open at the end of ``epoch`` (its epoch had fewer steps): write the files
        and log the summary (collective, as at the window's last step)."""
        if self.steps and not self.done:
            self._finish()
        elif (self.cfg.memory_profile and not self.steps and epoch == self.cfg.memory_profile_epoch
              and self.world.is_main):
            log.warning("memory profile: epoch %d ran none of the window's steps %d-%d; nothing profiled",
                        epoch, self.first, self.last)

    def close(self, error: BaseException | None) -> None:
        """Release a step's hooks and tracker that ``error`` interrupted, and stop the allocator history if the
        window left it recording. Never raises; not collective."""
        try:
            if self.active is not None:
                self.active.__exit__(type(error), error, getattr(error, "__traceback__", None))
                self.active = None
            self._stop_history()
        except Exception as exc:  # closing after a failure must not raise over it
            log.warning("memory profile: could not stop the allocator history: %s", exc)

    def _stop_history(self) -> None:
        """End the window's history, unless the OOM snapshot wants it recorded for the whole run."""
        if self.recording and not snapshot_on_oom(self.cfg):
            torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False

    @contextlib.contextmanager
    def _profiled_step(self, epoch: int, step: int):
        if not self.steps:
            self._open(epoch, step)
        name = f"e{epoch}_s{step}"
        start = self._sample(f"snapshot_{name}_start.pickle")
        grads: list[int] = []
        with contextlib.ExitStack() as stack:
            activations = stack.enter_context(self.counter.count())
            # the gradients as the optimizer step finds them (set to None by zero_grad at the step's end)
            stack.callback(self.optimizer.register_step_pre_hook(
                lambda optimizer, args, kwargs: grads.append(gradient_bytes(optimizer))).remove)
            if self.table is None:
                self.table = ModuleTable(self.model, self.optimizer)
                stack.enter_context(self.table.track())
            t0 = time.perf_counter()
            yield
            if self.cuda:
                torch.cuda.synchronize(self.world.device)
            seconds = time.perf_counter() - t0
        end = self._sample(f"snapshot_{name}_end.pickle")
        self.steps.append({
            "epoch": epoch, "step": step, "step_time_s": seconds, "micro_batches": activations.micro_batches,
            "activation_bytes": activations.total, "activation_bytes_by_block": activations.by_block,
            # a step the GradScaler skipped has no optimizer step: the gradients' size, from the parameters
            "gradient_bytes": grads[-1] if grads else tensor_bytes(optimized_parameters(self.optimizer)),
            "start": start, "end": end, "end_minus_start": {k: end[k] - start[k] for k in start.keys() & end.keys()}})
        self._write_stats()
        if step == self.last:
            self._finish()

    def _open(self, epoch: int, step: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.counter = ActivationCounter(self.model)
        if self.cuda:
            record_history(self.cfg, clear=True)
            self.recording = True
        if self.world.is_main:
            log.info("memory profile: window opens at epoch %d step %d; files in %s", epoch, step,
                     self.directory.parent / "rank<r>")

    def _sample(self, snapshot: str) -> dict[str, int]:
        """``memory_stats`` (CUDA) and host memory now; on CUDA also dumps the allocator snapshot."""
        stats = host_memory()
        if self.cuda:
            stats.update(torch.cuda.memory_stats(self.world.device))
            torch.cuda.memory._dump_snapshot(str(self.directory / snapshot))
            self.snapshots.append(snapshot)
        return stats

    def _write_stats(self) -> None:
        # rewritten after each step, so a run that fails inside the window keeps the steps before
        records = [{k: r[k] for k in ("epoch", "step", "start", "end", "end_minus_start")} for r in self.steps]
        yaml = YAML()
        yaml.default_flow_style = False
        write_atomic(self.directory / STATS_FILE, lambda f: yaml.dump(records, f))

    def _finish(self) -> None:
        self.done = True
        self._stop_history()
        rows = self.table.rows(self.cfg.memory_profile_depth)
        write_text_atomic(self.directory / TABLE_FILE, format_table(rows))
        write_text_atomic(self.directory / TABLE_JSON_FILE, json.dumps(rows, indent=1))
        summary = self._summary(max((r["peak_bytes"] for r in rows if r["module"] == STEP_PEAK), default=0))
        write_text_atomic(self.directory / SUMMARY_FILE, json.dumps(summary, indent=1))
        self._log_summary(summary, rows)

    def _summary(self, tracker_peak: int) -> dict:
        worst = max(self.steps, key=lambda r: r["activation_bytes"])
        samples = self.local_batch_size * max(1, worst["micro_batches"])
        summary = {
            "rank": self.world.rank, "device": str(self.world.device),
            # with the trackers and hooks on; the first step also builds the module table
            "window": [{"epoch": r["epoch"], "step": r["step"], "step_time_s": r["step_time_s"]} for r in self.steps],
            "activation_bytes_per_step": worst["activation_bytes"],
            "activation_bytes_per_sample": worst["activation_bytes"] / samples,
            "activation_bytes_by_block": worst["activation_bytes_by_block"],
            "activation_bytes_by_step": [r["activation_bytes"] for r in self.steps],
            "micro_batches_per_step": worst["micro_batches"],
            "parameter_bytes": tensor_bytes(self.model.parameters()),
            "gradient_bytes": self.steps[-1]["gradient_bytes"],
            "optimizer_state_bytes": optimizer_state_bytes(self.optimizer),
            "module_table_peak_bytes": tracker_peak,
        }
        if self.cuda:
            stats = torch.cuda.memory_stats(self.world.device)
            summary["peak_allocated_bytes"] = stats.get("allocated_bytes.all.peak", 0)
            summary["peak_reserved_bytes"] = stats.get("reserved_bytes.all.peak", 0)
        else:
            summary["peak_rss_bytes"] = peak_rss_bytes()
        summary["files"] = {"summary": SUMMARY_FILE, "memory_stats": STATS_FILE, "module_table": TABLE_FILE,
                            "module_table_json": TABLE_JSON_FILE, "snapshots": self.snapshots}
        return summary

    def _log_summary(self, summary: dict, rows: list[dict]) -> None:
        """Rank 0 logs every rank's figures (a SUM all-reduce of a ``[world_size, 5]`` float64 tensor
        of bytes, each rank filling its row: collective over all ranks)."""
        peak_key = "peak_allocated_bytes" if self.cuda else "peak_rss_bytes"
        keys = ["parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes_per_step", peak_key]
        table = torch.zeros(self.world.world_size, len(keys), dtype=torch.float64,
                            device=self.world.device if self.cuda else "cpu")
        table[self.world.rank] = torch.tensor([float(summary[k]) for k in keys], dtype=torch.float64)
        table = all_reduce(table, self.world).cpu()
        if not self.world.is_main:
            return
        window = ", ".join(f"e{r['epoch']} s{r['step']}" for r in summary["window"])
        names = ["parameters", "gradients", "optimizer", "activations", "peak allocated" if self.cuda else "peak RSS"]
        unit, scale = size_unit(float(table.max()))
        lines = [f"memory profile ({window}), {unit} per rank:", "  rank" + "".join(f"{n:>15}" for n in names)]
        lines += [f"  {r:4d}" + "".join(f"{v / scale:15.3f}" for v in row) for r, row in enumerate(table.tolist())]
        top = sorted((r for r in rows if r["module"] != STEP_PEAK), key=lambda r: -r["peak_bytes"])[:TOP_MODULES]
        unit, scale = size_unit(max((r["peak_bytes"] for r in top), default=0))
        lines.append(f"  top modules by peak (rank 0, {unit}): " + ", ".join(
            f"{r['module']} {r['peak_bytes'] / scale:.3f} ({r['state']})" for r in top))
        lines.append(f"  files in {self.directory.parent}/rank<r>/: {SUMMARY_FILE} (these figures, bytes), "
                     f"{STATS_FILE} (memory_stats and host RSS/VMS at each step's start and end; any YAML viewer), "
                     f"{TABLE_FILE} / {TABLE_JSON_FILE} (memory per module and category at its peak)"
                     + (", snapshot_*.pickle (allocator history: drag onto https://pytorch.org/memory_viz)"
                        if self.cuda else ""))
        log.info("\n".join(lines))

