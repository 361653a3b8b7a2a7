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
what happens on OOM: ``training/tuner/trials.py``; the search and the choices: ``training/tuner/search.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file too

from utils.core.errors import run_cli  # noqa: E402
from training.tuner.command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_cli(main))
