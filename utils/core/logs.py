"""Console and file logging: rank 0 logs INFO, other ranks warnings only."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

from utils.core.errors import UserError, free_space
from utils.core.files import open_append


class LogFile(logging.Handler):
    """Appends each record as one ``write`` to ``path`` (opened by :func:`utils.core.files.open_append`: never
    through a link, never a FIFO or device).

    A failed write (full disk, quota, file size limit) is not logging's traceback per record: the handler stops
    writing and the next record logged from the main thread raises one :class:`UserError` naming the file and the
    free space, so the run stops with one line and exit status 2 (as a failed ``metrics.jsonl`` write does).
    """

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.fd = Path(path), open_append(path)
        self.failure: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.failure is None:
            try:
                os.write(self.fd, (self.format(record) + "\n").encode(errors="replace"))
            except OSError as exc:
                self.failure = (f"writing the run's log {self.path} failed: {exc.strerror or exc} "
                                f"({free_space(self.path.parent)}); free space or pass --expdir on a larger filesystem")
            except Exception:
                self.handleError(record)
        if self.failure and threading.current_thread() is threading.main_thread():
            failure, self.failure = self.failure, ""  # raised once; the handler stays silent after
            logging.getLogger().removeHandler(self)
            raise UserError(failure)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        super().close()


def setup_logging(log_file: Path | None, rank: int) -> None:
    """Rank 0 logs INFO to stdout and ``log_file`` (:class:`LogFile`); other ranks log warnings only, tagged with
    their rank.

    Raises:
        NotOurs: ``log_file`` is a symbolic link or not a regular file.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        if isinstance(handler, LogFile):
            handler.close()
    fmt = logging.Formatter("%(asctime)s %(message)s" if rank == 0 else f"%(asctime)s [rank {rank}] %(message)s",
                            datefmt="%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    if log_file is not None:
        file_handler = LogFile(log_file)
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
