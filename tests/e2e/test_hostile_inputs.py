"""A hostile user's inputs through the real entry points (issue 37): links and FIFOs planted in a run directory,
damaged run records, outputs that exist or are not files, parsers fed to spin, and signals while a process is
stuck. Each ends in one ``error:`` line (or the documented status) with nothing outside ``tmp_path`` touched:
every link points at a file of ``tmp_path`` that must stay as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_utils import subprocess_env
from tests.e2e.test_bad_inputs import assert_one_line_error, run_entry
from tests.jobs import RUN, reference_run, run_path, start_job

ROOT = Path(__file__).resolve().parents[2]
PRECIOUS = "precious\n"


@pytest.fixture
def finished_run(tiny_data, tmp_path, tmp_path_factory) -> Path:
    """A copy of a finished tiny run (24 iterations, checkpoints) at ``tmp_path/runs/tiny/1CPU/00``."""
    run = run_path(tmp_path, 1)
    shutil.copytree(reference_run(tmp_path_factory, tiny_data, [], 1)(), run)
    return run


def go_on(tiny_data: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The command that continues the finished run to 30 iterations."""
    return run_entry("train.py", [*RUN, "--data_path", str(tiny_data), "--expdir", str(tmp_path / "runs"),
                                  "--run_num", "00", "--num_iters", "30", *args], tmp_path)


@pytest.mark.parametrize("name", [".lock", "run.json", "config.yaml", "out.log", "metrics.jsonl"])
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_planted_run_file_is_never_followed(tiny_data, tmp_path, finished_run, name, kind):
    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    planted = finished_run / name
    planted.unlink(missing_ok=True)
    planted.symlink_to(outside) if kind == "link" else os.mkfifo(planted)
    proc = go_on(tiny_data, tmp_path)  # a FIFO would block a plain open forever
    assert_one_line_error(proc, [str(planted), "not a regular file", "remove it"])
    assert outside.read_text() == PRECIOUS
    assert os.path.lexists(planted)


@pytest.mark.parametrize("name", [".lock", "out.log"])
def test_a_hard_linked_run_file_is_never_written_through(tiny_data, tmp_path, finished_run, name):
    """A file the run appends to or rewrites in place, planted as a hard link to a file outside the run
    (#45 item 3): one line naming it, before anything of the run is written; the outside file stays as it was."""
    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    planted = finished_run / name
    planted.unlink(missing_ok=True)
    os.link(outside, planted)
    record = (finished_run / "run.json").read_text()
    assert_one_line_error(go_on(tiny_data, tmp_path), [str(planted), "has 2 hard links", "remove it"])
    assert outside.read_text() == PRECIOUS and (finished_run / "run.json").read_text() == record


@pytest.mark.parametrize("name", ["__0_0.distcp", "rank0.pt"])
def test_a_linked_checkpoint_file_is_named_as_a_link_without_checksums(tiny_data, tmp_path, finished_run, name):
    """With ``--checkpoint_checksums false`` no manifest catches a linked shard or per-rank file (DCP and
    ``torch.load`` followed it, #45 item 5): the checkpoint is refused naming the link, the previous one loads."""
    latest = finished_run / "checkpoints" / (finished_run / "checkpoints" / "latest").read_text().strip()
    outside = tmp_path / "outside"
    (latest / name).rename(outside)
    (latest / name).symlink_to(outside)
    proc = go_on(tiny_data, tmp_path, "--checkpoint_checksums", "false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (finished_run / "out.log").read_text()
    assert f"{latest / name} is a symbolic link, not a file this checkpoint wrote" in log
    assert "resumed at iteration 20 " in log


def test_a_torn_metrics_line_is_dropped_and_the_run_goes_on(tiny_data, tmp_path, finished_run):
    """What a SIGKILL or full disk during an append leaves: the resume warns and goes on (it used to end in a
    traceback at every later resume)."""
    metrics = finished_run / "metrics.jsonl"
    epochs = metrics.read_text().splitlines()
    metrics.write_text("\n".join(epochs) + '\n{"epoch": 3, "iterat')
    proc = go_on(tiny_data, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torn last line" in proc.stdout + (finished_run / "out.log").read_text()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records][:len(epochs)] == [json.loads(e)["iteration"] for e in epochs]


def test_a_full_disk_under_out_log_is_one_line_and_a_failure(tiny_data, tmp_path, finished_run):
    """The continued run's log outgrows the process's file-size limit (what a full disk does to it: the write
    fails, here with EFBIG): one line naming the log, exit 2 (logging printed 210 lines and the run exited 0)."""
    import resource
    log = finished_run / "out.log"
    with open(log, "a") as f:
        f.write("#\n" * (1 << 19))  # 1 MiB of log: larger than anything else the run writes
    limit = log.stat().st_size + 64

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited through exec: a write past the limit fails
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *RUN, "--data_path", str(tiny_data), "--expdir",
                           str(tmp_path / "runs"), "--run_num", "00", "--num_iters", "30"], cwd=tmp_path,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert_one_line_error(proc, [f"writing the run's log {log} failed: File too large", "free space"])
    assert log.stat().st_size <= limit


def test_a_file_size_limit_below_the_batch_buffers_is_one_line(tiny_data, tmp_path):
    """``ulimit -f 100`` (#45 item 7): the loader's shared-memory batch buffers, files of /dev/shm, cannot grow to
    their size. One line naming the limit, exit 2, before the run directory exists (it was two tracebacks, the
    second from ``BatchSlots.__del__`` of the half-built object, and exit 1). Python ignores SIGXFSZ from its
    start, so the resize fails with EFBIG instead of killing the process; the child ignores it explicitly all the
    same, as ``ulimit`` in a shell leaves it at its default."""
    import resource

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100 << 10, resource.RLIM_INFINITY))
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *RUN, "--data_path", str(tiny_data), "--expdir",
                           str(tmp_path / "runs")], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=limited)
    assert_one_line_error(proc, ["shared-memory batch buffers", "file-size limit (100 KiB, ulimit -f)",
                                 "ulimit -f unlimited"])
    assert not (tmp_path / "runs").exists()


def test_a_huge_run_record_is_not_read(tiny_data, tmp_path, finished_run):
    with open(finished_run / "run.json", "wb") as f:
        f.truncate(1 << 40)  # sparse: 1 TiB of zeros that read whole would take the host's memory
    assert_one_line_error(go_on(tiny_data, tmp_path), [str(finished_run / "run.json"), "larger than"])


@pytest.mark.parametrize("target", ["file", "fifo", "link", "dir"])
def test_export_never_replaces_what_it_did_not_create(tmp_path, finished_run, target):
    out = tmp_path / "model.pt"
    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    {"file": lambda: out.write_text(PRECIOUS), "fifo": lambda: os.mkfifo(out), "link": lambda: out.symlink_to(outside),
     "dir": lambda: out.mkdir()}[target]()
    proc = run_entry("tools.export_model", [str(finished_run), "--out", str(out)], tmp_path)
    assert_one_line_error(proc, [str(out), "--overwrite" if target == "file" else "not a regular file"])
    forced = run_entry("tools.export_model", [str(finished_run), "--out", str(out), "--overwrite"], tmp_path)
    if target == "file":
        assert forced.returncode == 0 and forced.stdout.startswith(f"wrote {out}"), forced.stderr[-3000:]
    else:  # --overwrite replaces a regular file only
        assert_one_line_error(forced, [str(out), "not a regular file"])
        assert os.path.lexists(out) and not out.is_file() or target == "link"
    assert outside.read_text() == PRECIOUS


@pytest.mark.parametrize("case,args,needles", [
    ("huge grid", ["--img_size", "100000", "100000"], ["one time step 149.0 GiB", "smaller --img_size"]),
    ("larger than the disk", ["--img_size", "4000", "8000", "--steps_per_year", "60000", "--dt_hours", "0.1"],
     ["GiB free under", "--out"]),
])
def test_generator_bounds_its_work_before_it_starts(tmp_path, case, args, needles):
    proc = run_entry("tools.make_synthetic_data", ["--out", str(tmp_path / "d"), *args], tmp_path)
    assert_one_line_error(proc, needles)
    assert not (tmp_path / "d").exists()


YAML_CASES = [
    ("alias bomb", "".join(f"l{i}: &l{i} [{','.join([f'*l{i - 1}' if i else '1'] * 10)}]\n" for i in range(12))
     + "a:\n  img_size: *l11\n", ["must map config names to settings"]),
    ("alias bomb in a value", "b:\n" + "".join(f"  l{i}: &l{i} [{','.join([f'*l{i - 1}' if i else '1'] * 10)}]\n"
                                               for i in range(12)) + "a:\n  img_size: *l11\n",
     ["img_size expects"]),
    ("deep nesting", "a:\n  img_size: " + "[" * 3000 + "]" * 3000 + "\n", ["nested more than 8 levels deep"]),
    ("float spelling of a huge int", "a:\n  num_iters: 1.0e100\n", ["num_iters expects an integer"]),
    ("int beyond int64", f"a:\n  num_iters: {10 ** 30}\n", ["num_iters expects an integer of at most"]),
    ("config named ../../x", "../../x:\n  lr: 1\n", ["--config '../../x' must be a plain name"]),
]


@pytest.mark.parametrize("case,text,needles", YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_config_files_that_would_spin_are_one_line(tiny_data, tmp_path, case, text, needles):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    name = "../../x" if "../../x" in case else "a"
    proc = run_entry("train.py", ["--yaml_config", str(path), "--config", name, "--data_path", str(tiny_data),
                                  "--expdir", str(tmp_path / "runs")], tmp_path)
    assert_one_line_error(proc, needles)
    assert len(proc.stderr) < 500 and not (tmp_path / "runs").exists() and not (tmp_path.parent / "x").exists()


@pytest.mark.parametrize("args,needles", [
    (["--config"], ["--config needs a value"]),
    (["--config", "--lr", "1"], ["--config needs a value"]),
    (["--num_iters", str(2 ** 63)], ["--num_iters expects an integer of at most"]),
    (["--patch_size", "64"], ["--patch_size 8 or 16 or 32"]),
])
def test_command_line_bounds_are_one_line(tiny_data, tmp_path, args, needles):
    proc = run_entry("train.py", ["--data_path", str(tiny_data), "--expdir", str(tmp_path / "runs"), *args], tmp_path)
    assert_one_line_error(proc, needles)
    assert "--img_size [0" not in proc.stderr


@pytest.mark.parametrize("order,needle", [("reversed", "runs south to north"), ("shuffled", "in no single direction")])
def test_a_latitude_axis_not_north_to_south_is_named(tiny_data, tmp_path, order, needle):
    import h5py
    import numpy as np
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    path = sorted((data / "train").glob("*.h5"))[0]
    with h5py.File(path, "r+") as f:
        lat = f["latitude"][()]
        del f["latitude"]
        f["latitude"] = lat[::-1] if order == "reversed" else np.roll(lat, 3)
    proc = run_entry("train.py", ["--data_path", str(data), "--expdir", str(tmp_path / "runs")], tmp_path)
    assert_one_line_error(proc, [str(path), needle, "north to south"])


STUCK = """
import sys, time
sys.path.insert(0, {root!r})
from utils.core.signals import install
install()
from utils.core.errors import run_cli
def main(argv):
    print("ready", flush=True)
    while True:  # a process stuck before its next step boundary: it never reads the flag
        time.sleep(0.05)
sys.exit(run_cli(main))
"""


@pytest.mark.parametrize("first", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_ctrl_c_after_a_recorded_signal_stops_at_once(first):
    proc = subprocess.Popen([sys.executable, "-c", STUCK.format(root=str(ROOT))], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env())
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(getattr(signal, first))
    time.sleep(0.3)  # the first signal is recorded (not a timed assertion: the order of delivery only)
    assert proc.poll() is None  # recorded, not acted on: the process is stuck
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "interrupted\n", err


def test_a_survivor_of_rank_0_prints_no_cpp_stack(tiny_data, tmp_path):
    """Rank 0 SIGKILLed mid-run: rank 1 prints its one line naming rank 0, and nothing from the TCPStore's C++
    side (44 lines of stack before)."""
    procs = start_job(tmp_path, tiny_data, ["--num_iters", "100000", "--collective_timeout_s", "20"], 2, signal_at=3,
                      KILL_RANKS="0")
    outputs = [p.communicate(timeout=300) for p in procs]
    assert procs[0].returncode == -signal.SIGKILL
    err = outputs[1][1]
    assert procs[1].returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 of 2"), err[-3000:]
