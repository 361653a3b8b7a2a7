"""Model-parallel entry point: the same training loop as train.py, defaulting to the ``mp`` config.

    torchrun --nproc_per_node=4 train_mp.py --config mp --tensor_parallel 2 --context_parallel 2
    srun python train_mp.py --config mp --tensor_parallel 4 --fsdp zero3

Tensor parallel (``--tensor_parallel N``), context parallel (``--context_parallel N``) and data
parallel over the remaining ranks (DDP, or FSDP with ``--fsdp``) share one device mesh whose
dimension order is ``--parallel_order`` (default ``tp-cp-dp``: tensor-parallel peers adjacent).
"""

import sys

from train import cli

if __name__ == "__main__":
    sys.exit(cli(default_config="mp", prog="train_mp.py"))
