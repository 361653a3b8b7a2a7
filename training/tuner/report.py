"""The tuner's report: a table of the trials, the JSON of trials and choices, and a plot of the curve; the
planner's table of one simulated job (``training/tuner/planner.py``) and the ``submit_pm.sh`` line it suggests."""

from __future__ import annotations

import json
from pathlib import Path

from training.monitor.memory import GIB
from training.tuner.search import OBJECTIVES, Trial, fmt
from utils.core.files import write_atomic, write_text_atomic

MIB = 2**20

# the parts of a step's peak (the planner sums the memory tracker's categories into them) and of a rank's shards
PARTS = ("parameters", "gradients", "optimizer state", "activations", "all-gather buffers", "other")
SHARDS = ("parameters", "gradients", "optimizer state")

SUBMIT_GPUS_PER_NODE = 4  # submit_pm.sh's layout (Perlmutter: one task per GPU, 4 per node)


def _gib(nbytes: int | None) -> str:
    return fmt(None if nbytes is None else nbytes / GIB, ".2f")


# (header, cell of a trial)
_COLUMNS = (("local", lambda t: str(t.local_batch_size)), ("global", lambda t: str(t.global_batch_size)),
            ("samples/s", lambda t: fmt(t.samples_per_s, ".1f")),
            ("MFU", lambda t: fmt(t.mfu, ".1%")),
            ("step s", lambda t: fmt(t.step_time_s, ".3f")),
            ("alloc GiB", lambda t: _gib(t.peak_allocated_bytes)),
            ("reserved GiB", lambda t: _gib(t.peak_reserved_bytes)),
            ("frag GiB", lambda t: _gib(t.inactive_split_bytes)),
            ("retries", lambda t: str(t.alloc_retries)), ("OOM", lambda t: str(t.ooms)),
            ("verdict", lambda t: t.verdict))


def report_table(trials: list[Trial], setting: str | None = None) -> str:
    """The trials as a plain-text table, one row per local batch in increasing order: local and global
    batch, samples/s, MFU, step time (s), peak allocated and reserved (GiB), fragmentation
    (inactive split blocks, GiB), retries, OOMs and the verdict; ``-`` where unknown. With a ``setting``
    name (a combined tuning), a first column holds each trial's setting, and rows are in measurement order."""
    columns = (((setting, lambda t: fmt(t.setting, "d")),) if setting else ()) + _COLUMNS
    ordered = trials if setting else sorted(trials, key=lambda t: t.local_batch_size)
    rows = [[h for h, _ in columns]] + [[cell(t) for _, cell in columns] for t in ordered]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def save_json(path: str | Path, trials: list[Trial], choices: dict[str, Trial],
              args: dict[str, list[str]], extra: dict | None = None) -> None:
    """Write ``{"trials": [...], "choice": {"max-throughput": {...}, "min-batch-at-peak": {...}}}``.

    Each choice is its trial's :meth:`Trial.to_dict` (``local_batch_size``, ``samples_per_s``, ...)
    plus ``args``, the ``train.py`` arguments in ``args[objective]`` (:func:`choice_args`); an objective
    missing from ``choices`` (no clean trial) is null; ``extra`` keys are added at the top level.
    Creates the parent directory.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    chosen = {name: {**choices[name].to_dict(), "args": args[name]} if name in choices else None
              for name in OBJECTIVES}
    write_text_atomic(path, json.dumps({**(extra or {}), "trials": [t.to_dict() for t in trials],
                                        "choice": chosen}, indent=2))


def plot(path: str | Path, trials: list[Trial], choices: dict[str, Trial] | None = None,
         budget_bytes: float | None = None, device: str = "cuda"):
    """Save a PNG of samples/s (left axis) and peak memory in GiB (right axis) against the local batch: on a GPU
    the allocator's peak reserved and allocated, on the CPU the peak RSS. Marked: each objective's pick (a star),
    the memory budget (a horizontal line), trials over it (a cross), with allocator retries (a ring) and OOMs
    (a vertical line). Returns the matplotlib Figure."""
    from matplotlib.figure import Figure  # lazily: the search needs no matplotlib; Figure needs no pyplot backend

    trials = sorted(trials, key=lambda t: t.local_batch_size)
    batches = [t.local_batch_size for t in trials]
    fig = Figure(figsize=(7, 4.4), constrained_layout=True)
    rate = fig.add_subplot()
    ran = [t for t in trials if t.samples_per_s is not None]
    rate.plot([t.local_batch_size for t in ran], [t.samples_per_s for t in ran], "o-", color="C0", label="samples/s")
    rate.set(xlabel="local batch size", ylabel="samples/s",
             title=f"batch-size tuner: throughput and peak memory per local batch ({device.upper()})")
    memory = rate.twinx()
    if device == "cuda":
        memory.plot(batches, [t.peak_reserved_bytes / GIB for t in trials], "s--", color="C1", label="peak reserved")
        memory.plot(batches, [t.peak_allocated_bytes / GIB for t in trials], "^:", color="C2", label="peak allocated")
    else:
        memory.plot(batches, [t.peak_reserved_bytes / GIB for t in trials], "s--", color="C1", label="peak RSS")
    if budget_bytes is not None:
        memory.axhline(budget_bytes / GIB, color="C3", ls="-.", lw=1, label="memory budget")
    memory.set_ylabel("GiB")
    _mark(rate, [t for t in ran if t.alloc_retries], "o", dict(ms=12, mfc="none", mec="orange", mew=2),
          "allocator retries")
    _mark(rate, [t for t in ran if t.over_budget], "x", dict(ms=10, color="C3", mew=2), "over budget")
    for i, (name, t) in enumerate((n, t) for n, t in (choices or {}).items() if t.samples_per_s is not None):
        rate.plot([t.local_batch_size], [t.samples_per_s], "*", ms=16 - 4 * i, color=f"C{4 + i}",
                  label=f"pick: {name} ({t.local_batch_size})")
    for i, t in enumerate(t for t in trials if t.ooms):  # no rate to place them at: a vertical line each
        rate.axvline(t.local_batch_size, color="red", ls="--", label="OOM" if i == 0 else None)
    handles = rate.get_legend_handles_labels()
    more = memory.get_legend_handles_labels()
    rate.legend(handles[0] + more[0], handles[1] + more[1], loc="lower right", fontsize="small")
    write_atomic(Path(path), lambda f: fig.savefig(f, dpi=100, format="png"))  # never through a link
    return fig


def _mark(axes, trials: list[Trial], marker: str, style: dict, label: str) -> None:
    if trials:
        axes.plot([t.local_batch_size for t in trials], [t.samples_per_s for t in trials], marker, ls="none",
                  label=label, **style)


def _mib(nbytes: int | None) -> str:
    return fmt(None if nbytes is None else nbytes / MIB, ".1f")


def device_peak(plan) -> int | None:
    """A plan's predicted device memory, bytes: peak reserved (else the tracker's tensor peak, a dry run's
    estimate) plus the NCCL allowance."""
    base = plan.peak_reserved if plan.peak_reserved is not None else plan.tensor_peak
    return None if base is None else base + plan.nccl.total


def plan_table(plans: list, title: str, budget: int | None) -> str:
    """The planner's table: one column per planned rank (``training.tuner.planner.RankPlan``), rows in MiB: the parts of
    the step's tensor peak and that peak, the allocator's peaks (measured on a GPU, ``-`` in a dry run), the NCCL
    allowance, the predicted device memory (:func:`device_peak`), the ``budget`` (bytes; None: unknown) and the
    headroom, then the shard bytes counted and, where the layout allows, computed; followed by where each figure
    comes from and which rank to plan for."""
    rows = [["", *(f"rank {p.rank}" for p in plans)], ["local batch (global)",
            *(f"{p.local_batch} ({p.global_batch})" for p in plans)], ["tokens", *(str(p.tokens) for p in plans)]]
    rows += [[f"{part} MiB", *(_mib(p.parts and p.parts[part]) for p in plans)] for part in PARTS]
    rows += [["tensor peak MiB", *(_mib(p.tensor_peak) for p in plans)],
             ["peak allocated MiB", *(_mib(p.peak_allocated) for p in plans)],
             ["peak reserved MiB", *(_mib(p.peak_reserved) for p in plans)],
             ["NCCL buffers MiB", *(_mib(p.nccl.total) for p in plans)],
             ["device memory MiB", *(_mib(device_peak(p)) for p in plans)],
             ["budget MiB", *(_mib(budget) for _ in plans)],
             ["headroom MiB", *(_mib(None if budget is None or device_peak(p) is None else budget - device_peak(p))
                                for p in plans)]]
    for kind, pick in (("counted", lambda p: p.shards), ("analytic", lambda p: p.analytic)):
        rows += [[f"{shard} shard MiB ({kind})", *(_mib(pick(p).get(shard)) for p in plans)] for shard in SHARDS]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title] + ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                       for row in rows]
    nccl = plans[0].nccl
    groups = ", ".join(f"{name} {size}" for name, size in nccl.groups) or "none"
    lines += ["", f"NCCL buffers (estimated, outside PyTorch's allocator): per collective group NCCL_BUFFSIZE "
              f"{nccl.buffsize / MIB:g} MiB x {nccl.channels} channels x ring peers (2, 1 in a group of 2); "
              f"groups: {groups}"]
    lines += list(dict.fromkeys(note for p in plans for note in p.notes))
    if len(plans) > 1:
        lines.append(f"plan for rank {governing(plans).rank}: of the ranks whose shards differ, the smallest local "
                     "batch, then the most device memory")
    return "\n".join(lines)


def governing(plans: list):
    """The plan the whole job must follow: the smallest local batch (every rank must fit it), then the most device
    memory."""
    return min(plans, key=lambda p: (p.local_batch, -(device_peak(p) or 0)))


def submit_line(world_size: int, args: list[str]) -> str:
    """The ``sbatch submit_pm.sh`` command that launches ``train.py args`` on ``world_size`` GPUs, 4 per node."""
    per_node = SUBMIT_GPUS_PER_NODE
    if world_size < per_node:
        nodes = f"-N 1 --ntasks-per-node {world_size} --gpus-per-node {world_size}"
    elif world_size % per_node == 0:
        nodes = f"-N {world_size // per_node}"
    else:
        return (f"(no submit_pm.sh line: {world_size} GPUs is not a multiple of its {per_node} per node; launch "
                f"train.py {' '.join(args)} on {world_size} GPUs)")
    return f"sbatch {nodes} submit_pm.sh {' '.join(args)}"
