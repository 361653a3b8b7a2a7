"""Preemption: SIGUSR1 and SIGTERM ask the run to checkpoint and stop at the next step boundary.

SLURM sends SIGTERM at the time limit, or on ``scancel``, and with ``--signal=B:USR1@<s>`` a
SIGUSR1 ahead of it. The handler only records the signal: saving from inside a handler could run
in the middle of a backward pass or a collective. The trainer reads the flag at each step
boundary through its per-step all-reduce, so every rank sees the same verdict at the same step,
even when only some ranks got the signal. Then each rank writes the checkpoint and the run exits
with :data:`utils.core.errors.EXIT_PREEMPTED`.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionFlag:
    """Records the first SIGUSR1/SIGTERM this process receives, from :meth:`install` to :meth:`close`.

    ``signum``: 0 until a signal arrives, then its number (an int, for the all-reduce).
    Handlers can only be installed from the main thread; elsewhere (a test's worker thread)
    :meth:`install` leaves the default handlers and the flag never rises.
    """

    def __init__(self):
        self.signum = 0
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}
        return self

    def close(self) -> None:
        """Restore the handlers that were in place before :meth:`install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _record(self, signum: int, frame) -> None:
        self.signum = self.signum or signum


def signal_name(signum: int) -> str:
    """``10`` -> ``"SIGUSR1"``."""
    return signal.Signals(signum).name
