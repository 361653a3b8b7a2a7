"""``benchmarks/gpu_time.py``: the split of a trace's GPU time into compute, communication and exposed
communication, and the communication by kernel, against hand-worked traces and against counting a microsecond
grid (numpy) on random ones."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.gpu_time import collectives, gpu_time_split


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


def test_collectives_by_kernel_hand_worked():
    """Two steps. Compute 0-100 and 300-400. Two all-gathers (90-110, 290-310: 10 exposed each) and a
    reduce-scatter 150-250 (all exposed) on one stream; an all-reduce 350-450 on another (50 exposed) that
    overlaps nothing but compute; a peer copy 500-510. Names are cut at the first "(", and the rows are ordered
    by exposed time."""
    trace = {"traceEvents": [
        _kernel("gemm", 0, 100), _kernel("gemm", 300, 100),
        _kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 90, 20),
        _kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 290, 20),
        _kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", 150, 100),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 350, 100),
        _kernel("Memcpy PtoP (Device -> Device)", 500, 10, "gpu_memcpy"),
    ]}
    rows = collectives(trace, steps=2)
    assert [r["kernel"] for r in rows] == ["ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL",
                                           "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                                           "ncclDevKernel_AllGather_RING_LL", "Memcpy PtoP"]
    got = [(r["count"], r["ms"] * 1e3, r["exposed_ms"] * 1e3) for r in rows]  # microseconds a step
    assert np.array(got) == pytest.approx(np.array([(0.5, 50, 50), (0.5, 50, 25), (1.0, 20, 10), (0.5, 5, 5)]))
    assert collectives({"traceEvents": [_kernel("gemm", 0, 5)]}, 1) == []
    with pytest.raises(ValueError, match="steps must be positive"):
        collectives(trace, 0)


def test_collectives_match_counting_a_microsecond_grid():
    """Random traces of compute and two collectives: each kernel's time and exposed time as a grid counts them;
    the exposed times sum to the split's when the two never overlap each other."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        events, compute = [], np.zeros(2000, bool)
        comm = {"ncclA": np.zeros(2000, bool), "ncclB": np.zeros(2000, bool)}
        for _ in range(rng.integers(1, 30)):
            ts, dur, kind = int(rng.integers(0, 1900)), int(rng.integers(1, 100)), rng.choice(["gemm", "ncclA",
                                                                                            "ncclB"])
            events.append(_kernel(str(kind), ts, dur))
            (compute if kind == "gemm" else comm[kind])[ts:ts + dur] = True
        rows = {r["kernel"]: r for r in collectives({"traceEvents": events}, steps=1)}
        for name, busy in comm.items():
            if busy.any():
                assert rows[name]["ms"] * 1e3 == pytest.approx(busy.sum())
                assert rows[name]["exposed_ms"] * 1e3 == pytest.approx((busy & ~compute).sum())
            else:
                assert name not in rows
        if not (comm["ncclA"] & comm["ncclB"]).any():
            split = gpu_time_split({"traceEvents": events}, 1)
            assert sum(r["exposed_ms"] for r in rows.values()) == pytest.approx(split["exposed"])


def test_command_line_lists_the_collectives(tmp_path, capsys):
    import json

    from benchmarks.gpu_time import main
    trace = {"traceEvents": [_kernel("gemm", 0, 3000), _kernel("ncclDevKernel_AllReduce(args)", 2000, 2000)]}
    (tmp_path / "a.json").write_text(json.dumps(trace))
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": []}))
    main([str(tmp_path / "a.json"), str(tmp_path / "cpu.json"), "--steps", "2", "--collectives"])
    out = capsys.readouterr().out
    assert "| trace | kernel | a step | ms | exposed ms |" in out
    assert "| a.json | ncclDevKernel_AllReduce | 0.5 | 1.00 | 0.50 |" in out  # 2 ms, 1 exposed, over 2 steps
    assert "| cpu.json | no communication | 0 | 0.00 | 0.00 |" in out
