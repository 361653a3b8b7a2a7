"""The one way this project touches files it reads back or writes: output paths checked before anything is
written; atomic writes (a reader never sees half a file, a failed write never replaces a good one); and the
rules that keep a run's files its own:

* never followed: a file of a run or checkpoint directory is opened with ``O_NOFOLLOW``, so a symbolic link
  planted there is refused (naming the link) instead of truncating or appending to the file it points at;
* never anything but a regular file: FIFOs, devices and directories are refused, and are opened with
  ``O_NONBLOCK`` first so that a FIFO cannot hang the open;
* never written through a hard link: a file appended to or rewritten in place (``out.log``, ``.lock``) must
  have no other name, since the writes would change the file under its other names too;
* never overwritten unless ours: :func:`write_atomic` never replaces something that is not a regular file, and
  with ``overwrite=False`` (a tool's ``--out`` without ``--overwrite``) nothing that exists;
* bounded: a record is read with a size limit (:data:`RECORD_LIMIT`), so a link to an endless file or a
  huge file cannot take the host's memory; a torn last line of an append-only log (what a SIGKILL or a full
  disk during an append leaves) is dropped with a warning.

Every refusal is a :class:`NotOurs` (a :class:`UserError`: one line, exit 2).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable

from utils.core.errors import UserError

log = logging.getLogger(__name__)

NAME_MAX = 255  # bytes in one file name: ext4, xfs, Lustre and GPFS alike
PATH_MAX = 4096  # bytes in a whole path (Linux)


def check_output_path(flag: str, value: str | Path, name: bool = False) -> Path:
    """``value`` as a path to write to, checked before anything is written.

    ``flag`` names the option in the message (``--expdir``); with ``name``, ``value`` must be one file name that
    starts with a letter or digit (no ``/``; not ``.``, ``..``, a hidden name or one that reads as an option), as
    ``--run_num`` is.

    Raises:
        UserError: an empty value, control characters (a newline pasted into a job script), a name longer than
            :data:`NAME_MAX` bytes or a path longer than :data:`PATH_MAX` bytes, or (``name``) not a plain name.
    """
    text = str(value)
    if not text.strip():
        raise UserError(f"{flag} is empty; pass a {'name' if name else 'path'}")
    bad = next((c for c in text if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise UserError(f"{flag} {text!r} contains the control character {bad!r}; pass a {'name' if name else 'path'} "
                        "without it")
    if name and (not text[0].isalnum() or "/" in text or "\\" in text):  # not -x (an option), .hidden, . or ..
        raise UserError(f"{flag} {text!r} must be a plain name that starts with a letter or digit, like 00 or lr1e-3")
    long = next((part for part in Path(text).parts if len(part.encode()) > NAME_MAX), None)
    if long is not None:
        raise UserError(f"{flag}: the name {long[:40]!r}... is {len(long.encode())} bytes, longer than the "
                        f"{NAME_MAX} a file system allows; shorten it")
    if len(os.fsencode(os.path.abspath(text))) > PATH_MAX:
        raise UserError(f"{flag}: the path is longer than the {PATH_MAX} bytes Linux allows; shorten it")
    return Path(text)


def output_path_type(flag: str) -> Callable[[str], Path]:
    """An ``argparse`` ``type=`` for an output path option: :func:`check_output_path` of the value (``Path('')``
    would silently be the current directory)."""
    return lambda text: check_output_path(flag, text)


RECORD_LIMIT = 64 << 20  # bytes: a run record (run.json, metrics.jsonl, a config, checksums.json) is far smaller


class NotOurs(UserError):
    """A path that this program will not read or write: a symbolic link, FIFO, device or directory where a
    regular file belongs, an existing output without ``--overwrite``, or a record over its size limit."""


def _kind(mode: int) -> str:
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a directory"
            if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "not a regular file")


def _refuse(path: Path, what: str) -> NotOurs:
    return NotOurs(f"{path} is {what}, not a regular file this program wrote: it is never followed or replaced; "
                   "remove it (or pass another path)")


def _hard_linked(path: Path, links: int) -> NotOurs:
    return NotOurs(f"{path} has {links} hard links: writing it in place would change the file under its other names "
                   f"too; remove it, or make it a copy of its own (cp {path} {path}.copy && mv {path}.copy {path})")


def check_in_place(path: str | Path) -> None:
    """Check, before anything is written, that ``path`` (a file the project appends to or rewrites in place:
    ``out.log``, ``.lock``) is absent or a regular file of one name, as :func:`open_regular` will require.

    Raises:
        NotOurs: ``path`` is a link, not a regular file, or has more than one hard link.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(Path(path), _kind(st.st_mode))
    if st.st_nlink > 1:
        raise _hard_linked(Path(path), st.st_nlink)


def open_regular(path: str | Path, flags: int, mode: int = 0o644, follow: bool = False) -> int:
    """``os.open(path, flags)`` of a regular file, never through a symbolic link in its last component
    (``O_NOFOLLOW``; ``follow`` for a file the user names, such as ``--yaml_config``) and never a FIFO, device or
    directory (opened ``O_NONBLOCK``, so a FIFO does not block, checked with ``fstat``, then made blocking again).
    Opened for writing (an append, a lock file rewritten in place), it must have one name only: a hard link
    planted there would carry the writes to the file's other names. Returns the descriptor (``O_CLOEXEC``).

    Raises:
        NotOurs: ``path`` is a link or not a regular file (naming what it is), or is opened for writing and has
            more than one hard link.
        OSError: any other failure (missing, no permission, full disk).
    """
    try:
        fd = os.open(path, flags | (0 if follow else os.O_NOFOLLOW) | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EWOULDBLOCK):
            what = os.lstat(path).st_mode if os.path.lexists(path) else 0
            raise _refuse(Path(path), _kind(what)) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(Path(path), _kind(st.st_mode))
    if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:  # written in place: the other names would change too
        os.close(fd)
        raise _hard_linked(Path(path), st.st_nlink)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def read_bounded(path: str | Path, limit: int = RECORD_LIMIT, follow: bool = False) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`), at most ``limit`` of them.

    Raises:
        NotOurs: a link, not a regular file, or longer than ``limit`` bytes (read no further).
        OSError: missing or unreadable.
    """
    with os.fdopen(open_regular(path, os.O_RDONLY, follow=follow), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise NotOurs(f"{path} is larger than {limit} bytes, far more than this program writes there: it is not "
                      "read; remove or replace it")
    return data


def read_jsonl(path: str | Path, limit: int = RECORD_LIMIT) -> list[tuple[int, Any]]:
    """``(line number, record)`` of each line of the append-only JSON-lines log ``path`` (read as
    :func:`read_bounded`; blank lines skipped). A last line that
    does not parse and has no newline is torn (a SIGKILL or full disk during the append): it is dropped with a
    warning, as a torn write should be.

    Raises:
        NotOurs: as :func:`read_bounded`.
        ValueError: a line before the last is not JSON (naming the line), or the file is not UTF-8.
        OSError: missing or unreadable.
    """
    text = read_bounded(path, limit).decode()
    lines = text.split("\n")
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except ValueError:
            if lineno == len(lines):  # no newline after it: the append never finished
                log.warning("%s: dropped its torn last line %d (an append that never finished)", path, lineno)
                break
            raise ValueError(f"line {lineno}: not valid JSON") from None
    return records


def open_append(path: str | Path) -> int:
    """A descriptor appending to the regular file ``path`` (created if missing), as :func:`open_regular`."""
    return open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def check_own_folder(path: str | Path) -> None:
    """Check that ``path``, a folder this program makes (a run directory, its ``checkpoints/``), is a real folder
    or absent: a symbolic link planted there would send every file of the run, each opened without following
    links, through the folder it points at.

    Raises:
        NotOurs: ``path`` is a link, a FIFO, a device or a file.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise NotOurs(f"{path} is {_kind(mode)}, not a folder this program made: it is never followed; remove it "
                      "(or pass another --run_num / --expdir)")


def check_replaceable(path: Path, overwrite: bool = True) -> None:
    """Check that :func:`write_atomic` may put a file at ``path``: nothing there, or (``overwrite``) a regular
    file. Called before anything is written, so a refused output leaves nothing behind. Checked by name
    (``lstat``): it does not race a second writer of the same folder, which the run directory's lock keeps out.

    Raises:
        NotOurs: ``path`` is a link, FIFO, device or directory, or exists and ``overwrite`` is False.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _refuse(Path(path), _kind(mode))
    if not overwrite:
        raise NotOurs(f"{path} exists; pass --overwrite to replace it, or another path")


def write_atomic(path: Path, write: Callable[[BinaryIO], Any], overwrite: bool = True) -> None:
    """Write ``path`` with ``write(binary file)`` into a new ``<path>.tmp`` (a leftover one is removed first,
    never followed), flushed to disk, then renamed over ``path`` (``os.replace``: atomic on POSIX filesystems).

    Raises:
        NotOurs: ``path`` is not replaceable (:func:`check_replaceable`); nothing is written.
        OSError: or whatever ``write`` raises; the temporary file is removed and ``path`` is untouched.
    """
    def through_file(tmp: Path) -> None:
        with os.fdopen(open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    _write_renamed(Path(path), through_file, overwrite)


def write_atomic_by_name(path: Path, write: Callable[[Path], Any], overwrite: bool = True) -> None:
    """:func:`write_atomic` for a writer that opens its file by name (netCDF): ``write(temporary path)``, then
    the file it made (which must be a regular file) is flushed to disk and renamed over ``path``.

    Raises:
        as :func:`write_atomic`.
    """
    def by_name(tmp: Path) -> None:
        write(tmp)
        fd = open_regular(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _write_renamed(Path(path), by_name, overwrite)


def _write_renamed(path: Path, produce: Callable[[Path], None], overwrite: bool) -> None:
    """``produce(<path>.tmp)``, then rename it over ``path``; on any failure or signal the temporary is removed."""
    check_replaceable(path, overwrite)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a killed write, or a planted link: the link itself goes
    try:
        produce(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, overwrite: bool = True) -> None:
    """:func:`write_atomic` of UTF-8 ``text``."""
    write_atomic(path, lambda f: f.write(text.encode()), overwrite)


def write_json_atomic(path: Path, payload: Any, overwrite: bool = True) -> None:
    """:func:`write_atomic` of ``payload`` as indented JSON with a final newline."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n", overwrite)
