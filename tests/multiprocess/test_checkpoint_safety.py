"""Checkpoints that were damaged or crafted elsewhere: checksums catch any flipped byte, and no file of a
checkpoint runs code when read (``distributed/checkpoint/storage.py``). Command-line cases (``--resume``,
auto-resume, ``evaluate.py``, ``tools.export_model``): ``tests/e2e/test_untrusted_checkpoints.py``."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed.checkpoint.folder import CHECKSUMS, LATEST, METADATA
from distributed.checkpoint.storage import (HASH, MANIFEST_MARK, METADATA_CLASSES, RestrictedUnpickler, SafeReader,
                                            check_model_shapes, file_digest)
from networks.vit import VisionTransformer
from tests.multiprocess.test_checkpoint import SMALL, LOGGER, assert_same, make_run, make_world, snapshot, train
from utils.core.errors import UnsafeCheckpoint, UserError
from utils.core.files import RECORD_LIMIT
from utils.core.safe_load import load_plain


class Evil:
    """Unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def two_checkpoints(directory: Path) -> dict:
    """Steps 1 and 2 saved; returns step 1's snapshot."""
    run = make_run(directory, make_world())
    train(run, 1)
    run.manager.save(1)
    want = snapshot(run)
    train(run, 1)
    run.manager.save(2)
    return want


def rewrite_manifest(folder: Path) -> None:
    """What a crafter does after changing files: checksums.json rewritten to match them."""
    files = {p.name: file_digest(p) for p in folder.iterdir() if p.name != CHECKSUMS}
    (folder / CHECKSUMS).write_text(json.dumps({"hash": HASH, "files": files}))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_any_file_falls_back_naming_the_file(tmp_path, caplog):
    want = two_checkpoints(tmp_path / "base")
    files = sorted(p.name for p in (tmp_path / "base" / "step_00000002").iterdir() if p.name != CHECKSUMS)
    assert METADATA in files and "rank0.pt" in files and any(f.endswith(".distcp") for f in files), files
    for name in files:
        copy = tmp_path / name.strip(".")
        shutil.copytree(tmp_path / "base", copy)
        flip_byte(copy / "step_00000002" / name)
        caplog.clear()
        fresh = make_run(copy, make_world(), seed=1)
        assert fresh.manager.load() == 1, name
        assert_same(snapshot(fresh), want, name)
        warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]
        assert len(warnings) == 1 and f"step_00000002/{name} does not match its checksum" in warnings[0], warnings


def test_checksums_off_writes_none_and_loads(tmp_path, caplog):
    """Written without checksums, a checkpoint is unmarked, as those written before checksums existed: it loads
    (with a warning when the loading run verifies)."""
    run = make_run(tmp_path, make_world(), checkpoint_checksums=False)
    train(run, 1)
    run.manager.save(1)
    assert not (tmp_path / "step_00000001" / CHECKSUMS).exists()
    assert MANIFEST_MARK not in SafeReader(tmp_path / "step_00000001").checked().read_metadata().storage_meta.modules
    assert make_run(tmp_path, make_world(), seed=1, checkpoint_checksums=False).manager.load() == 1
    assert make_run(tmp_path, make_world(), seed=1).manager.load() == 1
    assert any("written before checkpoints were checksummed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", ["deleted", "a link", "a FIFO", "a directory", "huge"])
def test_a_lost_manifest_is_damage_not_a_pass(tmp_path, caplog, how):
    """Deleting (or replacing) checksums.json does not switch verification off: the checkpoint is marked as
    having one, so it counts as damaged and the load falls back to the older one, naming why."""
    want = two_checkpoints(tmp_path)
    manifest = tmp_path / "step_00000002" / CHECKSUMS
    assert MANIFEST_MARK in SafeReader(manifest.parent).checked().read_metadata().storage_meta.modules
    flip_byte(next(manifest.parent.glob("*.distcp")))  # what the missing manifest would have caught
    manifest.unlink()
    if how == "a link":
        manifest.symlink_to(tmp_path / "step_00000001" / CHECKSUMS)
    elif how == "a FIFO":
        os.mkfifo(manifest)
    elif how == "a directory":
        manifest.mkdir()
    elif how == "huge":
        with open(manifest, "wb") as f:
            f.truncate(RECORD_LIMIT + 1)
    fresh = make_run(tmp_path, make_world(), seed=1)
    assert fresh.manager.load() == 1
    assert_same(snapshot(fresh), want)
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]
    assert len(warnings) == 1 and "step_00000002" in warnings[0], warnings
    assert ("has lost its checksums.json" if how == "deleted" else str(manifest)) in warnings[0], warnings


@pytest.mark.parametrize("shard_path", ["../step_00000001/__0_0.distcp", "/etc/hostname", "..", "", "a\x00b"])
def test_a_shard_path_outside_its_folder_is_refused(tmp_path, shard_path):
    """A crafted ``.metadata`` of allow-listed classes only, pointing a shard at another file: refused before DCP
    opens anything."""
    two_checkpoints(tmp_path)
    folder = tmp_path / "step_00000002"
    metadata = SafeReader(folder).checked().read_metadata()
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = shard_path
    (folder / METADATA).write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match="which is not a file of its own folder"):
        SafeReader(folder).checked()


@pytest.mark.parametrize("target", [METADATA, "rank0.pt"])
def test_a_crafted_file_is_refused_and_runs_no_code(tmp_path, target):
    two_checkpoints(tmp_path)
    marker = tmp_path / "marker"
    folder = tmp_path / "step_00000002"
    (tmp_path / "step_00000001" / CHECKSUMS).unlink()  # no trusted fallback either
    if target == METADATA:
        (folder / METADATA).write_bytes(pickle.dumps(Evil(marker)))
    else:
        torch.save({"toy": Evil(marker)}, folder / "rank0.pt")
    rewrite_manifest(folder)  # a crafter rewrites the checksums too
    with pytest.raises(UnsafeCheckpoint, match="could run code, so it is refused") as err:
        make_run(tmp_path, make_world(), seed=1).manager.load()  # never falls back to step 1: nothing to trust here
    assert str(folder / target) in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_metadata_written_by_this_torch_holds_only_allowed_classes(tmp_path):
    """Fails when a new torch writes a class outside the allow-list: METADATA_CLASSES must follow it."""
    two_checkpoints(tmp_path)
    with open(tmp_path / "step_00000002" / METADATA, "rb") as f:
        seen = []

        class Recording(RestrictedUnpickler):
            def find_class(self, module, name):
                seen.append((module, name))
                return super().find_class(module, name)
        Recording(f, tmp_path).load()
    assert seen and all(item in METADATA_CLASSES for item in seen)


def test_damaged_metadata_without_checksums_logs_no_traceback(tmp_path, caplog):
    want = two_checkpoints(tmp_path)
    (tmp_path / "step_00000002" / CHECKSUMS).unlink()
    (tmp_path / "step_00000002" / METADATA).write_bytes(b"garbage" * 10)
    caplog.set_level(logging.DEBUG)
    fresh = make_run(tmp_path, make_world(), seed=1)
    assert fresh.manager.load() == 1
    assert_same(snapshot(fresh), want)
    assert not [r for r in caplog.records if r.exc_info], "DCP's own tracebacks reached the log"
    assert any(".metadata is damaged" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("content", [b"\x00\xff\xfe", b"../../elsewhere/step_00000001", b"not_a_step\n"])
def test_a_damaged_latest_pointer_is_one_line(tmp_path, content):
    two_checkpoints(tmp_path)
    (tmp_path / LATEST).write_bytes(content)
    with pytest.raises(UserError, match=r"latest is damaged: it must hold the name of a step_\* folder; delete it"):
        make_run(tmp_path, make_world(), seed=1).manager.load()


def test_files_of_older_versions_load_as_data(tmp_path):
    """Before RNG states were plain lists, rank<r>.pt held NumPy's generator state as an array: still data."""
    old = {"numpy_rng": np.random.RandomState(3).get_state(), "python_rng": (3, tuple(range(5)), None)}
    torch.save(old, tmp_path / "rank0.pt")
    loaded = load_plain(tmp_path / "rank0.pt")
    assert loaded["numpy_rng"][0] == "MT19937" and np.array_equal(loaded["numpy_rng"][1], old["numpy_rng"][1])
    assert loaded["python_rng"] == old["python_rng"]


def test_model_shapes_checked_from_metadata_alone(tmp_path):
    two_checkpoints(tmp_path)
    folder = tmp_path / "step_00000002"
    shapes = {k: tuple(v.shape) for k, v in VisionTransformer(**SMALL).state_dict().items()}
    check_model_shapes(folder, shapes)
    wider = {k: tuple(v.shape) for k, v in VisionTransformer(**{**SMALL, "embed_dim": 32}).state_dict().items()}
    with pytest.raises(UserError, match=r"does not fit this config's model: pos_embed is \(1, 8, 16\) there, "
                                        r"\(1, 8, 32\) here"):
        check_model_shapes(folder, wider)
    deeper = {k: tuple(v.shape) for k, v in VisionTransformer(**{**SMALL, "depth": 3}).state_dict().items()}
    with pytest.raises(UserError, match=r"tensors missing there \(blocks\.2\."):
        check_model_shapes(folder, deeper)
