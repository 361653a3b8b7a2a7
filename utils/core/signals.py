"""Preemption: SIGTERM, SIGUSR1 and Ctrl-C (SIGINT) ask the run to checkpoint and stop at the next step boundary.

SLURM sends SIGTERM at the time limit, or on ``scancel``, and with ``--signal=B:USR1@<s>`` a SIGUSR1 ahead of
it; a user at a terminal presses Ctrl-C. The entry points install the handlers as their first statement
(:func:`install`), so a signal during the minutes of start-up is never lost to the default action: it is
recorded, and the run stops with the preemption status before its first step, having trained nothing.

The handler only records the signal: saving from inside a handler could run in the middle of a backward
pass or a collective. The trainer reads the flag at each step boundary through its per-step all-reduce, so
every rank sees the same verdict at the same step, even when only some ranks got the signal. Then each rank
writes the checkpoint and the run exits with :data:`utils.core.errors.EXIT_PREEMPTED`. A Ctrl-C after any
recorded signal (a second Ctrl-C, or one after SLURM's SIGTERM or SIGUSR1) does not wait: it stops the process
at once (``KeyboardInterrupt``, one line, exit status 130), even one stuck before its next step.
"""

from __future__ import annotations

import os
import signal
import threading

from utils.core.errors import Stopped

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class PreemptionFlag:
    """Records the first preemption signal this process receives, from :meth:`install` to :meth:`close`.

    ``signum``: 0 until a signal arrives, then its number (an int, for the all-reduce).
    Handlers can only be installed from the main thread; elsewhere (a test's worker thread)
    :meth:`install` leaves the default handlers and the flag never rises.
    """

    def __init__(self):
        self.signum = 0
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionFlag:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}
        return self

    def close(self) -> None:
        """Restore the handlers that were in place before :meth:`install` and forget the signal."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous, self.signum = {}, 0

    def _record(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signum:
            raise KeyboardInterrupt  # Ctrl-C once a stop is already asked for: stop now
        self.signum = self.signum or signum


# the process's flag: signal handlers belong to the process, not to one object of it
PREEMPTION = PreemptionFlag()


def install() -> PreemptionFlag:
    """Catch the preemption signals from now on (the entry points' first statement, before torch is imported);
    returns the flag.

    Also asks torch's C++ side for errors only (``TORCH_CPP_LOG_LEVEL=ERROR``, unless the user set it; read
    once, when torch is imported): when a peer dies, its TCPStore client logs each failed socket call as a
    warning with a C++ stack, dozens of lines before the failure channel's one line naming the lost rank.
    """
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return PREEMPTION.install()


class StopOnSignal:
    """For a command with no state to save (``evaluate.py``, ``tools.compare_runs``, ``tools.export_model``):
    within ``with StopOnSignal():``, SIGTERM, SIGUSR1 or Ctrl-C stops it at once by raising :class:`Stopped` from
    the handler (``run_cli``: one line, exit status 75). Every output is written to a temporary name and renamed
    when complete (``utils/core/files.py``), and the exception removes the temporary file of a write under way,
    so no half-written output is left under a final name or beside it. Handlers are restored on exit (a test
    calls a tool's ``main`` in its own process); outside the main thread nothing is installed."""

    def __init__(self):
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            self._previous = {s: signal.signal(s, self._stop) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _stop(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a forked loader worker (a terminal's Ctrl-C reaches it too): its parent stops it
            return
        for s in SIGNALS:  # a second signal must not cut short the clean-up the first one starts
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(f"stopped by {signal_name(signum)}: no output is left half-written (each is renamed into "
                      "place only when complete); run the same command again")


def signal_name(signum: int) -> str:
    """``10`` -> ``"SIGUSR1"``."""
    return signal.Signals(signum).name
