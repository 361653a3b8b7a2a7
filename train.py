"""Train the ERA5 ViT: one entry point for one GPU, DDP, FSDP and (via train_mp.py) tensor/context parallel.

    python train.py --config short [--<key> <value> ...]
    python train.py --help [KEY] | --list-configs | --print-config
    python train.py --config vit_2b --fsdp zero3 --simulate_world_size 256 --local_batch_size 4   (docs/planning.md)
    torchrun --nproc_per_node=4 train.py --config bs64_opt
    sbatch submit_pm.sh --config=short

Order: parse the config, validate it against the launch (world size, GPU and its compute capability),
join the other ranks, then train (``training/loop/trainer.py``). Nothing is written to disk before the config,
the launch and the data have been checked. Expected errors (bad config, data or environment) print one
line, ``error: ...``, on every rank and exit with status 2.
"""

from __future__ import annotations

from utils.core.signals import install

install()  # first: a SIGTERM, SIGUSR1 or Ctrl-C during start-up is recorded, never the default's sudden death

import sys  # noqa: E402
from functools import partial  # noqa: E402

from utils.core.errors import run_cli  # noqa: E402


def main(argv: list[str], default_config: str = "tiny", prog: str = "train.py") -> None:
    from utils.config.command_line import cli_config

    cfg = cli_config(argv, default_config, prog)
    if cfg is None:  # --help, --list-configs or --print-config
        return
    from distributed.launch import detect_launch, validation_launch
    from distributed.simulate import dry_run_wanted, simulation_config
    from distributed.world import distributed_session
    from utils.config.validate import validate
    from training.loop.trainer import run
    from training.tuner.auto import reject_tuner_keys, resolve_local_batch

    launch = detect_launch()
    if dry_run_wanted(cfg.parallel):  # a simulated job without a GPU: checked, stepped on fake tensors, its plan printed
        from training.tuner.planner import plan_job
        from training.tuner.tune import without_tuner_keys
        print(plan_job(cfg, without_tuner_keys(argv), launch), flush=True)
        return
    reject_tuner_keys(argv, cfg)
    validate(cfg, validation_launch(launch))
    cfg = simulation_config(cfg)  # a simulated rank (distributed/simulate.py) writes no checkpoint
    with distributed_session(cfg.parallel, launch) as world:
        resolved, extra = resolve_local_batch(cfg, world)
        run(resolved, world, cfg, extra)


def cli(default_config: str = "tiny", prog: str = "train.py") -> int:
    """Run :func:`main` on ``sys.argv`` (exit statuses: ``utils.core.errors.run_cli``)."""
    return run_cli(partial(main, default_config=default_config, prog=prog))


if __name__ == "__main__":
    sys.exit(cli())
