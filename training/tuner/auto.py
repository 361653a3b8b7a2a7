"""``train.py --local_batch_size auto``: the local batch (and scaled learning rate) a run trains with.

A run that continues an earlier one keeps what the tuner chose when it started (its
``tune_batch_size.json``); a new run tunes quickly on its own setup (``tune(quick=True)``: a few steps per
trial, nothing measured below the boundary) and trains with the ``max-throughput`` choice. The tuner's
table, JSON and PNG then go into the run directory (:class:`TuneReport`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from distributed.world import World, main_decides
from training.loop.rollout import max_rollout_steps
from training.loop.run_dir import find_run
from training.loop.trainer import ExtraComponents
from training.tuner.tune import (AUTO_OBJECTIVE, TUNE_FILE, TUNER_ONLY, TuneResult, journal_path, out_path,
                                 recorded_choice, summary, tune, with_batch, write_outputs)
from utils.config.schema import Config
from utils.config.types import AUTO
from utils.core.component import Component
from utils.core.errors import NothingToDo, UserError
from utils.core.logs import setup_logging
from utils.data.loaders import build_data

log = logging.getLogger(__name__)


def reject_tuner_keys(argv: list[str], cfg: Config) -> None:
    """The tuner's own keys on a ``train.py`` command line do something only with ``--local_batch_size auto``.

    Raises:
        UserError: such keys given without it (they would be ignored), naming them.
    """
    given = sorted({arg.split("=", 1)[0][2:] for arg in argv if arg.startswith("--")} & set(TUNER_ONLY))
    if given and cfg.optim.local_batch_size != AUTO:
        flags = " ".join(f"--{k}" for k in given)
        raise UserError(f"{flags}: tuner keys, which train.py uses only with --local_batch_size auto; drop them, add "
                        "--local_batch_size auto, or run python -m tools.tune_batch_size")


class TuneReport(Component):
    """Logs the quick tuning's table and choice when the run starts, and keeps its JSON and PNG in the run
    directory (rank 0)."""

    def __init__(self, result: TuneResult, run_dir: Path, world: World):
        self.result, self.run_dir, self.world = result, run_dir, world

    def start(self, state) -> None:
        log.info("local batch auto: the tuner's %s choice\n%s", AUTO_OBJECTIVE, summary(self.result))
        if self.world.is_main:
            write_outputs(self.result, self.run_dir / TUNE_FILE)


def resolve_local_batch(cfg: Config, world: World) -> tuple[Config, ExtraComponents | None]:
    """``cfg`` with a number for ``local_batch_size auto`` (collective), and the components that report the
    tuning in the run directory (None when nothing was tuned). Any other ``cfg`` is returned as it is."""
    if cfg.optim.local_batch_size != AUTO:
        return cfg, None
    setup_logging(None, world.rank)  # the trials' progress, before the run's log file exists
    run = cfg.logging, cfg.checkpoint.resume, cfg.name, world.world_size, cfg.flat(), world.device.type == "cuda"
    prior = main_decides(lambda: recorded_choice(find_run(*run)), world, (UserError, NothingToDo))
    if prior is not None:
        log.info("local batch auto: %d, as tuned when this run started", prior[0])
        return with_batch(cfg, *prior), None
    # the data is checked before minutes of tuning (the trials use synthetic batches by default)
    build_data(cfg.data, 1, world.dp_rank, world.dp, world.device, cfg.optim.seed,
               train_target_steps=max_rollout_steps(cfg.optim)).close()
    tuned = tune(cfg, world, [], journal_path(out_path(cfg)), quick=True)
    choice = tuned.choices[AUTO_OBJECTIVE]
    resolved = with_batch(cfg, choice.local_batch_size, tuned.lr(AUTO_OBJECTIVE))
    return resolved, lambda run_dir: [TuneReport(tuned, run_dir, world)]
