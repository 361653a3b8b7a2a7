"""Train the ERA5 ViT: one entry point for one GPU, DDP, FSDP and (via train_mp.py) tensor/context parallel.

    python train.py --yaml_config config/ViT.yaml --config short --run_num 00 [--<key> <value> ...]
    torchrun --nproc_per_node=4 train.py --config bs64_opt
    sbatch submit_pm.sh --config=short

Every key of the chosen config can be overridden as ``--<key> <value>`` (or ``--key=value``).
Expected errors (bad config, data or environment) print one line and exit with status 2.
"""

from __future__ import annotations

import sys

from utils.errors import exit_status

DEFAULT_YAML = "config/ViT.yaml"


def main(argv: list[str] | None = None, default_config: str = "tiny") -> int:
    from utils.config import load_params, parse_overrides

    overrides = parse_overrides(sys.argv[1:] if argv is None else argv)
    yaml_path = overrides.pop("yaml_config", DEFAULT_YAML)
    name = overrides.pop("config", default_config)
    params = load_params(yaml_path, name, overrides)

    from distributed.env import init_distributed, shutdown
    from utils.trainer import run

    world = init_distributed(params)
    try:
        run(params, world)
    finally:
        shutdown()
    return 0


def cli(default_config: str = "tiny") -> int:
    """Run :func:`main`, turning expected errors into a one-line message and exit status 2."""
    try:
        return exit_status(main, default_config=default_config)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
