"""Compare training runs: a table of what differs and how they did, plus loss/RMSE plots (the command line:
``tools/compare_runs.py``).

A run directory is what the trainer writes, ``<expdir>/<config name>/<N>GPU/<run_num>/``, with
``run.json`` (config, world size, status) and ``metrics.jsonl`` (one JSON object per epoch).

Usage::

    python -m tools.compare_runs runs/tiny/1GPU/00 runs/tiny/2GPU/00
    python -m tools.compare_runs --expdir runs --config 'tiny*'
    python -m tools.compare_runs --expdir runs --channels t2m,z500 --out plots/
    python -m tools.compare_runs --expdir runs --json | jq '.runs[].samples_per_s'

The table has one row per run: the config keys whose values differ between the runs (and
``world_size`` when it differs), throughput (``samples/s``, ``MFU``: median over the epochs after
the first, which includes compilation and warm-up), peak memory (GPU allocated or CPU RSS, GiB),
allocator retries, the last train/validation loss and the last RMSE of the key channels, and the
status when a run has not completed. Plots (``valid_loss.png``, ``rmse_<channel>.png``) go to
``--out``, each metric against iteration and against wall-clock time since the run started.
``--json`` prints ``{"runs": [...], "differing_keys": [...], "channels": [...], "plots": [...]}``.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from utils.core.errors import UserError
from utils.core.files import read_bounded, read_jsonl, write_atomic

# config keys that differ between runs by construction, or say how a run was started, not what it trained
# (``--resume never`` repeats a run; the repeat's table row would otherwise differ from it in ``resume``)
IGNORED_KEYS = ("run_num", "expdir", "description", "resume")
# metrics the tool reads, checked to be numbers when a line is loaded (``rmse/<channel>`` too)
NUMERIC_KEYS = ("iteration", "elapsed_s", "samples_per_s", "mfu", "memory/peak_allocated", "memory/peak_rss",
                "memory/alloc_retries", "loss/train", "loss/valid")
REQUIRED_KEYS = ("iteration", "elapsed_s")  # the x axes of the plots
MAX_CELL = 24  # characters of a config value in the table; --json has the full value
USAGE_HINT = "see --help"


@dataclass
class Run:
    """One run directory: ``info`` is run.json, ``epochs`` the metrics.jsonl records in order."""

    path: Path
    info: dict
    epochs: list[dict]
    name: str = ""

    @property
    def config(self) -> dict:
        """The run's resolved config (every key)."""
        return self.info.get("config") or {}

    def channels(self) -> list[str]:
        """Channels with an RMSE in any epoch, in the order the metrics list them."""
        seen = {}
        for record in self.epochs:
            seen.update((key[len("rmse/"):], None) for key in record if key.startswith("rmse/"))
        return list(seen)


# ---------------------------------------------------------------- loading
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_json(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{where}: not valid JSON ({exc}); the file is corrupt, fix or delete it") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(value).__name__}; the file is corrupt, "
                        "fix or delete it")
    return value


def _read_text(path: Path) -> str:
    try:
        return read_bounded(path).decode()
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}; check the file and its permissions") from None


def load_metrics(path: Path) -> list[dict]:
    """The epoch records of ``metrics.jsonl`` (none if the file is missing: the run has not finished an epoch).

    Raises:
        UserError: a line is not a JSON object, lacks ``iteration``/``elapsed_s``, or has a non-numeric metric.
    """
    if not os.path.lexists(path):
        return []
    try:
        lines = read_jsonl(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}, {exc}; the file is corrupt, fix or delete the line") from None
    epochs = []
    for lineno, record in lines:
        where = f"{path}, line {lineno}"
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}; the file is corrupt, "
                            "fix or delete it")
        missing = [k for k in REQUIRED_KEYS if k not in record]
        bad = [k for k, v in record.items()
               if (k in NUMERIC_KEYS or k.startswith("rmse/")) and v is not None and not _is_number(v)]
        if missing:
            raise UserError(f"{where}: no {' or '.join(missing)}, so not a metrics line of the current trainer; "
                            "fix or delete the line, or re-run with the current trainer")
        if bad:
            raise UserError(f"{where}: {', '.join(bad)} not a number; the line is corrupt, fix or delete it")
        epochs.append(record)
    return epochs


def load_run(path: Path) -> Run:
    """Read a run directory (``run.json`` and ``metrics.jsonl``).

    Raises:
        UserError: not a directory, no ``run.json``, or a corrupt file.
    """
    if not path.is_dir():
        raise UserError(f"{path}: no such directory; pass a run directory <expdir>/<config>/<N>GPU/<run_num> "
                        "or --expdir")
    run_json = path / "run.json"
    if not run_json.is_file():
        raise UserError(f"{path}: not a run directory (no run.json); pass <expdir>/<config>/<N>GPU/<run_num>, "
                        f"or --expdir {path} to compare the runs below it")
    info = _read_json(_read_text(run_json), str(run_json))
    if not isinstance(info.get("config", {}), (dict, type(None))):
        raise UserError(f"{run_json}: 'config' is not a JSON object; the file is corrupt, fix or delete it")
    return Run(path=path.resolve(), info=info, epochs=load_metrics(path / "metrics.jsonl"))


def _natural_key(path: Path) -> list:
    # 2GPU before 10GPU, run 9 before run 10
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_runs(expdir: Path, config: str = "*") -> list[Path]:
    """Run directories ``<expdir>/<config>/<N>GPU/<run_num>`` (``<N>CPU`` for CPU jobs) whose config name matches
    the glob ``config``.

    Raises:
        UserError: ``expdir`` is not a directory, or holds no (matching) runs.
    """
    if not expdir.is_dir():
        raise UserError(f"--expdir {expdir}: no such directory; pass the directory the trainer's --expdir named")
    found = sorted((p.parent for p in expdir.glob(f"{config}/*[GC]PU/*/run.json")), key=_natural_key)
    if found:
        return found
    if config != "*":
        names = sorted({p.parents[2].name for p in expdir.glob("*/*[GC]PU/*/run.json")})
        raise UserError(f"no runs of config '{config}' under {expdir} (configs there: {', '.join(names) or 'none'}); "
                        "fix --config")
    raise UserError(f"no runs under {expdir} (looked for {expdir}/<config>/<N>GPU/<run_num>/run.json); "
                    "pass the trainer's --expdir or run directories")


def short_names(paths: list[Path]) -> list[str]:
    """Each path relative to the runs' common parent; a lone run keeps ``<config>/<N>GPU/<run_num>``."""
    if len(set(paths)) < 2:
        return [str(Path(*p.parts[-3:])) for p in paths]
    common = Path(os.path.commonpath(paths))
    return [str(p.relative_to(common)) for p in paths]


def load_runs(run_dirs: list[Path], expdir: Optional[Path], config: Optional[str]) -> list[Run]:
    """The runs named on the command line and found under ``expdir``, each once, with short names."""
    if config is not None and expdir is None:
        raise UserError("--config needs --expdir; add --expdir DIR")
    if not run_dirs and expdir is None:
        raise UserError(f"no runs given; pass RUN_DIR ... or --expdir DIR; {USAGE_HINT}")
    paths = list(run_dirs) + (find_runs(expdir, config or "*") if expdir is not None else [])
    runs, seen = [], set()
    for path in paths:
        run = load_run(path)
        if run.path not in seen:
            seen.add(run.path)
            runs.append(run)
    for run, name in zip(runs, short_names([r.path for r in runs])):
        run.name = name
    return runs


# ---------------------------------------------------------------- rows
def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def differing_keys(runs: list[Run]) -> list[str]:
    """Config keys whose values differ between the runs (a missing key counts as a value), then ``world_size``."""
    keys = {}
    for run in runs:
        keys.update((k, None) for k in run.config if k not in IGNORED_KEYS)
    out = [k for k in keys if len({_canonical(r.config[k]) if k in r.config else "<missing>" for r in runs}) > 1]
    if len({_canonical(r.info.get("world_size")) for r in runs}) > 1:
        out.append("world_size")
    return out


def key_channels(runs: list[Run], requested: Optional[list[str]]) -> list[str]:
    """The channels to show: ``requested``, else the runs' ``key_channels``, else the first 4; only channels
    in the metrics of every run that has validated.

    Raises:
        UserError: a requested channel is missing from some run.
    """
    per_run = [r.channels() for r in runs if r.channels()]
    common = [c for c in per_run[0] if all(c in chs for chs in per_run[1:])] if per_run else []
    if requested:
        for channel in requested:
            if channel not in common:
                lacking = [r.name for r in runs if r.channels() and channel not in r.channels()]
                raise UserError(f"--channels {channel}: no RMSE for it in {', '.join(lacking) or 'any run'}; pick "
                                f"from the channels common to all runs: {', '.join(common) or 'none yet'}")
        return requested
    configured = {}
    for run in runs:
        configured.update((c, None) for c in run.config.get("key_channels") or [])
    return [c for c in configured if c in common] or common[:4]


def _values(run: Run, key: str) -> list[float]:
    return [r[key] for r in run.epochs if r.get(key) is not None]


def _last(run: Run, key: str) -> Optional[float]:
    values = _values(run, key)
    return values[-1] if values else None


def _steady_median(run: Run, key: str) -> Optional[float]:
    # the first epoch includes compilation and warm-up; use it only when it is all there is
    values = [r[key] for r in (run.epochs[1:] or run.epochs) if r.get(key) is not None]
    return statistics.median(values) if values else None


def run_row(run: Run, keys: list[str], channels: list[str]) -> dict:
    """One run's values with machine-friendly keys (None where the metrics lack them)."""
    peak = _values(run, "memory/peak_allocated") or _values(run, "memory/peak_rss")
    retries = _values(run, "memory/alloc_retries")
    return {
        "name": run.name,
        "path": str(run.path),
        "status": run.info.get("status"),
        "error": run.info.get("error"),
        "epochs": len(run.epochs),
        "config": {k: run.info.get("world_size") if k == "world_size" else run.config.get(k) for k in keys},
        "samples_per_s": _steady_median(run, "samples_per_s"),
        "mfu": _steady_median(run, "mfu"),
        "peak_gib": max(peak) if peak else None,
        "alloc_retries": int(sum(retries)) if retries else None,
        "train_loss": run.epochs[-1].get("loss/train") if run.epochs else None,
        "valid_loss": _last(run, "loss/valid"),
        "rmse": {c: _last(run, f"rmse/{c}") for c in channels},
    }


# ---------------------------------------------------------------- table
def _compact(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_compact(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    text = "null" if value is None else str(value)
    # keep the end: paths and names differ there
    return text if len(text) <= MAX_CELL else "..." + text[-(MAX_CELL - 3):]


def _number(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: list[dict], keys: list[str], channels: list[str]) -> str:
    """The comparison as aligned plain text: names and config values left-aligned, numbers right-aligned,
    headers of two words on two lines."""
    columns = [("run", [r["name"] for r in rows], "<")]
    columns += [(k, [_compact(r["config"][k]) for r in rows], "<") for k in keys]
    columns += [
        ("samples/s", [_number(r["samples_per_s"], ".1f") for r in rows], ">"),
        ("MFU", ["-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%" for r in rows], ">"),
        ("peak GiB", [_number(r["peak_gib"], ".2f") for r in rows], ">"),
        ("retries", [_number(r["alloc_retries"], "d") for r in rows], ">"),
        ("train loss", [_number(r["train_loss"], ".4g") for r in rows], ">"),
        ("valid loss", [_number(r["valid_loss"], ".4g") for r in rows], ">"),
    ]
    columns += [(f"RMSE {c}", [_number(r["rmse"][c], ".4g") for r in rows], ">") for c in channels]
    if any(r["status"] != "completed" for r in rows):
        columns.append(("status", [str(r["status"]) for r in rows], "<"))
    # two-line headers ("RMSE" over "t2m"): headers are wider than the numbers under them
    headers = [h.rpartition(" ")[::2] for h, _, _ in columns]
    widths = [max(len(top), len(bottom), *(len(c) for c in cells))
              for (top, bottom), (_, cells, _) in zip(headers, columns)]
    aligns = [a for _, _, a in columns]
    lines = ["  ".join(format(part, f"{a}{w}") for part, a, w in zip(parts, aligns, widths))
             for parts in zip(*headers)]
    if not lines[0].strip():
        del lines[0]
    lines += ["  ".join(format(cells[i], f"{a}{w}") for (_, cells, a), w in zip(columns, widths))
              for i in range(len(rows))]
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------- plots
def _time_axis(seconds: float) -> tuple[float, str]:
    # TensorBoard-like readable units for the wall-clock axis
    for scale, unit in ((3600.0, "h"), (60.0, "min")):
        if seconds >= 2 * scale:
            return scale, unit
    return 1.0, "s"


def _file_stem(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


LEGEND_KEYS = 3  # differing keys named in a plot's legend; the table has them all


def legend_labels(runs: list[Run], keys: list[str]) -> list[str]:
    """Each run's name and its values of the first :data:`LEGEND_KEYS` differing ``keys`` (``00: lr=0.003``), so
    the legend says what the lines differ in, not just run ids."""
    labels = []
    for run in runs:
        values = [f"{k}={_compact(run.info.get('world_size') if k == 'world_size' else run.config.get(k))}"
                  for k in keys[:LEGEND_KEYS]]
        labels.append(f"{run.name}: {', '.join(values)}" if values else run.name)
    return labels


def default_out(run_dirs: list[Path], expdir: Optional[Path]) -> Path:
    """Where the plots go without ``--out``: ``<expdir>/compare_runs``, else beside the runs (their common
    parent's ``compare_runs``): never the directory the command happens to run in."""
    if expdir is not None:
        return expdir / "compare_runs"
    return Path(os.path.commonpath([p.absolute() for p in run_dirs])).parent / "compare_runs"


def write_plots(runs: list[Run], channels: list[str], out: Path, keys: list[str] = ()) -> tuple[list[Path], list[str]]:
    """``valid_loss.png`` and ``rmse_<channel>.png`` in ``out``: the metric against iteration (left) and
    wall-clock time since start (right), one line per run, labelled with its values of the differing ``keys``
    (:func:`legend_labels`). Returns the files written and notes on what was left out.

    Raises:
        UserError: ``out`` cannot be written.
    """
    import matplotlib  # here, so that errors and --help do not wait for matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    notes = [f"{r.name} has no epochs yet; left out of the plots" for r in runs if not r.epochs]
    metrics = [("loss/valid", "validation loss (normalized units)", "valid_loss")]
    metrics += [(f"rmse/{c}", f"RMSE {c} (the data's units)", f"rmse_{_file_stem(c)}") for c in channels]
    seconds = max((r["elapsed_s"] for run in runs for r in run.epochs), default=0.0)
    scale, unit = _time_axis(seconds)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {out}: {exc}; pass another --out") from None
    written = []
    names = legend_labels(runs, list(keys))
    for key, label, stem in metrics:
        series = [(name, [r for r in run.epochs if r.get(key) is not None]) for name, run in zip(names, runs)]
        series = [(name, records) for name, records in series if records]
        if not series:
            notes.append(f"no run has {key} yet; {stem}.png not written")
            continue
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True, layout="tight")
        for name, records in series:
            y = [r[key] for r in records]
            by_step.plot([r["iteration"] for r in records], y, marker=".", label=name)
            by_time.plot([r["elapsed_s"] / scale for r in records], y, marker=".", label=name)
        by_step.set(xlabel="iteration", ylabel=label, title=f"{label} vs iteration")
        by_time.set(xlabel=f"wall-clock time since start ({unit})", title=f"{label} vs time")
        for ax in (by_step, by_time):
            ax.grid(alpha=0.3)
        by_step.legend(fontsize="small")
        path = out / f"{stem}.png"
        try:
            write_atomic(path, lambda f: fig.savefig(f, dpi=100, format="png"))  # never through a link
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc}; pass another --out") from None
        finally:
            plt.close(fig)
        written.append(path)
    return written, notes


def finite(value: Any) -> Any:
    """``value`` with NaN/Inf floats (also inside dicts and lists) as None: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value
