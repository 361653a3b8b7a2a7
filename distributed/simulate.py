"""One rank of a job you cannot run yet, on one device: ``--simulate_world_size N`` (``--simulate_rank r``).

This process joins torch's fake process group (``backend="fake"``, ``torch.testing._internal.distributed.fake_pg``:
every collective returns at once without moving data; an all-gather copies this rank's input into every
slot) as an N-rank world, and :func:`distributed.world.init_distributed` builds the mesh the config asks for
(dp, FSDP/HSDP, tp, cp) on it. So FSDP shards the parameters N ways, tensor parallelism slices the layers,
context parallelism splits the tokens, and the step allocates what rank r of the real job allocates: its
memory, the allocator's retries and OOMs are real. What the collectives would compute is not, nor their time,
nor NCCL's own buffers (outside PyTorch's allocator; ``training/tuner/planner.py`` adds an allowance).

To the fake process group this process is rank r, so every group and mesh coordinate (FSDP's shard index,
the tensor- and context-parallel rank, the data shard) is rank r's. To the run it is the main process
(``LaunchEnv.rank`` 0, :func:`simulated_env`): it is the only one, so it keeps the run's records and decides
for itself what rank 0 would broadcast (``distributed.world.broadcast_from_main``).

Without a GPU a simulation is a dry run (:func:`dry_run_wanted`, ``training/tuner/planner.py``): the config and the
mesh are checked and two steps run on fake tensors.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from distributed.launch import LaunchEnv
from utils.config.schema import ALL_DISTINCT, Config, ParallelConfig
from utils.core.errors import UserError

SIMULATED = "simulated"  # the launcher of a simulated rank (LaunchEnv.launcher)


def simulating(parallel: ParallelConfig) -> bool:
    """Whether ``--simulate_world_size`` is set."""
    return parallel.simulate_world_size > 0


def is_simulated(env: LaunchEnv) -> bool:
    """Whether ``env`` is a simulated rank's (:func:`simulated_env`)."""
    return env.launcher == SIMULATED


def dry_run_wanted(parallel: ParallelConfig) -> bool:
    """A simulation on a machine without a GPU: checked and stepped on fake tensors, nothing trained."""
    return simulating(parallel) and not torch.cuda.is_available()


def simulated_env(parallel: ParallelConfig, env: LaunchEnv) -> LaunchEnv:
    """This process as the run sees it: the main process (rank 0, which keeps the records) of
    ``simulate_world_size`` ranks; its rank in the fake process group is ``simulate_rank``
    (:func:`start_fake_process_group`).

    Raises:
        UserError: this process is one of several (``utils/config/validate.py`` says so first), or
            ``simulate_rank`` is ``all-distinct``, which only the tuner and the dry run resolve to ranks.
    """
    if env.world_size > 1:
        raise UserError(f"--simulate_world_size runs one process, but this is rank {env.rank} of {env.world_size}; "
                        "start it without torchrun or srun")
    if parallel.simulate_rank == ALL_DISTINCT:
        raise UserError(f"--simulate_rank {ALL_DISTINCT} plans several ranks, which training cannot: pass one "
                        "rank, or run python -m tools.tune_batch_size (or a dry run without a GPU)")
    return LaunchEnv(0, parallel.simulate_world_size, 0, 1, launcher=SIMULATED)


def start_fake_process_group(world_size: int, rank: int) -> None:
    """Join the fake process group as ``rank`` of ``world_size`` (no store server, no peers)."""
    # importing the module registers the "fake" backend (built in from torch 2.13 on, a plugin before)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def notice(parallel: ParallelConfig) -> str:
    """The line a simulated run logs first and keeps in ``run.json``."""
    return (f"SIMULATED: rank {parallel.simulate_rank} of a {parallel.simulate_world_size}-rank job on torch's fake "
            "process group; collectives move no data, so the losses are meaningless and communication time is "
            "absent; memory, cudaMalloc retries and OOMs are this rank's; no checkpoint is written")


def simulation_config(cfg: Config) -> Config:
    """``cfg`` as a simulated run trains it: no checkpoint written, none continued (a new run directory each
    time); any other ``cfg`` unchanged."""
    if not simulating(cfg.parallel):
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.save_checkpoint = False
    cfg.checkpoint.resume = "never"
    return cfg
