"""The files of ``benchmarks/check.py``: the stored reference it compares with (``--reference``), and an earlier
output of it that ``--resume`` goes on from. Each is read as JSON only, checked, and refused with one
``error:`` line when it is not this script's, was measured on another kind of GPU or, for ``--resume``, with
other settings."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

from utils.core.errors import UserError

# the train.py rows of benchmarks/checkpoint.py whose stall is compared: a save of each kind after the first
SAVES = {"sync save stall s": "sharded save, sync, with checksums (again)",
         "async save stall s": "sharded save, async (again)"}
SETTINGS = ("config", "amp_modes", "data_path", "train_args")  # what --resume's runs must share with these


def gpu_slug(device: str) -> str:
    """A short name of a device for file names: ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``cpu`` -> ``cpu``."""
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", device)
    return (found.group(1) if found else re.sub(r"\W+", "_", device)).lower()


def read_saved(path: Path, flag: str, device: str, keys: tuple[str, ...]) -> dict:
    """An earlier output of ``check.py`` (``flag``: the option naming it), measured on this kind of device, with
    ``keys`` besides ``device``.

    Raises:
        UserError: it cannot be read, is not this script's JSON, or was measured on another kind of device.
    """
    try:
        saved = json.loads(path.read_text())
        theirs = saved["device"]
        missing = [key for key in keys if key not in saved]
        if not isinstance(theirs, str) or missing:
            raise ValueError(f"no {', '.join(missing) or 'device name'}")
    except OSError as exc:
        raise UserError(f"{flag} {path} cannot be read ({exc.strerror}); name an --out of benchmarks/check.py") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{flag} {path} is not a JSON written by benchmarks/check.py ({exc})") from None
    if gpu_slug(theirs) != gpu_slug(device):
        raise UserError(f"{flag} {path} was measured on {theirs}, this is {device}; pass one of this kind of GPU"
                        f"{' (or none: the first run makes one)' if flag == '--reference' else ''}")
    return saved


def read_reference(path: Path, device: str) -> dict[str, float] | None:
    """The reference's metrics, or None when ``path`` does not exist.

    Raises:
        UserError: see :func:`read_saved`.
    """
    return read_saved(path, "--reference", device, ("metrics",))["metrics"] if path.exists() else None


def read_resumed(path: Path, device: str, settings: dict) -> tuple[dict[str, dict], list[dict]]:
    """What an earlier ``--out`` (``--resume``) measured with the same ``settings`` (:data:`SETTINGS`): its
    succeeded train.py runs (exit 0, with a rate and a loss) by name, and its checkpoint rows (none unless every compared save is among them).

    Raises:
        UserError: see :func:`read_saved`; it has no rows, or was measured with other settings.
    """
    saved = read_saved(path, "--resume", device, ("results", *SETTINGS))
    rows = saved["results"]
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise UserError(f"--resume {path} is not a JSON written by benchmarks/check.py (its results are not rows)")
    differ = [f"{key} {saved[key]!r} (here {settings[key]!r})" for key in SETTINGS if saved[key] != settings[key]]
    if differ:
        raise UserError(f"--resume {path} was measured with other settings: {'; '.join(differ)}; resume with the "
                        "same ones, or measure again without --resume")
    runs = {row["variant"]: row for row in rows if row.get("returncode") == 0 and isinstance(row.get("variant"), str)
            and all(isinstance(row.get(key), (int, float)) for key in ("samples_per_s", "loss/train"))}
    saves = [row for row in rows if row.get("measurement") == "checkpoint"]
    return runs, saves if set(SAVES.values()) <= {row.get("what") for row in saves} else []


def keeping(run: Callable, checkpoint: Callable, path: Path, runs: dict[str, dict],
            saves: list[dict]) -> tuple[Callable, Callable]:
    """``run`` and ``checkpoint`` that hand back the rows of ``--resume``'s finished runs (``runs``, ``saves``:
    :func:`read_resumed`), each marked ``kept_from``, instead of running them again."""
    def kept(row: dict) -> dict:
        return {**{k: v for k, v in row.items() if k != "measurement"}, "kept_from": str(path)}

    def run_or_keep(name: str, args: list[str], expdir: Path, **launch) -> dict:
        if name not in runs:
            return run(name, args, expdir, **launch)
        print(f"[{name}] kept from {path}: {runs[name]['samples_per_s']:.4g} samples/s", flush=True)
        return kept(runs[name])

    def checkpoint_or_keep(args: list[str], folder: Path) -> list[dict]:
        return [kept(row) for row in saves] if saves else checkpoint(args, folder)
    return run_or_keep, checkpoint_or_keep
