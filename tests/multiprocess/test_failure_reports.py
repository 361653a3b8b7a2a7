"""The multi-process test helpers say why a worker died: the signal's name and its stderr's start and end."""

from __future__ import annotations

import os
import sys

import pytest

from tests.dist_utils import run_distributed, subprocess_env
from tests.forked import run_forked


def _abort_worker(rank: int, world_size: int) -> None:
    """Rank 1 writes a line to stderr, then more than the quoted tail holds, and aborts, as a C++
    ``std::terminate`` does (its message, then every thread's stack); rank 0 returns."""
    if rank == 1:
        print("rank 1 about to abort: marker-7f3a", file=sys.stderr)
        print("filler line\n" * 1000, file=sys.stderr, flush=True)
        os.abort()


def test_run_distributed_names_the_signal_and_quotes_stderr():
    with pytest.raises(AssertionError) as failed:
        run_distributed(_abort_worker, 2)
    message = str(failed.value)
    assert "rank 1 of 2" in message and "killed by signal SIGABRT" in message, message
    assert "rank 1 about to abort: marker-7f3a" in message, message  # what it wrote first
    assert "characters ...]" in message and message.count("filler line") < 1000, message  # the middle left out
    # faulthandler's Python stack of the abort, down to the function that called it
    assert "Fatal Python error: Aborted" in message and "_abort_worker" in message, message


def _raise_worker(rank: int, world_size: int) -> None:
    print(f"rank {rank} before raising: marker-9c1e", file=sys.stderr, flush=True)
    if rank == 0:
        raise ValueError("raised on rank 0")


def test_run_distributed_quotes_the_exception_and_stderr():
    with pytest.raises(AssertionError) as failed:
        run_distributed(_raise_worker, 2)
    message = str(failed.value)
    assert "rank 0 of 2 raised" in message and "ValueError: raised on rank 0" in message, message
    assert "rank 0 before raising: marker-9c1e" in message, message


def test_forked_process_killed_by_a_signal_says_so(tmp_path):
    code = "import os, sys; print('about to abort: marker-2b8d', file=sys.stderr, flush=True); os.abort()"
    result = run_forked(["-c", code], tmp_path, subprocess_env())
    assert result.returncode == -6, result
    assert "about to abort: marker-2b8d" in result.stderr, result.stderr
    assert "Fatal Python error: Aborted" in result.stderr, result.stderr  # faulthandler's stack of the abort
    assert result.stderr.rstrip().endswith("killed by signal SIGABRT]"), result.stderr
    ok = run_forked(["-c", "import sys; print('fine', file=sys.stderr)"], tmp_path, subprocess_env())
    assert ok.returncode == 0 and ok.stderr == "fine\n", ok.stderr


def _port_worker(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size))


def test_run_distributed_keeps_its_port(monkeypatch):
    """The rendezvous port is bound when it is chosen: a port that another process takes after a free-port
    probe (a gloo listener of a test running beside this one) cannot fail the run with EADDRINUSE."""
    import socket

    import tests.dist_utils as dist_utils
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(dist_utils, "free_port", lambda: taken.getsockname()[1])
        run_distributed(_port_worker, 2)
