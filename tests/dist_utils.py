"""Run a test function on N CPU processes over gloo, and entry points as users run them.

Both fork from the server of ``tests/forked.py``, which has torch imported: a spawned process would import
it again, seconds of CPU per rank on the 2-core CI machine."""

from __future__ import annotations

import faulthandler
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from tests.forked import Forked, context, exit_reason


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# characters of a failed worker's stderr that its failure message quotes: its start (a C++ abort's
# ``terminate called ...`` line comes before the faulthandler stacks of every thread that follow it) and its end
STDERR_HEAD, STDERR_TAIL = 2000, 3000


def _worker(rank: int, world_size: int, port: int, fn, args, errq, logdir: str) -> None:
    # stderr (fd 2: Python's and C++'s alike) to this rank's file, which the parent quotes if the rank fails; a
    # fatal signal (SIGABRT, SIGSEGV) writes every thread's Python stack there first
    opened = os.open(stderr_path(logdir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
    os.dup2(opened, 2)
    os.close(opened)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    torch.set_num_threads(1)
    try:
        # a client of the store the parent already listens on (run_distributed)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=default_pg_timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def stderr_path(logdir: str, rank: int) -> str:
    return os.path.join(logdir, f"rank{rank}.stderr")


def stderr_excerpt(path: str, head: int = STDERR_HEAD, tail: int = STDERR_TAIL) -> str:
    """The first ``head`` and the last ``tail`` characters of the file at ``path`` (cut at line starts where
    one is near), the whole file when it is no longer, or a note that it is empty or missing."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"(no stderr: {exc})"
    if not text.strip():
        return "(stderr empty)"
    if len(text) <= head + tail:
        return text.rstrip()
    first, last = text[:head], text[-tail:]
    first = first[: first.rindex("\n")] if "\n" in first[-200:] else first
    last = last[last.index("\n") + 1:] if "\n" in last[:200] else last
    return f"{first.rstrip()}\n[... {len(text) - len(first) - len(last)} characters ...]\n{last.rstrip()}"


def run_distributed(fn, world_size: int, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise the first failure.

    ``fn`` must be importable (module level): the workers get it by reference. They are forked from
    the fork server of ``tests/forked.py``; their environment is the fork server's, from its start.

    The rendezvous store listens before any rank starts, in this process, on a port the system picks at that
    moment (``MASTER_PORT`` in the ranks): no port is chosen first and bound later, which another test running
    beside this one (``pytest -n 2``) could take in between. Each rank's stderr goes to a file of its own: a
    failure names the rank that failed first and how (its exception, or the signal or exit status it died of)
    and quotes the start and the end of that rank's stderr (the C++ message of an abort, then the Python stacks
    that ``faulthandler`` writes at a fatal signal), then the other ranks' stderr where they wrote any.
    """
    errq = context().SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)
    try:
        with tempfile.TemporaryDirectory(prefix="run_distributed-") as logdir:
            try:
                mp.start_processes(_worker, args=(world_size, store.port, fn, args, errq, logdir),
                                   nprocs=world_size, join=True, start_method="forkserver")
            except ProcessException as exc:
                raise AssertionError(failure_message(exc, errq, logdir, world_size)) from None
    finally:
        del store


def failure_message(exc: ProcessException, errq, logdir: str, world_size: int) -> str:
    """What :func:`run_distributed` says of a failed run: the failed rank's exception or death and its stderr's
    tail (and the tails of the other ranks' stderr, which may show the same cause from their side)."""
    rank = exc.error_index
    raised = {}
    while not errq.empty():
        r, text = errq.get()
        raised.setdefault(r, text)
    if isinstance(exc, ProcessExitedException):
        head = f"rank {rank} of {world_size} (pid {exc.error_pid}) {exit_reason(exc.exit_code)}"
    else:
        head = f"rank {rank} of {world_size} raised:\n{raised[rank]}" if rank in raised else str(exc)
    parts = [head, f"--- stderr of rank {rank} (first {STDERR_HEAD} and last {STDERR_TAIL} characters):",
             stderr_excerpt(stderr_path(logdir, rank))]
    for other in range(world_size):
        excerpt = stderr_excerpt(stderr_path(logdir, other), 400, 800)
        if other != rank and not excerpt.startswith("("):
            parts += [f"--- stderr of rank {other} (first 400 and last 800 characters):", excerpt]
    return "\n".join(parts)


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
