"""``make era5_sample`` works from a fresh clone with nothing beside it: the real ERA5 sample ships inside the
repository (samples/, with its source and licence), and the Makefile reads it from there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import subprocess_env

REPO = Path(__file__).resolve().parents[2]


def test_make_era5_sample_in_a_fresh_clone(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: nothing to clone")
    clone = tmp_path / "alone" / "clone"  # its parent holds nothing else: no ../shared
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
    sample = clone / "samples" / "era5-levels-members.nc"
    assert sample.is_file() and 1e6 < sample.stat().st_size < 5e6  # committed, compressed (9.4 MB raw)
    licence = (clone / "samples" / "README.md").read_text()
    assert all(s in licence for s in ("cfgrib", "Apache License, Version 2.0", "ECMWF", "Copernicus"))
    stamp = tmp_path / "installed"  # the set-up done: this environment's Python; the clone's code (no PYTHONPATH)
    stamp.touch()
    proc = subprocess.run(["make", "-C", str(clone), "era5_sample", f"BIN={Path(sys.executable).parent}",
                           f"STAMP={stamp}", "ERA5_SAMPLE_ARGS=--num_iters 5 --checkpoint_every_steps 5"],
                          env=subprocess_env(PYTHONPATH=""), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "converted samples/era5-levels-members.nc -> data/era5_sample" in proc.stdout
    assert "note: training has 1 distinct initial time(s)" in proc.stdout  # what the numbers can mean
    assert (clone / "runs" / "era5_sample" / "1CPU" / "00" / "checkpoints" / "model.pt").is_file() or \
        (clone / "runs" / "era5_sample" / "1GPU" / "00" / "checkpoints" / "model.pt").is_file()
