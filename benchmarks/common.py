"""Shared pieces of the benchmark scripts: run train.py variants, read their metrics, print tables."""

from __future__ import annotations

import datetime
import json
import platform
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from utils.core.errors import ArgumentParser, UserError
from utils.core.files import read_bounded, write_json_atomic

ROOT = Path(__file__).resolve().parents[1]


RUNNING: set[subprocess.Popen] = set()  # the runs in flight, in any thread: kill_running() stops them


def run_variant(name: str, args: list[str], expdir: Path, launcher: list[str] | None = None,
                timeout: int = 900, entry: str = "train.py", env: dict[str, str] | None = None) -> dict:
    """Run ``train.py`` (under ``launcher``, e.g. torchrun; with ``env`` added to the environment) with ``args``;
    return its last epoch's metrics.

    The result holds the variant name, the command, the exit status and, on success, the fields of the
    last line of ``metrics.jsonl`` (samples_per_s, mfu, data_wait_share, memory/..., ...). Safe to call from
    several threads at once (runs side by side); a stop then calls :func:`kill_running`.
    """
    # a fresh, named run directory per call (train.py refuses to reuse one)
    run_num = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    cmd = (launcher or [sys.executable]) + [str(ROOT / entry), *args, "--expdir", str(expdir),
                                            "--run_num", run_num, "--save_checkpoint", "false"]
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))) as child:
        RUNNING.add(child)
        try:
            stdout, stderr = child.communicate(timeout=timeout)
            code = child.returncode
        except subprocess.TimeoutExpired:  # a failed variant, not a crash of the benchmark
            child.kill()
            stdout, stderr = child.communicate()
            code, stderr = None, stderr + f"\ntimed out after {timeout} s (run_variant's timeout)"
        except BaseException:  # a stop (StopOnSignal) in this thread: the run goes with it
            child.kill()
            raise
        finally:
            RUNNING.discard(child)
    result = {"variant": name, "command": " ".join(cmd), "returncode": code,
              "wall_s": round(time.perf_counter() - t0, 1),
              "profiler_log": [line for line in stdout.splitlines() if "CUDA profiler" in line]}
    metrics = sorted(expdir.glob(f"*/*/{run_num}/metrics.jsonl"))
    if code != 0 or not metrics:
        # the ranks' error lines first: torchrun's summary of the failure fills the tail of stderr
        said = [line for line in (stdout + stderr).splitlines() if "error" in line.lower()][-8:]
        result["error"] = "\n".join(said) + "\n" + stdout[-1500:] + stderr[-1500:]
        print(f"[{name}] FAILED ({code}):\n{result['error']}", flush=True)
        return result
    epochs = [json.loads(line) for line in metrics[-1].read_text().strip().splitlines()]
    result.update(epochs[-1])
    # the loss curve over epochs, to compare runs (e.g. tensor parallel against tp=1), and each epoch's clocks
    result["curve"] = [{**{k: e.get(k) for k in ("iteration", "loss/train", "loss/valid", "samples_per_s",
                                                  "epoch_time_s", "elapsed_s")},
                        "alloc_retries": e.get("memory/alloc_retries")} for e in epochs]
    print(f"[{name}] {result['samples_per_s']:.1f} samples/s", flush=True)
    return result


def one_line(text: str, chars: int = 300) -> str:
    """A run's output in an ``error:`` line: its own last ``error:`` line if it printed one (under torchrun the
    ranks' lines come before torchrun's summary of the failure, which would fill the tail), else the end of
    ``text``; at most ``chars`` characters, each run of whitespace made one space."""
    said = [line.removeprefix("error: ") for line in text.splitlines() if line.startswith("error: ")]
    return " ".join((said[-1] if said else text).split())[-chars:]


def succeeded_row(row: dict, name: str, note: str = "") -> dict:
    """``row`` of :func:`run_variant` if its run succeeded (exit status 0, a rate recorded).

    Raises:
        UserError: it failed; the message names the run ``name``, its exit status (``note`` after it) and the end
            of its output.
    """
    if row.get("returncode") != 0 or "samples_per_s" not in row:
        raise UserError(f"the {name} run failed (exit status {row.get('returncode')}{note}): "
                        f"{one_line(str(row.get('error', '')))}")
    return row


def kill_running() -> None:
    """Kill every :func:`run_variant` run in flight (those of other threads, when the main thread is stopped)."""
    for child in list(RUNNING):
        child.kill()


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table; ``columns`` are (header, key path 'a.b', format)."""
    def get(row, path):
        for part in path.split("."):
            row = row.get(part) if isinstance(row, dict) else None
        return row

    cells = [[h for h, _, _ in columns]]
    for row in rows:
        cells.append([("-" if get(row, k) is None else format(get(row, k), f)) for _, k, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def read_json(path: Path, fix: str):
    """The JSON value of the file ``path`` (read as ``utils.core.files.read_bounded``: a regular file, bounded).

    Raises:
        UserError: missing, unreadable or not JSON, with ``fix`` (what to do) after the problem.
    """
    try:
        return json.loads(read_bounded(path))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}; {fix}") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise UserError(f"{path} is not JSON ({type(e).__name__}); {fix}") from None


def save_json(path: Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (a stopped benchmark leaves its last complete file, never half
    of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, payload)


class Results(list):
    """A benchmark's rows, rewritten to ``path`` as JSON after every row, so a run stopped at a time
    limit keeps what it measured. ``meta`` (config, suite, ...) is saved beside the rows."""

    def __init__(self, path: Path, **meta):
        super().__init__()
        import torch
        self.path = path
        self.meta = {**meta, "date": datetime.datetime.now().isoformat(), "host": platform.node(),
                     "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__}

    def append(self, row: dict) -> None:
        super().append(row)
        self.save()

    def save(self) -> None:
        save_json(self.path, {**self.meta, "results": list(self)})


def runs_parser(doc: str, name: str) -> ArgumentParser:
    """The options of a benchmark that runs ``train.py`` ``--runs`` times in each of its settings, each run on
    ``--gpus`` ranks (torchrun above 1), in folders under ``--expdir`` (``/tmp/<name>``), saving ``--out``
    (``benchmarks/results/<name>.json``); ``train.py`` options follow ``--`` (:func:`parse_runs`)."""
    ap = ArgumentParser(description=doc, usage="%(prog)s [options] [-- train.py options]")
    ap.add_argument("--runs", type=int, default=2, help="runs of each setting")
    ap.add_argument("--gpus", type=int, default=1, help="ranks of each run (more than 1: torchrun)")
    ap.add_argument("--expdir", default=f"/tmp/{name}", help="the runs' folders")
    ap.add_argument("--out", default=f"benchmarks/results/{name}.json")
    return ap


def parse_runs(ap: ArgumentParser, argv: list[str]):
    """``(options, train.py options)``: ``argv`` before ``--`` parsed by ``ap`` (:func:`runs_parser`), the rest.

    Raises:
        UserError: ``--runs`` or ``--gpus`` below 1.
    """
    cut = argv.index("--") if "--" in argv else len(argv)
    args, train_args = ap.parse_args(argv[:cut]), argv[cut + 1:]
    for flag, value in (("--runs", args.runs), ("--gpus", args.gpus)):
        if value < 1:
            raise UserError(f"{flag} {value}: give 1 or more")
    return args, train_args


def add_attention_shape(parser) -> None:
    """The options of one attention block's shape, by default the ``short`` config's blocks at local batch 16."""
    parser.add_argument("--batch", type=int, default=16, help="local batch size")
    parser.add_argument("--tokens", type=int, default=4050, help="tokens per sample (360 x 720 in patches of 8)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=48)


def mean_ms(fn, iters: int) -> float:
    """Mean milliseconds of a call of ``fn`` on the GPU: ``iters`` calls after 3 warm-ups, between two
    synchronizations."""
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3
