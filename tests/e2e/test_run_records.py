"""Run records end to end through the real entry points: run.json, one run per directory, TensorBoard
HParams, and tools.compare_runs on four tiny runs (two learning rates x one and two ranks)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from tests.dist_utils import free_port, subprocess_env
from tests.forked import run_forked
from tests.forked_python import ForkingPython

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--config", "tiny", "--num_iters", "16", "--limit_nsamples", "64", "--limit_nsamples_val", "32",
         "--log_every", "1000", "--save_checkpoint", "false"]


def _command(tmp_path: Path, data: Path, *args: str) -> list[str]:
    return [str(ROOT / "train.py"), *QUICK, "--data_path", str(data), "--expdir", str(tmp_path / "runs"), *args]


def _train(tmp_path: Path, data: Path, *args: str) -> subprocess.CompletedProcess:
    """``python train.py QUICK ... args``, forked (``tests/forked.py``: torch already imported)."""
    return run_forked(_command(tmp_path, data, *args), tmp_path, subprocess_env(), timeout=300)


def _torchrun(python: ForkingPython, tmp_path: Path, data: Path, *args: str,
              ranks: int) -> subprocess.CompletedProcess:
    """The same on ``ranks`` processes under torchrun (the records name it), launcher and workers run by the
    forking ``python``."""
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}"]
    return python.run([*launcher, *_command(tmp_path, data, *args)], subprocess_env(), timeout=300, cwd=tmp_path)


@pytest.fixture(scope="module")
def four_runs(tiny_data, tmp_path_factory, forking_python):
    """tiny at lr 1e-3 and 3e-3, each on one and on two ranks (torchrun)."""
    tmp = tmp_path_factory.mktemp("compare")
    for ranks in (1, 2):
        for lr in ("1e-3", "3e-3"):
            proc = (_train(tmp, tiny_data, "--lr", lr) if ranks == 1 else
                    _torchrun(forking_python, tmp, tiny_data, "--lr", lr, ranks=ranks))
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = sorted((tmp / "runs" / "tiny").glob("*CPU/*"))
    assert [r.relative_to(tmp / "runs" / "tiny").as_posix() for r in runs] == \
        ["1CPU/00", "1CPU/01", "2CPU/00", "2CPU/01"]  # --run_num auto numbers them
    return tmp, runs


def test_run_json_records_code_versions_world_and_config(four_runs):
    _, runs = four_runs
    record = json.loads((runs[2] / "run.json").read_text())
    assert record["status"] == "completed" and record["finished"] and record["error"] is None
    assert record["config_name"] == "tiny" and record["command"][0] == "train.py" and "--lr" in record["command"]
    assert record["world_size"] == 2 and record["mesh"] == {"dp": 2, "ens": 1, "cp": 1, "tp": 1}
    assert record["launcher"] == "torchrun" and record["devices"] == ["cpu", "cpu"]
    assert len(record["hosts"]) == 2 and record["hosts"][0]
    assert len(record["git"]["commit"]) == 40 and isinstance(record["git"]["dirty"], bool)
    assert record["versions"]["torch"] and record["versions"]["python"]
    assert record["config"]["lr"] == 1e-3 and record["config"]["run_num"] == "00"
    assert record["config"]["img_size"] == [32, 64] and record["config"]["num_iters"] == 16


def _hparams(run_dir: Path) -> tuple[dict, list[str]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0}).Reload()
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    values = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
              for k, v in start.session_start_info.hparams.items()}
    metrics = [m.name.tag for m in experiment.experiment.metric_infos]
    return values, metrics


def test_hparams_entries_read_back_from_the_event_files(four_runs):
    _, runs = four_runs
    values, metrics = _hparams(runs[1])
    assert values["lr"] == pytest.approx(3e-3) and values["depth"] == 2 and values["world_size"] == 1
    assert values["img_size"] == "[32, 64]" and values["amp_mode"] == "none"
    assert {"loss/train", "loss/valid", "perf/samples_per_s", "memory/peak_rss", "rmse/u10m"} <= set(metrics)
    # every metric the HParams tab lists is a scalar the run logged
    tags = EventAccumulator(str(runs[1])).Reload().Tags()["scalars"]
    assert set(metrics) <= set(tags)
    assert _hparams(runs[2])[0]["world_size"] == 2


def test_compare_runs_table_json_and_plots(four_runs):
    tmp, runs = four_runs
    out = tmp / "plots"
    proc = run_forked(["-m", "tools.compare_runs", "--expdir", str(tmp / "runs"), "--out", str(out)], ROOT,
                      subprocess_env())
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = lines[0] + lines[1]  # two header rows
    assert "lr" in header and "world_size" in header and "samples/s" in header and "depth" not in header
    assert [line.split()[0] for line in lines[2:6]] == ["1CPU/00", "1CPU/01", "2CPU/00", "2CPU/01"]
    for name in ("valid_loss.png", "rmse_u10m.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(run_forked(["-m", "tools.compare_runs", *map(str, runs), "--json", "--out", str(out)], ROOT,
                                 subprocess_env()).stdout)
    assert set(data["differing_keys"]) >= {"lr", "world_size"}
    last = [json.loads(line) for line in (runs[3] / "metrics.jsonl").read_text().splitlines()][-1]
    row = data["runs"][3]
    assert row["valid_loss"] == pytest.approx(last["loss/valid"])


def test_a_run_directory_is_never_shared(tiny_data, tmp_path):
    first = _train(tmp_path, tiny_data, "--run_num", "07")
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "runs" / "tiny" / "1CPU" / "07"
    metrics = (run_dir / "metrics.jsonl").read_text()
    again = _train(tmp_path, tiny_data, "--run_num", "07")  # the same command: the run is complete
    assert again.returncode == 0 and "is complete (16 iterations)" in again.stdout, again.stderr
    never = _train(tmp_path, tiny_data, "--run_num", "07", "--resume", "never")
    assert never.returncode == 2 and never.stderr.strip().startswith("error: run directory")
    assert "already holds a run" in never.stderr and "--run_num" in never.stderr and "Traceback" not in never.stderr
    longer = _train(tmp_path, tiny_data, "--run_num", "07", "--num_iters", "24")  # no checkpoint to go on from
    assert longer.returncode == 2 and "no complete checkpoint to resume from" in longer.stderr
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # nothing appended
    fresh = _train(tmp_path, tiny_data, "--lr", "5e-3")  # another config: a new run number
    assert fresh.returncode == 0 and (tmp_path / "runs" / "tiny" / "1CPU" / "08").is_dir()


def test_a_killed_run_is_recorded_as_killed_when_it_goes_on(tiny_data, tmp_path):
    """#45 item 8: rank 0 SIGKILLed mid-run leaves run.json at ``running``; the next start records ``killed``
    with the last checkpoint, its first line says so, and that record stays in the resume's entry once the run
    completes."""
    from tests.jobs import run_job, run_path
    [(status, _, _)] = run_job(tmp_path, tiny_data, [], 1, signal_at=13)  # checkpoints every 10 steps: 10 is last
    record = json.loads((run_path(tmp_path, 1) / "run.json").read_text())
    assert status == -9 and record["status"] == "running"
    [(status, out, err)] = run_job(tmp_path, tiny_data, [], 1)
    assert status == 0, err[-3000:]
    first = (out + err).strip().splitlines()[0]
    assert " from its latest checkpoint step_00000010 (its previous attempt was killed: run.json still said running " \
           "and no process held the run)" in first, first
    record = json.loads((run_path(tmp_path, 1) / "run.json").read_text())
    assert record["status"] == "completed" and record["resumes"][-1]["step"] == 10
    after = record["resumes"][-1]["after"]
    assert after["status"] == "killed" and after["last_checkpoint"] == "step_00000010" and "killed" in after["error"]
