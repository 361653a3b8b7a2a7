"""The forking ``python`` of the documented commands (``tests/forked_python.py``) behaves as a fresh interpreter
to the shell: arguments, working directory, environment, input and output, exit status, signals and ``$!``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.dist_utils import subprocess_env

SCRIPT = """import os, signal, sys, time
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "var", os.environ["PROBE"], "torch" in sys.modules,
      "executable", os.path.basename(os.path.dirname(sys.executable)))
if sys.argv[1] == "wait":  # the handler train.py installs: a signal stops it with its own status
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))
    print("ready", os.getpid(), flush=True)
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def shell(tmp_path_factory, forking_python):
    """``run(script)``: bash ``script`` in a folder holding ``probe.py``, the forking ``python`` first on PATH."""
    work = tmp_path_factory.mktemp("work")
    (work / "probe.py").write_text(SCRIPT)
    env = forking_python.env(subprocess_env(PROBE="x1"))

    def run(script: str) -> str:
        done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout
    return run


def test_a_run_gets_the_command_line_and_ends_with_its_status(shell):
    out = shell('python probe.py 3 "a b"; echo "status $?"; echo \'{"k": 1}\' | python -m json.tool; '
                'python -c "import sys; print(sys.argv)" x; python --version; python -u probe.py 0 u; '
                'python probe.py 0 fd 3<probe.py')
    assert "argv ['3', 'a b'] cwd work0 var x1 True executable python_bin0" in out  # forked: torch already imported
    assert "status 3" in out and '"k": 1' in out and "['-c', 'x']" in out
    assert "argv ['0', 'u'] cwd work0 var x1 True" in out  # -u, as torchrun starts its workers
    # an option, or a file given beyond the standard three (multiprocessing's spawn): the real interpreter
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in out
    assert "argv ['0', 'fd'] cwd work0 var x1 False" in out


def test_signals_reach_the_run_and_its_end_reaches_the_shell(shell):
    # start NAME: a run in the background, its pid in $p, once it is ready; one log per run, so that a run's
    # "ready" is never read from the previous run's log before the shell truncates it
    out = shell('start() { python probe.py wait > $1.log 2>&1 & p=$!; '
                'until grep -q ready $1.log; do sleep 0.1; done; }; '
                'start usr1; kill -USR1 $p; wait $p; echo "handled $?"; '
                'start term; kill -TERM $p; wait $p; echo "terminated $?"; '
                'start int; kill -INT $p; sleep 0.5; kill -0 $p && echo "SIGINT ignored in the background"; '
                'kill -KILL $p; '
                'wait $p; echo "killed $?"; run=$(sed -n "s/^ready //p" int.log); '  # the run's pid, as it printed it
                'for i in $(seq 100); do kill -0 $run 2>/dev/null || break; sleep 0.1; done; '  # 10 s on a busy machine
                'if test -n "$run" && ! kill -0 $run 2>/dev/null; then echo "no run left"; fi')
    assert "handled 75" in out and "terminated 143" in out, out
    assert "SIGINT ignored in the background" in out, out  # as bash starts a background job
    assert "killed 137" in out and "no run left" in out, out  # SIGKILL of the client takes the run along
