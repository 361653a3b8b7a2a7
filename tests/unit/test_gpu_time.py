"""``benchmarks/gpu_time.py``: the split of a trace's GPU time into compute, communication and exposed
communication, against a hand-worked trace and against counting a microsecond grid (numpy) on random ones."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.gpu_time import gpu_time_split


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_hand_worked_trace():
    """Two steps. Compute on two streams overlaps (0-100, 50-150) and is merged; NCCL 120-200 is hidden until
    150, exposed for 50; a peer copy 300-320 is communication, fully exposed; a gap 200-250 is idle. CPU ops and
    instant events are ignored."""
    trace = {"traceEvents": [
        _kernel("sm90_gemm", 0, 100), _kernel("flash_fwd", 50, 100),
        _kernel("ncclDevKernel_AllGather_RING_LL", 120, 80),
        _kernel("triton_poi_fused_add", 250, 50), _kernel("Memcpy PtoP (Device -> Device)", 300, 20, "gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5},
    ]}
    split = gpu_time_split(trace, steps=2)
    want = {"span": 320, "busy": 270, "idle": 50, "compute": 200, "communication": 100, "exposed": 70}
    assert split == pytest.approx({k: v / 2 / 1e3 for k, v in want.items()})


def test_matches_counting_a_microsecond_grid():
    rng = np.random.default_rng(0)
    for _ in range(20):
        events, compute, comm = [], np.zeros(2000, bool), np.zeros(2000, bool)
        for _ in range(rng.integers(1, 30)):
            ts, dur, nccl = int(rng.integers(0, 1900)), int(rng.integers(1, 100)), bool(rng.random() < 0.4)
            events.append(_kernel("ncclKernel_AllReduce" if nccl else "gemm", ts, dur))
            (comm if nccl else compute)[ts:ts + dur] = True
        busy = compute | comm
        on = np.flatnonzero(busy)
        want = {"span": on[-1] + 1 - on[0], "busy": busy.sum(), "idle": on[-1] + 1 - on[0] - busy.sum(),
                "compute": compute.sum(), "communication": comm.sum(), "exposed": (comm & ~compute).sum()}
        split = gpu_time_split({"traceEvents": events}, steps=1)
        assert split == pytest.approx({k: float(v) / 1e3 for k, v in want.items()})


def test_no_gpu_activity_and_bad_input():
    assert gpu_time_split({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]},
                          1) is None
    with pytest.raises(ValueError, match="not a Chrome trace"):
        gpu_time_split({"events": []}, 1)
    with pytest.raises(ValueError, match="steps must be positive"):
        gpu_time_split({"traceEvents": []}, 0)
    for ts, dur in (("0", 5), (0, -1), (float("nan"), 5), (True, 5), (0, None)):
        with pytest.raises(ValueError, match="no finite ts and non-negative dur"):
            gpu_time_split({"traceEvents": [_kernel("gemm", 0, 5), _kernel("bad", ts, dur)]}, 1)


def test_command_line_splits_saved_traces(tmp_path, capsys):
    """``python benchmarks/gpu_time.py`` on a plain and a gzipped trace and one without GPU activity: a row each."""
    import gzip
    import json

    from benchmarks.gpu_time import main
    trace = {"traceEvents": [_kernel("gemm", 0, 3000), _kernel("ncclDevKernel_AllReduce", 2000, 2000)]}
    (tmp_path / "a.json").write_text(json.dumps(trace))
    with gzip.open(tmp_path / "b.json.gz", "wt") as f:
        json.dump(trace, f)
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": []}))
    main([str(tmp_path / n) for n in ("a.json", "b.json.gz", "cpu.json")] + ["--steps", "2"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("| trace | span ms") and len(rows) == 4
    for row in rows[1:3]:  # span 4 ms, busy 4, idle 0, compute 3, communication 2, exposed 1; over 2 steps
        assert row.endswith("| 2.0 | 2.0 | 0.0 | 1.5 | 1.0 | 0.5 |"), row
    assert rows[3].startswith("| cpu.json | no GPU activity")
