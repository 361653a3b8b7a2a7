"""Failure propagation between ranks: no rank hangs after another rank failed or stopped answering.

* :class:`FailureChannel` publishes one rank's error on the job's store; a watchdog thread on every
  other rank prints it as one line and exits, even from inside a blocked collective; heartbeats let
  rank 0 name a rank that stopped answering (SIGSTOP, frozen node) and stop the job;
* :func:`finish` ends a successful run so that rank 0 (the store's host) exits last.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distributed.rendezvous import arrive_and_wait, rank_list, store_address, wait_count
from utils.core.errors import UserError

_FAILURE = "failure"  # "<rank>\n<message>" of the first rank that reported
_ACKS = "failure/acks"  # how many of the other ranks have seen the failure
_LEFT = "failure/left"  # how many ranks other than rank 0 are done with the store
_BEAT = "beat"  # beat/<rank>: a count each rank's watchdog bumps


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
    is doing. When ``silence_s`` is given, every rank watches the next one in a ring (rank r watches
    r + 1, the last rank watches rank 0: every rank is watched, and the store's load grows with the number
    of ranks, not its square) and, once it has not beaten for ``silence_s`` (a stopped, frozen or vanished
    process: a live one beats even while blocked), publishes the failure naming it and the iteration this
    rank is at (:meth:`note_step`), so every live rank stops with one line instead of waiting for the
    collective timeout (or forever). Rank 0 hosts the store: when it stops or dies, every other rank
    loses the store and names rank 0. A collective that fails because a peer died (a reset connection)
    is explained by :meth:`explain` with the ranks that stopped beating.

    The channel uses its own connection (``store.clone()``), so its polls are never queued behind
    a blocking store call of the main thread. A store call does not time out when rank 0 is stopped
    (SIGSTOP: its kernel still holds the connection open, so the client waits forever): a guard thread
    stops the rank when any of the channel's store calls has been waiting ``silence_s`` (30 s without it).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, poll_s: float = 0.5,
                 silence_s: float | None = None):
        self._pending: dict[int, float] = {}  # thread id -> when its store call began
        self._store = _TimedStore(store.clone(), self._pending)
        self._store.set_timeout(timedelta(seconds=max(4 * poll_s, 2.0)))  # a hung rank 0 counts as lost
        self._lost_after_s = silence_s or 30.0
        self._where = store_address(store)
        self._rank, self._world_size, self._poll_s = rank, world_size, poll_s
        self._ack_wait_s = 4 * poll_s + 1
        self._silence_s = silence_s
        self._step: int | None = None  # the iteration the main thread last noted
        self._beats = 0
        self._heard: dict[int, tuple[bytes, float]] = {}  # watched rank -> (last beat, when it changed)
        self._watched = [(rank + 1) % world_size] if world_size > 1 else []  # the ring's next rank
        self._lock = threading.Lock()
        self._speaker: str | None = None  # "report" or "watchdog": who prints this rank's one line
        self._status = 2  # the exit status of the failure the watchdog stops this rank for
        self._report_line = ""  # what this rank's main thread reported
        self._closed = threading.Event()  # the watchdog stops polling
        self._done = threading.Event()  # the guard stops: the run ended normally
        self._thread = threading.Thread(target=self._watch, name="failure-watchdog", daemon=True)
        self._guard_thread = threading.Thread(target=self._guard, name="failure-guard", daemon=True)

    def start(self) -> None:
        """Start the guard, publish the first heartbeat and start the watchdog thread."""
        self._guard_thread.start()
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
            if speaker is None:
                self._report_line, self._status = message.strip().splitlines()[0] if message.strip() else "", status
        if speaker == "watchdog":
            time.sleep(self._ack_wait_s + 2)  # the watchdog exits within _leave()
            os._exit(self._status)
        if speaker == "report":
            return
        self._stop_watching()  # its next poll could hit a store that rank 0 already took down
        payload = f"{self._rank}\n{status}\n{message}"
        try:
            if self._store.compare_set(_FAILURE, "", payload) != payload.encode():
                self._store.add(_ACKS, 1)
            self._leave()
        except Exception:  # the store may be gone with rank 0; the caller still prints its line
            pass

    def close(self) -> None:
        """Stop the watchdog and the guard (normal end, after every rank finished: see :func:`finish`)."""
        self._stop_watching()
        self._done.set()

    def _stop_watching(self) -> None:
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()  # bounded: the guard ends the process if its store call hangs

    def _guard(self) -> None:
        """Stop the rank when a store call of the channel has waited ``_lost_after_s``: rank 0 is stopped or
        frozen. Prints the line of whoever speaks for the rank (the main thread's report, else the loss)."""
        while not self._done.wait(self._poll_s):
            started = min(self._pending.values(), default=None)
            if started is None or time.monotonic() - started < self._lost_after_s:
                continue
            with self._lock:
                speaker = self._speaker
                self._speaker = speaker or "watchdog"
            if speaker is None:
                print(f"error: {self._store_lost()}", file=sys.stderr, flush=True)
            elif speaker == "report" and self._report_line:
                print(f"error: {self._report_line}", file=sys.stderr, flush=True)
            os._exit(self._status)

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
                    self._stop(self._store_lost(), acknowledge=False)
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
        """Beat; with ``silence_s``, also return the watched ranks that stopped beating."""
        self._beat()
        return self._silent_ranks(self._watched, self._silence_s) if self._silence_s else []

    def _store_lost(self) -> str:
        return (f"rank 0 of {self._world_size} stopped answering{self._at()}: its rendezvous store at {self._where} "
                f"is unreachable (rank 0 exited, was stopped or killed, or its node is gone); stopping rank "
                f"{self._rank}")

    def explain(self, wait_s: float = 3.0) -> str | None:
        """Why a collective of this rank failed, when a peer is gone: the published failure, the loss of rank 0's
        store, or the ranks whose heartbeat stopped during ``wait_s`` seconds (a live rank beats about once a
        second); None when every rank still beats (then the failure is not a lost peer). The watchdog goes on
        beating meanwhile: the other ranks, explaining the same failure, must not count this one as lost."""
        keys = [f"{_BEAT}/{r}" for r in range(self._world_size)]
        try:
            before = self._store.multi_get(keys)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                failure = self._read_failure()
                if failure is not None:
                    return f"{failure[2].strip().splitlines()[0]} (on rank {failure[0]}; stopping rank {self._rank})"
                time.sleep(self._poll_s)
            after = self._store.multi_get(keys)
        except dist.DistError:
            return self._store_lost()
        silent = [r for r, (a, b) in enumerate(zip(before, after)) if a == b and r != self._rank]
        if not silent:
            return None
        return (f"{rank_list(silent, self._world_size)} stopped answering{self._at()}: a collective with it failed "
                f"and it has no heartbeat (killed, or its node is gone); stopping rank {self._rank}")

    def _at(self) -> str:
        return "" if self._step is None else f" at iteration {self._step}"

    def _beat(self) -> None:
        self._beats += 1
        self._store.set(f"{_BEAT}/{self._rank}", str(self._beats))

    def _silent_ranks(self, ranks: list[int], silence_s: float) -> list[int]:
        """The ``ranks`` whose heartbeat has not changed for ``silence_s`` (measured on this rank's clock, from
        when it first read that beat)."""
        keys = [f"{_BEAT}/{r}" for r in ranks]
        if not keys or not self._store.check(keys):  # a rank not yet started (its first beat precedes training)
            return []
        now, silent = time.monotonic(), []
        for r, value in zip(ranks, self._store.multi_get(keys)):
            last, since = self._heard.get(r, (b"", now))
            if value != last:
                self._heard[r] = (value, now)
            elif now - since >= silence_s:
                silent.append(r)
        return silent

    def _publish_silence(self, silent: list[int]) -> None:
        """Publish that ``silent`` ranks stopped answering, print it and exit (status 2)."""
        message = (f"{rank_list(silent, self._world_size)} stopped answering{self._at()}: no heartbeat for "
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
        wait_count(self._store, _ACKS, self._world_size - 1, deadline)
        if self._rank == 0:
            wait_count(self._store, _LEFT, self._world_size - 1, deadline + 1.0)
        else:
            self._store.add(_LEFT, 1)


class _TimedStore:
    """A store whose calls are registered in ``pending`` (thread id -> start time) while they run, so that the
    channel's guard sees a call that hangs."""

    def __init__(self, store: dist.Store, pending: dict[int, float]):
        self._store, self._pending = store, pending

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def timed(*args):
            me = threading.get_ident()
            self._pending[me] = time.monotonic()
            try:
                return method(*args)
            finally:
                self._pending.pop(me, None)
        return timed


def finish(store: dist.Store, channel: FailureChannel, rank: int, world_size: int, timeout_s: float) -> None:
    """End a successful run on every rank: wait until all ranks got here, stop the watchdog, and
    on rank 0 (the store's host) wait until the others have left the store, so none of them
    loses it while still using it.

    Raises:
        UserError: some ranks did not get here within ``timeout_s`` s (the message names them).
    """
    deadline = time.monotonic() + timeout_s
    missing = arrive_and_wait(store, "done", rank, world_size, deadline)
    if missing:
        raise UserError(f"{rank_list(missing, world_size)} did not reach the end of the run within "
                        f"{timeout_s:g} s of this rank (stuck or died: see their logs)")
    channel.close()
    if rank == 0:
        wait_count(store, "done/left", world_size - 1, deadline)
    else:
        store.add("done/left", 1)
