"""Console and file logging: rank 0 logs INFO, other ranks warnings only."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def setup_logging(log_file: Path | None, rank: int) -> None:
    """Rank 0 logs INFO to stdout and ``log_file``; other ranks log warnings only, tagged with their rank."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    fmt = logging.Formatter("%(asctime)s %(message)s" if rank == 0 else f"%(asctime)s [rank {rank}] %(message)s",
                            datefmt="%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    if log_file is not None:
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
