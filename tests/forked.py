"""Run an entry point as a real process forked from a server that already imported torch and the project.

A fresh ``python train.py`` spends about 2.5 s of CPU importing torch and the project before it reads its
first argument; the suite starts hundreds of them, and the CI machine has 2 cores. multiprocessing's fork
server imports :data:`PRELOAD` once, runs nothing else (no thread pool to copy), and forks a process per
call. The child takes the command's working directory, environment, ``sys.argv`` and ``sys.path[0]``, writes
its stdout and stderr to files, runs the script or module as ``__main__`` (``runpy``), runs the ``atexit``
functions and exits with the script's status: what the tests read of a process (status, output, files,
signals) is that of ``python script args``, but for what a crash adds to stderr: the Python stacks that
``faulthandler`` writes at a fatal signal (SIGABRT, SIGSEGV), and a last line naming the signal a process died
of (:func:`death_note`), as a shell prints ``Aborted``. Commands that need a live ``Popen`` (signals sent
during the run) still start a fresh interpreter.
"""

from __future__ import annotations

import atexit
import faulthandler
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

# what an entry point imports on its way to its first step and its first validation (torch._dynamo: the
# optimizer's constructor imports it, ~0.9 s; matplotlib: the figure of each validation, ~0.6 s) and what
# evaluate.py adds; the fork server imports them once
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo",
           "h5py", "tests.dist_utils", "networks.vit", "distributed.world", "training.loop.trainer",
           "utils.config.command_line", "training.evaluation.plots", "training.evaluation.outputs",
           "training.evaluation.scoring", "distributed.checkpoint.export", "xarray"]


def exit_reason(exitcode: int | None) -> str:
    """How a process ended, in words: ``killed by signal SIGABRT``, ``exit status 1`` or ``still running``."""
    if exitcode is None:
        return "still running"
    if exitcode >= 0:
        return f"exit status {exitcode}"
    try:
        return f"killed by signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"


def death_note(exitcode: int | None) -> str:
    """The line a forked process's stderr gets when it died of a signal (nothing otherwise), as a shell says
    ``Aborted`` after a ``python script`` that aborted: the tail of its stderr that a failed test shows then says
    why it died, after what it wrote before."""
    return f"\n[tests/forked.py: {exit_reason(exitcode)}]\n" if exitcode is not None and exitcode < 0 else ""


def context():
    """multiprocessing's fork-server context, with :data:`PRELOAD` (the server starts at its first use)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _exit_code(code) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run(command: list[str], cwd: str, env: dict[str, str], out, err, ignored: tuple[int, ...] = (),
         stdin=None, unbuffered: bool = False, executable: str | None = None) -> None:
    """The child: become ``python *command`` in ``cwd`` with ``env``, its stdout and stderr going to ``out`` and
    ``err`` (file paths, or open files and pipes as ``Connection`` objects), ignoring the signals ``ignored``
    (as a process started ignoring them does), reading ``stdin`` (a ``Connection``; else nothing), writing
    through at once with ``unbuffered`` (``python -u``), ``executable`` as ``sys.executable`` (the command that
    started it), then exit with its status."""
    os.chdir(cwd)
    sys.executable = executable or sys.executable
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    _redirect(out, err, stdin, unbuffered)
    faulthandler.enable(all_threads=True)  # a fatal signal (SIGABRT, SIGSEGV) writes the Python stacks to stderr
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    status = 0
    try:
        if command[0] == "-c":
            sys.argv = ["-c", *command[2:]]
            sys.path.insert(0, cwd)
            exec(compile(command[1], "<string>", "exec"), {"__name__": "__main__"})
        elif command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path.insert(0, str(Path(command[0]).resolve().parent))
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exc:
        status = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            if not stream.closed:  # a script may close them, as json.tool closes stdout
                stream.flush()
        os._exit(status)


def _redirect(out, err, stdin, unbuffered: bool) -> None:
    """Point file descriptors 0-2 where :func:`_run` says (stdin stays the fork server's empty one when ``stdin``
    is None), and sys.stdout and sys.stderr, unbuffered with ``unbuffered``, at them."""
    if stdin is not None:
        os.dup2(stdin.fileno(), 0)
        stdin.close()
        sys.stdin = open(0, closefd=False, errors=sys.stdin.errors)
    for fd, target in ((1, out), (2, err)):
        if isinstance(target, str):
            opened = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(opened, fd)
            os.close(opened)
        else:
            os.dup2(target.fileno(), fd)
            target.close()
    if unbuffered:
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                                   encoding=stream.encoding, errors=stream.errors)
                                  for fd, stream in ((1, sys.stdout), (2, sys.stderr)))


class Forked:
    """One forked ``python *command``, started at once: :meth:`wait` gives its ``CompletedProcess``."""

    def __init__(self, command: list[str], cwd, env: dict[str, str]):
        self.command = command
        self._dir = tempfile.TemporaryDirectory(prefix="forked-")
        self._out, self._err = Path(self._dir.name, "out"), Path(self._dir.name, "err")
        self.process = context().Process(target=_run, args=(command, str(cwd), env, str(self._out), str(self._err)))
        self.process.start()

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Wait for the process (killing it after ``timeout`` seconds: ``subprocess.TimeoutExpired``)."""
        self.process.join(timeout)
        try:
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()
                raise subprocess.TimeoutExpired(self.command, timeout, self._out.read_text(), self._err.read_text())
            err = self._err.read_text(errors="replace") + death_note(self.process.exitcode)
            return subprocess.CompletedProcess([sys.executable, *self.command], self.process.exitcode,
                                               self._out.read_text(errors="replace"), err)
        finally:
            self._dir.cleanup()


class ForkedPopen:
    """A ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)`` look-alike for a forked ``python
    *command``, for tests that signal a process while it runs: ``pid``, ``stdout``/``stderr`` (text streams),
    ``send_signal``, ``kill``, ``poll``, ``wait``, ``communicate``, ``returncode``. The process is a child of
    the fork server, not of the test."""

    def __init__(self, command: list[str], cwd, env: dict[str, str]):
        self.args = [sys.executable, *command]
        ends = [multiprocessing.Pipe(duplex=False) for _ in range(2)]  # (read, write) Connections
        self.process = context().Process(target=_run, args=(command, str(cwd), env, ends[0][1], ends[1][1]))
        self.process.start()
        for _, write in ends:
            write.close()
        self.stdout, self.stderr = (os.fdopen(os.dup(read.fileno()), "r", errors="replace") for read, _ in ends)
        for read, _ in ends:
            read.close()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """The rest of stdout and stderr once the process has exited (read by threads, so neither pipe fills)."""
        texts: dict[str, str] = {}
        readers = [threading.Thread(target=lambda n=name, f=stream: texts.__setitem__(n, f.read()), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr))]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join()
        return texts["out"], texts["err"] + death_note(self.returncode)


def run_forked(command: list[str], cwd, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True)``, forked."""
    return Forked(command, cwd, env).wait(timeout)
