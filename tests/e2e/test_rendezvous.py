"""Bounded rendezvous and failure propagation, with real stores, processes and timeouts.

The multi-process tests run this file as a script: ``python tests/e2e/test_rendezvous.py <scenario>``
is one rank (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` in its environment) that joins, starts
gloo and a :class:`FailureChannel`, runs the scenario and handles errors the way an entry point
does (report, print ``error: ...``, exit 2).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distributed.launch import LaunchEnv  # noqa: E402
from distributed.failure import FailureChannel, finish  # noqa: E402
from distributed.rendezvous import rank_list, rendezvous  # noqa: E402
from tests.forked import ForkedPopen  # noqa: E402
from utils.core.errors import UserError  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_env(rank: int, world_size: int, port: int) -> LaunchEnv:
    return LaunchEnv(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port,
                     launcher="torchrun")


# ---------------------------------------------------------------- one rank (script mode)

def all_reduce_sum(rank: int, world_size: int) -> None:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2, t
    print(f"sum {t.item():g}", flush=True)


def rank1_fails(rank: int, world_size: int) -> None:
    """Rank 1 fails before a collective that the others are already blocked in."""
    if rank == 1:
        time.sleep(0.5)
        raise UserError("bad thing; fix it")
    dist.all_reduce(torch.ones(1))


def rank0_is_killed(rank: int, world_size: int, in_collective: bool) -> None:
    """Rank 0 waits to be killed; rank 1 is blocked in a collective or in a long computation."""
    print("ready", flush=True)
    if rank == 0 or not in_collective:
        time.sleep(60)
    else:
        dist.all_reduce(torch.ones(1))


SCENARIOS = {
    "all_reduce": all_reduce_sum,
    "rank1_fails": rank1_fails,
    "kill0_collective": lambda r, w: rank0_is_killed(r, w, in_collective=True),
    "kill0_compute": lambda r, w: rank0_is_killed(r, w, in_collective=False),
}


def run_rank(scenario: str) -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rendezvous(local_env(rank, world_size, int(os.environ["MASTER_PORT"])), timeout_s=20)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    channel = FailureChannel(store, rank, world_size, poll_s=0.2)
    channel.start()
    try:
        SCENARIOS[scenario](rank, world_size)
    except Exception as exc:
        message = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        channel.report(message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        os._exit(2)  # skip interpreter shutdown with a broken gloo group
    finish(store, channel, rank, world_size, timeout_s=20)
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's threads release their last work (see distributed.world.shutdown)


# ---------------------------------------------------------------- helpers for the tests

def start_ranks(scenario: str, world_size: int, port: int) -> list[ForkedPopen]:
    """``python tests/e2e/test_rendezvous.py scenario`` once per rank, forked (``tests/forked.py``): real
    processes, without the seconds of importing torch in each."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    return [ForkedPopen([__file__, scenario], ROOT, {**base, "RANK": str(r)}) for r in range(world_size)]


def wait_all(procs: list[ForkedPopen], timeout_s: float) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of every process; kills them all if one outlives ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        outs = [p.communicate(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate() for p in procs]
        raise AssertionError(f"ranks still running after {timeout_s} s (hang): {outs}") from None
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def expect_user_error(env: LaunchEnv, timeout_s: float) -> tuple[str, float]:
    start = time.monotonic()
    try:
        rendezvous(env, timeout_s)
    except UserError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("rendezvous returned")


# ---------------------------------------------------------------- tests

def testrank_list_is_compact():
    assert rank_list([1], 2) == "rank 1 of 2"
    assert rank_list([3, 4, 5, 6, 7, 9], 16) == "ranks 3-7, 9 of 16"
    assert rank_list(list(range(0, 40, 2)), 64) == "ranks 0, 2, 4, 6, 8, 10, 12, 14, ... (20 in all) of 64"


def test_two_ranks_join_start_gloo_and_finish():
    results = wait_all(start_ranks("all_reduce", 2, free_port()), timeout_s=30)
    for status, out, err in results:
        assert status == 0, err
        assert "sum 3" in out


def test_rank0_alone_times_out_naming_the_missing_rank(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    message, took = expect_user_error(local_env(0, 2, free_port()), timeout_s=3)
    assert "timed out after 3 s: rank 1 of 2 never joined" in message
    assert "torchrun --nproc_per_node=2" in message and "\n" not in message
    assert 2.5 < took < 15


def test_client_without_master_names_the_address(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    port = free_port()
    message, took = expect_user_error(local_env(1, 2, port), timeout_s=2)
    assert f"could not reach rank 0's rendezvous at 127.0.0.1:{port} within 2 s" in message
    assert "MASTER_ADDR/MASTER_PORT" in message and "\n" not in message
    assert took < 15


def test_master_port_in_use(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message, _ = expect_user_error(local_env(0, 2, port), timeout_s=2)
    assert message == f"MASTER_PORT {port} is already in use on this host; export another MASTER_PORT"


def test_agent_store_makes_every_rank_a_client(monkeypatch):
    """torchrun's agent hosts the store on MASTER_PORT: rank 0 must connect, not host (hosting would
    fail with "in use"), and keys go under the restart count's prefix."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    results: dict[int, object] = {}

    def join(rank: int) -> None:
        try:
            results[rank] = rendezvous(local_env(rank, 2, port), timeout_s=10)
        except Exception as exc:  # reported by the assertion below
            results[rank] = exc

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(isinstance(results.get(r), dist.PrefixStore) for r in range(2)), results
    assert agent.add("era5vit/attempt3/joined/count", 0) == 2
    results[0].set("k", "v")
    assert results[1].get("k") == b"v"


def test_finish_names_ranks_that_never_finish():
    store = dist.PrefixStore("job", dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    channel = FailureChannel(store, 0, 3, poll_s=0.2)
    store.append("done/ranks", "1,")  # rank 1 finished, rank 2 did not
    store.add("done/count", 1)
    with pytest.raises(UserError, match=r"^rank 2 of 3 did not reach the end of the run within 1 s"):
        finish(store, channel, 0, 3, timeout_s=1)


def test_failure_on_one_rank_stops_the_others_with_its_message():
    results = wait_all(start_ranks("rank1_fails", 3, free_port()), timeout_s=20)
    assert [status for status, _, _ in results] == [2, 2, 2], results
    assert results[1][2].strip() == "error: bad thing; fix it"
    for rank in (0, 2):
        err = results[rank][2]
        assert err.strip() == f"error: bad thing; fix it (on rank 1; stopping rank {rank})", err
        assert "Traceback" not in err


def test_killed_store_host_stops_a_computing_rank():
    """Rank 1 is busy (not in a collective) when rank 0 dies: its watchdog notices the lost store."""
    procs = start_ranks("kill0_compute", 2, free_port())
    assert all(p.stdout.readline().strip() == "ready" for p in procs)
    procs[0].send_signal(signal.SIGKILL)
    status, _, err = wait_all(procs, timeout_s=20)[1]
    assert status == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 of 2 stopped answering: its rendezvous store at "), err
    assert lines[0].endswith("is unreachable (rank 0 exited, was stopped or killed, or its node is gone); stopping rank 1")
    assert "Traceback" not in err


def test_killed_store_host_stops_a_rank_blocked_in_a_collective():
    """Rank 1 is in an all_reduce when rank 0 dies: it exits 2 with one error line, whichever of
    gloo (main thread) or the watchdog (lost store) notices first."""
    procs = start_ranks("kill0_collective", 2, free_port())
    assert all(p.stdout.readline().strip() == "ready" for p in procs)
    time.sleep(0.5)  # let rank 1 enter the all_reduce
    procs[0].send_signal(signal.SIGKILL)
    status, _, err = wait_all(procs, timeout_s=20)[1]
    assert status == 2, err
    assert len(error_lines(err)) == 1 and "Traceback" not in err, err
    print(error_lines(err)[0])


if __name__ == "__main__":
    run_rank(sys.argv[1])
