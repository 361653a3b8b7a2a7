"""A checkpoint from elsewhere runs no code, through every command that opens one: ``train.py --resume PATH``,
``train.py`` continuing its own run, ``evaluate.py`` and ``tools.export_model``. Each refuses a crafted
``rank0.pt`` or ``.metadata`` with one line, and the marker file the crafted pickle would create never
appears. Also: a flipped byte named by ``evaluate.py`` and ``tools.export_model``, and a ``--resume`` target
that does not fit the config, refused before any run directory exists."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed.checkpoint.storage import HASH, file_digest
from tests.dist_utils import subprocess_env
from tests.forked import run_forked
from tests.jobs import RUN, reference_run, run_path, with_args

ROOT = Path(__file__).resolve().parents[2]


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def crafted_run(tiny_data, tmp_path, tmp_path_factory, request):
    """A copy of a finished tiny run whose newest checkpoint holds a crafted file (``request.param``) and a
    checksums.json rewritten to match (as a crafter would); the older checkpoint lost its checksums.json, so it
    is no trusted fallback."""
    run = tmp_path / "run"
    shutil.copytree(reference_run(tmp_path_factory, tiny_data, [], 1)(), run)
    folder = run / "checkpoints" / "step_00000024"
    for manifest in run.glob("checkpoints/step_*/checksums.json"):
        manifest.unlink()
    marker = tmp_path / "marker"
    if request.param == ".metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    else:
        torch.save({"train_state": Evil(marker)}, folder / "rank0.pt")
    files = {p.name: file_digest(p) for p in folder.iterdir()}
    (folder / "checksums.json").write_text(json.dumps({"hash": HASH, "files": files}))
    return run, folder / request.param, marker


def command(tiny_data: Path, tmp_path: Path, run: Path, which: str) -> list[str]:
    train = [sys.executable, str(ROOT / "train.py"), *RUN, "--data_path", str(tiny_data)]
    return {
        "--resume PATH": [*train, "--expdir", str(tmp_path / "new"), "--resume", str(run / "checkpoints")],
        "auto-resume": [*train, "--expdir", str(run.parents[2]), "--run_num", run.name, "--num_iters", "30"],
        "evaluate.py": [sys.executable, str(ROOT / "evaluate.py"), "--run_dir", str(run), "--lead_steps", "1"],
        "export_model": [sys.executable, "-m", "tools.export_model", str(run), "--out", str(tmp_path / "m.pt")],
    }[which]


# evaluate.py and export_model need the model only: they never open rank0.pt
CASES = [(".metadata", which) for which in ("--resume PATH", "auto-resume", "evaluate.py", "export_model")] + [
    ("rank0.pt", "--resume PATH"), ("rank0.pt", "auto-resume")]


@pytest.mark.parametrize("crafted_run,which", CASES, indirect=["crafted_run"])
def test_a_crafted_checkpoint_is_refused_without_running_code(tiny_data, tmp_path, crafted_run, which):
    run, crafted, marker = crafted_run
    if which == "auto-resume":  # the run as the command that made it would find it: under <expdir>/tiny/1CPU/
        home = tmp_path / "runs" / "tiny" / "1CPU"
        home.mkdir(parents=True)
        run = Path(shutil.move(run, home / "00"))
        crafted = run / crafted.relative_to(crafted.parents[2])
    proc = run_forked(command(tiny_data, tmp_path, run, which)[1:], ROOT, subprocess_env())
    assert not marker.exists()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert str(crafted) in errors[0] and "could run code, so it is refused" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "new").exists()  # --resume PATH: refused before the run directory


@pytest.mark.parametrize("which", ["evaluate.py", "export_model"])
def test_a_flipped_byte_is_named(tiny_data, tmp_path, tmp_path_factory, which):
    run = tmp_path / "run"
    shutil.copytree(reference_run(tmp_path_factory, tiny_data, [], 1)(), run)
    shard = max((run / "checkpoints" / "step_00000024").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    proc = run_forked(command(tiny_data, tmp_path, run, which)[1:], ROOT, subprocess_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: checkpoint {shard} does not match its checksum" in proc.stderr, proc.stderr[-3000:]


def test_resume_target_of_another_model_is_refused_before_the_run_directory(tiny_data, tmp_path, tmp_path_factory):
    source = reference_run(tmp_path_factory, tiny_data, [], 1)() / "checkpoints"
    train = [sys.executable, str(ROOT / "train.py"), *RUN, "--data_path", str(tiny_data), "--expdir",
             str(tmp_path / "new"), "--resume", str(source)]
    proc = run_forked([*train[1:], "--embed_dim", "32"], ROOT, subprocess_env())
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: checkpoint {source / 'step_00000024'} does not fit this config's model: "
                                  "pos_embed is "), proc.stderr[-3000:]
    assert not (tmp_path / "new").exists()
    assert not run_path(tmp_path / "new", 1).exists()


def test_a_raw_pickle_model_file_is_one_line(tiny_data, tmp_path):
    """A ``.pt`` written by ``pickle.dump`` (not ``torch.save``) is refused with one ``error:`` line: torch's
    UserWarning about its pickle protocol is not printed before it (#45 item 11)."""
    marker = tmp_path / "marker"
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps({"model": Evil(marker)}, protocol=4))
    train = [sys.executable, str(ROOT / "train.py"), *RUN, "--data_path", str(tiny_data)]
    proc = subprocess.run([*train, "--expdir", str(tmp_path / "new"), "--init_from", str(raw)], cwd=tmp_path,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(raw) in lines[0], proc.stderr
    assert not marker.exists()


def test_a_renamed_step_folder_is_refused_not_taken_for_its_name(tiny_data, tmp_path, tmp_path_factory):
    """The newest checkpoint (iteration 24) renamed step_00000099, with ``latest`` naming it: the run does not go on
    as if at 99, nor from 24 under the wrong name; one line names both (#45 item 2)."""
    run = run_path(tmp_path, 1)
    shutil.copytree(reference_run(tmp_path_factory, tiny_data, [], 1)(), run)
    (run / "checkpoints" / "step_00000024").rename(run / "checkpoints" / "step_00000099")
    (run / "checkpoints" / "latest").write_text("step_00000099\n")
    train = [str(ROOT / "train.py"), *with_args(RUN, ["--num_iters", "120"]), "--data_path", str(tiny_data),
             "--expdir", str(tmp_path / "runs")]
    proc = run_forked(train, ROOT, subprocess_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: checkpoint folder step_00000099 holds iteration 24, not 99: it was renamed or copied under another "
        "name; rename it step_00000024 (and its latest file), or pass another --resume"], proc.stderr[-3000:]
