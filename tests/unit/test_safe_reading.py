"""No file read runs code: every NumPy read of the project passes ``allow_pickle=False``, every ``torch.load``
``weights_only=True``, and nothing calls ``pickle.load``/``pickle.loads`` (DCP's metadata goes through the
restricted unpickler of ``distributed/checkpoint/storage.py``). Checked on the source, so a new reader cannot
slip in without it."""

from __future__ import annotations

import ast
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType

from distributed.checkpoint.storage import SafeReader
from distributed.checkpoint.views import ViewLoadPlanner
from utils.core.errors import UnsafeCheckpoint

ROOT = Path(__file__).resolve().parents[2]
DCP_ONE_PROCESS = "torch.distributed is (disabled, )?unavailable or uninitialized"  # DCP's note, not ours
SKIP = {"tests", ".venv", "build", "site", ".gpuwheels", "data", "runs"}  # top-level folders that are not the project's


def project_files() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in SKIP]


def calls(tree: ast.AST):
    """``(dotted name, call)`` of every call, e.g. ``("np.lib.format.read_array", node)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, func = [], node.func
            while isinstance(func, ast.Attribute):
                parts.append(func.attr)
                func = func.value
            if isinstance(func, ast.Name):
                parts.append(func.id)
            yield ".".join(reversed(parts)), node


def keyword(call: ast.Call, name: str):
    found = [k.value for k in call.keywords if k.arg == name]
    return found[0].value if found and isinstance(found[0], ast.Constant) else None


def test_every_reader_refuses_code():
    problems = []
    for path in project_files():
        for name, call in calls(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{call.lineno} {name}"
            last = name.rsplit(".", 1)[-1]
            if last in ("load", "read_array") and name.split(".")[0] in ("np", "numpy") \
                    and keyword(call, "allow_pickle") is not False:
                problems.append(f"{where} without allow_pickle=False")
            if name == "torch.load" and keyword(call, "weights_only") is not True:
                problems.append(f"{where} without weights_only=True")
            if name in ("pickle.load", "pickle.loads", "pickle.Unpickler"):
                problems.append(f"{where}: unrestricted unpickling")
    assert not problems, problems


def test_the_check_sees_the_readers_it_guards():
    """The scan finds the project's real readers (else it would pass on nothing)."""
    seen = {name for path in project_files() for name, _ in calls(ast.parse(path.read_text()))}
    assert "np.lib.format.read_array" in seen and "torch.load" in seen


def test_checkpoint_bytes_items_load_and_are_refused_without_a_warning(tmp_path):
    """A ``.distcp``'s non-tensor item (the train state's numbers) loads with no warning; a crafted one, a raw
    pickle, is refused with one line and no warning either (torch's UserWarning about its pickle protocol)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_ONE_PROCESS)
        dcp.save({"w": torch.ones(3), "state": {"epoch": 3}}, checkpoint_id=tmp_path, no_dist=True)
    state = {"w": torch.zeros(3), "state": {"epoch": 0}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=DCP_ONE_PROCESS)
        dcp.load(state, storage_reader=SafeReader(tmp_path), planner=ViewLoadPlanner({}), no_dist=True)
        planner = ViewLoadPlanner({})
        planner.set_up_planner({"state": {"epoch": 0}}, SafeReader(tmp_path).read_metadata())
        item = next(r for r in planner.create_local_plan().items if r.type == LoadItemType.BYTE_IO)
        with pytest.raises(UnsafeCheckpoint, match="state.epoch holds more than plain data"):
            planner.load_bytes(item, io.BytesIO(pickle.dumps({"epoch": 3}, protocol=4)))
    assert state["state"]["epoch"] == 3 and torch.equal(state["w"], torch.ones(3))
    assert not caught, [str(w.message) for w in caught]
