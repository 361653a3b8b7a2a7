"""Train the ERA5 ViT: one entry point for one GPU, DDP, FSDP and (via train_mp.py) tensor/context parallel.

    python train.py --config short [--<key> <value> ...]
    python train.py --help [KEY] | --list-configs | --print-config
    torchrun --nproc_per_node=4 train.py --config bs64_opt
    sbatch submit_pm.sh --config=short

Order: parse the config, validate it against the launch (world size, GPU and its compute capability),
join the other ranks, then train. Nothing is written to disk before the config, the launch and the data
have been checked. Expected errors (bad config, data or environment) print one line, ``error: ...``, on every
rank and exit with status 2.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from utils.errors import exit_status


def main(argv: list[str], default_config: str = "tiny", prog: str = "train.py") -> int:
    from utils.config import cli_config

    cfg = cli_config(argv, default_config, prog)
    if cfg is None:  # --help, --list-configs or --print-config
        return 0
    from distributed.env import detect_launch, distributed_session, validation_launch
    from utils.schema import validate
    from utils.trainer import run

    launch = detect_launch()
    validate(cfg, validation_launch(launch))
    with distributed_session(cfg.parallel, launch) as world:
        run(cfg, world)
    return 0


def cli(default_config: str = "tiny", entry=main, prog: str | None = None) -> int:
    """Run ``entry`` (:func:`main`, or another entry point of the same signature) on ``sys.argv``: exit
    status 0, 2 with one line for expected errors, 130 when interrupted, 1 with a traceback for a bug.
    A failed rank of a multi-process job exits at once, without tearing down a process group whose
    peers may be gone."""
    prog = prog or Path(sys.argv[0]).name
    try:
        status = exit_status(entry, sys.argv[1:], default_config, prog)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    except BrokenPipeError:  # output piped into a reader that closed early (--help | head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    except Exception:
        traceback.print_exc()
        status = 1
    if status:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(cli())
