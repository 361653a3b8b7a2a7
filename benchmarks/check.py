r"""Regression guard: rerun the headline measurements on this GPU and compare them with its stored reference.

Run by hand on one GPU (two for ``tp``), never in CI (it times real training). With data of the real shape:

    python -m tools.make_synthetic_data --out /tmp/full --channels 20 --img_size 360 720 --train_years 4 \
        --valid_years 1 --steps_per_year 140 --workers 16 --overwrite
    python benchmarks/check.py --data_path /tmp/full --out $OUT/h100_check.json
    python benchmarks/check.py --only tp --out $OUT/h100_check_tp.json   # on 2 GPUs; no data needed

The measurements (``--only`` picks some), each a ``train.py`` run of two epochs of ``--config`` (default
``short_opt``; its second epoch is reported) or, for the checkpoint stall, ``benchmarks/checkpoint.py``:

* ``ceiling``: compute only (``--data_loader_config synthetic``), once per ``--amp_modes`` mode: samples/s;
* ``e2e``: end to end with the native loader (8 workers) on ``--data_path``, in the mode of the highest
  ceiling (the ceiling of the same precision): samples/s and its share of that ceiling;
* ``fp8``: compute only with ``--amp_mode fp8``: samples/s and the ratio to the highest bf16 ceiling;
* ``checkpoint``: the training stall of a sync and of an async sharded save (the second of each kind);
* ``tp``: on 2 GPUs, ``mp`` with DDP and with tp 2 (the variants of ``benchmarks/multi_gpu.py --suite tp
  --gpus_max 2``, run by its runner): both samples/s and tp 2's share of DDP's per-GPU rate (the tensor-parallel
  overlap of docs/speed.md). With fewer GPUs it is skipped, and says so.

Each metric is compared with the same metric of the reference, ``benchmarks/results/<gpu>_check.json``
(``<gpu>`` from the device name: h100, h200, ...; ``--reference`` names another), an earlier output of this
script on the same kind of GPU: a change for the worse of more than ``--tolerance`` (relative; stalls
also need to grow by more than ``STALL_SLACK_S``) is a regression. Prints a table and what regressed,
writes JSON (``--out``; copy it to the reference path to make it the next reference), and exits with
status 4 when something regressed. A failed run is reported and the other measurements go on; the script
then exits 2 with an ``error:`` line naming it. Arguments after ``--`` go to every run.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import multi_gpu  # noqa: E402
from benchmarks.common import ROOT, Results, run_variant, table  # noqa: E402
from utils.core.errors import ArgumentParser, UserError, exit_status  # noqa: E402

MEASUREMENTS = ("ceiling", "e2e", "fp8", "checkpoint", "tp")
NEEDS_DATA = ("ceiling", "e2e", "fp8", "checkpoint")  # tp runs multi_gpu.py's synthetic batches
TP_GPUS = 2
TP_METRICS = {"mp_tp1_cp1": "mp DDP 2 GPUs samples/s", "mp_tp2_cp1": "mp tp 2 samples/s"}  # multi_gpu.py's names
TP_SHARE = "mp tp 2 / DDP per GPU"
SYNTHETIC = ["--data_loader_config", "synthetic"]
NATIVE = ["--data_loader_config", "pytorch", "--num_data_workers", "8"]
STALL_SLACK_S = 0.05  # a stall must grow by more than this too: short ones are timer noise
EXIT_REGRESSED = 4
# the train.py rows of benchmarks/checkpoint.py whose stall is compared: a save of each kind after the first
SAVES = {"sync save stall s": "sharded save, sync, with checksums (again)",
         "async save stall s": "sharded save, async (again)"}


def gpu_slug(device: str) -> str:
    """A short name of a device for file names: ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``cpu`` -> ``cpu``."""
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", device)
    return (found.group(1) if found else re.sub(r"\W+", "_", device)).lower()


def lower_is_better(metric: str) -> bool:
    return metric.endswith(" s")


# ---------------------------------------------------------------- measuring
class Measure:
    """Runs the measurements: ``run(name, args, expdir, launcher=..., entry=...)`` is
    :func:`benchmarks.common.run_variant` (a train.py run; the row of its last epoch), ``checkpoint(args, out)``
    runs ``benchmarks/checkpoint.py`` (its rows); ``gpus``: the GPUs this machine has."""

    def __init__(self, args, extra: list[str], run: Callable = run_variant, checkpoint: Callable | None = None,
                 gpus: int = 1):
        self.args, self.extra, self.run_fn, self.gpus = args, extra, run, gpus
        self.checkpoint_fn = checkpoint or run_checkpoint_benchmark
        self.rows: list[dict] = []
        self.metrics: dict[str, float] = {}
        self.skipped: list[str] = []

    def checked(self, name: str, row: dict) -> dict:
        """Keep ``row`` (of measurement ``name``); raises UserError when its run failed."""
        self.rows.append({"measurement": name, **row})
        if row.get("returncode") != 0 or "samples_per_s" not in row:
            raise UserError(f"the {row.get('variant', name)} run failed (exit status {row.get('returncode')}; its "
                            f"output is in {self.args.out}): {' '.join(str(row.get('error', '')).split())[-300:]}")
        return row

    def train(self, name: str, args: list[str]) -> dict:
        a = self.args
        common = ["--config", a.config, "--data_path", str(Path(a.data_path).absolute()), "--num_iters",
                  str(2 * a.steps_per_epoch), "--valid_every", "2", "--log_every", "1000"]
        return self.checked(name, self.run_fn(name, common + args + self.extra, Path(a.expdir).absolute()))

    def ceilings(self) -> dict[str, float]:
        return {m: self.metrics[f"ceiling {m} samples/s"] for m in self.args.amp_modes
                if f"ceiling {m} samples/s" in self.metrics}

    def ceiling(self) -> None:
        for mode in self.args.amp_modes:
            row = self.train(f"ceiling_{mode}", SYNTHETIC + ["--amp_mode", mode])
            self.metrics[f"ceiling {mode} samples/s"] = row["samples_per_s"]

    def e2e(self) -> None:
        ceilings = self.ceilings()
        mode = max(ceilings, key=ceilings.get) if ceilings else self.args.amp_modes[0]
        row = self.train(f"e2e_{mode}", NATIVE + ["--amp_mode", mode])
        self.metrics[f"end to end {mode} samples/s"] = row["samples_per_s"]
        if mode in ceilings:
            self.metrics[f"end to end {mode} / ceiling"] = row["samples_per_s"] / ceilings[mode]

    def fp8(self) -> None:
        row = self.train("fp8", SYNTHETIC + ["--amp_mode", "fp8"])
        self.metrics["fp8 samples/s"] = row["samples_per_s"]
        ceilings = self.ceilings()
        if ceilings:
            self.metrics["fp8 / best bf16 ceiling"] = row["samples_per_s"] / max(ceilings.values())

    def checkpoint(self) -> None:
        a = self.args
        args = ["--config", a.config, *SYNTHETIC, "--amp_mode", a.amp_modes[0], *self.extra]
        rows = {r["what"]: r for r in self.checkpoint_fn(args, Path(a.expdir).absolute() / "checkpoint")}
        self.rows.extend({"measurement": "checkpoint", **r} for r in rows.values())
        for metric, what in SAVES.items():
            if what not in rows:
                raise UserError(f"benchmarks/checkpoint.py gave no row '{what}'")
            self.metrics[metric] = rows[what]["stall_s"]


    def tp(self) -> None:
        """``mp`` with DDP and with tp 2 on 2 GPUs, as ``multi_gpu.py --suite tp --gpus_max 2`` runs them (its
        variants and runner): samples/s of each and tp 2's share of DDP's per-GPU rate."""
        if self.gpus < TP_GPUS:
            self.skipped.append(f"tp (it needs {TP_GPUS} GPUs, this machine has {self.gpus})")
            print(f"[tp] skipped: it needs {TP_GPUS} GPUs, this machine has {self.gpus}", flush=True)
            return
        suite = argparse.Namespace(suite="tp", gpus_max=TP_GPUS, config="", steps=16, epochs=2, data_path="",
                                   entry="train.py", extra=" ".join(self.extra),
                                   expdir=str(Path(self.args.expdir).absolute() / "tp"))
        rows: list[dict] = []
        for name, n, args in multi_gpu.tp(suite):
            if name in TP_METRICS:
                row = multi_gpu.run(suite, rows, name, n, args, multi_gpu.validation_every(suite), self.run_fn)
                self.metrics[TP_METRICS[name]] = self.checked("tp", row)["samples_per_s"]
        ddp, tp2 = rows
        self.metrics[TP_SHARE] = tp2["per_gpu"] / ddp["per_gpu"]


def run_checkpoint_benchmark(args: list[str], folder: Path) -> list[dict]:
    """``benchmarks/checkpoint.py`` with ``args`` (train.py options) on one process; its rows.

    Raises:
        UserError: it failed.
    """
    out = folder / "checkpoint.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "checkpoint.py"), *args, "--dir", str(folder / "ckpt"),
           "--steps", "5", "--async_steps", "5", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise UserError(f"benchmarks/checkpoint.py failed (exit status {proc.returncode}): "
                        f"{' '.join((proc.stdout + proc.stderr).split())[-300:]}")
    return json.loads(out.read_text())["results"]


# ---------------------------------------------------------------- comparing (pure)
def compare(metrics: dict[str, float], reference: dict[str, float], tolerance: float) -> list[dict]:
    """One row per measured metric: its value, the reference's, the relative change and the verdict
    (``ok``, ``better``, ``REGRESSED``, or ``new`` without a reference value)."""
    rows = []
    for name, value in metrics.items():
        ref = reference.get(name)
        row = {"metric": name, "value": value, "reference": ref, "change": None, "verdict": "new"}
        if ref is not None:
            change = (value - ref) / abs(ref) if ref else 0.0
            worse = -change if not lower_is_better(name) else change
            slack = lower_is_better(name) and value - ref <= STALL_SLACK_S
            row["change"] = change
            row["verdict"] = ("REGRESSED" if worse > tolerance and not slack else
                              "better" if -worse > tolerance else "ok")
        rows.append(row)
    return rows


def read_reference(path: Path, device: str) -> dict[str, float] | None:
    """The reference's metrics, or None when ``path`` does not exist.

    Raises:
        UserError: it is not this script's JSON, or it was measured on another kind of device.
    """
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        metrics, theirs = saved["metrics"], saved["device"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--reference {path} is not a JSON written by benchmarks/check.py ({exc})") from None
    if gpu_slug(theirs) != gpu_slug(device):
        raise UserError(f"--reference {path} was measured on {theirs}, this is {device}; pass the reference of "
                        "this kind of GPU (or none: the first run makes one)")
    return metrics


# ---------------------------------------------------------------- command line
def parser() -> ArgumentParser:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                        usage="%(prog)s [--data_path DIR] [options] [-- train.py arguments]")
    ap.add_argument("--data_path", help="data of the real shape (see above); not needed for --only tp")
    ap.add_argument("--config", default="short_opt")
    ap.add_argument("--amp_modes", nargs="+", default=["bf16", "bf16_pure"], choices=["bf16", "bf16_pure"],
                    help="bf16 modes whose compute ceiling is measured (default: bf16 bf16_pure)")
    ap.add_argument("--only", nargs="+", default=list(MEASUREMENTS), choices=MEASUREMENTS)
    ap.add_argument("--tolerance", type=float, default=0.05, help="relative change for the worse that counts")
    ap.add_argument("--reference", help="reference JSON (default benchmarks/results/<gpu>_check.json)")
    ap.add_argument("--expdir", default="/tmp/check_runs")
    ap.add_argument("--out", default="benchmarks/results/check.json")
    return ap


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


def steps_per_epoch(config: str, extra: list[str]) -> int:
    """Optimizer steps of one epoch of ``config`` with ``extra`` (the runs' epoch length).

    Raises:
        UserError: a bad config name, key or value.
    """
    from utils.config.loading import DEFAULT_YAML, load_config, parse_overrides
    cfg = load_config(DEFAULT_YAML, config, parse_overrides(extra))
    return max(1, (cfg.data.limit_nsamples or 512) // cfg.optim.global_batch_size)


def main(argv: list[str], run: Callable = run_variant, checkpoint: Callable | None = None,
         gpus: int | None = None) -> bool:
    """Measure, compare, print and save; True when something regressed (see the module docstring). ``gpus``:
    the GPUs to count on (default: those visible)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser().parse_args(argv[:cut]), argv[cut + 1:]
    needs_data = [name for name in args.only if name in NEEDS_DATA]
    if needs_data and args.data_path is None:
        raise UserError(f"{', '.join(needs_data)} need --data_path (data of the real shape; see --help)")
    if needs_data and not Path(args.data_path).is_dir():
        raise UserError(f"--data_path {args.data_path} is not a folder; generate data first (see --help)")
    args.steps_per_epoch = steps_per_epoch(args.config, extra)
    device = device_name()
    ref_path = Path(args.reference or ROOT / "benchmarks" / "results" / f"{gpu_slug(device)}_check.json")
    reference = read_reference(ref_path, device)  # before any run: a wrong reference wastes no GPU time
    measure = Measure(args, extra, run, checkpoint, gpu_count() if gpus is None else gpus)
    results = Results(Path(args.out), command=" ".join([sys.executable, __file__, *argv]), config=args.config,
                      amp_modes=args.amp_modes, reference_path=str(ref_path), metrics=measure.metrics)
    failed = []
    try:
        for name in MEASUREMENTS:  # in this order: e2e and fp8 use the ceilings
            if name in args.only:
                try:
                    getattr(measure, name)()
                except UserError as exc:  # the other measurements go on
                    failed.append(f"{name} ({exc})")
                    print(f"[{name}] failed: {exc}", flush=True)
    finally:
        results.extend(measure.rows)
        rows = compare(measure.metrics, reference or {}, args.tolerance)
        results.meta.update(comparison=rows, failed=failed, skipped=measure.skipped)
        results.save()
    print(table(rows, [("metric", "metric", "s"), ("measured", "value", ".4g"), ("reference", "reference", ".4g"),
                       ("change", "change", "+.1%"), ("verdict", "verdict", "s")]))
    if reference is None:
        print(f"no reference for this GPU at {ref_path}: copy {args.out} there to make this run the reference")
    regressed = [r["metric"] for r in rows if r["verdict"] == "REGRESSED"]
    print(f"regressed (more than {args.tolerance:.0%} worse than {ref_path.name}): {', '.join(regressed)}" if regressed
          else "nothing regressed")
    print(f"saved {args.out}")
    if failed:
        raise UserError(f"{len(failed)} measurement(s) failed: {'; '.join(failed)}")
    return bool(regressed)


def cli(argv: list[str]) -> int:
    regressed = []
    status = exit_status(lambda: regressed.append(main(argv)))
    return EXIT_REGRESSED if status == 0 and any(regressed) else status


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
