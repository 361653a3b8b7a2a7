"""Run directory, console/file logging and the TensorBoard writer (rank 0 only)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from utils.errors import UserError


def run_directory(params, world_size: int) -> Path:
    """``<expdir>/<config>/<N>GPU/<run_num>/``, created. Raises UserError when not writable."""
    path = Path(params.expdir) / params.config / f"{world_size}GPU" / str(params.run_num)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write to run directory {path} ({exc.strerror}); pass a writable --expdir") from None
    return path


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
