"""A run's life with real processes and real signals: signals from the first instant, Ctrl-C as a
preemption (a second one stops at once), one live owner per run directory, and ``make train``'s command
killed at a random moment and run again."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_utils import subprocess_env
from tests.forked import ForkedPopen
from tests.jobs import RUN, assert_same_state, reference_run, run_job, run_path, with_args
from utils.core.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]
MAKE_TRAIN = ["--yaml_config", "config/ViT.yaml", "--config", "tiny"]  # the Makefile's train target
MAKE_TRAIN_300 = [*MAKE_TRAIN, "--num_iters", "300"]  # the same, 300 of tiny's 800 iterations (the suite's time)


def train(workdir: Path, data: Path, *args: str, run_args=tuple(RUN), forked: bool = False) -> subprocess.Popen:
    """``python train.py run_args + args`` in ``workdir``, running: a fresh interpreter, or with ``forked`` one
    forked from ``tests/forked.py``'s server (torch already imported: seconds of CPU less) for tests that do not
    signal it during its start-up."""
    workdir.mkdir(exist_ok=True)
    command = [str(ROOT / "train.py"), *with_args([*run_args, "--data_path", str(data), "--expdir",
                                                   str(workdir / "runs")], args)]
    if forked:
        return ForkedPopen(command, workdir, subprocess_env())
    return subprocess.Popen([sys.executable, *command], cwd=workdir, env=subprocess_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float = 120) -> None:
    """Read ``proc``'s stdout until a line contains ``text``."""
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if text in line:
            return
        assert time.monotonic() < deadline, f"no line with {text!r} within {timeout_s} s"
    raise AssertionError(f"{text!r} never printed; stderr: {proc.stderr.read()[-3000:]}")


@pytest.mark.parametrize("sig", ["TERM", "USR1", "INT"])
def test_a_signal_at_0_2_s_is_a_preemption_with_a_line(tiny_data, tmp_path, sig):
    proc = train(tmp_path, tiny_data)
    time.sleep(0.2)
    proc.send_signal(getattr(signal, "SIG" + sig))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert f"preempted by SIG{sig} during start-up: nothing trained" in out, out[-3000:]
    assert "Traceback" not in err and not (tmp_path / "runs").exists()  # stopped before writing anything


def test_ctrl_c_saves_then_the_same_command_equals_uninterrupted(tiny_data, tmp_path, tmp_path_factory):
    whole = reference_run(tmp_path_factory, tiny_data, [], 1)
    [(status, out, err)] = run_job(tmp_path, tiny_data, [], 1, signal_at=13, KILL_SIGNAL="INT")
    assert status == EXIT_PREEMPTED, err[-3000:]
    stopped = re.search(r"preempted by SIGINT at iteration (\d+): checkpoint .* written; exit status 75; run the same "
                        "command to resume", out)
    assert stopped and 13 <= int(stopped.group(1)) <= 15, out[-3000:]  # at the next step boundary all agree on
    assert hparams_status(run_path(tmp_path, 1)) == "STATUS_RUNNING"  # preempted: it goes on when run again
    [(status, _, err)] = run_job(tmp_path, tiny_data, [], 1)
    assert status == 0, err[-3000:]
    run = run_path(tmp_path, 1)
    assert f"resumed at iteration {stopped.group(1)}" in (run / "out.log").read_text()
    assert_same_state(run, whole(), tmp_path)
    assert hparams_status(whole()) == "STATUS_SUCCESS"


def hparams_status(run_dir: Path) -> str:
    """The status of the run's HParams session, as TensorBoard reads it from the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
    content = EventAccumulator(str(run_dir), size_guidance={"tensors": 0}).Reload().PluginTagToContent("hparams")
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"])
    return api_pb2.Status.Name(end.session_end_info.status)


def test_a_second_ctrl_c_stops_at_once_with_one_line(tiny_data, tmp_path):
    proc = train(tmp_path, tiny_data, "--num_iters", "100000")
    # during start-up: the first Ctrl-C is recorded and start-up goes on, so the second surely finds the run
    # alive (mid-run, tiny's stop after the first can finish within any fixed delay)
    wait_for_line(proc, "model: ")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert err.strip().splitlines() == ["interrupted"], err[-3000:]


def test_a_second_copy_of_a_live_run_is_refused_or_skipped(tiny_data, tmp_path):
    live = train(tmp_path, tiny_data, "--num_iters", "100000", forked=True)
    try:
        wait_for_line(live, "training ")
        explicit = train(tmp_path, tiny_data, "--num_iters", "100000", "--run_num", "00", forked=True)
        _, err = explicit.communicate(timeout=120)
        assert explicit.returncode == 2, err[-3000:]
        assert err.startswith(f"error: run directory {run_path(tmp_path, 1)} is in use by a live run (host ") and \
            f" pid {live.pid})" in err, err[-3000:]
        auto = train(tmp_path, tiny_data, "--num_iters", "100000", forked=True)
        wait_for_line(auto, "run 00 (the same settings) is in use by host ")
        auto.kill()
        auto.communicate()
    finally:
        live.kill()
        live.communicate()
    assert (run_path(tmp_path, 1, "01") / "out.log").is_file()  # the second copy made its own run
    assert "starting run 00" in (run_path(tmp_path, 1) / "out.log").read_text().splitlines()[0]


def test_make_train_killed_at_a_random_moment_then_rerun_equals_uninterrupted(tmp_path):
    """The Makefile's command on its data: SIGKILLed after a random step past the first checkpoint (100),
    then the same command; then another config, then the same command again, which says the run is complete.

    The command is the Makefile's with ``--num_iters 300`` (``MAKE_TRAIN_300``) rather than tiny's 800, to keep
    the suite's time: everything else the point rests on is the Makefile's (config, data, warm-up,
    ``checkpoint_every_steps`` 100, several epochs), and 300 iterations still hold two checkpoints (100, 200)
    past which the random kill (101..299) can land, a rerun that must resume from the last one and end with the
    uninterrupted run's state and validation loss, and a finished run that the same command calls complete."""
    from utils.preprocess.synthetic_dataset import make_synthetic_dataset
    data = make_synthetic_dataset(tmp_path / "data", channels=4, img_size=(32, 64), train_years=4,
                                  steps_per_year=128, seed=0)  # the Makefile's data target
    whole = train(tmp_path / "whole", data, run_args=MAKE_TRAIN_300, forked=True)
    step = random.Random().randint(101, 299)
    [(status, _, err)] = run_job(tmp_path / "cut", data, [], 1, signal_at=step, run_args=MAKE_TRAIN_300)
    assert status == -signal.SIGKILL, err[-3000:]
    [(status, out, err)] = run_job(tmp_path / "cut", data, [], 1, run_args=MAKE_TRAIN_300)
    assert status == 0, err[-3000:]
    run = run_path(tmp_path / "cut", 1)
    # the kill lands right after optimizer step `step`, before that step's own checkpoint: at 200, 100 is the last
    assert f"resumed at iteration {(step - 1) // 100 * 100}" in (run / "out.log").read_text(), step
    assert whole.wait(timeout=600) == 0, whole.stderr.read()[-3000:]
    assert_same_state(run, run_path(tmp_path / "whole", 1), tmp_path)

    def final_valid_loss(run_dir: Path) -> float:
        return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["loss/valid"]
    assert final_valid_loss(run) == final_valid_loss(run_path(tmp_path / "whole", 1)), step
    [(status, _, err)] = run_job(tmp_path / "cut", data, ["--num_iters", "16", "--lr", "5e-3"], 1,
                                 run_args=MAKE_TRAIN_300)  # another config: a run of its own
    assert status == 0 and run_path(tmp_path / "cut", 1, "01").is_dir(), err[-3000:]
    [(status, out, err)] = run_job(tmp_path / "cut", data, [], 1, run_args=MAKE_TRAIN_300)
    assert status == 0 and f"run {run} is complete (300 iterations)" in out, out[-3000:]


def test_a_continued_run_must_find_the_data_it_started_on(tiny_data, tmp_path, tmp_path_factory):
    import shutil
    run = run_path(tmp_path, 1)
    shutil.copytree(reference_run(tmp_path_factory, tiny_data, [], 1)(), run)
    record = json.loads((run / "run.json").read_text())
    assert record["data"] == {"channels": ["u10m", "v10m", "t2m", "sp"], "step_hours": 6.0}, record["data"]
    record["data"]["step_hours"] = 1.0  # as if --data_path now held hourly files
    (run / "run.json").write_text(json.dumps(record))
    proc = train(tmp_path, tiny_data, "--run_num", "00", "--num_iters", "30", forked=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert err.startswith(f"error: run {run} was trained on data with step_hours 1.0, but the data at {tiny_data} "
                          "has step_hours 6.0; point --data_path at the run's data"), err[-3000:]
