r"""Skill parity of the precision modes: does a model trained in bf16_pure or fp8 forecast as well as with bf16
autocast?

Trains the ``short`` config (512 training samples, 128 iterations at global batch 16: 4 epochs, each
validated) once per precision mode and seed, every run its own ``train.py`` process (a failed run is
reported, the others go on) on the same data, with the same speed settings for every mode: fused Adam,
torch.compile, cuDNN attention, the native loader with 8 workers (``SPEED``). A mode is the
``--amp_mode`` of its runs (bf16: autocast; bf16_pure: autocast with a bf16 residual stream; fp8: float8
linears); by default bf16, bf16_pure and fp8 on seeds 0 and 1. On one GPU, data of the real shape:

    python -m tools.make_synthetic_data --out /tmp/full --channels 20 --img_size 360 720 --train_years 4 \
        --valid_years 1 --steps_per_year 140 --workers 10 --overwrite
    python benchmarks/precision_parity.py --data_path /tmp/full --out $OUT/h100_precision_parity.json

Arguments after ``--`` go to every run after the defaults, so they override them (the last value of a
key wins); the fp8-only keys (``--fp8_recipe``, ``--fp8_all_gather``) go to the fp8 runs only:
``python benchmarks/precision_parity.py --data_path /tmp/full -- --fp8_recipe rowwise``.

Compared per mode over the seeds (mean, sample std, min, max, spread = max - min), from each run's
``metrics.jsonl``: the train and valid loss after every epoch, the final valid loss and the final
latitude-weighted RMSE of every channel (the table shows the key channels), and samples/s (end to end:
these runs read data). Runs of one mode differ only by seed, so the first mode's (the reference's, bf16 by
default) seed-to-seed range [min, max] is the noise a change of precision should stay inside: for every
other mode and final metric the summary says whether its mean lies within that range, the relative
difference of the means, and how far outside the range the mean lies (signed: above is worse for a loss
or an RMSE).

Prints tables and saves JSON (``--out``): the device, torch version, this command, every run (its exact
train.py command, exit status, last-epoch record and loss curve) and the summary (:func:`summarize`).
After a failed run the script saves and prints what it has, then exits 2 with an ``error:`` line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, run_variant, table  # noqa: E402
from utils.config.loading import DEFAULT_YAML, load_config, parse_overrides  # noqa: E402
from utils.core.errors import ArgumentParser, UserError, run_cli  # noqa: E402
from utils.config.schema import FP8_KEYS  # noqa: E402

# benchmarks/throughput.py's OPT less its --amp_mode (the mode sets that), with cuDNN attention and the
# native loader: the fast settings, the same for every mode, so that only the precision differs
SPEED = ["--enable_fused", "true", "--enable_jit", "true", "--attention_backend", "cudnn",
         "--data_loader_config", "pytorch", "--num_data_workers", "8"]
# keys the benchmark sets per run: after -- they would change what is compared, or where it is found
SET_HERE = ("config", "yaml_config", "data_path", "amp_mode", "seed", "expdir", "run_num", "save_checkpoint")
CURVES = ("loss/train", "loss/valid")
SPEED_KEY = "samples_per_s"


# ---------------------------------------------------------------- the comparison (pure)
def stats(values: list[float]) -> dict:
    """One metric over seeds: the values, mean, sample std (None for one value), min, max, spread."""
    return {"values": values, "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), "spread": max(values) - min(values)}


def succeeded(run: dict) -> bool:
    """Whether the run finished with metrics (``run_variant`` adds the curve only then)."""
    return "curve" in run


def final_metrics(runs: list[dict]) -> list[str]:
    """The skill metrics compared at the end: valid loss and every channel's RMSE, in the records' order."""
    keys: dict[str, None] = {}
    for run in runs:
        keys.update((k, None) for k in run if k == "loss/valid" or k.startswith("rmse/"))
    return list(keys)


def curve_stats(runs: list[dict], key: str) -> list[dict]:
    """``key`` over seeds at each iteration that has it (an epoch without validation has no valid loss)."""
    by_iteration: dict[int, list[float]] = {}
    for run in runs:
        for point in run["curve"]:
            if point.get(key) is not None:
                by_iteration.setdefault(point["iteration"], []).append(point[key])
    return [{"iteration": it, **stats(values)} for it, values in sorted(by_iteration.items())]


def mode_summary(runs: list[dict], metrics: list[str]) -> dict:
    """One mode's seeds (finished and failed), final metrics and samples/s over seeds, and loss curves."""
    done = [r for r in runs if succeeded(r)]
    final = {}
    for key in (*metrics, SPEED_KEY):
        values = [r[key] for r in done if r.get(key) is not None]
        if values:
            final[key] = stats(values)
    return {"seeds": [r["seed"] for r in done], "failed_seeds": [r["seed"] for r in runs if not succeeded(r)],
            "final": final, "curves": {key: curve_stats(done, key) for key in CURVES}}


def relative(delta: float, reference: float) -> float | None:
    return delta / abs(reference) if reference else None


def against_range(mine: dict, reference: dict) -> dict:
    """Where a mode's final metric (:func:`stats`) lies against the reference's seed-to-seed [min, max]:
    within or not, the means' relative difference, and the signed distance of the mean outside the range
    (0 within; > 0 above the max, < 0 below the min), absolute and relative to the reference mean."""
    low, high, mean = reference["min"], reference["max"], mine["mean"]
    outside = mean - high if mean > high else mean - low if mean < low else 0.0
    return {"mean": mean, "reference_mean": reference["mean"], "reference_range": [low, high],
            "within": low <= mean <= high, "rel_diff": relative(mean - reference["mean"], reference["mean"]),
            "outside_by": outside, "outside_rel": relative(outside, reference["mean"]),
            "seeds_within": sum(low <= v <= high for v in mine["values"])}


def summarize(runs: list[dict], reference: str) -> dict:
    """The comparison of the runs: records in, summary out.

    ``runs``: ``run_variant`` rows with ``mode`` and ``seed`` added. Returns ``{"reference", "metrics"
    (the compared final metrics), "modes": {mode: mode_summary}, "parity": {mode: {metric:
    against_range}}, "speedup": {mode: mean samples/s over the reference's}}`` for every mode other than
    the reference; failed runs are left out of the statistics (listed as ``failed_seeds``).
    """
    metrics = final_metrics([r for r in runs if succeeded(r)])
    modes = {mode: mode_summary([r for r in runs if r["mode"] == mode], metrics)
             for mode in dict.fromkeys(r["mode"] for r in runs)}
    ref = modes.get(reference, {"final": {}})["final"]
    others = {mode: s["final"] for mode, s in modes.items() if mode != reference}
    parity = {mode: {m: against_range(final[m], ref[m]) for m in metrics if m in final and m in ref}
              for mode, final in others.items()}
    speedup = {mode: final[SPEED_KEY]["mean"] / ref[SPEED_KEY]["mean"]
               for mode, final in others.items() if SPEED_KEY in final and SPEED_KEY in ref}
    return {"reference": reference, "metrics": metrics, "modes": modes, "parity": parity, "speedup": speedup}


# ---------------------------------------------------------------- tables
def mean_std(s: dict) -> str:
    return f"{s['mean']:.5g}" + ("" if s["std"] is None else f" ± {s['std']:.2g}")


def percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.3g}%"  # significant digits: parity differences are small


def verdict(p: dict) -> str:
    """``within (+0.123%)`` or ``above by 0.0021 (+0.4%), means +0.9%``."""
    if p["within"]:
        return f"within ({percent(p['rel_diff'])})"
    side = "above" if p["outside_by"] > 0 else "below"
    return f"{side} by {abs(p['outside_by']):.3g} ({percent(p['outside_rel'])}), means {percent(p['rel_diff'])}"


def runs_table(runs: list[dict], channels: list[str]) -> str:
    rows = [{**r, "status": "ok" if succeeded(r) else f"failed ({r['returncode']})"} for r in runs]
    columns = [("mode", "mode", "s"), ("seed", "seed", "d"), ("train loss", "loss/train", ".5g"),
               ("valid loss", "loss/valid", ".5g"), *[(f"RMSE {c}", f"rmse/{c}", ".5g") for c in channels],
               ("samples/s", SPEED_KEY, ".1f"), ("wall s", "wall_s", ".0f"), ("status", "status", "s")]
    return table(rows, columns)


def curves_table(summary: dict) -> str:
    """Train and valid loss by iteration, each mode's mean over seeds with its spread (max - min)."""
    def label(mode: str, key: str) -> str:
        return f"{mode} {key.split('/')[1]}"  # "bf16 train"

    rows: dict[int, dict] = {}
    for mode, s in summary["modes"].items():
        for key in CURVES:
            for p in s["curves"][key]:
                rows.setdefault(p["iteration"], {"iteration": p["iteration"]})[label(mode, key)] = \
                    f"{p['mean']:.5g} ({p['spread']:.2g})"
    columns = [("iteration", "iteration", "d")] + [(label(mode, key), label(mode, key), "s")
                                                  for mode in summary["modes"] for key in CURVES]
    return table([rows[i] for i in sorted(rows)], columns)


def final_table(summary: dict, channels: list[str]) -> str:
    """Final metrics (mean ± std and [min, max] per mode) and where each mode lies against the reference."""
    ref, modes, rows = summary["reference"], summary["modes"], []
    for metric in ("loss/valid", *[f"rmse/{c}" for c in channels], SPEED_KEY):
        row = {"metric": metric}
        for mode, s in modes.items():
            if metric in s["final"]:
                st = s["final"][metric]
                row[f"{mode} mean ± std"], row[f"{mode} [min, max]"] = \
                    mean_std(st), f"[{st['min']:.5g}, {st['max']:.5g}]"
        for mode, parity in summary["parity"].items():
            if metric in parity:
                row[f"{mode} vs {ref}"] = verdict(parity[metric])
            elif metric == SPEED_KEY and mode in summary["speedup"]:
                row[f"{mode} vs {ref}"] = f"x{summary['speedup'][mode]:.2f}"
        rows.append(row)
    headers = ["metric", *[h for mode in modes for h in (f"{mode} mean ± std", f"{mode} [min, max]")],
               *[f"{mode} vs {ref}" for mode in summary["parity"]]]
    return table(rows, [(h, h, "s") for h in headers])


# ---------------------------------------------------------------- runs
def mode_args(mode: str, overrides: dict[str, str]) -> list[str]:
    """The arguments after -- for one mode's runs: all of them, less the fp8 keys outside fp8 runs (the
    schema refuses them without --amp_mode fp8, and they would change nothing there)."""
    kept = {key: value for key, value in overrides.items() if mode == "fp8" or key not in FP8_KEYS}
    return [arg for key, value in kept.items() for arg in (f"--{key}", value)]


def train_args(args, mode: str, seed: int, overrides: dict[str, str]) -> list[str]:
    """One run's train.py arguments: validate every epoch (the curves; no figures, which would be drawn during
    the next epoch and count in its samples/s), then SPEED, the mode, the overrides."""
    # absolute: train.py runs in the repository root, wherever this script was started
    return ["--config", args.config, "--data_path", str(Path(args.data_path).absolute()), "--seed", str(seed),
            "--valid_every", "1", "--log_every", "1000", "--figure_every", "0", *SPEED, "--amp_mode", mode,
            *mode_args(mode, overrides)]


def check(args, overrides: dict[str, str]) -> list[str]:
    """The configured key channels; before any run, a UserError for a bad mode, seed, config, key or value
    (the schema's own checks on every run's config) or a missing data folder."""
    fixed = [key for key in overrides if key in SET_HERE]
    if fixed:
        raise UserError(f"--{fixed[0]} after -- is set by the benchmark; use its own --config, --data_path, "
                        "--modes, --seeds or --expdir")
    fp8_only = [key for key in overrides if key in FP8_KEYS]
    if fp8_only and "fp8" not in args.modes:
        raise UserError(f"--{fp8_only[0]} after -- applies to fp8 runs only, but --modes has no fp8; add it or "
                        f"drop --{fp8_only[0]}")
    if len(set(args.modes)) < len(args.modes) or len(set(args.seeds)) < len(args.seeds):
        raise UserError("--modes and --seeds take each value once")
    if not Path(args.data_path).is_dir():
        raise UserError(f"--data_path {args.data_path} is not a folder; generate data first (see --help)")
    for mode in args.modes:
        for seed in args.seeds:
            run = parse_overrides(train_args(args, mode, seed, overrides))
            cfg = load_config(DEFAULT_YAML, run.pop("config"), run)
    return list(cfg.evaluation.key_channels)


def parser() -> ArgumentParser:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                        usage="%(prog)s [options] [-- train.py arguments]")
    ap.add_argument("--config", default="short")
    ap.add_argument("--data_path", required=True)
    ap.add_argument("--modes", nargs="+", default=["bf16", "bf16_pure", "fp8"],
                    help="--amp_mode of each mode's runs; the first is the reference (default: bf16 bf16_pure fp8)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="one run per mode and seed (default: 0 1)")
    ap.add_argument("--expdir", default="/tmp/precision_parity_runs")
    ap.add_argument("--out", default="benchmarks/results/precision_parity.json")
    return ap


def main(argv: list[str]) -> None:
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser().parse_args(argv[:cut]), argv[cut + 1:]
    overrides = parse_overrides(extra)
    configured = check(args, overrides)
    runs = Results(Path(args.out), command=" ".join([sys.executable, __file__, *argv]), config=args.config,
                   data_path=args.data_path, modes=args.modes, seeds=args.seeds, speed=SPEED, extra=extra)
    expdir = Path(args.expdir).absolute()
    for seed in args.seeds:  # modes alternate, so a slow drift of the machine touches every mode alike
        for mode in args.modes:
            row = run_variant(f"{mode}_seed{seed}", train_args(args, mode, seed, overrides), expdir)
            runs.append({"mode": mode, "seed": seed, **row})
    summary = summarize(runs, args.modes[0])
    runs.meta["summary"] = summary
    runs.save()
    channels = configured or [m[len("rmse/"):] for m in summary["metrics"] if m.startswith("rmse/")][:4]
    print("runs (last epoch)", runs_table(runs, channels), "",
          "loss by iteration: mean over seeds (max - min)", curves_table(summary), "",
          f"final metrics over seeds; 'vs {summary['reference']}': the mean against its seed-to-seed range",
          final_table(summary, channels), sep="\n")
    print(f"saved {args.out}")
    failed = [r["variant"] for r in runs if not succeeded(r)]
    if failed:
        raise UserError(f"{len(failed)} of {len(runs)} runs failed ({', '.join(failed)}); their output is in "
                        f"{args.out}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
