"""A ZeRO-3 checkpoint written by 2 GPUs resumes on 1 GPU and on 2 GPUs with tp 2, and the losses continue
those of the uninterrupted 2-GPU run: docs/checkpoints.md#resume (``--resume PATH`` on any number of ranks,
DCP reshards model and optimizer, at the same global batch every step sees the same samples).

The same test runs on 2 gloo CPU ranks when ``RESHARDING_ON_CPU=1`` (and no GPU is visible): a check of the
test itself on a machine without GPUs. The CPU suite covers the 2 -> 1 rank case in
``tests/e2e/test_resume_world_size.py``."""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.background import Run
from tests.jobs import metrics, run_path, run_record, start_job

DEVICES = [
    pytest.param("GPU", marks=[pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
                               pytest.mark.runs("GPU")]),
    pytest.param("CPU", marks=pytest.mark.skipif(
        torch.cuda.is_available() or os.environ.get("RESHARDING_ON_CPU") != "1",
        reason="the CPU twin runs only with RESHARDING_ON_CPU=1 and no GPU visible")),
]
# Relative tolerance on the epoch losses. The resumed runs see the same samples from the same state; they
# differ from the reference only in the order of floating-point sums: the gradient reduce-scatter of 2 ranks
# against one rank's sum over its local batch of 8, tp's all-reduce of partial GEMM outputs, and (on GPUs)
# cuBLAS/cuDNN kernels chosen per shape. Each is a rounding difference of float32 (tiny trains without AMP),
# about 1e-7 relative per operation, grown through 14 Adam steps. On 2 CPU ranks the losses agree to 1e-4
# (tests/e2e/test_resume_world_size.py); on GPUs 1e-3 leaves room for cuDNN's TF32 convolutions (the patch
# embedding: torch.backends.cudnn.allow_tf32 is on by default) and NCCL's ring order. A resharding bug (a
# shard in the wrong place, optimizer moments or schedule lost, a sample skipped) moves these losses by
# percents: between epochs 2 and 3 tiny's training loss falls by more than 10 %.
TOLERANCE = {"GPU": 1e-3, "CPU": 1e-4}
KEYS = ("loss/train", "loss/valid")


def finish(procs) -> None:
    """Wait for every rank of a job (:func:`tests.jobs.start_job`); fail with rank 0's output on an error."""
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outputs[0][0][-3000:] + outputs[0][1][-3000:]


def reshard(tmp_path, tiny_data, device: str = "GPU") -> None:
    """Train with ZeRO-3 on 2 ranks, resume its step-10 checkpoint on 1 rank and on 2 with tp 2, compare."""
    # fresh interpreters (not tests/forked.py's fork server): each rank initializes CUDA itself
    whole = tmp_path / "whole"
    finish(start_job(whole, tiny_data, ["--fsdp", "zero3", "--keep_checkpoints", "5"], 2))
    reference = run_path(whole, 2, device=device)
    checkpoint = reference / "checkpoints" / "step_00000010"  # mid-epoch 2 (8 steps per epoch)
    assert run_record(reference)["mesh"] == {"dp": 2, "ens": 1, "cp": 1, "tp": 1}
    layouts = {"one_rank": (1, [], 1), "tp2": (2, ["--tensor_parallel", "2"], 2)}  # ranks, arguments, tp
    jobs = {name: start_job(tmp_path / name, tiny_data, ["--resume", str(checkpoint), *args], ranks)
            for name, (ranks, args, _) in layouts.items()}  # side by side: rank 0 of both on the first GPU
    for procs in jobs.values():
        finish(procs)
    want = metrics(reference)[1:]  # the resumed runs are runs of their own from epoch 2 on
    assert [m["iteration"] for m in want] == [16, 24]
    tolerance = TOLERANCE[device]
    for name, (ranks, _, tp) in layouts.items():
        resumed = run_path(tmp_path / name, ranks, device=device)
        assert run_record(resumed)["mesh"] == {"dp": 1, "ens": 1, "cp": 1, "tp": tp}
        assert "resumed at iteration 10" in (resumed / "out.log").read_text()
        got = metrics(resumed)
        assert [m["iteration"] for m in got] == [16, 24], name
        worst = max(abs(a[k] - b[k]) / b[k] for a, b in zip(got, want) for k in KEYS)
        assert worst <= tolerance, f"{name}: largest relative loss difference {worst:.2e}: {got} vs {want}"


# on GPUs the jobs start with the session's other runs (tests/gpu/background.py), beside them
RUNS = {"GPU": Run(job=reshard, gpus=2)}


@pytest.mark.parametrize("device", DEVICES)
def test_zero3_checkpoint_of_two_ranks_resumes_on_one_rank_and_on_tp2(tiny_data, tmp_path, device, request):
    if device == "GPU":
        request.getfixturevalue("train_run")("GPU")
    else:
        reshard(tmp_path, tiny_data, device)
