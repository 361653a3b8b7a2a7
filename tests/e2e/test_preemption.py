"""Preemption and stuck ranks with real signals and real processes.

SIGUSR1/SIGTERM: every rank checkpoints at the same step boundary and exits with status 75, and the
same command resumes to bitwise the result of an uninterrupted run. SIGSTOP of one rank: the others
stop within the collective timeout with one line naming it.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.jobs import (
    assert_same_state,
    reference_run,
    run_job,
    run_path,
    run_record,
    start_job,
)
from utils.core.errors import EXIT_PREEMPTED


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    """Reference runs without any signal, by number of ranks (shared by the session: see reference_run);
    ``uninterrupted(ranks)`` starts one and returns a function that waits for its run directory."""
    return lambda ranks: reference_run(tmp_path_factory, tiny_data, [], ranks)


def test_sigusr1_on_one_rank_stops_every_rank_with_a_checkpoint(tiny_data, tmp_path, uninterrupted):
    reference = uninterrupted(2)
    # only rank 1 gets the signal (after step 13): the per-step all-reduce makes both stop together
    job = run_job(tmp_path, tiny_data, [], 2, signal_at=13, KILL_SIGNAL="USR1", KILL_RANKS="1")
    assert [status for status, _, _ in job] == [EXIT_PREEMPTED] * 2, [err[-2000:] for _, _, err in job]
    run = run_path(tmp_path, 2)
    stopped = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 13 < stopped <= 15  # within two steps of the signal; not at a periodic checkpoint (10, 15 aside)
    lines = [line for line in job[0][1].splitlines() if line.startswith("preempted")]
    assert lines == [f"preempted by SIGUSR1 at iteration {stopped}: checkpoint {run / 'checkpoints'}"
                     f"/step_{stopped:08d} written; exit status 75; run the same command to resume"]
    assert not any(line.startswith("preempted") for line in job[1][1].splitlines())  # one line per job
    assert "error:" not in job[0][2] + job[1][2]
    assert run_record(run)["status"] == "preempted"
    for status, _, err in run_job(tmp_path, tiny_data, [], 2):  # the same command again
        assert status == 0, err[-3000:]
    assert f"resumed at iteration {stopped}" in (run / "out.log").read_text()
    assert_same_state(run, reference(), tmp_path)


def test_sigterm_at_an_epochs_last_step_resumes_before_its_report(tiny_data, tmp_path, uninterrupted):
    reference = uninterrupted(1)  # runs meanwhile
    # signalled after step 6, agreed at step 8: the epoch's last, before validation and its report
    [(status, out, err)] = run_job(tmp_path, tiny_data, [], 1, signal_at=6, KILL_SIGNAL="TERM")
    assert status == EXIT_PREEMPTED, err[-3000:]
    assert "preempted by SIGTERM at iteration 8" in out
    run = run_path(tmp_path, 1)
    assert not (run / "metrics.jsonl").exists()  # epoch 1 not yet reported
    [(status, _, err)] = run_job(tmp_path, tiny_data, [], 1)
    assert status == 0, err[-3000:]
    assert_same_state(run, reference(), tmp_path)


def test_without_checkpoints_a_signal_stops_at_once(tiny_data, tmp_path):
    [(status, out, err)] = run_job(tmp_path, tiny_data, ["--save_checkpoint", "false"], 1, signal_at=3,
                                   KILL_SIGNAL="USR1")
    assert status == EXIT_PREEMPTED, err[-3000:]  # the preemption status all the same: a requeue runs it again
    assert re.search(r"preempted by SIGUSR1 at iteration \d+: no checkpoint written \(--save_checkpoint false\)",
                     out + err), out[-3000:]
    assert not (run_path(tmp_path, 1) / "checkpoints" / "latest").exists()


def test_a_stopped_rank_makes_the_others_exit_naming_it(tiny_data, tmp_path):
    timeout_s = 12  # silence for 3/4 of it (9 s) declares the rank lost; above gVisor's 5 s store stalls (launching.md)
    procs = start_job(tmp_path, tiny_data, ["--collective_timeout_s", str(timeout_s)], 2, signal_at=5,
                      KILL_SIGNAL="STOP", KILL_RANKS="1")
    try:
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        waited = time.monotonic() - t0
    finally:
        procs[1].kill()  # SIGKILL also ends a stopped process
        procs[1].communicate()
    assert procs[0].returncode == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith("error: rank 1 of 2 stopped answering at iteration ")
    assert ": no heartbeat for 9 s; the process is stopped, hung or its node is gone" in errors[0]
    assert "Traceback" not in err
    assert waited < 60  # startup plus 9 s of silence: never the hang a stopped rank used to cause


def test_a_resume_never_run_stopped_names_its_run_num(tiny_data, tmp_path):
    """``--resume never`` starts a new run each time: the preemption line names ``--run_num`` of the run it
    stopped, not "the same command" (#45 item 14)."""
    job = run_job(tmp_path, tiny_data, ["--resume", "never"], 1, signal_at=5, KILL_SIGNAL="INT")
    assert [status for status, _, _ in job] == [EXIT_PREEMPTED], job[0][2][-2000:]
    run = run_path(tmp_path, 1)
    lines = [line for line in job[0][1].splitlines() if line.startswith("preempted")]
    assert len(lines) == 1 and "run the same command to resume" not in lines[0], lines
    assert lines[0].endswith(f"to resume this run, run the same command with --run_num {run.name} instead of "
                             "--resume never (as it is, it starts another new run)"), lines
