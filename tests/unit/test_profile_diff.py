"""``benchmarks/profile_diff.py``: two ``profile_step.py`` op tables side by side, per step, against hand-worked
files; its command line's tables and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.profile_diff import differences, kernel_kind, kernel_kinds, main, per_step, short, summary
from utils.core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def _op(name, calls, device_us, cpu_us=0.0):
    return {"name": name, "calls": calls, "device_time_total_us": device_us, "self_device_time_total_us": device_us,
            "cpu_time_total_us": cpu_us, "self_cpu_time_total_us": cpu_us}


def _profile(steps, ops, **extra):
    return {"config": "mp", "steps": steps, "step_ms": 100.0, "ops": ops, **extra}


# a: 2 profiled steps; b: 4. Per step: gemm 1.0 -> 2.0 ms (+1.0), calls 3 -> 3; attention 4.0 -> 3.5 (-0.5);
# copy 0.2 -> 0.3 (+0.1, under 0.3); send only in b (+0.75); all-gather only in a (-0.8)
A = _profile(2, [_op("gemm", 6, 2000), _op("attention(q, k, v)", 2, 8000), _op("copy", 4, 400),
                 _op("ncclDevKernel_AllGather_RING_LL(args)", 2, 1600)],
             profiled_step_ms=98.0, gpu_time_ms={"span": 90.0, "busy": 85.0, "idle": 5.0, "compute": 70.0,
                                                 "communication": 16.0, "exposed": 15.0})
B = _profile(4, [_op("gemm", 12, 8000), _op("attention(q, k, v)", 4, 14000), _op("copy", 8, 1200),
                 _op("ncclDevKernel_SendRecv(args)", 8, 3000)],
             profiled_step_ms=99.0, gpu_time_ms={"span": 91.0, "busy": 88.0, "idle": 3.0, "compute": 80.0,
                                                 "communication": 12.0, "exposed": 2.0})


def test_hand_worked_differences_per_step_largest_first():
    kind, rows = differences(A, B, min_ms=0.3)
    assert kind == "device"
    assert [r["name"] for r in rows] == ["gemm", "ncclDevKernel_AllGather_RING_LL(args)",
                                         "ncclDevKernel_SendRecv(args)", "attention(q, k, v)"]
    got = [[r["a_ms"], r["b_ms"], r["diff_ms"], r["a_calls"], r["b_calls"]] for r in rows]
    want = [[1.0, 2.0, 1.0, 3, 3], [0.8, 0.0, -0.8, 1, 0], [0.0, 0.75, 0.75, 0, 2], [4.0, 3.5, -0.5, 1, 1]]
    assert [pytest.approx(w) == g for w, g in zip(want, got)] == [True] * 4, got
    assert [r["name"] for r in differences(A, B, min_ms=0.0)[1]][-1] == "copy"  # 0.1 ms: listed at 0


# One step of an async-tp-like GPU profile as key_averages saves it: an Inductor kernel on two rows (its launch
# on the CPU, which carries the kernel's device time, and the kernel), a record_function range on two rows (the
# CPU op, no device time of its own, and its span drawn on the GPU timeline, 9 ms that are other kernels').
RANGED = _profile(1, [
    _op("triton_poi_fused_gelu_9", 2, 1500, cpu_us=40), _op("triton_poi_fused_gelu_9", 2, 1500),
    {**_op("fused_all_gather_matmul", 4, 0, cpu_us=300), "device_time_total_us": 9000},
    _op("fused_all_gather_matmul", 8, 9000),
    _op("nvjet_sm90_tst_256x144_NNT", 4, 5000), _op("void cublasLt::splitKreduce_kernel<32>(args)", 1, 100),
    _op("Memcpy PtoP (Device -> Device)", 4, 2000), _op("Memcpy DtoD (Device -> Device)", 4, 300),
    _op("c10d::symmetric_memory::barrier_kernel(unsigned int**)", 12, 400),
    _op("void at::native::reduce_kernel<128, 4>(args)", 2, 600),
    _op("cudnn_generated_fort_native_sdpa_sm90_flash_fprop(args)", 1, 3000),
    _op("ncclDevKernel_AllGather_RING_LL(args)", 1, 250), _op("spin_kernel(long)", 1, 10)])


def test_a_name_on_two_rows_counts_once_and_gpu_ranges_are_no_ops():
    ops = per_step(RANGED, "self_device_time_total_us")
    assert ops["triton_poi_fused_gelu_9"] == (1.5, 2)  # once, not 3.0
    assert ops["fused_all_gather_matmul"] == (0.0, 4)  # the CPU op; its GPU span (9 ms of other kernels) left out
    assert per_step(RANGED, "self_device_time_total_us", scale=0.5)["nvjet_sm90_tst_256x144_NNT"] == (2.5, 4)


def test_kernels_by_kind_hand_worked():
    assert kernel_kinds(RANGED) == pytest.approx({
        "Triton": 1.5, "GEMM": 5.1, "peer-to-peer copy": 2.0, "copy and set": 0.3, "symmetric-memory barrier": 0.4,
        "eager ATen": 0.6, "attention": 3.0, "NCCL": 0.25, "other": 0.01})
    assert kernel_kinds(RANGED, scale=2.0)["GEMM"] == pytest.approx(10.2)
    assert kernel_kinds(_profile(1, [_op("aten::addmm", 2, 0, cpu_us=5000)])) == {}  # a CPU profile: no kernels
    assert kernel_kind("nccl:all_reduce") == "other" and kernel_kind("ncclDevKernel_SendRecv(x)") == "NCCL"


def test_scale_a_puts_a_ddp_rank_against_half_its_work(tmp_path, capsys):
    """--scale_a 0.5: every time of a (summary, kinds, ops) halved, calls kept; b as it is."""
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(B)), pb.write_text(json.dumps(RANGED))
    assert summary(B, RANGED, 0.5)[0] == ("step ms", 50.0, 100.0)
    main([str(pa), str(pb), "--scale_a", "0.5", "--min_ms", "0.5"])
    out = capsys.readouterr().out
    assert "/a.json (a x 0.5) | " in out and "| step ms | 50.00 | 100.00 | +50.00 |" in out
    assert "| GEMM | 1.00 | 5.10 | +4.10 |" in out  # B's "gemm": 2.0 ms a step, halved
    assert "| gemm | 1.00 | 0.00 | -1.00 | 3 | 0 |" in out  # calls are not scaled
    with pytest.raises(UserError, match="--scale_a must be a positive number"):
        main([str(pa), str(pb), "--scale_a", "0"])


def test_cpu_profiles_compare_cpu_time():
    """No device time in either file (a CPU run): the self CPU time is compared."""
    a = _profile(1, [_op("aten::addmm", 2, 0, cpu_us=5000)])
    b = _profile(1, [_op("aten::addmm", 2, 0, cpu_us=3000)])
    kind, rows = differences(a, b, 0.3)
    assert kind == "CPU" and [(r["name"], r["diff_ms"]) for r in rows] == [("aten::addmm", pytest.approx(-2.0))]


def test_a_gpu_profile_against_a_cpu_one_is_refused():
    cpu = _profile(1, [_op("aten::addmm", 2, 0, cpu_us=5000)])
    with pytest.raises(UserError, match="b is a GPU profile and a a CPU one"):
        differences(cpu, B, 0.3)


def test_summary_holds_only_the_figures_both_files_have():
    assert summary(A, B)[:3] == [("step ms", 100.0, 100.0), ("profiled step ms", 98.0, 99.0),
                                 ("GPU span ms", 90.0, 91.0)]
    assert summary(A, _profile(1, [])) == [("step ms", 100.0, 100.0)]  # a CPU profile has no split


def test_short_names_cut_at_the_arguments():
    assert short("void cudnn::fusion::convert_dq<true>(void const*, int)", 90) == "void cudnn::fusion::convert_dq<true>"
    assert short("x" * 20, 10) == "xxxxxxx..." and short("(odd)", 90) == "(odd)"


def test_command_line_prints_both_tables(tmp_path, capsys):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    pa, pb = tmp_path / "a" / "p.json", tmp_path / "b" / "p.json"
    pa.write_text(json.dumps(A)), pb.write_text(json.dumps(B))
    main([str(pa), str(pb), "--min_ms", "0.6"])
    out = capsys.readouterr().out
    assert "| | a/p.json (a) | b/p.json (b) | b - a |" in out and "| GPU exposed ms | 15.00 | 2.00 | -13.00 |" in out
    assert "| gemm | 1.00 | 2.00 | +1.00 | 3 | 3 |" in out and "| ncclDevKernel_SendRecv | 0.00 | 0.75 | +0.75 | 0 | 2 |" in out
    assert "attention" not in out and "self device time" in out
    main([str(pa), str(pa)])
    assert "| (none) | | | | | |" in capsys.readouterr().out


@pytest.mark.parametrize("content, words", [
    ("{", "is not JSON"),
    (json.dumps([1]), "is not a JSON written by profile_step.py --out"),
    (json.dumps({**A, "steps": 0}), "it needs steps, step_ms and ops"),
    (json.dumps({**A, "steps": True}), "it needs steps"),
    (json.dumps({**A, "ops": [{"name": "x", "calls": 1}]}), "each op with name, calls and self times"),
    (json.dumps({**A, "step_ms": "fast"}), "it needs steps, step_ms and ops"),
])
def test_a_file_that_is_not_profile_steps_is_refused(tmp_path, content, words):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(A))
    with pytest.raises(UserError, match=words):
        main([str(good), str(bad)])


def test_refusals_are_one_line_from_the_command(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(A))
    for args, words in [([str(good), str(tmp_path / "none.json")], "cannot read"),
                        ([str(good), str(good), "--min_ms", "nan"], "--min_ms must be >= 0")]:
        proc = subprocess.run([sys.executable, "benchmarks/profile_diff.py", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.startswith("error: ") and words in proc.stderr and proc.stderr.count("\n") == 1
