"""Bounded rendezvous on the job's TCPStore, and the store helpers the failure channel shares.

``torch.distributed.init_process_group(init_method="tcp://...")`` waits silently forever for a
rank that never starts, and a rank that fails after the group is up leaves the others blocked in
their next collective. Here:

* :func:`rendezvous` creates the store (rank 0 hosts it, or torchrun's agent does), waits at most
  ``timeout_s`` seconds for every rank and names the ranks that never joined;
* ``distributed/failure.py`` turns a failed or silent rank into one line on every rank.

Keys live under a prefix naming the elastic attempt (``TORCHELASTIC_RESTART_COUNT``), so a
restarted job never sees an earlier attempt's joins or failures on torchrun's long-lived store.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from distributed.launch import LaunchEnv
from utils.core.errors import UserError

_MAX_POLL_S = 0.5


def rendezvous(env: LaunchEnv, timeout_s: float) -> dist.Store:
    """Create the job's store and wait until all ``env.world_size`` ranks have joined it.

    Rank 0 hosts a ``TCPStore`` on ``master_port``; the other ranks connect to
    ``master_addr:master_port``. Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``)
    the agent already hosts it there, so every rank connects. ``timeout_s`` bounds the connection
    and the wait together. The returned ``PrefixStore`` can be passed as ``store=`` to
    ``init_process_group``; its timeout for later blocking calls is torch's default process-group
    timeout (NCCL's id exchange waits with it), set it with ``store.set_timeout`` to change it.

    Raises:
        UserError: rank 0's port is taken, rank 0's store is unreachable, or some ranks did not
            join within ``timeout_s`` (the message names them).
    """
    deadline = time.monotonic() + timeout_s
    if env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        base = _host_store(env, timeout_s)
    else:
        base = _connect(env, deadline, timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"era5vit/attempt{attempt}", base)  # keys: <prefix>/<key>
    where = f"{env.master_addr}:{env.master_port}"
    try:
        missing = arrive_and_wait(store, "joined", env.rank, env.world_size, deadline)
    except dist.DistError:
        raise UserError(f"lost rank 0's rendezvous store at {where} while waiting for the other ranks "
                        "(rank 0 exited: see its error)") from None
    if missing:
        raise UserError(f"rendezvous at {where} timed out after {timeout_s:g} s: "
                        f"{rank_list(missing, env.world_size)} never joined; start every rank "
                        f"(torchrun --nproc_per_node={env.world_size} ..., or srun) or raise --rendezvous_timeout_s")
    store.set_timeout(dist.default_pg_timeout)
    return store


def _host_store(env: LaunchEnv, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store server. Raises UserError when it cannot listen on ``master_port``."""
    try:
        return dist.TCPStore(env.master_addr, env.master_port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" in str(exc):
            raise UserError(f"MASTER_PORT {env.master_port} is already in use on this host; "
                            "export another MASTER_PORT") from None
        raise UserError(f"rank 0 cannot host the rendezvous store on port {env.master_port} "
                        f"({str(exc).splitlines()[0]}); export another MASTER_PORT") from None


def _connect(env: LaunchEnv, deadline: float, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``master_addr:master_port``, once its port accepts connections.

    The port is probed with plain sockets first: TCPStore's own connect retries log a stack
    trace per try and can overrun the deadline. Raises UserError past the deadline.
    """
    address = (env.master_addr, env.master_port)
    reason = "timed out"
    while True:
        remaining = deadline - time.monotonic()
        try:
            socket.create_connection(address, timeout=max(min(remaining, 2.0), 0.1)).close()
            return dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                 timeout=timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
        except OSError as exc:  # refused, unresolvable, unreachable: rank 0 may not be up yet
            reason = exc.strerror or str(exc) or "timed out"
        except dist.DistError as exc:  # something listens there but does not answer like a store
            reason = str(exc).splitlines()[0]
        if time.monotonic() >= deadline:
            raise UserError(f"could not reach rank 0's rendezvous at {env.master_addr}:{env.master_port} "
                            f"within {timeout_s:g} s ({reason}); check MASTER_ADDR/MASTER_PORT and that "
                            "rank 0 started (--rendezvous_timeout_s to wait longer)")
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))


def arrive_and_wait(store: dist.Store, name: str, rank: int, world_size: int, deadline: float) -> list[int]:
    """Mark ``rank`` as arrived at ``name`` and wait until all ranks have: the ranks still missing
    at ``deadline``, ``[]`` when all arrived. Raises DistError when the store is gone."""
    store.append(f"{name}/ranks", f"{rank},")  # before the count: whoever sees the count sees the rank
    store.add(f"{name}/count", 1)
    if wait_count(store, f"{name}/count", world_size, deadline):
        return []
    arrived = {int(r) for r in store.get(f"{name}/ranks").decode().split(",") if r}
    return [r for r in range(world_size) if r not in arrived]


def wait_count(store: dist.Store, key: str, target: int, deadline: float) -> bool:
    """Poll the counter ``key`` until it reaches ``target`` (True) or ``deadline`` passes (False).

    Polling rather than ``store.wait``: a timed-out wait logs C++ warnings next to our one line.
    The interval grows to ``_MAX_POLL_S`` to keep a large job's load on rank 0 low.
    """
    delay = 0.01
    while store.add(key, 0) < target:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, _MAX_POLL_S)
    return True


def rank_list(ranks: list[int], world_size: int) -> str:
    """``[1], 2`` -> ``"rank 1 of 2"``; ``[3, 4, 5, 6, 7, 9], 16`` -> ``"ranks 3-7, 9 of 16"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(parts) > 8:
        parts = parts[:8] + [f"... ({len(ranks)} in all)"]
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(parts)} of {world_size}"


def store_address(store: dist.Store) -> str:
    """``host:port`` of the TCPStore under ``store``'s prefixes, for messages."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return f"{store.host}:{store.port}" if isinstance(store, dist.TCPStore) else type(store).__name__
