"""A symbolic link as a checkpoint's ``latest`` or as one of its shards is refused as a link, by name, not
reported as damage or a checksum mismatch (#45 item 5). Links are made only under tmp_path."""

from __future__ import annotations

import pytest

from distributed.checkpoint.folder import named_latest
from distributed.checkpoint.storage import file_digest, mismatched_file
from utils.core.errors import UserError


def test_a_linked_latest_is_named_as_a_link(tmp_path):
    (tmp_path / "step_00000010").mkdir()
    (tmp_path / "elsewhere").write_text("step_00000010\n")
    (tmp_path / "latest").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match=r"latest is a symbolic link") as caught:
        named_latest(tmp_path)
    assert "damaged" not in str(caught.value)


def test_a_linked_shard_is_named_as_a_link(tmp_path):
    real = tmp_path / "outside.distcp"
    real.write_bytes(b"shard bytes")
    folder = tmp_path / "step_00000010"
    folder.mkdir()
    (folder / "__0_0.distcp").symlink_to(real)
    message = mismatched_file(folder, {"__0_0.distcp": file_digest(real)})
    assert message is not None and "__0_0.distcp is a symbolic link" in message
    assert "checksum" not in message


def test_a_linked_step_folder_is_refused(tmp_path):
    """#45 item 2: a step folder linked to one outside the run, with ``latest`` naming it, is never loaded."""
    from distributed.checkpoint.folder import load_candidates
    outside = tmp_path / "outside" / "step_00000040"
    outside.mkdir(parents=True)
    (outside / ".metadata").write_bytes(b"")
    run = tmp_path / "checkpoints"
    run.mkdir()
    (run / "step_00000099").symlink_to(outside)
    (run / "latest").write_text("step_00000099\n")
    with pytest.raises(UserError, match=r"step_00000099 is a symbolic link.*remove it"):
        load_candidates(run)


@pytest.mark.parametrize("name", ["__0_0.distcp", "rank0.pt"])
def test_a_linked_file_of_a_checkpoint_without_checksums_is_named_as_a_link(tmp_path, name):
    """Without a manifest (``--checkpoint_checksums false``, or a checkpoint older than checksums) nothing would
    catch a linked shard or per-rank file: DCP and ``torch.load`` open them by name and followed the link."""
    import torch
    import torch.distributed.checkpoint as dcp

    from distributed.checkpoint.storage import SafeReader, check_model_shapes
    folder = tmp_path / "step_00000010"
    dcp.save({"model.w": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"step": 10}, folder / "rank0.pt")
    outside = tmp_path / f"outside_{name}"
    (folder / name).rename(outside)
    (folder / name).symlink_to(outside)
    for load in (lambda: SafeReader(folder).checked(), lambda: check_model_shapes(folder, {"w": (2,)})):
        with pytest.raises(UserError, match=rf"{name} is a symbolic link, not a file this checkpoint wrote"):
            load()
