"""``evaluate.py``: score a trained run's forecasts by lead time, the WeatherBench 2 way, against persistence and climatology.

    python evaluate.py --run_dir runs/tiny/1GPU/00 --lead_steps 20
    python evaluate.py --run_dir RUN_DIR --lead_steps 40 --split valid --step 500 --init_every 4 --save_forecasts
    python evaluate.py --run_dir RUN_DIR --lead_steps 20 --ensemble_members 8   # a stochastic model's ensemble
    torchrun --nproc_per_node 4 evaluate.py --run_dir RUN_DIR --lead_steps 40   # initial times split over ranks

Loads the run's ``config.yaml`` and a checkpoint (sharded, or a single ``.pt`` file), rolls the model out
``--lead_steps`` times from every ``--init_every``-th initial time of the split (of the run's data, or of
``--data_path``, normalized with the run's statistics), and scores each lead
for the model, persistence and climatology (``training/evaluation/scoring.py``; the climatology of each valid
time from ``stats/climatology.h5`` when the data have it, else the time mean). With ``--ensemble_members N``
(a model trained with noise inputs) every initial time gets N members (``training/evaluation/ensemble_scoring.py``):
RMSE, ACC, bias and the spectra are the ensemble mean's; every run, a deterministic one as one member, also gets
the fair CRPS, ensemble-mean RMSE, spread, spread/skill ratio and rank histogram (docs/ensembles.md). Writes to
``--out`` (default ``<run_dir>/evaluation/``):

* ``scorecard.json``: ``{"lead_time": [...], "lead_time_unit": "hours", "lead_hours": [...], "channels": [...],
  "initial_times": N, "climatology": "...", "checkpoint_step": ..., "scores": {"model"|"persistence"|"climatology":
  {"rmse"|"acc"|"bias": {channel: [one value per lead]}}}, "blurring": {channel: [...]}, "spectra": {...},
  "members": N, "ensemble": {"crps"|"ensemble_mean_rmse"|"spread"|"spread_skill": {channel: [...]},
  "rank_histogram": {channel: [[count per rank] per lead]}}}``;
* ``scorecard.nc``: the same as an xarray Dataset: ``skill(metric, forecast, channel, lead_time)``,
  ``spectrum(source, channel, lead_time, wavenumber)``, ``blurring(channel, lead_time)``,
  ``ensemble_skill(ensemble_metric, channel, lead_time)``, ``rank_histogram(channel, lead_time, rank)``;
* ``scorecard.png``: RMSE, ACC and bias against lead time, and ``spectra.png``: zonal power spectra at a few
  leads against the truth, for the key channels; with N > 1, ``rank_histogram.png``;
* with ``--save_forecasts``: ``forecasts.nc`` (one file per rank under torchrun: ``forecasts_rank<r>.nc``),
  the forecasts in physical units by initial time, (member, with N > 1,) lead time, channel, latitude and
  longitude.

Lead times are in the data's own time step (hours, days, months or years). A relative ``data_path`` of the run's
config is found from the current directory or the repository root, so ``--run_dir`` works from anywhere. Ends
with a table of model vs persistence vs climatology by lead time and a summary line for every channel. Bad
input is one ``error:`` line, exit status 2, on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from utils.core.errors import ArgumentParser, UserError
from utils.core.files import output_path_type
from utils.data.layout import resolve_data_path

PROG = "evaluate.py"


def build_parser() -> ArgumentParser:
    """The CLI (usage errors are one ``error:`` line, exit status 2)."""
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", type=Path, required=True, help="run directory <expdir>/<config>/<N>GPU/<run_num>")
    p.add_argument("--lead_steps", type=int, required=True, help="rollout steps (lead times) to score, >= 1")
    p.add_argument("--split", default="valid", help="data split under the data path (default valid)")
    p.add_argument("--data_path", type=Path, default=None,
                   help="score another dataset of the same layout (held-out years, say); normalized with the "
                        "run's statistics (default: the run's data_path)")
    p.add_argument("--step", type=int, default=None, help="the sharded checkpoint of this optimizer step "
                                                           "(default: the latest complete one)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="a sharded checkpoint folder or a single .pt model file instead of --step")
    p.add_argument("--out", type=output_path_type("--out"), default=None,
                   help="output folder (default <run_dir>/evaluation)")
    p.add_argument("--init_every", type=int, default=1, help="roll out from every n-th initial time (default 1)")
    p.add_argument("--batch_size", type=int, default=None, help="initial times per batch and rank "
                                                                 "(default: the run's local batch size)")
    p.add_argument("--save_forecasts", action="store_true", help="also write the forecasts as netCDF")
    p.add_argument("--channels", default=None, help="comma-separated channels for the table and figure "
                                                     "(default: the run's key channels)")
    p.add_argument("--ensemble_members", type=int, default=1,
                   help="members per initial time, each with its own noise (a model trained with --noise_channels; "
                        "default 1)")
    return p


def check_args(args) -> None:
    """Raise UserError for out-of-range arguments (before anything is loaded)."""
    for name in ("lead_steps", "init_every", "batch_size", "ensemble_members"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name} must be at least 1, got {value}")
    if args.step is not None and args.checkpoint is not None:
        raise UserError("--step and --checkpoint both name a checkpoint; pass one of them")
    if args.checkpoint is not None and not args.checkpoint.exists():
        raise UserError(f"--checkpoint {args.checkpoint} not found; pass a checkpoint folder (checkpoints/step_*) or "
                        "a .pt file written by python -m tools.export_model")


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    check_args(args)
    import torch

    from distributed.launch import detect_launch
    from distributed.world import distributed_session
    from training.evaluation.ensemble_scoring import check_members
    from utils.config.loading import load_run_config
    from utils.config.schema import ParallelConfig
    from utils.core.logs import setup_logging

    cfg = load_run_config(args.run_dir)
    check_members(args.ensemble_members, cfg.model.noise_channels, "--ensemble_members")
    launch = detect_launch()
    # the checkpoint holds the single-GPU layout: every rank runs the plain model on its share of initial times
    parallel = ParallelConfig(rendezvous_timeout_s=cfg.parallel.rendezvous_timeout_s,
                              collective_timeout_s=cfg.parallel.collective_timeout_s)
    with distributed_session(parallel, launch) as world:
        setup_logging(None, world.rank)
        with torch.no_grad():
            evaluate(args, cfg, world)


def evaluate(args, cfg, world) -> None:
    """Roll out, score, and (rank 0) write the scorecard files and print the table."""
    import torch

    from distributed.checkpoint.export import load_checkpoint_model
    from training.evaluation.evaluator import checked_latitude_weights
    from training.evaluation.metrics import spectrum_rows
    from training.evaluation.ensemble_scoring import Ensemble
    from training.evaluation.outputs import ForecastWriter, write_rank_histogram, write_scorecard
    from training.evaluation.scoring import format_scorecard, lead_times, score_rollouts
    from utils.data.forcing_source import dataset_forcings, input_roles
    from utils.data.loaders import split_batches
    from utils.data.metadata import read_channel_units, read_metadata
    from utils.data.stats import Stats
    from utils.precision.amp import AMP_DTYPES

    device, data = world.device, cfg.data
    data = dataclasses.replace(data, data_path=str(resolve_data_path(data.data_path)))
    channels = args.channels.split(",") if args.channels else list(cfg.evaluation.key_channels)
    stats = Stats.load(Path(data.data_path) / "stats", data.n_in_channels, data.img_size, device)
    if args.data_path is not None:
        data = dataclasses.replace(data, data_path=str(args.data_path))
    check_split(Path(data.data_path), args.split)
    batches, dataset = split_batches(data, args.split, args.batch_size or default_batch(cfg.optim, world.dp),
                                     world.dp_rank, world.dp, device, target_steps=args.lead_steps,
                                     init_every=args.init_every, stats=stats)
    names, lat = read_metadata(dataset.files[0].path, data.n_in_channels, data.img_size[0])
    unknown = [ch for ch in channels if ch not in names]
    if unknown:
        raise UserError(f"--channels {','.join(unknown)}: not in the data, whose channels are {', '.join(names)}")
    key_channels = channels or names[:4]
    forcing = dataset_forcings(data, dataset, lat, device)  # what the model was trained with, for these times
    model, step = load_checkpoint_model(args.run_dir, cfg, args.step, args.checkpoint)
    model.to(device)
    # the run's autocast dtype on a GPU; a run trained with fp8 is scored in bf16 (its checkpoint holds plain
    # weights, and the plain model loads them)
    dtype = AMP_DTYPES[cfg.precision.amp_mode] if device.type == "cuda" else None
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    unit = dataset.time_step.unit
    leads = lead_times(data.dt, dataset.time_step, args.lead_steps)
    writer = ForecastWriter(dataset, stats, names, lat, leads, unit) if args.save_forecasts else None
    try:
        sums, _ = score_rollouts(model, batches, stats, checked_latitude_weights(lat, device), args.lead_steps,
                                 autocast, writer.add if writer else None,
                                 climatology=stats.sample_climatology(dataset),
                                 rows=torch.as_tensor(spectrum_rows(lat), device=device), forcing=forcing,
                                 members=Ensemble(args.ensemble_members, cfg.model.noise_channels, cfg.optim.seed))
    finally:
        batches.close()
    sums.reduce(world)
    card = sums.scorecard(stats.std, leads, names, unit, stats.climatology_source(dataset))
    out = args.out or args.run_dir / "evaluation"
    if writer is not None:
        writer.write(out / ("forecasts.nc" if world.world_size == 1 else f"forecasts_rank{world.rank}.nc"))
    if world.is_main:
        units = dict(zip(names, read_channel_units(dataset.files[0].path, len(names))))
        run = "/".join(args.run_dir.resolve().parts[-3:])
        trained = training_rollout(cfg)
        write_scorecard(card, out, key_channels, {"checkpoint_step": step, "data_path": data.data_path,
                                                  "split": args.split, "init_every": args.init_every,
                                                  "training_rollout": trained, "inputs": input_roles(data)},
                        units, run, step)
        print(f"model: {run} at step {step}, trained with {trained}; {input_roles(data)}", flush=True)
        print(format_scorecard(card, key_channels), flush=True)
        figures = "scorecard.png and spectra.png"
        if card.members > 1:
            write_rank_histogram(card, out, key_channels, run, step)
            figures = "scorecard.png, spectra.png and rank_histogram.png"
        print(f"wrote {out / 'scorecard.json'}, scorecard.nc, {figures}", flush=True)


def training_rollout(cfg) -> str:
    """How the run was trained, for comparing runs by it: ``K 1``, ``K 4`` or the curriculum ``K 1 -> 4`` (rollout
    training), and ``from <run>`` for a fine-tune (``--init_from``)."""
    o = cfg.optim
    k = f"K {o.train_rollout_steps}" + (f" -> {o.rollout_max_steps}" if o.rollout_max_steps else "")
    return f"rollout {k}" + (f", fine-tuned from {cfg.checkpoint.init_from}" if cfg.checkpoint.init_from else "")


def default_batch(optim, dp: int) -> int:
    """Initial times per batch and rank: the run's local batch size, else its global batch over ``dp`` ranks."""
    if isinstance(optim.local_batch_size, int):
        return optim.local_batch_size
    return max(1, optim.global_batch_size // dp)


def check_split(data_path: Path, split: str) -> None:
    """Raise UserError when ``data_path`` has no folder ``split``, naming the splits it has."""
    if not (data_path / split).is_dir():
        have = sorted(p.name for p in data_path.iterdir() if p.is_dir() and p.name != "stats") if data_path.is_dir() else []
        raise UserError(f"no split {split!r} in {data_path} (it has: {', '.join(have) or 'nothing'}); pass --split "
                        "with one of those, or --data_path with a dataset folder")

