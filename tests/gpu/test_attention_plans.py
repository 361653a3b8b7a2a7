"""``benchmarks/attention_plans.py`` on a GPU: its graphs are the training kernel's, and every plan it times is
checked against that kernel's result."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks.attention_plans import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cudnn") is None,
                                reason="needs a CUDA GPU and cudnn-frontend")


def test_attention_plans_time_every_plan_and_check_each_against_the_training_kernel(tmp_path):
    out = tmp_path / "plans.json"
    assert main(["--batch", "1", "--tokens", "128", "--heads", "2", "--head_dim", "48", "--iters", "2",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    for graph in ("fwd", "bwd"):
        mine = [r for r in rows if r["graph"] == graph]
        first = [r for r in mine if r["note"].startswith("heuristics' #0")]
        # the heuristics' first plan is the kernel training runs: the forward bit for bit; the backward sums dQ with
        # atomics, so its order (and a bf16 rounding) may differ between runs
        assert len(first) == 1 and "ms" in first[0], first
        assert first[0]["max_diff"] == 0.0 if graph == "fwd" else first[0]["max_diff"] <= 0.02
        assert any(r["note"] == "knob sweep" for r in mine)  # each engine's knobs were tried beyond the heuristics
        built = [r for r in mine if "ms" in r]
        assert all(r["ms"] > 0 and ("wrong" in r["note"]) == (r["max_diff"] > 0.02) for r in built)
        assert all(r["declined"] for r in mine if "ms" not in r)  # every plan not timed says why
