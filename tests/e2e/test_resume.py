"""Exact resume through the real entry point: a run SIGKILLed mid-epoch and re-run with the same command
ends with bitwise the same parameters, optimizer state and metrics as an uninterrupted run, on one
process, DDP, FSDP, tensor parallel, context parallel and tensor parallel with FSDP."""

from __future__ import annotations

import re
import signal

import pytest
import torch

from tests.jobs import assert_same_state, final_state, metrics, reference_run, run_job, run_path, run_record


# (ranks, arguments, whether to re-run the finished run too: that path does not depend on the
# parallelism, and a launch of 4 processes costs ~10 s of start-up on 2 cores). 3 and 4 data-parallel ranks:
# a sum of 3 or more addends depends on their order, which an all-reduce must keep across a restart
@pytest.mark.parametrize("ranks,extra,again", [
    (1, [], True), (2, [], True), (3, ["--global_batch_size", "9"], False), (4, ["--fsdp", "zero3"], False),
    (2, ["--tensor_parallel", "2"], False), (2, ["--context_parallel", "2"], False),
    (4, ["--tensor_parallel", "2", "--fsdp", "zero3"], False),
], ids=["one process", "DDP 2 ranks", "DDP 3 ranks", "FSDP ZeRO-3 4 ranks", "tp 2", "cp 2",
        "tp 2 x FSDP ZeRO-3 dp 2"])
def test_sigkill_mid_epoch_then_rerun_equals_uninterrupted(tiny_data, tmp_path, tmp_path_factory, ranks, extra,
                                                          again):
    # the uninterrupted run (shared with other tests of the session that need the same one)
    whole = reference_run(tmp_path_factory, tiny_data, extra, ranks)
    cut = tmp_path / "cut"
    killed = run_job(cut, tiny_data, extra, ranks, signal_at=13)
    assert all(p[0] == -signal.SIGKILL for p in killed), [p[0] for p in killed]
    run = run_path(cut, ranks)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    for proc in run_job(cut, tiny_data, extra, ranks):  # the same command again
        assert proc[0] == 0, proc[2][-3000:]
    assert "resumed at iteration 10" in (run / "out.log").read_text()
    assert_same_state(run, whole(), tmp_path)
    # the checkpoint holds the single-GPU layout (tensor-parallel slices as blocks of the dense tensors)
    got = final_state(run, tmp_path)
    exported = torch.load(run / "checkpoints" / "model.pt")["model"]
    assert exported.keys() == {k[len("/model/"):] for k in got if k.startswith("/model/")}
    for key, value in exported.items():
        assert torch.equal(got[f"/model/{key}"], value), key
    record = run_record(run)
    assert record["status"] == "completed" and [r["step"] for r in record["resumes"]] == [10]
    if again:
        rerun = run_job(cut, tiny_data, extra, ranks)  # a finished run: nothing to do
        assert all(p[0] == 0 and "is complete (24 iterations)" in p[1] for p in rerun)


ENSEMBLE = ["--noise_channels", "2", "--loss", "crps", "--ensemble_members", "3"]


@pytest.mark.parametrize("inputs,ranks", [
    ([], 1), (["--forcings", "[cos_solar_zenith_angle,sin_local_time,cos_local_time]", "--residual", "true"], 1),
    (ENSEMBLE, 1), ([*ENSEMBLE, "--ensemble_parallel", "3"], 3),
], ids=["state only", "forcings", "ensemble", "ensemble over 3 ranks"])
def test_sigkill_mid_rollout_curriculum_then_rerun_equals_uninterrupted(tiny_data, tmp_path, tmp_path_factory,
                                                                       inputs, ranks):
    """K rises 1 -> 2 -> 3 at iterations 6 and 12: killed after 13 (checkpoint at 10, K 2), the same command
    continues the curriculum across the raise at 12 to bitwise the uninterrupted run, its epoch lines showing K's range
    over each epoch and its records counting epochs from 1 as they do (with forcings too: each of the
    K applications reads those of its own valid time, recomputed after the restart; with an ensemble too: each
    member's noise is drawn again from its key, on one rank or with its 3 members on 3 ranks)."""
    curriculum = ["--rollout_max_steps", "3", "--rollout_raise_every", "6", "--rollout_checkpointing", "true",
                  *inputs]
    whole = reference_run(tmp_path_factory, tiny_data, curriculum, ranks)
    cut = tmp_path / "cut"
    run_job(cut, tiny_data, curriculum, ranks, signal_at=13)
    run = run_path(cut, ranks)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    for status, out, err in run_job(cut, tiny_data, curriculum, ranks):
        assert status == 0, err[-3000:]
    assert "resumed at iteration 10" in (run / "out.log").read_text()
    assert_same_state(run, whole(), tmp_path)
    assert [m["train/rollout_steps"] for m in metrics(run)] == [2, 3, 3]  # epochs end at 8, 16, 24
    assert [m["epoch"] for m in metrics(run)] == [1, 2, 3]  # as the console counts them
    log = (run / "out.log").read_text()
    assert "epoch 3 step 8/8 loss" in log and "train loss" in log
    assert [line.rsplit(" K ", 1)[-1] for line in log.splitlines() if " step 8/8 loss " in line] == ["2", "3", "3"]
    # the epoch line: K over the epoch, a range where a raise fell inside it (epoch 2 resumed at 10, after its start)
    epochs = [re.search(r" epoch (\d)/3 \|.*\(K ([\d-]+)\)", line) for line in log.splitlines()]
    assert [m.groups() for m in epochs if m] == [("1", "1-2"), ("2", "2-3"), ("3", "3")], log


def test_fine_tune_from_a_run_killed_then_rerun_resumes_its_own_checkpoint(tiny_data, tmp_path, tmp_path_factory):
    """--init_from a finished K=1 run, at K=2: SIGKILLed, the same command resumes the fine-tune's checkpoint (not
    the source's weights again) and ends bitwise equal to the uninterrupted fine-tune."""
    source = reference_run(tmp_path_factory, tiny_data, [], 1)()
    fine_tune = ["--init_from", str(source), "--train_rollout_steps", "2", "--lr", "5e-4"]
    whole = reference_run(tmp_path_factory, tiny_data, fine_tune, 1)
    cut = tmp_path / "cut"
    run_job(cut, tiny_data, fine_tune, 1, signal_at=13)
    (status, _, err), = run_job(cut, tiny_data, fine_tune, 1)
    assert status == 0, err[-3000:]
    log = (run_path(cut, 1) / "out.log").read_text()
    assert log.count(f"weights from {source}") == 1 and "resumed at iteration 10" in log
    assert_same_state(run_path(cut, 1), whole(), tmp_path)
    assert run_record(run_path(cut, 1))["config"]["init_from"] == str(source)
