"""``python -m tools.torchrun``: a SIGTERMed launcher exits 75 after every worker checkpointed (what a job script
requeues on), with no traceback, the workers naming the signal it got; two Ctrl-C stop the workers at once and
exit 130, also said by the launcher when they had stopped before the second; a worker killed by a signal is named
in one line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.dist_utils import subprocess_env
from tests.jobs import RUN
from tools.torchrun import catches, worker_pids
from utils.core.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_LINE = "interrupted: the workers had stopped before the last Ctrl-C reached them"

# train.py whose checkpoint writes, once a signal is recorded, last until a second Ctrl-C ends them (60 s at most),
# as a large model's take seconds: the tiny model's took less than the forwarder's 0.1 s between two signals
SLOW_WRITE = """
import train  # first: its signal handlers
import sys, time
from distributed.checkpoint.storage import CheckedWriter
from utils.core.signals import PREEMPTION
write_data = CheckedWriter.write_data


def slow_write_data(self, plan, planner):
    if PREEMPTION.signum:
        time.sleep(60)
    return write_data(self, plan, planner)


CheckedWriter.write_data = slow_write_data
sys.exit(train.cli())
"""

# train.py whose process, its run stopped and its signal handlers restored, exits once the file $RELEASE exists
LATE_EXIT = """
import train  # first: its signal handlers
import os, sys, time
from pathlib import Path

status = train.cli()
deadline = time.monotonic() + 60
while not Path(os.environ["RELEASE"]).exists() and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(status)
"""


def start(tiny_data: Path, tmp_path: Path, entry: Path = ROOT / "train.py", **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tools.torchrun", "--standalone", "--nproc_per_node=2",
                             str(entry), *RUN, "--num_iters", "100000", "--data_path", str(tiny_data),
                             "--expdir", str(tmp_path / "runs")], cwd=ROOT, env=subprocess_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "entry.py"
    path.write_text(text)
    return path


def read_until(proc: subprocess.Popen, text: str) -> None:
    for line in proc.stdout:
        if text in line:
            return
    raise AssertionError(proc.stderr.read()[-3000:])


def wait_until_training(proc: subprocess.Popen) -> None:
    read_until(proc, " epoch 1/")  # both ranks are past start-up


def wait_until_taken(pid: int, signum: int) -> None:
    """Until ``signum`` sent to process ``pid`` is no longer pending: its Python handler then runs before any other
    code of its main thread."""
    def pending() -> bool:
        status = Path(f"/proc/{pid}/status").read_text()
        mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("ShdPnd:"))
        return bool(mask >> (signum - 1) & 1)
    while pending():
        time.sleep(0.01)


def test_sigterm_checkpoints_and_exits_75(tiny_data, tmp_path):
    proc = start(tiny_data, tmp_path)
    wait_until_training(proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    # the signal the launcher got, not the one it once passed on in its place (#45 item 6)
    assert "preempted by SIGTERM at iteration" in out and "run the same command to resume" in out, out[-3000:]
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    assert list((tmp_path / "runs" / "tiny" / "2CPU" / "00" / "checkpoints").glob("step_*/.metadata"))


def test_two_ctrl_c_stop_the_job_at_once_with_130(tiny_data, tmp_path):
    """Two SIGINTs 50 ms apart to the launcher mid-epoch (#45 item 6): the workers stop at once, during their
    checkpoint's write, with 130, as one process does (the forwarder sent both at once, which the kernel merged
    into one: a checkpoint and 75)."""
    proc = start(tiny_data, tmp_path, script(tmp_path, SLOW_WRITE))
    wait_until_training(proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    # the workers' line (a rank may relay its peer's), as one process prints it: no checkpoint completed, no 75
    assert "preempted by" not in out and "interrupted" in err and LAUNCHER_LINE not in err, f"{out[-2000:]}\n{err}"


def test_a_second_ctrl_c_after_the_workers_stopped_gives_130_with_the_launchers_line(tiny_data, tmp_path):
    """The first Ctrl-C's checkpoint done and the workers' handlers restored, the forwarder sends them nothing:
    they exit 75 and the launcher, which got two Ctrl-C, exits 130 with its own ``interrupted`` line."""
    release = tmp_path / "release"
    proc = start(tiny_data, tmp_path, script(tmp_path, LATE_EXIT), RELEASE=str(release))
    wait_until_training(proc)
    proc.send_signal(signal.SIGINT)
    read_until(proc, "preempted by SIGINT at iteration")  # rank 0's line, after every rank's checkpoint
    proc.send_signal(signal.SIGINT)
    wait_until_taken(proc.pid, signal.SIGINT)
    release.touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert LAUNCHER_LINE in err.splitlines() and "Traceback" not in err, err[-3000:]


def test_a_signal_before_the_workers_start_waits_for_them(tiny_data, tmp_path):
    proc = start(tiny_data, tmp_path)
    while proc.poll() is None and not catches(proc.pid):  # a sleep could end before the wrapper's first statement
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # the wrapper is importing torch: no worker exists yet
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "preempted by SIGTERM during start-up: nothing trained" in out, out[-3000:]
    assert "Traceback" not in err and "error:" not in err, err[-3000:]


def test_a_worker_killed_by_a_signal_is_named(tiny_data, tmp_path):
    proc = start(tiny_data, tmp_path)
    wait_until_training(proc)
    workers = sorted(worker_pids(proc.pid))
    assert len(workers) == 2, workers
    time.sleep(0.5)
    subprocess.run(["kill", "-KILL", str(workers[1])], check=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]  # a lost rank, as docs/errors.md says: 1 is for bugs
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert any(line.startswith("error: rank 1 was killed by SIGKILL") for line in lines), err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_worker_is_signalled_once_it_has_exec_d_and_catches_every_signal():
    """A worker forked but not yet exec'd has the launcher's handlers: the SIGTERM sent it then was lost or killed
    it, and the other rank waited at the rendezvous until the agent's SIGKILL 30 s later (exit 2, not 75)."""
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "late_worker.py")], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == str(EXIT_PREEMPTED), f"worker exit status {done.stdout}\n{done.stderr[-3000:]}"
