"""The tuner's command line (``python -m tools.tune_batch_size``): parse like ``train.py``, validate, join the
ranks, search, report; with ``--simulate_world_size N``, the planner of an N-rank job (``training/tuner/planner.py``)."""

from __future__ import annotations

import logging

PROG = "python -m tools.tune_batch_size"


def main(argv: list[str], default_config: str = "tiny", prog: str = PROG) -> None:
    from utils.config.command_line import cli_config

    cfg = cli_config(argv, default_config, prog)
    if cfg is None:  # --help, --list-configs or --print-config
        return
    from distributed.launch import detect_launch, validation_launch
    from distributed.world import distributed_session
    from training.tuner.trials import trial_config
    from training.tuner.tune import (journal_path, out_path, summary, tune, tune_combination, without_tuner_keys,
                                     write_outputs)
    from utils.config.validate import validate
    from utils.core.logs import setup_logging

    launch = detect_launch()
    if cfg.parallel.simulate_world_size:
        from training.tuner.planner import plan_job
        setup_logging(None, 0)
        print(plan_job(cfg, without_tuner_keys(argv), launch, out_path(cfg), cfg.tune.tune_start), flush=True)
        return
    # as the trials run: with synthetic batches, the configured loader (DALI, say) need not be installed here
    validate(trial_config(cfg, cfg.tune.tune_start), validation_launch(launch))
    with distributed_session(cfg.parallel, launch) as world:
        setup_logging(None, world.rank)
        out = out_path(cfg)
        search = tune if cfg.tune.tune == "batch" else tune_combination
        result = search(cfg, world, without_tuner_keys(argv), journal_path(out))
        if world.is_main:
            written = write_outputs(result, out)
            print(summary(result), flush=True)
            logging.getLogger(__name__).info("wrote %s", " and ".join(map(str, written)))
