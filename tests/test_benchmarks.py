"""The benchmark harness reports each run on its own, with the run's own epochs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import run_variant
from tests.dist_utils import free_port, subprocess_env


def test_run_variant_reports_only_its_own_epochs(tiny_data, tmp_path):
    args = ["--config", "tiny", "--data_path", str(tiny_data), "--num_iters", "8", "--valid_every", "1",
            "--limit_nsamples", "32", "--log_every", "1000"]
    first = run_variant("same_name", args, tmp_path, timeout=300)
    again = run_variant("same_name", args, tmp_path, timeout=300)
    for row in (first, again):
        assert row["returncode"] == 0, row.get("error")
        assert [e["iteration"] for e in row["curve"]] == [4, 8], row["curve"]  # 2 epochs of 4 steps
        assert row["samples_per_s"] > 0 and row["memory/peak_rss"] > 0
    assert first["command"] != again["command"]  # two runs, two run directories


def test_checkpoint_benchmark_measures_every_kind_of_save(tiny_data, tmp_path):
    out = tmp_path / "ckpt.json"
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "benchmarks/checkpoint.py", "--config", "tiny", "--fsdp", "zero3", "--data_path",
           str(tiny_data), "--dir", str(tmp_path / "ckpt"), "--steps", "2", "--async_steps", "2", "--out", str(out)]
    procs = [subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=subprocess_env(**launch, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:]
    rows = {r["what"]: r for r in json.loads(out.read_text())["results"]}
    assert len(rows) == 9 and all(r["seconds"] > 0 for r in rows.values())
    assert all(rows[f"host buffers of {kind} saves, allocated in the background"]["steps_during_write"] == 2
               for kind in ("sync", "async"))
    saves = [r for what, r in rows.items() if what.startswith("sharded save")]
    assert len(saves) == 4 and all(r["size_gb"] > 0 and r["stall_s"] >= 0 for r in saves)
    assert "sharded load" in outputs[0][0]  # the table, on rank 0
