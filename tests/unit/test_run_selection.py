"""Which run a command trains in (docs/checkpoints.md#which-run-a-command-trains-in): runs are fabricated as their
records (run.json, checkpoints/latest), so each case of the rule is checked without training."""

import json
from pathlib import Path

import pytest

from utils.config.loading import DEFAULT_YAML, load_config
from utils.core.errors import NothingToDo, UserError
from training.loop.run_dir import find_run, open_run_dir


def command(tmp_path: Path, **overrides):
    cfg = load_config(DEFAULT_YAML, "tiny", {"expdir": str(tmp_path), **overrides})
    return cfg


def fake_run(tmp_path: Path, num: str, status: str, step: int | None = None, **overrides) -> Path:
    """A run of config tiny on 1 CPU as its files say: ``status`` in run.json, a checkpoint at ``step``."""
    path = tmp_path / "tiny" / "1CPU" / num
    (path / "checkpoints").mkdir(parents=True)
    record = {"config_name": "tiny", "status": status, "config": command(tmp_path, **overrides).flat()}
    (path / "run.json").write_text(json.dumps(record))
    if step is not None:
        (path / "checkpoints" / "latest").write_text(f"step_{step:08d}")
    return path


def open_for(tmp_path: Path, **overrides):
    cfg = command(tmp_path, **overrides)
    run = open_run_dir(cfg.logging, cfg.checkpoint.resume, "tiny", 1, cfg.flat(), cuda=False)
    run.close(None)
    return run


def test_a_finished_run_is_complete_and_num_iters_extends_it(tmp_path):
    fake_run(tmp_path, "00", "completed", 800)
    with pytest.raises(NothingToDo, match="00 is complete \\(800 iterations\\); raise --num_iters"):
        open_for(tmp_path)
    run = open_for(tmp_path, num_iters=900)
    assert run.path.name == "00" and run.resume
    assert run.note == ("continuing run 00 from its latest checkpoint: complete at 800 iterations, to be extended "
                        "to 900, the only run of these settings with work left; --resume never starts a new run "
                        "instead")


def test_an_unfinished_run_is_continued_and_says_why(tmp_path):
    fake_run(tmp_path, "00", "completed", 800)
    fake_run(tmp_path, "01", "preempted", 570)
    run = open_for(tmp_path)
    assert run.path.name == "01" and run.resume
    assert run.note == ("continuing run 01 from its latest checkpoint: unfinished: iteration 570 of 800, the only "
                        "run of these settings with work left (complete: run 00); --resume never starts a new run "
                        "instead")


def test_two_runs_with_work_left_are_an_error_naming_the_flags(tmp_path):
    """The issue's case: run 00 complete, run 02 (its repeat) interrupted; --num_iters 900 fits both."""
    fake_run(tmp_path, "00", "completed", 800)
    fake_run(tmp_path, "02", "interrupted", 570, resume="never")
    with pytest.raises(UserError) as err:
        open_for(tmp_path, num_iters=900)
    assert str(err.value) == (
        f"2 runs of config tiny in {tmp_path}/tiny/1CPU have this command's settings and work left: run 02 "
        "(unfinished: iteration 570 of 800, re-planned for 900), run 00 (complete at 800 iterations, to be extended "
        "to 900); pick one with --run_num 02 or --run_num 00, or start a new run with --resume never")
    assert not (tmp_path / "tiny" / "1CPU" / "03").exists()  # nothing written
    assert open_for(tmp_path, num_iters=900, run_num="00").path.name == "00"


def test_changed_settings_never_continue_a_run(tmp_path):
    fake_run(tmp_path, "00", "preempted", 300)
    run = open_for(tmp_path, lr=1e-3)
    assert run.path.name == "01" and not run.resume
    assert run.note == ("starting run 01: a new run (run 00 of config tiny differs from this command in lr; to "
                        "continue a run, repeat its settings (its config.yaml))")
    with pytest.raises(UserError, match="^run .*/00 was trained with other settings: lr 0.002 \\(this command: "
                                        "0.001\\); repeat its settings"):
        open_for(tmp_path, lr=1e-3, run_num="00")


def test_run_num_and_resume_never(tmp_path):
    fake_run(tmp_path, "00", "preempted", 300)
    run = open_for(tmp_path, run_num="00")
    assert run.resume and run.note == ("continuing run 00 from its latest checkpoint: named by --run_num 00; "
                                       "without --run_num, --resume never starts a new run instead")
    run = open_for(tmp_path, resume="never")
    assert run.path.name == "01" and not run.resume and run.note == "starting run 01: a new run (--resume never)"
    assert open_for(tmp_path, run_num="07").note == "starting run 07: named by --run_num 07"
    with pytest.raises(UserError, match="already holds a run"):
        open_for(tmp_path, run_num="00", resume="never")


def test_the_first_run_says_it_is_the_first(tmp_path):
    run = open_for(tmp_path)
    assert run.note == f"starting run 00: a new run (no earlier run of config tiny in {tmp_path}/tiny/1CPU)"


def test_a_named_run_is_passed_over_and_the_first_line_says_so(tmp_path):
    """#45 item 15: a run named by --run_num (pre), unfinished and of these settings, is not continued by a command
    without --run_num; the new run's first line names it and the flag that continues it."""
    fake_run(tmp_path, "pre", "preempted", 300)
    run = open_for(tmp_path)
    assert run.path.name == "00" and not run.resume
    assert run.note == (f"starting run 00: a new run (no earlier run of config tiny in {tmp_path}/tiny/1CPU; named "
                        "runs (pre) are continued only by naming them with --run_num)")
    assert open_for(tmp_path, run_num="pre").resume


def test_find_run_agrees_with_open_run_dir(tmp_path):
    fake_run(tmp_path, "00", "completed", 800)
    fake_run(tmp_path, "01", "preempted", 570)
    cfg = command(tmp_path)
    assert find_run(cfg.logging, "auto", "tiny", 1, cfg.flat(), cuda=False).name == "01"
    cfg = command(tmp_path, num_iters=900)
    with pytest.raises(UserError, match="2 runs of config tiny"):
        find_run(cfg.logging, "auto", "tiny", 1, cfg.flat(), cuda=False)


@pytest.mark.parametrize("planted_at", ["run", "checkpoints"])
@pytest.mark.parametrize("run_num", ["auto", "00"])
def test_a_run_folder_that_is_a_link_is_never_followed(tmp_path, planted_at, run_num):
    """A run directory or its checkpoints/ planted as a link (to a folder elsewhere) is refused in one line naming
    it, whether the command finds the run or names it; nothing is written where the link points."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = fake_run(tmp_path, "00", "preempted", 40)
    if planted_at == "run":
        (elsewhere / "run.json").write_text(run.joinpath("run.json").read_text())
        (elsewhere / "checkpoints").mkdir()
        (elsewhere / "checkpoints" / "latest").write_text("step_00000040")
        for f in (run / "checkpoints" / "latest", run / "run.json"):
            f.unlink()
        (run / "checkpoints").rmdir()
        run.rmdir()
        run.symlink_to(elsewhere, target_is_directory=True)
        link = run
    else:
        for f in (run / "checkpoints").iterdir():
            f.unlink()
        (run / "checkpoints").rmdir()
        (run / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
        link = run / "checkpoints"
    before = sorted(p.name for p in elsewhere.rglob("*"))
    with pytest.raises(UserError) as err:
        open_for(tmp_path, run_num=run_num)
    message = str(err.value)
    assert str(link) in message and "a symbolic link" in message and "\n" not in message, message
    assert sorted(p.name for p in elsewhere.rglob("*")) == before and link.is_symlink()


def test_a_run_killed_without_a_word_is_recorded_as_killed_with_its_last_checkpoint(tmp_path):
    """#45 item 8: run.json left at ``running`` (rank 0 SIGKILLed, no live owner): the next start of the run
    records ``killed`` and its last complete checkpoint before it goes on, and its first line says so."""
    path = fake_run(tmp_path, "00", "running", 40)
    (path / "checkpoints" / "step_00000040").mkdir()
    (path / "checkpoints" / "step_00000040" / ".metadata").write_bytes(b"")
    run = open_for(tmp_path)
    record = json.loads((path / "run.json").read_text())
    assert run.resume and run.path == path
    assert run.note.startswith("continuing run 00 from its latest checkpoint step_00000040 (its previous attempt was "
                               "killed: run.json still said running and no process held the run): "), run.note
    assert record["status"] == "killed" and record["last_checkpoint"] == "step_00000040"
    assert "killed" in record["error"]
