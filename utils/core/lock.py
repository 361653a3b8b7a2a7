"""One owner per directory: an exclusive OS file lock, which the kernel releases when its process dies.

A live run holds ``<run_dir>/.lock`` (``flock``, which Linux carries across nodes on NFS, and Lustre mounted with
``flock``) for its whole life; the file names its owner (host and pid). A second process that tries the
same directory learns the owner at once instead of mixing its files into the live run's; a SIGKILLed or
vanished owner leaves no stale lock behind, so the directory is free again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from utils.core.files import open_regular, read_bounded

LOCK_FILE = ".lock"


class Held(Exception):
    """The directory is locked by a live process; ``owner`` is what its lock file says (``host pid N``)."""

    def __init__(self, directory: Path, owner: str):
        super().__init__(f"{directory} is in use by {owner}")
        self.directory, self.owner = directory, owner


class DirectoryLock:
    """The exclusive lock of ``directory`` (created if missing), held from :meth:`acquire` until :meth:`release`
    or the process's end. Not reentrant: one per process and directory."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> DirectoryLock:
        """Take the lock without waiting and write this process's host and pid into it.

        Raises:
            Held: another live process holds it.
            NotOurs: the lock file is a symbolic link or not a regular file (never followed).
            OSError: the lock file cannot be created or locked (no permission, no locking on this file system).
        """
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
                raise Held(self.path.parent, owner(self.path.parent)) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        """Give the lock up (the kernel also does, when the process ends)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def owner(directory: Path) -> str:
    """What ``directory``'s lock file says about its owner (``host H pid P``), or ``an unknown process``."""
    try:
        text = read_bounded(Path(directory) / LOCK_FILE, 4096).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "an unknown process"


def is_held(directory: Path) -> bool:
    """Whether a live process (this one included, through another lock) holds ``directory``'s lock; probed with
    a lock of the probe's own, released at once, so a free lock stays free.

    Raises:
        NotOurs: the lock file is a symbolic link or not a regular file (never followed).
    """
    path = Path(directory) / LOCK_FILE
    try:
        fd = open_regular(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK)
    finally:
        os.close(fd)  # closing releases a lock this probe took
    return False
