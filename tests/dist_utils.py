"""Run a test function on N CPU processes over gloo, and entry points as users run them.

Both fork from the server of ``tests/forked.py``, which has torch imported: a spawned process would import
it again, seconds of CPU per rank on the 2-core CI machine."""

from __future__ import annotations

import os
import socket
import subprocess
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.forked import Forked, context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, errq) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errq.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise the first failure.

    ``fn`` must be importable (module level): the workers get it by reference. They are forked from
    the fork server of ``tests/forked.py``; their environment is the fork server's, from its start.
    """
    errq = context().SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, errq), nprocs=world_size,
                           join=True, start_method="forkserver")
    except Exception as exc:
        msg = errq.get() if not errq.empty() else str(exc)
        raise AssertionError(msg) from None


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for an entry point run as a user would: the repository first on PYTHONPATH
    (kept, so carried packages stay importable), one thread per process, no launcher variables."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def launch_entry(script, args: list[str], cwd, ranks: int = 1) -> list[subprocess.CompletedProcess]:
    """``python script args`` as a user runs it: one plain process, or ``ranks`` processes with the
    variables torchrun sets (gloo on the CPU). Returns each process's result, rank order."""
    launch = {} if ranks == 1 else {"WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [Forked([str(script), *args], cwd,
                    subprocess_env(**launch, **({"RANK": str(r), "LOCAL_RANK": str(r)} if launch else {})))
             for r in range(ranks)]
    return [proc.wait(300) for proc in procs]
