"""Output paths checked before anything is written; atomic writes: a reader never sees half a file, and a failed
write never replaces a good one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable

from utils.core.errors import UserError

NAME_MAX = 255  # bytes in one file name: ext4, xfs, Lustre and GPFS alike
PATH_MAX = 4096  # bytes in a whole path (Linux)


def check_output_path(flag: str, value: str | Path, name: bool = False) -> Path:
    """``value`` as a path to write to, checked before anything is written.

    ``flag`` names the option in the message (``--expdir``); with ``name``, ``value`` must be one file name (no
    ``/``, not ``.`` or ``..``), as ``--run_num`` is.

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
    if name and (text in (".", "..") or "/" in text or "\\" in text):
        raise UserError(f"{flag} {text!r} must be a plain name like 00 or lr1e-3")
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


def write_atomic(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write ``path`` with ``write(binary file)`` into ``<path>.tmp``, flushed to disk, then renamed over
    ``path`` (``os.replace``: atomic on POSIX filesystems).

    Raises:
        OSError: or whatever ``write`` raises; the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """:func:`write_atomic` of UTF-8 ``text``."""
    write_atomic(path, lambda f: f.write(text.encode()))


def write_json_atomic(path: Path, payload: Any) -> None:
    """:func:`write_atomic` of ``payload`` as indented JSON with a final newline."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")
