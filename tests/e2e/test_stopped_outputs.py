"""``evaluate.py``, ``tools.export_model`` and ``tools.compare_runs`` stopped by a real signal while they write
(#45 item 4): one line, exit status 75, and no output left half-written under its final name or beside it.
The signal comes right after the writer returns (``tests/signal_after_write.py``): the file is whole on disk,
not yet renamed, the moment a process writing in place would leave a finished-looking file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import subprocess_env
from tests.e2e.test_hostile_inputs import finished_run  # noqa: F401 (a fixture)
from utils.core.errors import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]


def stopped(target: str, entry: str, args: list[str], cwd: Path, signal: str) -> subprocess.CompletedProcess:
    """``entry args`` signalled with ``signal`` right after ``target`` (the writer) returns."""
    return subprocess.run([sys.executable, str(ROOT / "tests" / "signal_after_write.py"), target, entry, *args],
                          cwd=cwd, env=subprocess_env(KILL_SIGNAL=signal), capture_output=True, text=True,
                          timeout=300)


def assert_stopped(proc: subprocess.CompletedProcess, signal: str, folder: Path, output: str) -> None:
    assert proc.returncode == EXIT_PREEMPTED, f"exit {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip().splitlines()[-1].startswith(f"stopped by SIG{signal}: no output is left half-written")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (folder / output).exists() and not list(folder.glob("*.tmp")), sorted(folder.iterdir())


@pytest.mark.parametrize("signal", ["TERM", "INT"])
def test_evaluate_stopped_while_writing_forecasts_leaves_none(tmp_path, finished_run, signal):  # noqa: F811
    out = tmp_path / "evaluation"
    proc = stopped("xarray:DataArray.to_netcdf", "evaluate.py", ["--run_dir", str(finished_run), "--lead_steps", "2",
                                                                 "--save_forecasts", "--out", str(out)],
                   tmp_path, signal)
    assert_stopped(proc, signal, out, "forecasts.nc")


def test_export_stopped_while_writing_leaves_no_model(tmp_path, finished_run):  # noqa: F811
    proc = stopped("torch:save", "tools.export_model", [str(finished_run), "--out", str(tmp_path / "model.pt")],
                   tmp_path, "TERM")
    assert_stopped(proc, "TERM", tmp_path, "model.pt")


def test_compare_runs_stopped_while_writing_a_plot_leaves_none(tmp_path, finished_run):  # noqa: F811
    out = tmp_path / "plots"
    proc = stopped("matplotlib.figure:Figure.savefig", "tools.compare_runs", [str(finished_run), "--out", str(out)],
                   tmp_path, "TERM")
    assert_stopped(proc, "TERM", out, "valid_loss.png")
