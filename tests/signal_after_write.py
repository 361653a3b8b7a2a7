"""Run an entry point, but send this process a signal right after a function that writes an output returns
(a test helper).

    python tests/signal_after_write.py MODULE:ATTRIBUTE ENTRY [arguments ...]

A real signal at the worst moment: the output is whole on disk but not yet renamed into place, where a
process that dies leaves a file under its final name if it wrote there directly. ``MODULE:ATTRIBUTE`` names
the writer (``xarray:DataArray.to_netcdf``, ``torch:save``); ``ENTRY`` is a script (``evaluate.py``) or a
module (``tools.export_model``), run as ``__main__``. The signal is SIGTERM unless ``KILL_SIGNAL`` names
another (``INT``, ``USR1``).
"""

import functools
import importlib
import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET, ENTRY = sys.argv.pop(1), sys.argv.pop(1)
SIGNAL = getattr(signal, "SIG" + os.environ.get("KILL_SIGNAL", "TERM"))
module_name, attribute = TARGET.split(":")
*owner_path, name = attribute.split(".")
owner = functools.reduce(getattr, owner_path, importlib.import_module(module_name))
write = getattr(owner, name)


@functools.wraps(write)
def write_then_signal(*args, **kwargs):
    out = write(*args, **kwargs)
    os.kill(os.getpid(), SIGNAL)
    return out


setattr(owner, name, write_then_signal)
sys.argv[0] = ENTRY
if ENTRY.endswith(".py"):
    runpy.run_path(str(ROOT / ENTRY), run_name="__main__")
else:
    runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)
