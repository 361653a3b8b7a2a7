"""Exact resume through the real entry point: a run SIGKILLed mid-epoch and re-run with the same command
ends with bitwise the same parameters, optimizer state and metrics as an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.dist_utils import free_port, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
# tiny on 64 samples: 8 steps per epoch at global batch 8; checkpoints every 5 steps, killed at step 13
RUN = ["--config", "tiny", "--num_iters", "24", "--limit_nsamples", "64", "--limit_nsamples_val", "32",
       "--checkpoint_every_steps", "5", "--log_every", "1000"]


def _launch(tmp_path: Path, data: Path, args: list[str], ranks: int, kill_at: int | None = None) -> list:
    """Run the job on ``ranks`` processes (RANK/WORLD_SIZE, as srun would), optionally SIGKILLed at a step."""
    entry = [str(ROOT / "tests" / "kill_at_step.py"), str(kill_at)] if kill_at else [str(ROOT / "train.py")]
    port = str(free_port())
    launch = {} if ranks == 1 else {"WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    tmp_path.mkdir(exist_ok=True)
    procs = [subprocess.Popen([sys.executable, *entry, *RUN, "--data_path", str(data), "--expdir",
                               str(tmp_path / "runs"), *args], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env=subprocess_env(**launch, **({"RANK": str(r), "LOCAL_RANK": str(r)} if launch else {})))
             for r in range(ranks)]
    outputs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]


def _final_state(run_dir: Path, tmp_path: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    out = tmp_path / f"{run_dir.parent.parent.name}_{run_dir.name}_{latest}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / latest, out)
    return torch.load(out, weights_only=False)


def _tensors(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def _metrics(run_dir: Path) -> list[dict]:
    keep = ("epoch", "iteration", "loss/train", "loss/valid", "rmse/u10m", "acc/sp", "lr")
    return [{k: r.get(k) for k in keep} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("ranks,extra", [(1, []), (2, []), (2, ["--fsdp", "zero3"])],
                         ids=["one process", "DDP 2 ranks", "FSDP ZeRO-3 2 ranks"])
def test_sigkill_mid_epoch_then_rerun_equals_uninterrupted(tiny_data, tmp_path, ranks, extra):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for proc in _launch(whole, tiny_data, extra, ranks):
        assert proc[0] == 0, proc[2][-3000:]
    killed = _launch(cut, tiny_data, extra, ranks, kill_at=13)
    assert all(p[0] == -signal.SIGKILL for p in killed), [p[0] for p in killed]
    run = cut / "runs" / "tiny" / f"{ranks}GPU" / "00"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    for proc in _launch(cut, tiny_data, extra, ranks):  # the same command again
        assert proc[0] == 0, proc[2][-3000:]
    assert "resumed at iteration 10" in (run / "out.log").read_text()
    ref_run = whole / "runs" / "tiny" / f"{ranks}GPU" / "00"
    assert _metrics(run) == _metrics(ref_run)
    got, want = dict(_tensors(_final_state(run, tmp_path))), dict(_tensors(_final_state(ref_run, tmp_path)))
    assert got.keys() == want.keys() and any("optim" in k for k in got)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "completed" and [r["step"] for r in record["resumes"]] == [10]
    again = _launch(cut, tiny_data, extra, ranks)  # a finished run: nothing to do
    assert all(p[0] == 0 and "is complete (24 iterations)" in p[1] for p in again)
