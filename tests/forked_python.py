"""A ``python`` command whose runs fork from ``tests/forked.py``'s server, for the commands tests start.

The documented commands (``tests/e2e/test_docs_commands.py``) run as a user types them, in bash, each a fresh
``python`` that spends seconds of CPU importing torch, dynamo and matplotlib before its first line of work.
:class:`PythonServer` listens on an abstract Unix socket (no file) in the test process; :func:`install` writes
an executable ``python`` into a folder to put first on ``PATH``. That client starts in milliseconds (no site
packages), sends its arguments, working directory, environment, the signals it ignores (bash's background
jobs ignore SIGINT) and its stdin, stdout and stderr, and the server forks the run from the preloaded server
(``tests.forked._run``: the same ``__main__``, ``sys.argv``, ``sys.path[0]`` and exit status). The run's
``sys.executable`` is this ``python``, as an interpreter's is the path it was started by, so the processes a
run starts fork too. The client stays in the shell's place: its pid is ``$!``, a signal sent to it goes on to
the run, and it ends as the run ended (the same status, or killed by the same signal). A client killed
outright (SIGKILL) takes the run with it: the server kills the run when the client's connection closes. A
command line the server does not run (``python`` options but ``-u``, a script that is not a file, a process
given more open files than the standard three) gets the real interpreter.

This module imports the standard library only: the client imports it under ``python -SE``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

ADDRESS_VARIABLE = "FORKED_PYTHON_SOCKET"
REPO = Path(__file__).resolve().parents[1]
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
MESSAGE = 1 << 20  # bytes: the request (argv, cwd, environment) fits one SOCK_SEQPACKET message


def forkable(argv: list[str]) -> bool:
    """Whether ``python *argv`` is a run the server can fork: ``-c CODE``, ``-m MODULE`` or a script file."""
    if not argv:
        return False
    if argv[0] in ("-c", "-m"):
        return len(argv) > 1
    return not argv[0].startswith("-") and os.path.isfile(argv[0])


def passed_files() -> bool:
    """Whether the process that started this one left it files beyond stdin, stdout and stderr (as
    multiprocessing's spawn and fork server do): a forked run would not have them."""
    listed = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2]  # with the listing's own, closed now
    return any(_is_open(fd) for fd in listed)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def client(real_python: str) -> None:
    """The ``python`` command: send the run to the server named in the environment and end as it ends."""
    argv, address = sys.argv[1:], os.environ.get(ADDRESS_VARIABLE)
    unbuffered = argv[:1] == ["-u"]  # torchrun starts its workers with -u
    if not address or not forkable(argv[unbuffered:]) or passed_files():
        os.execv(real_python, [real_python, *argv])
    ignored = [int(s) for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # a signal sent before the run exists reaches it then
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect("\0" + address)
    request = {"argv": argv[unbuffered:], "cwd": os.getcwd(), "env": dict(os.environ), "ignored": ignored,
               "unbuffered": unbuffered, "executable": os.path.abspath(sys.argv[0])}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    try:
        reply = conn.recv(64)
    except ConnectionResetError:  # closed with the request unread
        reply = b""
    if not reply:  # the server could not start the run: nothing ran, the real interpreter runs it
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        os.execv(real_python, [real_python, *argv])
    pid = int(reply)
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _frame: os.kill(pid, s))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    status = int(conn.recv(64))  # a forwarded signal interrupts the wait; recv resumes it (PEP 475)
    if status < 0:  # killed by a signal: so is the client, as the shell then reports it
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 128 - status)


def install(folder: Path) -> Path:
    """Write the ``python`` client into ``folder`` (made if missing); returns the folder, to put first on
    ``PATH`` with :attr:`PythonServer.address` in :data:`ADDRESS_VARIABLE`."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "python"
    script.write_text(f"#!{sys.executable} -SE\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      f"from forked_python import client\nclient({sys.executable!r})\n")
    script.chmod(0o755)
    return folder


@dataclass(frozen=True)
class ForkingPython:
    """An installed client (``folder/python``) and its server's address."""

    folder: Path
    address: str

    @property
    def python(self) -> str:
        """The client's path: a command's interpreter, in place of ``sys.executable``."""
        return str(self.folder / "python")

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the client first on ``PATH``, the server's address, and the client as torchrun's
        workers' interpreter (torchrun's ``PYTHON_EXEC``)."""
        return {**base, "PATH": f"{self.folder}:{base.get('PATH', os.defpath)}", ADDRESS_VARIABLE: self.address,
                "PYTHON_EXEC": self.python}

    def run(self, args: list[str], base: dict[str, str], timeout: float, cwd: Path = REPO):
        """``python args`` under the client, in ``cwd`` with :meth:`env` of ``base``: the finished process, its
        output captured as text (``subprocess.CompletedProcess``)."""
        import subprocess  # here: the client imports this module and needs none of it
        return subprocess.run([self.python, *args], cwd=cwd, env=self.env(base), capture_output=True, text=True,
                              timeout=timeout)


class PythonServer:
    """Forks the runs the ``python`` clients send, one thread per client, until :meth:`close`."""

    def __init__(self):
        self.address = f"era5-vit-forked-{os.getpid()}-{id(self)}"
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket.bind("\0" + self.address)
        self._socket.listen(16)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._socket.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        from multiprocessing.connection import Connection

        from tests.forked import _run, context
        with conn:  # an error here closes the connection before the pid is sent: the client runs it itself
            data, fds, _, _ = socket.recv_fds(conn, MESSAGE, 3)
            request = json.loads(data)
            stdin, out, err = ends = [Connection(fd) for fd in fds]
            process = context().Process(target=_run, args=(request["argv"], request["cwd"], request["env"], out, err),
                                        kwargs=dict(ignored=request["ignored"], stdin=stdin,
                                                    unbuffered=request["unbuffered"],
                                                    executable=request["executable"]))
            process.start()
            for end in ends:
                end.close()
            conn.sendall(str(process.pid).encode())
            ready, _, _ = select.select([conn, process.sentinel], [], [])
            if conn in ready and process.sentinel not in ready:  # the client died: so does its run
                process.kill()
            process.join()
            try:
                conn.sendall(str(process.exitcode).encode())
            except OSError:
                pass  # the client is gone

    def close(self) -> None:
        self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._socket.close()
