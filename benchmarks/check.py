r"""Regression guard: rerun the headline measurements on this GPU and compare them with its stored reference.

Run by hand on one GPU (two for ``tp``, ``tp_async``, ``cp`` and ``fp8_zero3``, two or more for ``scaling``), never in
CI (it times real training). With data of the real shape:

    python -m tools.make_synthetic_data --out /tmp/full --channels 20 --img_size 360 720 --train_years 4 \
        --valid_years 1 --steps_per_year 140 --workers 16 --overwrite
    python benchmarks/check.py --data_path /tmp/full --out $OUT/h100_check.json
    python benchmarks/check.py --only tp tp_async cp --out $OUT/h100_check_tp.json   # on 2 GPUs; no data needed
    python benchmarks/check.py --data_path /tmp/full --only scaling --out $OUT/h100x2_check_scaling.json  # 2+ GPUs
    python benchmarks/check.py --data_path /tmp/full --only fp8_zero3 --out $OUT/h100x2_check_fp8_zero3.json  # 2 GPUs

The measurements (``--only`` picks some), in the order they run, each a ``train.py`` run of two epochs of
``--config`` (default ``short_opt``; its second epoch is reported) or, for the checkpoint stall,
``benchmarks/checkpoint.py``:

* ``ceiling``: compute only (``--data_loader_config synthetic``), once per ``--amp_modes`` mode: samples/s;
* ``e2e``: end to end with the native loader (8 workers) on ``--data_path``, in the mode of the highest
  ceiling (the ceiling of the same precision): samples/s and its share of that ceiling;
* ``fp8``: compute only with ``--amp_mode fp8``: samples/s and the ratio to the highest bf16 ceiling;
* ``modes``: rollout training (K 2), 3 forcings and the ensemble CRPS (2 members, 4 noise fields), each compute
  only in the precision of the highest ceiling and compiled as ``--config`` is (``short_opt``: compiled):
  samples/s (initial states) and the share of that ceiling, the mode's cost;
* ``fp8_vit2b``: ``vit_2b`` at local batch 4, compute only, in ``bf16_pure`` and in ``fp8`` with the default
  recipe and with rowwise scaling (fp8 attention on, as by default: head dim 128): each one's samples/s, the
  fp8 runs' ratio to bf16_pure (the 1.3x goal of round 5) and each run's train loss after 16 steps (lower is
  better: speed must not hide a worse loss, nor a divergence, as fp8 attention's at step 9 before its keys were
  centred);
* ``tp``: on 2 GPUs, ``mp`` with DDP and with tp 2 (the variants of ``benchmarks/multi_gpu.py --suite tp
  --gpus_max 2``, run by its runner): both samples/s and tp 2's share of DDP's per-GPU rate (the tensor-parallel
  overlap of docs/speed.md). With fewer GPUs it is skipped, and says so; so are the next three.
* ``tp_async``: the same with torch's asynchronous tensor parallelism (``--async_tp true``), with the sequence-
  parallel gradient all-reduces bucketed (``--sp_grad_bucketing true``) and with tp 2 without sequence
  parallelism: each one's samples/s and share of DDP;
* ``cp``: cp 2 with the key/value all-gather and with the ring (``--cp_attention ring``): the same;
* ``fp8_zero3``: on 2 GPUs, ``vit_2b`` with ZeRO-3 at local batch 4, compute only, in bf16_pure and in fp8 with
  float8 all-gather (the default) and without (``--fp8_all_gather false``): as ``fp8_vit2b`` (samples/s, ratio
  to bf16_pure, train loss);
* ``scaling``: on every GPU of this machine (2 or more), DDP weak scaling of ``--config``, compute only, in the
  precision of the highest ceiling, local batch that of one GPU, ``--bucket_cap_mb 200``: samples/s and its
  share of n x the one-GPU ceiling; then the ceiling run on each of the n GPUs at the same time, one process a
  GPU: the slowest over the fastest (the GPUs' spread, which moves the share of n x one GPU's ceiling by as much)
  and DDP's share of their sum (what DDP itself loses, each GPU at its own pace and the host shared alike);
* ``checkpoint``: the training stall of a sync and of an async sharded save (the second of each kind). It runs
  last: on H200s the bf16 ceiling run right after it was 13-15 % slow, twice (docs/speed.md, round 5r). Round 5s
  traced that to one step stopped for 0.68 s, the length of a full collection of Python's garbage after a compile,
  which ``--gc_freeze`` (on by default) now keeps short.

Within a measurement of several runs (``modes``, ``fp8_vit2b``, ``tp_async``, ``cp``, ``fp8_zero3``) a failed run
is named and the runs that do not need it go on (the baselines, bf16_pure and DDP, are needed by the others). The
DDP run of ``mp`` that ``tp``, ``tp_async`` and ``cp`` compare with runs once per invocation. A metric missing
from the reference is reported as new: the H200 reference holds every measurement (``scaling`` at 4 GPUs;
``fp8_vit2b``'s rowwise run through ``--resume``); the H100 one ``ceiling``, ``e2e``, ``fp8``, ``checkpoint``,
``tp``, ``modes``, ``fp8_vit2b`` and ``scaling`` (but not its ceilings at once), and in part ``tp_async`` (async
tp).

Each metric is compared with the same metric of the reference, ``benchmarks/results/<gpu>_check.json``
(``<gpu>`` from the device name: h100, h200, ...; ``--reference`` names another), an earlier output of this
script on the same kind of GPU: a change for the worse of more than ``--tolerance`` (relative; stalls
also need to grow by more than ``STALL_SLACK_S``) is a regression. Prints a table and what regressed,
writes JSON (``--out``; copy it to the reference path to make it the next reference), and exits with
status 4 when something regressed. A failed run is reported and the other measurements go on; the script
then exits 2 with an ``error:`` line naming it. Measure a flagged regression again before looking for its
cause in the code, and run ``--only checkpoint`` after the others when you run them one by one. Arguments
after ``--`` go to every run.

The JSON is rewritten (atomically) after each measurement, so a device call's time limit loses only the
measurement under way: SIGTERM (``timeout``'s), SIGUSR1 or Ctrl-C stops the script at once, the run in flight
killed, with the finished measurements saved and the rest listed as ``unfinished`` (exit 75). ``--resume JSON``
goes on from such an output (or one with failed runs): each train.py run (and the checkpoint benchmark) that
succeeded there is kept, its row marked ``kept_from``, and only the others run. The runs of a measurement are then
compared across two invocations, so a call's limit need not fit the whole of ``fp8_vit2b`` (about 650 s on an
H200). The earlier output must be of this kind of GPU, with the same ``--config``, ``--amp_modes``, ``--data_path``
and train.py arguments; else the script stops before any run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import multi_gpu  # noqa: E402
from benchmarks.check_files import SAVES, gpu_slug, keeping, read_reference, read_resumed  # noqa: E402
from benchmarks.common import ROOT, Results, kill_running, one_line, run_variant, succeeded_row, table  # noqa: E402
from utils.core.errors import ArgumentParser, UserError, run_cli  # noqa: E402
from utils.core.signals import StopOnSignal  # noqa: E402

# the order they run in: the checkpoint stall last (the module docstring says why)
MEASUREMENTS = ("ceiling", "e2e", "fp8", "modes", "fp8_vit2b", "tp", "tp_async", "cp", "fp8_zero3", "scaling",
                "checkpoint")
# tp, tp_async and cp run multi_gpu.py's synthetic batches
NEEDS_DATA = ("ceiling", "e2e", "fp8", "modes", "fp8_vit2b", "checkpoint", "fp8_zero3", "scaling")
TP_GPUS = 2
TP_METRICS = {"mp_tp1_cp1": "mp DDP 2 GPUs samples/s", "mp_tp2_cp1": "mp tp 2 samples/s"}  # multi_gpu.py's names
TP_SHARE = "mp tp 2 / DDP per GPU"
DDP_VARIANT = "mp_tp1_cp1"
# the two-GPU measurements: multi_gpu.py --suite tp variants (besides DDP) -> the label of their metrics
TWO_GPU = {"tp": {"mp_tp2_cp1": "mp tp 2"},
           "tp_async": {"mp_tp2_cp1_async": "mp tp 2 async", "mp_tp2_cp1_buckets": "mp tp 2 sp grad buckets",
                        "mp_tp2_cp1_nosp": "mp tp 2 without sp"},
           "cp": {"mp_tp1_cp2": "mp cp 2", "mp_tp1_cp2_ring": "mp cp 2 ring"}}
# the training modes' extra train.py arguments (measurement modes), by the label of their metrics
MODES = {"rollout K2": ["--train_rollout_steps", "2"],
         "forcings 3": ["--forcings", "[cos_solar_zenith_angle,sin_local_time,cos_local_time]"],
         "ensemble crps M2": ["--noise_channels", "4", "--loss", "crps", "--ensemble_members", "2"]}
VIT2B_BATCH, VIT2B_STEPS = 4, 8  # local batch and steps per epoch of fp8_vit2b
VIT2B_FP8 = {"fp8": [], "fp8 rowwise": ["--fp8_recipe", "rowwise"]}  # fp8_vit2b's fp8 runs: extra arguments
VIT2B_ZERO3 = {"fp8": [], "fp8 bf16 all-gather": ["--fp8_all_gather", "false"]}  # fp8_zero3's
SCALING_BUCKET_MB = "200"  # the measured choice for short on one node (docs/speed.md, round 5)
SYNTHETIC = ["--data_loader_config", "synthetic"]
NATIVE = ["--data_loader_config", "pytorch", "--num_data_workers", "8"]
# a stall must grow by more than this too: the async stall spanned 0.22-0.46 s over 11 runs on three H200s (round 5s),
# and 0.15 s lost to each save of a run that saves every 30 minutes is less than 0.01 % of its time
STALL_SLACK_S = 0.15
EXIT_REGRESSED = 4


def lower_is_better(metric: str) -> bool:
    return metric.endswith((" s", " loss"))


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
        self.ddp: dict | None = None  # the DDP row of mp on 2 GPUs (tp, tp_async, cp)

    def checked(self, name: str, row: dict, run: str | None = None) -> dict:
        """Keep ``row`` (of measurement ``name``; of the run named ``run``); raises UserError when its run failed."""
        self.rows.append({"measurement": name, **row})
        return succeeded_row(row, row.get("variant", run or name), f"; its output is in {self.args.out}")

    def train(self, name: str, args: list[str], config: str | None = None, steps: int | None = None,
              gpus: int = 1, measurement: str | None = None) -> dict:
        """Two epochs of ``config`` (default ``--config``; ``steps`` per epoch, default its own) with ``args``, on
        ``gpus`` GPUs (more than 1: torchrun); the row, kept under ``measurement`` (default ``name``)."""
        return self.checked(measurement or name, self.launch(name, args, config, steps, **multi_gpu.ranks_launch(gpus)),
                            name)

    def launch(self, name: str, args: list[str], config: str | None = None, steps: int | None = None,
               **launch) -> dict:
        """:meth:`train`'s run, unchecked (``launch``: ``run_variant``'s launcher and env)."""
        a = self.args
        common = ["--config", config or a.config, "--data_path", str(Path(a.data_path).absolute()), "--num_iters",
                  str(2 * (steps or a.steps_per_epoch)), "--valid_every", "2", "--log_every", "1000"]
        return self.run_fn(name, common + args + self.extra, Path(a.expdir).absolute(), **launch)

    def at_once(self, name: str, args: list[str], n: int, measurement: str) -> list[dict]:
        """The one-GPU run ``args`` on each of this machine's ``n`` GPUs at the same time (one process a GPU,
        ``CUDA_VISIBLE_DEVICES`` of the visible ones), named ``<name>_gpu<i>``: the rows, in GPU order. A stop
        kills all of them."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",")[:n] if visible else [str(i) for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            try:
                rows = list(pool.map(lambda i: self.launch(f"{name}_gpu{i}", args, env={
                    "CUDA_VISIBLE_DEVICES": ids[i]}), range(n)))
            except BaseException:  # a stop reaches the main thread only: the other threads' runs go too
                kill_running()
                raise
        return [self.checked(measurement, row, f"{name}_gpu{i}") for i, row in enumerate(rows)]

    def best_mode(self) -> str:
        """The precision of the highest ceiling measured (the first of ``--amp_modes`` without one)."""
        ceilings = self.ceilings()
        return max(ceilings, key=ceilings.get) if ceilings else self.args.amp_modes[0]

    def each(self, measurement: str, runs: list[Callable[[], None]]) -> None:
        """Run every one of ``runs`` (a measurement of several runs), going on after a failed one; then raise
        one UserError naming the failures."""
        failed = []
        for run in runs:
            try:
                run()
            except UserError as exc:
                failed.append(str(exc))
                print(f"[{measurement}] {exc}", flush=True)
        if failed:
            raise UserError("; ".join(failed))

    def skip_below(self, measurement: str, gpus: int) -> bool:
        """True (and said, and recorded) when this machine has fewer than ``gpus`` GPUs."""
        if self.gpus >= gpus:
            return False
        self.skipped.append(f"{measurement} (it needs {gpus} GPUs, this machine has {self.gpus})")
        print(f"[{measurement}] skipped: it needs {gpus} GPUs, this machine has {self.gpus}", flush=True)
        return True

    def ceilings(self) -> dict[str, float]:
        return {m: self.metrics[f"ceiling {m} samples/s"] for m in self.args.amp_modes
                if f"ceiling {m} samples/s" in self.metrics}

    def ceiling(self) -> None:
        for mode in self.args.amp_modes:
            row = self.train(f"ceiling_{mode}", SYNTHETIC + ["--amp_mode", mode])
            self.metrics[f"ceiling {mode} samples/s"] = row["samples_per_s"]

    def e2e(self) -> None:
        ceilings = self.ceilings()
        mode = self.best_mode()
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

    def modes(self) -> None:
        """Each training mode of :data:`MODES`, compute only, in the precision of the highest ceiling: samples/s
        and the share of that ceiling."""
        mode = self.best_mode()
        ceiling = self.ceilings().get(mode)

        def one(label: str, extra: list[str]) -> Callable[[], None]:
            def run() -> None:
                row = self.train(f"mode_{label.replace(' ', '_')}", SYNTHETIC + ["--amp_mode", mode, *extra],
                                 measurement="modes")
                self.metrics[f"{label} samples/s"] = row["samples_per_s"]
                if ceiling:
                    self.metrics[f"{label} / ceiling"] = row["samples_per_s"] / ceiling
            return run
        self.each("modes", [one(label, extra) for label, extra in MODES.items()])

    def fp8_vit2b(self) -> None:
        self.vit2b_fp8("fp8_vit2b", "vit_2b", [], VIT2B_FP8, gpus=1)

    def fp8_zero3(self) -> None:
        if not self.skip_below("fp8_zero3", TP_GPUS):
            self.vit2b_fp8("fp8_zero3", "vit_2b ZeRO-3", ["--fsdp", "zero3"], VIT2B_ZERO3, gpus=TP_GPUS)

    def vit2b_fp8(self, measurement: str, prefix: str, parallel: list[str], fp8_runs: dict[str, list[str]],
                  gpus: int) -> None:
        """``vit_2b`` at local batch :data:`VIT2B_BATCH` on ``gpus`` GPUs with ``parallel``, compute only:
        bf16_pure, then each fp8 run of ``fp8_runs`` (label -> extra arguments): samples/s, train loss and each
        fp8 run's ratio to bf16_pure, as metrics named ``<prefix> <label> ...``."""
        shape = ["--local_batch_size", str(VIT2B_BATCH), "--limit_nsamples", str(gpus * VIT2B_BATCH * VIT2B_STEPS)]

        def train(label: str, args: list[str]) -> float:
            row = self.train(f"{measurement}_{label.replace(' ', '_')}", SYNTHETIC + parallel + shape + args,
                             config="vit_2b", steps=VIT2B_STEPS, gpus=gpus, measurement=measurement)
            self.metrics[f"{prefix} {label} samples/s"] = row["samples_per_s"]
            self.metrics[f"{prefix} {label} train loss"] = row["loss/train"]
            return row["samples_per_s"]
        bf16 = train("bf16_pure", ["--amp_mode", "bf16_pure"])

        def one(label: str, args: list[str]) -> Callable[[], None]:
            def run() -> None:
                self.metrics[f"{prefix} {label} / bf16_pure"] = train(label, ["--amp_mode", "fp8", *args]) / bf16
            return run
        self.each(measurement, [one(label, args) for label, args in fp8_runs.items()])

    def scaling(self) -> None:
        """DDP on every GPU of this machine (2 or more), the one-GPU ceiling's run per GPU: samples/s and its
        share of n x that ceiling (measured here first when ``ceiling`` did not run); then the ceiling on all n
        GPUs at once (:meth:`at_once`): their spread and DDP's share of their sum."""
        n = self.gpus
        if self.skip_below("scaling", 2):
            return
        mode = self.best_mode()
        if mode not in self.ceilings():
            self.metrics[f"ceiling {mode} samples/s"] = self.train(f"ceiling_{mode}", SYNTHETIC + [
                "--amp_mode", mode], measurement="scaling")["samples_per_s"]
        a = self.args
        row = self.train(f"scaling_{n}gpu", SYNTHETIC + [
            "--amp_mode", mode, "--bucket_cap_mb", SCALING_BUCKET_MB, "--local_batch_size", str(a.global_batch),
            "--limit_nsamples", str(n * a.global_batch * a.steps_per_epoch)], gpus=n, measurement="scaling")
        self.metrics[f"DDP {n} GPUs samples/s"] = row["samples_per_s"]
        self.metrics[f"DDP {n} GPUs / {n} x ceiling"] = row["samples_per_s"] / (n * self.ceilings()[mode])
        # each GPU's own pace, the host shared as under DDP: the share DDP itself loses, GPU spread aside
        alone = [r["samples_per_s"] for r in self.at_once(f"ceiling_{mode}", SYNTHETIC + ["--amp_mode", mode], n,
                                                          "scaling")]
        self.metrics[f"{n} one-GPU ceilings at once, slowest / fastest"] = min(alone) / max(alone)
        self.metrics[f"DDP {n} GPUs / sum of {n} one-GPU ceilings at once"] = row["samples_per_s"] / sum(alone)

    def checkpoint(self) -> None:
        a = self.args
        args = ["--config", a.config, *SYNTHETIC, "--amp_mode", a.amp_modes[0], *self.extra]
        rows = {r["what"]: r for r in self.checkpoint_fn(args, Path(a.expdir).absolute() / "checkpoint")}
        self.rows.extend({"measurement": "checkpoint", **r} for r in rows.values())
        for metric, what in SAVES.items():
            if what not in rows:
                raise UserError(f"benchmarks/checkpoint.py gave no row '{what}'")
            self.metrics[metric] = rows[what]["stall_s"]


    def two_gpu(self, measurement: str) -> None:
        """``mp`` with DDP and with the variants of :data:`TWO_GPU` ``[measurement]`` on 2 GPUs, as ``multi_gpu.py
        --suite tp --gpus_max 2`` runs them (its variants and runner): each one's samples/s and share of DDP's
        per-GPU rate. The DDP run is shared by the measurements of one invocation."""
        if self.skip_below(measurement, TP_GPUS):
            return
        suite = argparse.Namespace(suite="tp", gpus_max=TP_GPUS, config="", steps=16, epochs=2, data_path="",
                                   entry="train.py", extra=" ".join(self.extra),
                                   expdir=str(Path(self.args.expdir).absolute() / "tp"))
        variants = {name: (n, args) for name, n, args in multi_gpu.tp(suite)}

        def measure(name: str) -> dict:
            n, args = variants[name]
            return self.checked(measurement, multi_gpu.run(suite, [], name, n, args, multi_gpu.validation_every(suite),
                                                           self.run_fn))
        if self.ddp is None:
            self.ddp = measure(DDP_VARIANT)
            self.metrics[TP_METRICS[DDP_VARIANT]] = self.ddp["samples_per_s"]

        def one(name: str, label: str) -> Callable[[], None]:
            def run() -> None:
                row = measure(name)
                self.metrics[f"{label} samples/s"] = row["samples_per_s"]
                self.metrics[f"{label} / DDP per GPU"] = row["per_gpu"] / self.ddp["per_gpu"]
            return run
        self.each(measurement, [one(name, label) for name, label in TWO_GPU[measurement].items()])

    def tp(self) -> None:
        self.two_gpu("tp")

    def tp_async(self) -> None:
        self.two_gpu("tp_async")

    def cp(self) -> None:
        self.two_gpu("cp")


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
                        f"{one_line(proc.stdout + proc.stderr)}")
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
            slack = name.endswith(" s") and value - ref <= STALL_SLACK_S  # timer noise: stalls only
            row["change"] = change
            row["verdict"] = ("REGRESSED" if worse > tolerance and not slack else
                              "better" if -worse > tolerance else "ok")
        rows.append(row)
    return rows


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
    ap.add_argument("--resume", metavar="JSON", help="an earlier --out of the same settings, stopped or failed: its "
                    "finished runs are kept, not run again (a device call's time limit cut it short)")
    return ap


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


def steps_per_epoch(config: str, extra: list[str]) -> tuple[int, int]:
    """Optimizer steps of one epoch of ``config`` with ``extra`` (the runs' epoch length), and its global batch.

    Raises:
        UserError: a bad config name, key or value.
    """
    from utils.config.loading import DEFAULT_YAML, load_config, parse_overrides
    cfg = load_config(DEFAULT_YAML, config, parse_overrides(extra))
    return max(1, (cfg.data.limit_nsamples or 512) // cfg.optim.global_batch_size), cfg.optim.global_batch_size


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
    args.steps_per_epoch, args.global_batch = steps_per_epoch(args.config, extra)
    device = device_name()
    ref_path = Path(args.reference or ROOT / "benchmarks" / "results" / f"{gpu_slug(device)}_check.json")
    reference = read_reference(ref_path, device)  # before any run: a wrong reference wastes no GPU time
    settings = {"config": args.config, "amp_modes": args.amp_modes, "train_args": extra,
                "data_path": args.data_path and str(Path(args.data_path).absolute())}
    if args.resume:
        run, checkpoint = keeping(run, checkpoint or run_checkpoint_benchmark, Path(args.resume),
                                  *read_resumed(Path(args.resume), device, settings))
    measure = Measure(args, extra, run, checkpoint, gpu_count() if gpus is None else gpus)
    results = Results(Path(args.out), command=" ".join([sys.executable, __file__, *argv]), **settings,
                      reference_path=str(ref_path), metrics=measure.metrics)
    # in MEASUREMENTS' order: e2e, fp8, modes and scaling use the ceilings
    failed, pending = [], [name for name in MEASUREMENTS if name in args.only]
    rows = save(results, measure, reference, args.tolerance, failed, pending)
    try:
        while pending:
            try:
                getattr(measure, pending[0])()
            except UserError as exc:  # the other measurements go on
                failed.append(f"{pending[0]} ({exc})")
                print(f"[{pending[0]}] failed: {exc}", flush=True)
            pending.pop(0)
            rows = save(results, measure, reference, args.tolerance, failed, pending)
    finally:  # a signal (StopOnSignal) stopped a measurement: keep its finished runs, name what did not finish
        if pending:
            save(results, measure, reference, args.tolerance, failed, pending)
            print(f"saved {args.out}; unfinished: {', '.join(pending)}", flush=True)
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


def save(results: Results, measure: Measure, reference: dict[str, float] | None, tolerance: float,
         failed: list[str], pending: list[str]) -> list[dict]:
    """Write what has been measured so far to ``--out`` (the rows, the comparison with the reference, and the
    failed, skipped and unfinished measurements); the comparison rows."""
    results[:] = measure.rows
    rows = compare(measure.metrics, reference or {}, tolerance)
    results.meta.update(comparison=rows, failed=failed, skipped=measure.skipped, unfinished=pending)
    results.save()
    return rows


def cli(argv: list[str]) -> int:
    """``main`` as a command: SIGTERM (a time limit's ``timeout``), SIGUSR1 or Ctrl-C stops it at once, with
    what was measured saved (exit 75); a regression exits :data:`EXIT_REGRESSED`."""
    regressed = []
    with StopOnSignal():
        status = run_cli(lambda args: regressed.append(main(args)), argv)
    return EXIT_REGRESSED if status == 0 and any(regressed) else status


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
