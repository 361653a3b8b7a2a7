"""Where this process sits in the job: rank, world size and rendezvous address from torchrun or SLURM, and
its device.

Launchers:
* ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
* ``srun`` (SLURM): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``),
  ``SLURM_LOCALID``; master address = ``MASTER_ADDR`` or the first host of
  ``SLURM_JOB_NODELIST``; port = ``MASTER_PORT`` or 29500 + job id mod 1000.
* anything else: one process.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from utils.config.validate import Launch
from utils.core.errors import UserError


@dataclass
class LaunchEnv:
    """Where this process sits: ``rank`` in ``[0, world_size)``, ``local_rank`` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "single"


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"nid[001-004,010],gpu7"`` -> ``"nid001"``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise UserError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR explicitly")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def _int(environ, key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise UserError(f"environment variable {key}={environ[key]!r} is not an integer; "
                        "fix or unset it") from None


def _tasks_per_node(environ) -> int:
    """Tasks on this node from ``SLURM_NTASKS_PER_NODE`` (``4``, ``4(x2)`` or ``4,2``: the first count)."""
    value = environ.get("SLURM_NTASKS_PER_NODE", "1")
    m = re.match(r"\d+", value)
    if not m:
        raise UserError(f"environment variable SLURM_NTASKS_PER_NODE={value!r} is not a task count; "
                        "fix or unset it")
    return int(m.group())


def _port(environ, default: int) -> int:
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else default
    if not 1 <= port <= 65535:
        raise UserError(f"MASTER_PORT={port} is not a TCP port (1-65535); export a free port such as 29500")
    return port


def detect_launch(environ=os.environ) -> LaunchEnv:
    """Read the launcher's environment. Raises UserError when the variables are inconsistent."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        env = LaunchEnv(_int(environ, "RANK"), _int(environ, "WORLD_SIZE"), _int(environ, "LOCAL_RANK")
                        if "LOCAL_RANK" in environ else 0,
                        _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else 1,
                        environ.get("MASTER_ADDR", "127.0.0.1"), _port(environ, 29500), "torchrun")
    elif "SLURM_PROCID" in environ and ("SLURM_STEP_NUM_TASKS" in environ or "SLURM_NTASKS" in environ):
        ntasks_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        if "MASTER_ADDR" in environ:
            addr = environ["MASTER_ADDR"]
        elif "SLURM_JOB_NODELIST" in environ:
            addr = first_slurm_host(environ["SLURM_JOB_NODELIST"])
        else:
            raise UserError("SLURM launch without SLURM_JOB_NODELIST or MASTER_ADDR; export MASTER_ADDR")
        job = _int(environ, "SLURM_JOB_ID") if environ.get("SLURM_JOB_ID") else 0
        env = LaunchEnv(_int(environ, "SLURM_PROCID"), _int(environ, ntasks_key),
                        _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
                        _tasks_per_node(environ),
                        addr, _port(environ, 29500 + job % 1000), "slurm")
    else:
        return LaunchEnv()
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise UserError(f"{env.launcher} gave rank {env.rank} with world size {env.world_size}; "
                        "rank must be in [0, world size): check the launcher's variables")
    if env.local_rank < 0 or env.local_rank > env.rank:
        raise UserError(f"{env.launcher} gave local rank {env.local_rank} for rank {env.rank}; "
                        "check LOCAL_RANK / SLURM_LOCALID")
    return env


def validation_launch(env: LaunchEnv) -> Launch:
    """What :func:`utils.config.validate.validate` checks the config against: the world size, whether a CUDA GPU is
    visible and the compute capability of the one this rank will train on (``cuda:<local rank>``; the first
    when there are fewer GPUs, which :func:`select_device` then refuses)."""
    if not torch.cuda.is_available():
        return Launch(env.world_size)
    index = env.local_rank if env.local_rank < torch.cuda.device_count() else 0
    return Launch(env.world_size, True, torch.cuda.get_device_capability(index))


def select_device(env: LaunchEnv) -> torch.device:
    """``cuda:<local rank>`` (made current) when GPUs are visible, else the CPU.

    Raises:
        UserError: more local ranks than visible GPUs.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if env.local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {env.local_rank} but only {torch.cuda.device_count()} GPUs visible; "
                        "launch one process per GPU")
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)
    return device
