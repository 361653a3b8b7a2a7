"""Resuming on another number of data-parallel ranks at the same global batch: DCP reshards model and
optimizer, and the data order, a function of (seed, epoch, global sample position), stays the same."""

from __future__ import annotations

import torch

from tests.jobs import final_state, metrics, reference_run, run_job, run_path


def test_two_ranks_then_one_rank_follows_the_one_rank_run(tiny_data, tmp_path, tmp_path_factory):
    whole = reference_run(tmp_path_factory, tiny_data, [], 1)  # the one-rank run (shared; runs meanwhile)
    cut = tmp_path / "cut"
    job = run_job(cut, tiny_data, ["--fsdp", "zero3"], 2, signal_at=13)  # SIGKILLed after step 13
    assert all(status < 0 for status, _, _ in job), job[0][2][-3000:]
    checkpoint = run_path(cut, 2) / "checkpoints" / "step_00000010"
    [(status, out, err)] = run_job(cut, tiny_data, ["--resume", str(checkpoint)], 1)
    assert status == 0, err[-3000:]
    resumed, reference = run_path(cut, 1), whole()
    assert "resumed at iteration 10" in (resumed / "out.log").read_text()
    # the same samples in every global batch: the runs differ only by summation order
    got, want = metrics(resumed), metrics(reference)[1:]  # a run of its own: from epoch 2 on
    assert [m["iteration"] for m in got] == [m["iteration"] for m in want] == [16, 24]
    for a, b in zip(got, want):
        assert abs(a["loss/train"] - b["loss/train"]) < 1e-4 * b["loss/train"], (a, b)
    got, want = final_state(resumed, tmp_path), final_state(reference, tmp_path)
    model = [k for k in want if k.startswith("/model/")]
    assert model
    for key in model:
        torch.testing.assert_close(got[key], want[key], rtol=1e-3, atol=1e-5)
