"""The tuner's report: a table of the trials, the JSON of trials and choices, and a plot of the curve."""

from __future__ import annotations

import json
from pathlib import Path

from utils.monitor.memory import GIB
from utils.tuner.search import OBJECTIVES, Trial, fmt


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
    path.write_text(json.dumps({**(extra or {}), "trials": [t.to_dict() for t in trials], "choice": chosen},
                               indent=2))


def plot(path: str | Path, trials: list[Trial]):
    """Save a PNG of samples/s (left axis) and peak allocated and reserved GiB (right axis) against the
    local batch, with trials that had allocator retries and OOMs marked. Returns the matplotlib Figure."""
    from matplotlib.figure import Figure  # lazily: the search needs no matplotlib; Figure needs no pyplot backend

    trials = sorted(trials, key=lambda t: t.local_batch_size)
    batches = [t.local_batch_size for t in trials]
    fig = Figure(figsize=(7, 4), constrained_layout=True)
    rate = fig.add_subplot()
    ran = [t for t in trials if t.samples_per_s is not None]
    rate.plot([t.local_batch_size for t in ran], [t.samples_per_s for t in ran], "o-", color="C0", label="samples/s")
    rate.set_xlabel("local batch size")
    rate.set_ylabel("samples/s")
    memory = rate.twinx()
    memory.plot(batches, [t.peak_reserved_bytes / GIB for t in trials], "s--", color="C1", label="peak reserved")
    memory.plot(batches, [t.peak_allocated_bytes / GIB for t in trials], "^:", color="C2", label="peak allocated")
    memory.set_ylabel("GiB")
    retried = [t for t in ran if t.alloc_retries]
    if retried:
        rate.plot([t.local_batch_size for t in retried], [t.samples_per_s for t in retried], "o", ms=12,
                  mfc="none", mec="orange", mew=2, label="allocator retries")
    for i, t in enumerate(t for t in trials if t.ooms):  # no rate to place them at: a vertical line each
        rate.axvline(t.local_batch_size, color="red", ls="--", label="OOM" if i == 0 else None)
    handles = rate.get_legend_handles_labels()
    more = memory.get_legend_handles_labels()
    rate.legend(handles[0] + more[0], handles[1] + more[1], loc="lower right", fontsize="small")
    fig.savefig(path, dpi=100)
    return fig
