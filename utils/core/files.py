"""Atomic writes: a reader never sees half a file, and a failed write never replaces a good one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable


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
