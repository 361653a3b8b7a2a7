"""The one file mechanism (``utils/core/files.py``) and its users: nothing written follows a link or replaces
what is not a regular file, nothing read hangs on a FIFO or takes more than its bound, a torn last line of an
append-only log is dropped. Links and FIFOs are made in ``tmp_path`` only; their targets are files of
``tmp_path`` too, and each test checks the target is untouched."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from utils.core.errors import UserError
from utils.core.files import (NotOurs, check_replaceable, open_append, read_bounded, read_jsonl, write_atomic,
                              write_text_atomic)
from utils.core.lock import DirectoryLock, is_held, owner
from utils.core.logs import LogFile

ROOT = Path(__file__).resolve().parents[2]


def planted(tmp_path: Path, kind: str, name: str) -> tuple[Path, Path]:
    """``tmp_path/run/name`` made as ``kind`` (``link`` to a file outside the run, ``dangling`` link, ``fifo``,
    ``dir``); returns (the planted path, the outside file a link points at, or a path that must stay absent)."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    path = run / name
    if kind == "link":
        path.symlink_to(outside)
    elif kind == "dangling":
        outside.unlink()
        path.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    return path, outside


def untouched(outside: Path, kind: str) -> bool:
    return not outside.exists() if kind == "dangling" else outside.read_text() == "precious\n"


KINDS = ["link", "dangling", "fifo", "dir"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use", ["append", "read", "replace", "lock", "lock probe", "log"])
def test_no_run_file_follows_a_link_or_opens_a_non_regular_file(tmp_path, kind, use):
    name = {"lock": ".lock", "lock probe": ".lock", "log": "out.log"}.get(use, "metrics.jsonl")
    path, outside = planted(tmp_path, kind, name)
    act = {"append": lambda: os.close(open_append(path)), "read": lambda: read_bounded(path),
           "replace": lambda: write_text_atomic(path, "new\n"), "lock": lambda: DirectoryLock(path.parent).acquire(),
           "lock probe": lambda: is_held(path.parent), "log": lambda: LogFile(path)}[use]
    with pytest.raises(NotOurs) as err:  # a FIFO would block a plain open: this one returns
        act()
    message = str(err.value)
    assert str(path) in message and "not a regular file" in message and "\n" not in message, message
    assert untouched(outside, kind)
    assert os.path.lexists(path) and not os.path.lexists(path.with_name(name + ".tmp"))


@pytest.mark.parametrize("use", ["append", "lock", "lock probe", "log"])
def test_no_file_written_in_place_is_a_hard_link(tmp_path, use):
    """A hard link planted where the project appends or rewrites in place (#45 item 3): the write would change
    the file under its other name; refused in one line naming the file, which stays as it was."""
    name = {"lock": ".lock", "lock probe": ".lock", "log": "out.log"}.get(use, "metrics.jsonl")
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / name
    os.link(outside, path)
    act = {"append": lambda: os.close(open_append(path)), "lock": lambda: DirectoryLock(path.parent).acquire(),
           "lock probe": lambda: is_held(path.parent), "log": lambda: LogFile(path)}[use]
    with pytest.raises(NotOurs) as err:
        act()
    message = str(err.value)
    assert message.startswith(f"{path} has 2 hard links") and "remove it" in message and "\n" not in message
    assert outside.read_text() == "precious\n" and read_bounded(path) == b"precious\n"  # reading is harmless


def test_a_planted_temporary_link_is_removed_not_followed(tmp_path):
    path, outside = planted(tmp_path, "link", "run.json.tmp")
    write_text_atomic(path.with_name("run.json"), "{}\n")
    assert untouched(outside, "link") and path.with_name("run.json").read_text() == "{}\n"
    assert not os.path.lexists(path)


def test_outputs_are_never_overwritten_unless_asked(tmp_path):
    out = tmp_path / "model.pt"
    out.write_text("someone's file\n")
    with pytest.raises(NotOurs, match="exists; pass --overwrite"):
        write_atomic(out, lambda f: f.write(b"x"), overwrite=False)
    assert out.read_text() == "someone's file\n"
    write_atomic(out, lambda f: f.write(b"x"), overwrite=True)
    assert out.read_bytes() == b"x"
    check_replaceable(tmp_path / "new.pt", overwrite=False)  # nothing there: fine


@pytest.mark.parametrize("kind", KINDS)
def test_overwrite_never_replaces_what_is_not_a_regular_file(tmp_path, kind):
    path, outside = planted(tmp_path, kind, "model.pt")
    with pytest.raises(NotOurs, match="not a regular file"):
        write_atomic(path, lambda f: f.write(b"x"), overwrite=True)
    assert untouched(outside, kind) and os.path.lexists(path)


def test_reads_are_bounded(tmp_path):
    huge = tmp_path / "run.json"
    with open(huge, "wb") as f:
        f.truncate(10 << 30)  # a sparse 10 GiB file: reading it whole would take the host's memory
    with pytest.raises(NotOurs, match="larger than 1024 bytes"):
        read_bounded(huge, 1024)
    small = tmp_path / "small"
    small.write_bytes(b"12345")
    assert read_bounded(small, 5) == b"12345"
    with pytest.raises(NotOurs):
        read_bounded(small, 4)


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"iteration": 8}\n\n{"iteration": 16}\n{"iteration": 2')
    with caplog.at_level(logging.WARNING):
        assert read_jsonl(log) == [(1, {"iteration": 8}), (3, {"iteration": 16})]
    assert any("torn last line 4" in r.getMessage() for r in caplog.records)
    log.write_text('{"iteration": 8}\n{"iterat\n{"iteration": 16}\n')  # damage before the end is not a torn append
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        read_jsonl(log)
    log.write_text('{"iteration": 8}\n{"iteration": 16}')  # complete, only the newline missing: kept
    assert [r for _, r in read_jsonl(log)] == [{"iteration": 8}, {"iteration": 16}]


def test_lock_owner_is_read_bounded(tmp_path):
    lock = DirectoryLock(tmp_path).acquire()
    try:
        assert owner(tmp_path).startswith("host ") and f"pid {os.getpid()}" in owner(tmp_path)
    finally:
        lock.release()


FULL_LOG = """
import logging, resource, signal, sys
sys.path.insert(0, {root!r})
from utils.core.errors import run_cli
from utils.core.logs import setup_logging
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
def main(argv):
    setup_logging({log!r}, 0)
    for i in range(10000):
        logging.getLogger("x").info("line %d of a long run", i)
sys.exit(run_cli(main))
"""


def test_a_failed_log_write_is_one_line_and_a_failure(tmp_path):
    """A real process whose file-size limit the log outgrows: one line naming the file, exit 2 (logging's own
    handler printed a traceback per record and the run went on to exit 0)."""
    log = tmp_path / "out.log"
    proc = subprocess.run([sys.executable, "-c", FULL_LOG.format(root=str(ROOT), log=str(log))], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"error: writing the run's log {log} failed: File too large"), proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert 0 < log.stat().st_size <= 4096


def test_log_records_go_to_the_file(tmp_path):
    from utils.core.logs import setup_logging
    setup_logging(tmp_path / "out.log", 0)
    try:
        logging.getLogger("t").info("hello %s", "there")
        assert (tmp_path / "out.log").read_text().endswith("hello there\n")
    finally:
        setup_logging(None, 0)


def test_not_ours_is_a_user_error():
    assert issubclass(NotOurs, UserError)  # one line, exit 2, through run_cli


def test_metrics_of_a_resumed_run_survive_a_torn_line(tmp_path):
    """The reporter keeps the epochs up to the resumed step and drops a torn append (it used to raise)."""
    from training.monitor.reporter import Reporter
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"iteration": 8}) + "\n" + json.dumps({"iteration": 16}) + "\n" + '{"iter')
    reporter = Reporter.__new__(Reporter)
    reporter.run_dir = tmp_path
    reporter._truncate_metrics(8)
    assert path.read_text() == json.dumps({"iteration": 8}) + "\n"


def test_a_resumed_run_of_epochs_counted_from_0_goes_on_counting_from_1(tmp_path):
    """Records written when metrics.jsonl counted epochs from 0 are renumbered when the run resumes: the epochs
    appended next count from 1 (#45 item 20), and the file keeps one numbering."""
    from training.monitor.reporter import Reporter
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"epoch": e, "iteration": 8 * (e + 1)}) + "\n" for e in range(3)))
    reporter = Reporter.__new__(Reporter)
    reporter.run_dir = tmp_path
    reporter._truncate_metrics(16)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"epoch": 1, "iteration": 8},
                                                                           {"epoch": 2, "iteration": 16}]


@pytest.mark.parametrize("planted_at", ["a.h5.part", "a.h5"])
def test_dataset_files_never_write_through_a_planted_link(tmp_path, planted_at):
    """The HDF5 writers create their temporary file exclusively (a planted link is removed, not followed) and
    never rename over a link."""
    import numpy as np

    from utils.preprocess import writer
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    (tmp_path / planted_at).symlink_to(outside)
    lat, lon = np.array([60.0, 0.0, -60.0]), np.arange(4) * 90.0
    fields = np.zeros((2, 1, 3, 4), np.float32)
    if planted_at == "a.h5":
        with pytest.raises(NotOurs, match="a.h5 is a symbolic link"):
            writer.write_field_file(tmp_path / "a.h5", fields, ["z500"], lat, lon, dt_hours=6)
    else:
        writer.write_field_file(tmp_path / "a.h5", fields, ["z500"], lat, lon, dt_hours=6)
        assert (tmp_path / "a.h5").is_file() and not (tmp_path / "a.h5").is_symlink()
    assert outside.read_text() == "precious\n"
