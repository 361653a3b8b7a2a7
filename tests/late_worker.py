"""A ``tools.torchrun`` launcher SIGTERMed before its one worker runs, the worker late at each stage of its start
(a test helper).

    python tests/late_worker.py

The worker stays a fork of the launcher for 0.5 s (Popen's window between fork and exec, long under load), then
catches SIGUSR1 only for 0.5 s (``install`` sets one handler after the other), then catches all three. Prints
the worker's exit status: 75 once the forwarded SIGTERM reached it there, 1 when none came within 10 s, minus the
signal's number when a signal killed it.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import torchrun  # noqa: E402  (first: the launcher's handlers)

WORKER = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: None)
time.sleep(0.5)
from utils.core.signals import install
flag = install()
deadline = time.monotonic() + 10
while not flag.signum and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(75 if flag.signum == signal.SIGTERM else 1)
"""

os.kill(os.getpid(), signal.SIGTERM)  # recorded for the workers, none of which exists yet
pid = os.fork()
if pid == 0:
    time.sleep(0.5)
    os.execv(sys.executable, [sys.executable, "-c", WORKER])
threading.Thread(target=torchrun.forward_forever, daemon=True).start()  # after the fork: a fork keeps one thread
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
