"""Find the local batch size with the most samples/s and no cudaMalloc retries, on the real setup.

    python -m tools.tune_batch_size --config short_opt [any train.py overrides] [--out FILE.json]
    torchrun --nproc_per_node 2 -m tools.tune_batch_size --config vit_2b --fsdp zero3 ...
    torchrun --nproc_per_node 2 -m tools.tune_batch_size --config vit_2b --fsdp zero3 --tune ac_blocks \
        --global_batch_size 64
    sbatch submit_pm.sh --tune --config=short

Launched like ``train.py`` and parsed by the same config (the tuner's own keys are in the section
"batch-size tuner" of ``--help``). Prints the table of trials and, per objective, the choice and the
exact ``train.py`` arguments; writes the JSON (``--out``) and a PNG beside it. ``--tune ac_blocks``
(or ``fsdp_prefetch``) searches, at the config's global batch, the fastest clean combination of local
batch (with the accumulation that keeps the global batch) and that setting instead. How trials run and
what happens on OOM: ``utils/tuning.py``; the search and the choices: ``utils/batch_tuner.py``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file too

PROG = "python -m tools.tune_batch_size"


def main(argv: list[str], default_config: str = "tiny", prog: str = PROG) -> int:
    from utils.config import cli_config

    cfg = cli_config(argv, default_config, prog)
    if cfg is None:  # --help, --list-configs or --print-config
        return 0
    from distributed.env import detect_launch, distributed_session, validation_launch
    from utils.logging_utils import setup_logging
    from utils.schema import validate
    from utils.tuning import (journal_path, out_path, summary, trial_config, tune, tune_combination, without_tuner_keys,
                              write_outputs)

    launch = detect_launch()
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
    return 0


if __name__ == "__main__":
    from train import cli

    sys.exit(cli("tiny", main, PROG))
