"""tools/compare_runs.py on hand-written run directories: table, JSON, plots and one-line errors."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import subprocess_env
from tests.forked import run_forked
from tools.compare_runs import main
from training.evaluation.run_comparison import default_out, differing_keys, legend_labels, load_runs

ROOT = Path(__file__).resolve().parents[2]
CHANNELS = ["u10m", "v10m", "t2m", "sp", "msl"]
OTHER_CHANNELS = ["u10m", "v10m", "sp", "msl", "z500"]  # tiny/2GPU/01's
COMMON = ["u10m", "v10m", "sp", "msl"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# per-epoch throughput: the first epoch is slow (compilation), so its median differs from the steady one
SAMPLES_PER_S = [5.0, 100.0, 130.0, 110.0]  # steady median 110 (with the first: 105)
MFU = [0.05, 0.30, 0.40, 0.35]  # steady median 0.35
PEAK = [1.5, 2.25, 2.0, 1.75]  # max 2.25, not the last
RETRIES = [1, 0, 2, 0]  # sum 3
VALIDATED = (1, 2)  # the last epoch does not validate: "last valid loss" is epoch 2's


def make_run(expdir: Path, config_name: str, world_size: int, run_num: str, lr: float, gpu: bool,
             channels=CHANNELS, n_epochs: int = 4, status: str = "completed", key_channels=()) -> Path:
    """A run directory as the trainer writes it; metric values depend on ``lr`` and ``world_size``."""
    run_dir = expdir / config_name / f"{world_size}GPU" / run_num
    run_dir.mkdir(parents=True)
    config = {"lr": lr, "depth": 4, "img_size": [32, 64], "key_channels": list(key_channels),
              "global_batch_size": 8, "run_num": run_num, "expdir": str(expdir),
              "description": f"run {run_num}", "data_path": "data/tiny"}
    info = {"config_name": config_name, "command": ["train.py", "--lr", str(lr)], "started": "2026-11-22T04:00:00",
            "finished": None if status == "running" else "2026-11-22T05:00:00", "status": status,
            "error": "boom" if status == "failed" else None, "git": {"commit": "abc123", "dirty": False},
            "versions": {"python": "3.11", "torch": "2.13.0", "cuda": "12.8" if gpu else None},
            "devices": ["NVIDIA H100 80GB HBM3"] * world_size if gpu else ["cpu"], "world_size": world_size,
            "mesh": {"dp": world_size, "cp": 1, "tp": 1}, "launcher": "torchrun", "config": config}
    (run_dir / "run.json").write_text(json.dumps(info))
    lines = []
    for e in range(n_epochs):
        scale = world_size * (1 + lr * 1000)  # distinct per run
        record = {"epoch": e + 1, "iteration": 10 * (e + 1), "elapsed_s": 30.0 * (e + 1), "epoch_time_s": 30.0,
                  "samples_per_s": SAMPLES_PER_S[e] * scale, "data_wait_share": 0.1, "lr": lr,
                  "loss/train": 1.0 / (e + 1) / scale}
        if e in VALIDATED:
            record["loss/valid"] = 2.0 / (e + 1) / scale
            for i, ch in enumerate(channels):
                for kind in ("rmse", "acc", "rmse_persistence", "acc_persistence"):
                    record[f"{kind}/{ch}"] = (i + 1) * 10.0 / (e + 1) / scale
        if gpu:
            record.update({"mfu": MFU[e], "memory/peak_allocated": PEAK[e] * scale,
                           "memory/peak_reserved": PEAK[e] * scale + 1, "memory/peak_active": PEAK[e] * scale,
                           "memory/alloc_retries": RETRIES[e], "memory/ooms": 0})
            record.update({f"memory/{k}_rank": 0 for k in ("peak_allocated", "peak_reserved", "peak_active",
                                                           "alloc_retries", "ooms")})
        else:
            record.update({"memory/peak_rss": PEAK[e] * scale, "memory/peak_rss_rank": 0})
        lines.append(json.dumps(record))
    if n_epochs:
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "out.log").write_text("ignored\n")
    return run_dir


@pytest.fixture
def expdir(tmp_path):
    """Four runs: lr 1e-3 / 1e-4 x world size 1 (CPU metrics) / 2 (GPU metrics)."""
    root = tmp_path / "runs"
    make_run(root, "tiny", 1, "00", 1e-3, gpu=False)
    make_run(root, "tiny", 1, "01", 1e-4, gpu=False)
    make_run(root, "tiny", 2, "00", 1e-3, gpu=True)
    make_run(root, "tiny", 2, "01", 1e-4, gpu=True, channels=OTHER_CHANNELS)
    return root


def run_main(capsys, *argv):
    """``main(argv)`` in-process: (exit status, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def parse_table(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """Header names and {run name: {header: cell}} of the table (cells are separated by 2+ spaces).

    Two-word headers are on two lines, right-aligned like the numbers below them: a word on the top
    line belongs to the column that ends where it ends."""
    lines = [line for line in text.splitlines() if line and not line.startswith("wrote ")]
    n_header = 1 if lines[0].startswith("run ") else 2
    tops = {m.end(): m.group() for m in re.finditer(r"\S+", lines[0])} if n_header == 2 else {}
    header = [f"{tops[m.end()]} {m.group()}" if m.end() in tops else m.group()
              for m in re.finditer(r"\S+", lines[n_header - 1])]
    rows = {}
    for line in lines[n_header:]:
        cells = re.split(r" {2,}", line.strip())
        assert len(cells) == len(header), line
        rows[cells[0]] = dict(zip(header, cells))
    return header, rows


def expected(world_size: int, lr: float, channels=CHANNELS) -> dict:
    """The values make_run's metrics should give in the comparison."""
    scale = world_size * (1 + lr * 1000)
    return {"samples_per_s": 110.0 * scale, "peak_gib": 2.25 * scale, "train_loss": 0.25 / scale,
            "valid_loss": 2.0 / 3 / scale, "rmse": {c: (channels.index(c) + 1) * 10.0 / 3 / scale for c in COMMON}}


def test_table_and_plots(expdir, tmp_path, capsys):
    rc, out, err = run_main(capsys, "--expdir", expdir, "--out", tmp_path / "plots")
    assert rc == 0 and err == ""
    header, rows = parse_table(out)
    # lr and world_size differ; depth, img_size, ... are equal; run_num, expdir, description are ignored
    assert header == ["run", "lr", "world_size", "samples/s", "MFU", "peak GiB", "retries", "train loss",
                      "valid loss"] + [f"RMSE {c}" for c in COMMON]
    assert list(rows) == ["1GPU/00", "1GPU/01", "2GPU/00", "2GPU/01"]
    assert max(len(line) for line in out.splitlines()) <= 120  # a normal terminal

    gpu = rows["2GPU/00"]
    want = expected(2, 1e-3)
    assert (gpu["lr"], gpu["world_size"]) == ("0.001", "2")
    assert gpu["samples/s"] == f"{want['samples_per_s']:.1f}"  # median after the first epoch
    assert gpu["MFU"] == "35.0%"
    assert gpu["peak GiB"] == f"{want['peak_gib']:.2f}"  # max, not last
    assert gpu["retries"] == "3"
    assert gpu["train loss"] == f"{want['train_loss']:.4g}"
    assert gpu["valid loss"] == f"{want['valid_loss']:.4g}"  # last validated epoch, not last epoch
    assert gpu["RMSE sp"] == f"{want['rmse']['sp']:.4g}"

    cpu = rows["1GPU/01"]
    want = expected(1, 1e-4)
    assert (cpu["lr"], cpu["world_size"]) == ("0.0001", "1")
    assert cpu["MFU"] == "-" and cpu["retries"] == "-"
    assert cpu["peak GiB"] == f"{want['peak_gib']:.2f}"  # peak RSS on CPU
    assert cpu["samples/s"] == f"{want['samples_per_s']:.1f}"

    # the plots, one line each under the table
    out_dir = tmp_path / "plots"
    names = ["valid_loss.png"] + [f"rmse_{c}.png" for c in COMMON]
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(names)  # no rmse_t2m: not in every run
    for name in names:
        data = (out_dir / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
    assert [line for line in out.splitlines() if line.startswith("wrote ")] == \
        [f"wrote {out_dir / n}" for n in names]


def test_a_repeat_started_with_resume_never_differs_in_nothing():
    """README's repeat of run 00 (``--resume never``) trains the same config: no differing key."""
    from training.evaluation.run_comparison import Run
    runs = [Run(Path(n), {"config": {"lr": 1e-3, "resume": r}, "world_size": 1}, []) for n, r in
            (("00", "auto"), ("01", "never"))]
    assert differing_keys(runs) == []


def test_json_document(expdir, tmp_path, capsys):
    # a diverged last train loss: NaN is not JSON, so it becomes null
    metrics = expdir / "tiny" / "1GPU" / "01" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[-1] = json.dumps({**json.loads(lines[-1]), "loss/train": float("nan")})
    metrics.write_text("\n".join(lines) + "\n")
    out_dir = tmp_path / "plots"
    rc, out, _ = run_main(capsys, "--expdir", expdir, "--out", out_dir, "--json")
    assert rc == 0
    doc = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON output"))
    assert doc["differing_keys"] == ["lr", "world_size"]
    assert doc["channels"] == COMMON
    assert doc["plots"] == [str(out_dir / f) for f in ["valid_loss.png"] + [f"rmse_{c}.png" for c in COMMON]]
    runs = {r["name"]: r for r in doc["runs"]}
    assert list(runs) == ["1GPU/00", "1GPU/01", "2GPU/00", "2GPU/01"]

    gpu, want = runs["2GPU/01"], expected(2, 1e-4, OTHER_CHANNELS)
    assert Path(gpu["path"]) == (expdir / "tiny" / "2GPU" / "01").resolve()
    assert gpu["config"] == {"lr": 1e-4, "world_size": 2}
    assert gpu["status"] == "completed" and gpu["epochs"] == 4
    assert gpu["samples_per_s"] == pytest.approx(want["samples_per_s"])
    assert gpu["mfu"] == pytest.approx(0.35)
    assert gpu["peak_gib"] == pytest.approx(want["peak_gib"])
    assert gpu["alloc_retries"] == 3
    assert gpu["train_loss"] == pytest.approx(want["train_loss"])
    assert gpu["valid_loss"] == pytest.approx(want["valid_loss"])
    assert gpu["rmse"] == pytest.approx(want["rmse"])

    cpu = runs["1GPU/00"]
    assert cpu["mfu"] is None and cpu["alloc_retries"] is None
    assert cpu["peak_gib"] == pytest.approx(expected(1, 1e-3)["peak_gib"])
    assert runs["1GPU/01"]["train_loss"] is None


def test_channel_selection(expdir, tmp_path, capsys):
    rc, out, _ = run_main(capsys, "--expdir", expdir, "--out", tmp_path / "a", "--channels", "msl,u10m")
    assert rc == 0
    header, _ = parse_table(out)
    assert header[-2:] == ["RMSE msl", "RMSE u10m"] and "RMSE sp" not in header
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["rmse_msl.png", "rmse_u10m.png", "valid_loss.png"]

    # the runs' key_channels config value is the default (a channel not in every run is dropped)
    other = tmp_path / "other"
    make_run(other, "tiny", 1, "00", 1e-3, gpu=False, key_channels=["t2m", "sp"])
    make_run(other, "tiny", 1, "01", 1e-4, gpu=False, key_channels=["t2m", "sp"], channels=["u10m", "sp"])
    rc, out, _ = run_main(capsys, "--expdir", other, "--out", tmp_path / "b", "--json")
    assert rc == 0 and json.loads(out)["channels"] == ["sp"]


def test_runs_across_configs_world_sizes_and_unfinished(tmp_path, capsys):
    root = tmp_path / "runs"
    a = make_run(root, "tiny", 1, "00", 1e-3, gpu=False)
    b = make_run(root, "small", 2, "01", 1e-3, gpu=True, status="failed", channels=["sp", "u10m"])
    c = make_run(root, "small", 4, "00", 1e-3, gpu=True, status="running", n_epochs=0)
    rc, out, err = run_main(capsys, a, b, c, "--out", tmp_path / "plots")
    assert rc == 0
    header, rows = parse_table(out)
    assert list(rows) == ["tiny/1GPU/00", "small/2GPU/01", "small/4GPU/00"]
    assert header == ["run", "world_size", "samples/s", "MFU", "peak GiB", "retries", "train loss", "valid loss",
                      "RMSE u10m", "RMSE sp", "status"]
    assert [r["status"] for r in rows.values()] == ["completed", "failed", "running"]
    assert set(rows["small/4GPU/00"].values()) == {"small/4GPU/00", "4", "-", "running"}
    assert err == "note: small/4GPU/00 has no epochs yet; left out of the plots\n"
    assert (tmp_path / "plots" / "rmse_sp.png").exists()

    # --config filters --expdir by config name
    rc, out, _ = run_main(capsys, "--expdir", root, "--config", "sm*", "--out", tmp_path / "plots", "--json")
    assert rc == 0 and [r["name"] for r in json.loads(out)["runs"]] == ["2GPU/01", "4GPU/00"]


def test_runs_as_a_module(expdir, tmp_path):
    res = run_forked(["-m", "tools.compare_runs", str(expdir / "tiny" / "1GPU" / "00"),
                      str(expdir / "tiny" / "2GPU" / "00"), "--out", str(tmp_path / "plots"),
                      "--channels", "u10m"], ROOT, subprocess_env())  # fewer plots: faster
    assert res.returncode == 0, res.stderr
    header, rows = parse_table(res.stdout)
    assert list(rows) == ["1GPU/00", "2GPU/00"] and header[1] == "world_size" and "lr" not in header


def test_closed_output_pipe_exits_quietly(expdir, tmp_path):
    # like `| head`: the reader is gone before the table is printed (the tool first spends ~1 s on plots)
    proc = subprocess.Popen([sys.executable, "-m", "tools.compare_runs", "--expdir", str(expdir), "--out",
                             str(tmp_path / "plots"), "--channels", "u10m"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0  # every entry point (utils.core.errors.run_cli): the reader left, no error
    assert err == ""


def _corrupt_metrics(expdir):
    path = expdir / "tiny" / "2GPU" / "00" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:-5]
    path.write_text("\n".join(lines) + "\n")
    return ["--expdir", str(expdir)], f"{path}, line 3: not valid JSON"


def _non_numeric_metric(expdir):
    path = expdir / "tiny" / "1GPU" / "00" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "samples_per_s": "fast"})
    path.write_text("\n".join(lines) + "\n")
    return [str(path.parent)], f"{path}, line 2: samples_per_s not a number"


def _old_metrics_format(expdir):
    path = expdir / "tiny" / "2GPU" / "01" / "metrics.jsonl"
    path.write_text(json.dumps({"epoch": 1, "iteration": 10, "epoch_time": 3.0, "rmse": {"t2m": 1.0}}) + "\n")
    return ["--expdir", str(expdir)], f"{path}, line 1: no elapsed_s"


def _corrupt_run_json(expdir):
    path = expdir / "tiny" / "1GPU" / "01" / "run.json"
    path.write_text('{"config_name": "tiny", ')
    return ["--expdir", str(expdir)], f"{path}: not valid JSON"


def _not_a_run(expdir):
    return [str(expdir / "tiny")], "not a run directory (no run.json)"


def _out_is_a_file(expdir):
    (expdir / "file").write_text("x")
    return ["--expdir", str(expdir), "--out", str(expdir / "file")], "cannot create --out"


ERRORS = {
    "not a run directory": _not_a_run,
    "missing directory": lambda d: ([str(d / "nope")], "no such directory"),
    "expdir without runs": lambda d: (["--expdir", str(d / "tiny" / "1GPU" / "00")], "no runs under"),
    "no matching config": lambda d: (["--expdir", str(d), "--config", "big"], "no runs of config 'big'"),
    "corrupt metrics line": _corrupt_metrics,
    "non-numeric metric": _non_numeric_metric,
    "metrics line without elapsed_s": _old_metrics_format,
    "corrupt run.json": _corrupt_run_json,
    "no runs given": lambda d: ([], "no runs given"),
    "config without expdir": lambda d: ([str(d), "--config", "tiny"], "--config needs --expdir"),
    "channel not in every run": lambda d: (["--expdir", str(d), "--channels", "t2m"],
                                           "--channels t2m: no RMSE for it in 2GPU/01"),
    "empty channels": lambda d: (["--expdir", str(d), "--channels", ","], "--channels is empty"),
    "unknown option": lambda d: (["--expdir", str(d), "--bogus"], "unrecognized arguments: --bogus"),
    "option without value": lambda d: (["--expdir"], "argument --expdir: expected one argument"),
    "out is a file": _out_is_a_file,
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_are_one_line(case, expdir, tmp_path):
    args, message = ERRORS[case](expdir)
    if "--out" not in args:
        args += ["--out", str(tmp_path / "plots")]
    res = run_forked(["-m", "tools.compare_runs", *args], ROOT, subprocess_env())
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_legends_name_what_differs_and_plots_land_beside_the_runs(expdir):
    runs = load_runs([], expdir, None)
    labels = legend_labels(runs, differing_keys(runs))
    assert labels[0] == "1GPU/00: lr=0.001, world_size=1" and labels[3] == "2GPU/01: lr=0.0001, world_size=2"
    assert default_out([], expdir) == expdir / "compare_runs"
    assert default_out([r.path for r in runs], None) == expdir.absolute() / "compare_runs"  # runs' parent: tiny/
