"""Reading our own ``torch.save`` files without running code: ``weights_only`` unpickling of plain data."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch

from utils.core.errors import UnsafeCheckpoint, UserError


def _numpy_array_globals() -> list:
    """What a pickled NumPy array refers to (``ndarray``, its rebuild function, dtypes): data, no code. Checkpoints
    written before random states were plain data hold NumPy's generator state as such an array."""
    import numpy as np
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_data(source: Path | BinaryIO) -> Any:
    """``torch.load(weights_only=True)`` of a file or a binary stream (a ``torch.save`` written into it): the
    plain data of :func:`load_plain`, on the CPU, and no warning printed.

    Raises:
        pickle.UnpicklingError: ``source`` holds something else; the caller names it in its one line.
        RuntimeError, EOFError, OSError: ``source`` is damaged or unreadable.
    """
    # torch warns (UserWarning) about a raw pickle's protocol before refusing it, and any warning of its
    # unpickler is about the bytes read: the data, or the caller's one-line refusal, is all the user needs
    with torch.serialization.safe_globals(_numpy_array_globals()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(source, map_location="cpu", weights_only=True)


def load_plain(path: Path) -> Any:
    """``torch.load`` of one of our own files (``rank<r>.pt``, ``model.pt``) with ``weights_only=True``: tensors,
    numbers, strings, lists, tuples, dicts (and NumPy arrays, which older files hold), never code.

    Raises:
        UnsafeCheckpoint: the file holds something else (a crafted file), naming the file.
        UserError: the file cannot be read (damaged, truncated).
    """
    try:
        return load_data(path)
    except pickle.UnpicklingError as exc:
        detail = " ".join(str(exc).split()).split("Check the recommended steps")[0][:300]
        raise UnsafeCheckpoint(f"{path} holds more than plain data ({detail}): loading it could run code, so it is "
                               "refused; use a checkpoint you trust") from None
    except (OSError, RuntimeError, EOFError) as exc:
        raise UserError(f"cannot read {path} ({' '.join(str(exc).split())[:200]}); the file is damaged") from None
