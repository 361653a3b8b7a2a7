"""Per-module memory by category over one training step, from PyTorch's own memory trackers
(``torch.distributed._tools``: ``FSDPMemTracker`` for FSDP2 models, ``MemTracker`` otherwise)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from utils.core.errors import UserError

STEP_PEAK = "(step peak)"  # the module table's row of the whole step's peak


def load_trackers():
    """PyTorch's (private) memory trackers. Raises UserError when this PyTorch lacks them."""
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as exc:
        raise UserError(f"--memory_profile needs PyTorch's memory trackers (torch.distributed._tools), which torch "
                        f"{torch.__version__} lacks ({exc}); install the torch version pyproject.toml pins, or set "
                        "--memory_profile false") from None
    return FSDPMemTracker, MemTracker


class ModuleTable:
    """Per-module memory by category over one training step, from PyTorch's memory trackers.

    ``FSDPMemTracker`` for FSDP2 models (it instruments the FSDP modules: the root and each block),
    ``MemTracker`` otherwise (every module). Both are ``TorchDispatchMode``s that categorize each
    tensor storage created or touched (parameters, gradients, activations, temporaries, optimizer
    state; FSDP: sharded/unsharded parameters and gradients, all-gather and reduce-scatter buffers)
    and keep, per module, snapshots at its forward/backward boundaries and peaks. With gradient
    accumulation the module statistics are reset at each forward of the model (the trackers reject
    a second root forward), so the table shows the step's last micro-batch, the one holding the
    accumulated gradients. Raises UserError if the trackers are missing.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        fsdp_tracker, plain_tracker = load_trackers()
        self.model = model
        if isinstance(model, FSDPModule):
            self.tracker = fsdp_tracker(model, optimizer)
        else:
            self.tracker = plain_tracker()
            self.tracker.track_external(model, optimizer)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Track the ``with`` body (one training step)."""
        def reset_per_micro_batch(module, args):
            if module is self.model and module in self.tracker.memory_tracking:
                self.tracker.reset_mod_stats()

        # global, and registered before the tracker's own global hooks, so it runs first
        handle = nn.modules.module.register_module_forward_pre_hook(reset_per_micro_batch)
        try:
            with self.tracker:
                yield
        finally:
            handle.remove()

    def rows(self, depth: int) -> list[dict]:
        """One row per module down to ``depth`` (the plain model 1, its children 2, ``blocks.<i>`` 3;
        DDP's wrapper does not count) and device, at the module's peak: ``module``, ``device``,
        ``state`` (where the peak was), ``peak_bytes``, and ``bytes`` per category (the trackers'
        names). The first rows, module :data:`STEP_PEAK`, are the step's peak per device."""
        depth += isinstance(self.model, DistributedDataParallel)
        rows = [_row(STEP_PEAK, "", device, snap) for device, snap in self.tracker.get_tracker_snapshot("peak").items()]
        for stats in self.tracker.memory_tracking.values():
            if stats.mod_fqn.count(".") + 1 > depth:
                continue
            peaks: dict = {}
            for state, snapshots in stats.snapshots.items():
                for snapshot in snapshots:
                    for device, snap in snapshot.items():
                        if device not in peaks or snap["Total"] > peaks[device][1]["Total"]:
                            peaks[device] = (state.value, snap)
            rows += [_row(stats.mod_fqn, state, device, snap) for device, (state, snap) in peaks.items()]
        return rows


def _row(module: str, state: str, device, snap: dict) -> dict:
    return {"module": module, "device": str(device), "state": state, "peak_bytes": snap["Total"],
            "bytes": {getattr(k, "value", k): v for k, v in snap.items() if k != "Total"}}


def format_table(rows: list[dict]) -> str:
    """The module table as fixed-width text, memory in MiB."""
    categories = list(dict.fromkeys(c for row in rows for c in row["bytes"]))
    header = ["module", "device", "peak at", "peak MiB", *categories]
    lines = [[r["module"], r["device"], r["state"], f"{r['peak_bytes'] / 2**20:.2f}",
              *(f"{r['bytes'].get(c, 0) / 2**20:.2f}" for c in categories)] for r in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip()
                     for line in [header, *lines]) + "\n"
