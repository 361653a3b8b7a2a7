"""Bounded rendezvous on the job's TCPStore, and failure propagation between ranks.

``torch.distributed.init_process_group(init_method="tcp://...")`` waits silently forever for a
rank that never starts, and a rank that fails after the group is up leaves the others blocked in
their next collective. Here:

* :func:`rendezvous` creates the store (rank 0 hosts it, or torchrun's agent does), waits at most
  ``timeout_s`` seconds for every rank and names the ranks that never joined;
* :class:`FailureChannel` publishes one rank's error on the store; a watchdog thread on every
  other rank prints it as one line and exits (status 2), even from inside a blocked collective;
  heartbeats let rank 0 name a rank that stopped answering (SIGSTOP, frozen node) and stop the job;
* :func:`finish` ends a successful run so that rank 0 (the store's host) exits last.

Keys live under a prefix naming the elastic attempt (``TORCHELASTIC_RESTART_COUNT``), so a
restarted job never sees an earlier attempt's joins or failures on torchrun's long-lived store.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from utils.errors import UserError

if TYPE_CHECKING:  # distributed.env imports this module
    from distributed.env import LaunchEnv

_MAX_POLL_S = 0.5
_FAILURE = "failure"  # "<rank>\n<message>" of the first rank that reported
_ACKS = "failure/acks"  # how many of the other ranks have seen the failure
_LEFT = "failure/left"  # how many ranks other than rank 0 are done with the store
_BEAT = "beat"  # beat/<rank>: a count each rank's watchdog bumps


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
        missing = _arrive_and_wait(store, "joined", env.rank, env.world_size, deadline)
    except dist.DistError:
        raise UserError(f"lost rank 0's rendezvous store at {where} while waiting for the other ranks "
                        "(rank 0 exited: see its error)") from None
    if missing:
        raise UserError(f"rendezvous at {where} timed out after {timeout_s:g} s: "
                        f"{_rank_list(missing, env.world_size)} never joined; start every rank "
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


def _arrive_and_wait(store: dist.Store, name: str, rank: int, world_size: int, deadline: float) -> list[int]:
    """Mark ``rank`` as arrived at ``name`` and wait until all ranks have: the ranks still missing
    at ``deadline``, ``[]`` when all arrived. Raises DistError when the store is gone."""
    store.append(f"{name}/ranks", f"{rank},")  # before the count: whoever sees the count sees the rank
    store.add(f"{name}/count", 1)
    if _wait_count(store, f"{name}/count", world_size, deadline):
        return []
    arrived = {int(r) for r in store.get(f"{name}/ranks").decode().split(",") if r}
    return [r for r in range(world_size) if r not in arrived]


def _wait_count(store: dist.Store, key: str, target: int, deadline: float) -> bool:
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


def _rank_list(ranks: list[int], world_size: int) -> str:
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


def _address(store: dist.Store) -> str:
    """``host:port`` of the TCPStore under ``store``'s prefixes, for messages."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return f"{store.host}:{store.port}" if isinstance(store, dist.TCPStore) else type(store).__name__


class FailureChannel:
    """Makes every rank stop, with one line, when any rank fails or stops answering; no rank hangs
    in a collective.

    :meth:`report` publishes this rank's error (the first report in the job wins); a daemon
    watchdog on every other rank sees it within ``poll_s``, prints
    ``error: <message> (on rank R; stopping rank r)`` and exits with the reporter's status from its thread,
    since the main thread may be blocked in a gloo/NCCL collective. Every rank seeing the failure
    acknowledges it, and no rank leaves before all have (or ``4 * poll_s + 1`` s passed): an early
    exit would close sockets under the others' collectives (a second, misleading error) or, on
    rank 0, the store itself; rank 0 leaves last. The watchdog also stops the rank when the store
    is lost (rank 0 died or was stopped).

    Heartbeats: every watchdog bumps ``beat/<rank>`` about once a second, whatever the main thread
    is doing. When ``silence_s`` is given, rank 0's watchdog reads all of them and, once some rank
    has not beaten for ``silence_s`` (a stopped, frozen or vanished process: a live one beats even
    while blocked), publishes the failure naming those ranks and the iteration rank 0 is at
    (:meth:`note_step`), so every live rank stops with one line instead of waiting for the
    collective timeout (or forever).

    The channel uses its own connection (``store.clone()``), so its polls are never queued behind
    a blocking store call of the main thread.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, poll_s: float = 0.5,
                 silence_s: float | None = None):
        self._store = store.clone()
        self._store.set_timeout(timedelta(seconds=max(4 * poll_s, 2.0)))  # a hung rank 0 counts as lost
        self._where = _address(store)
        self._rank, self._world_size, self._poll_s = rank, world_size, poll_s
        self._ack_wait_s = 4 * poll_s + 1
        self._silence_s = silence_s
        self._step: int | None = None  # the iteration the main thread last noted
        self._beats = 0
        self._heard: dict[int, tuple[bytes, float]] = {}  # rank 0: rank -> (last beat, when it changed)
        self._lock = threading.Lock()
        self._speaker: str | None = None  # "report" or "watchdog": who prints this rank's one line
        self._status = 2  # the exit status of the failure the watchdog stops this rank for
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="failure-watchdog", daemon=True)

    def start(self) -> None:
        """Publish the first heartbeat and start the watchdog thread."""
        self._beat()
        self._thread.start()

    def note_step(self, step: int) -> None:
        """Record the iteration this rank is at; heartbeats and failure lines name it."""
        self._step = step

    def report(self, message: str, status: int = 2) -> None:
        """Publish this rank's failure, and the exit status every rank then gives (``status``), and give
        the other ranks a moment to see it; never raises.

        Prints nothing: the caller prints its own ``error:`` line after this returns. If another
        rank's failure was published first, this rank acknowledges that one instead. If the
        watchdog is already stopping this rank for another rank's failure, this does not return:
        the process exits (with that failure's status) with the watchdog's line as its only one.
        """
        with self._lock:
            speaker = self._speaker
            self._speaker = speaker or "report"
        if speaker == "watchdog":
            time.sleep(self._ack_wait_s + 2)  # the watchdog exits within _leave()
            os._exit(self._status)
        if speaker == "report":
            return
        self.close()  # its next poll could hit a store that rank 0 already took down
        payload = f"{self._rank}\n{status}\n{message}"
        try:
            if self._store.compare_set(_FAILURE, "", payload) != payload.encode():
                self._store.add(_ACKS, 1)
            self._leave()
        except Exception:  # the store may be gone with rank 0; the caller still prints its line
            pass

    def close(self) -> None:
        """Stop the watchdog (normal end, after every rank finished: see :func:`finish`)."""
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        """Poll the failure key and beat; stop this rank on another rank's failure, on losing the
        store, or (rank 0) on a rank that stopped beating."""
        misses, polls = 0, 0
        beat_every = max(1, round(1.0 / self._poll_s))  # about once a second
        while not self._closed.wait(self._poll_s) and self._speaker is None:
            polls += 1
            try:
                failure = self._read_failure()
                silent = self._heartbeat() if failure is None and polls % beat_every == 0 else []
                misses = 0
            except dist.DistError:
                misses += 1  # one miss may be a slow rank 0; two in a row mean it is gone
                if misses >= 2 and not self._closed.is_set():
                    self._stop(f"lost the rendezvous store at {self._where}{self._at()} (rank 0 exited, was "
                               f"stopped or killed); stopping rank {self._rank}", acknowledge=False)
                continue
            if failure is not None:
                rank, status, message = failure
                first_line = (message.strip().splitlines() or ["(no message)"])[0]
                self._stop(f"{first_line} (on rank {rank}; stopping rank {self._rank})", acknowledge=True,
                           status=status)
            elif silent:
                self._publish_silence(silent)

    def _read_failure(self) -> tuple[str, int, str] | None:
        """``(rank, exit status, message)`` of the published failure, or None."""
        if not self._store.check([_FAILURE]):
            return None
        rank, status, message = self._store.get(_FAILURE).decode().split("\n", 2)
        return rank, int(status), message

    def _heartbeat(self) -> list[int]:
        """Beat; on rank 0 with ``silence_s``, also return the ranks that stopped beating."""
        self._beat()
        return self._silent_ranks() if self._rank == 0 and self._silence_s else []

    def _at(self) -> str:
        return "" if self._step is None else f" at iteration {self._step}"

    def _beat(self) -> None:
        self._beats += 1
        self._store.set(f"{_BEAT}/{self._rank}", str(self._beats))

    def _silent_ranks(self) -> list[int]:
        """Rank 0: the ranks whose heartbeat has not changed for ``silence_s`` (measured on this
        rank's clock, from when it first read that beat)."""
        keys = [f"{_BEAT}/{r}" for r in range(self._world_size)]
        if not self._store.check(keys):  # a rank not yet started (its first beat precedes training)
            return []
        now, silent = time.monotonic(), []
        for r, value in enumerate(self._store.multi_get(keys)):
            last, since = self._heard.get(r, (b"", now))
            if value != last:
                self._heard[r] = (value, now)
            elif now - since >= self._silence_s:
                silent.append(r)
        return silent

    def _publish_silence(self, silent: list[int]) -> None:
        """Rank 0: publish that ``silent`` ranks stopped answering, print it and exit (status 2)."""
        message = (f"{_rank_list(silent, self._world_size)} stopped answering{self._at()}: no heartbeat for "
                   f"{self._silence_s:g} s; the process is stopped, hung or its node is gone: stopping every rank "
                   "(--collective_timeout_s sets the limit)")
        try:
            self._store.compare_set(_FAILURE, "", f"{self._rank}\n2\n{message}")
        except dist.DistError:
            pass
        self._stop(message, acknowledge=False, leave=True)

    def _stop(self, line: str, acknowledge: bool, leave: bool = False, status: int = 2) -> None:
        """Print ``error: <line>`` and exit with ``status``, unless this rank's main thread is
        reporting its own error (then it speaks for the rank and this returns). ``acknowledge``:
        count this rank as having seen another's failure; it and ``leave`` wait for the others."""
        with self._lock:
            if self._speaker is not None:
                return
            self._speaker, self._status = "watchdog", status
        if acknowledge:
            try:
                self._store.add(_ACKS, 1)
            except dist.DistError:
                pass
        sys.stdout.flush()
        print(f"error: {line}", file=sys.stderr, flush=True)
        if acknowledge or leave:
            try:
                self._leave()
            except dist.DistError:
                pass
        os._exit(status)

    def _leave(self) -> None:
        """Wait (bounded) until every rank but the reporter has seen the failure, then leave the
        store: rank 0, which hosts it, waits until the others have left."""
        deadline = time.monotonic() + self._ack_wait_s
        _wait_count(self._store, _ACKS, self._world_size - 1, deadline)
        if self._rank == 0:
            _wait_count(self._store, _LEFT, self._world_size - 1, deadline + 1.0)
        else:
            self._store.add(_LEFT, 1)


def finish(store: dist.Store, channel: FailureChannel, rank: int, world_size: int, timeout_s: float) -> None:
    """End a successful run on every rank: wait until all ranks got here, stop the watchdog, and
    on rank 0 (the store's host) wait until the others have left the store, so none of them
    loses it while still using it.

    Raises:
        UserError: some ranks did not get here within ``timeout_s`` s (the message names them).
    """
    deadline = time.monotonic() + timeout_s
    missing = _arrive_and_wait(store, "done", rank, world_size, deadline)
    if missing:
        raise UserError(f"{_rank_list(missing, world_size)} did not reach the end of the run within "
                        f"{timeout_s:g} s of this rank (stuck or died: see their logs)")
    channel.close()
    if rank == 0:
        _wait_count(store, "done/left", world_size - 1, deadline)
    else:
        store.add("done/left", 1)
