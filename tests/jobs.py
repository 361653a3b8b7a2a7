"""Helpers to run train.py as real jobs (one process per rank, as srun starts them) and read their results."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.dist_utils import free_port, subprocess_env
from tests.forked import Forked

ROOT = Path(__file__).resolve().parents[1]
# tiny on 64 samples: 8 steps per epoch at global batch 8, checkpoints every 10 steps (a save took 0.4-0.7 s of a
# 4-rank job's 3 s epoch on 2 cores), fused Adam (one kernel a parameter group: the for-loop Adam of a CPU run
# propagates DTensor shardings op by op, 15-20 % of a tp 2 x FSDP step; the docs' runs use the default); no
# TensorBoard figures (matplotlib's ~0.5 s a validation; tests/multiprocess/test_training.py tests them)
RUN = ["--config", "tiny", "--num_iters", "24", "--limit_nsamples", "64", "--limit_nsamples_val", "32",
       "--checkpoint_every_steps", "10", "--log_every", "1000", "--figure_every", "0", "--enable_fused"]


def with_args(base: list[str], args: list[str] | tuple[str, ...]) -> list[str]:
    """``base`` (such as :data:`RUN`) without the options that ``args`` gives, then ``args``: each option once, as a
    user types a command (an option given twice would print a note before a test's error line)."""
    given = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    kept, keep = [], True
    for token in base:
        if token.startswith("--"):  # an option, followed by its value(s)
            keep = token.split("=", 1)[0] not in given
        if keep:
            kept.append(token)
    return [*kept, *args]


def _job_command(workdir: Path, data: Path, args: list[str], ranks: int, signal_at: int | None,
                 entry: list[str] | None, run_args: list[str], env: dict[str, str]) -> tuple[list[str], list[dict]]:
    """The command (without the interpreter) and each rank's environment of a job."""
    if entry is None:
        entry = [str(ROOT / "tests" / "kill_at_step.py"), str(signal_at)] if signal_at else [str(ROOT / "train.py")]
    launch = {} if ranks == 1 else {"WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": str(free_port())}
    workdir.mkdir(exist_ok=True)
    command = [*entry, *with_args([*run_args, "--data_path", str(data), "--expdir", str(workdir / "runs")], args)]
    return command, [subprocess_env(**launch, **env, **({"RANK": str(r), "LOCAL_RANK": str(r)} if launch else {}))
                     for r in range(ranks)]


def start_job(workdir: Path, data: Path, args: list[str], ranks: int, signal_at: int | None = None,
              entry: list[str] | None = None, run_args: list[str] = RUN, **env: str) -> list[subprocess.Popen]:
    """Start ``train.py run_args + args`` (``RUN`` by default) on ``ranks`` processes (RANK/WORLD_SIZE variables),
    writing runs under ``workdir/runs``: fresh interpreters, for tests that signal them while they run.
    ``signal_at``: each process signals itself after that optimizer step (``tests/kill_at_step.py``; SIGKILL
    unless ``KILL_SIGNAL`` in ``env`` names another). ``entry``: another script (and its own arguments) in
    place of ``train.py``."""
    command, envs = _job_command(workdir, data, args, ranks, signal_at, entry, run_args, env)
    return [subprocess.Popen([sys.executable, *command], cwd=workdir, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=rank_env) for rank_env in envs]


def run_job(workdir: Path, data: Path, args: list[str], ranks: int, signal_at: int | None = None,
            entry: list[str] | None = None, run_args: list[str] = RUN, **env: str) -> list[tuple[int, str, str]]:
    """The job of :func:`start_job`, forked (``tests/forked.py``), and waited for: ``(exit status, stdout,
    stderr)`` of every rank."""
    command, envs = _job_command(workdir, data, args, ranks, signal_at, entry, run_args, env)
    procs = [Forked(command, workdir, rank_env) for rank_env in envs]
    return [(done.returncode, done.stdout, done.stderr) for done in (p.wait(600) for p in procs)]


_REFERENCES: dict[tuple, tuple[Path, Future]] = {}
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="reference-run")


def reference_run(tmp_path_factory, data: Path, args: list[str], ranks: int):
    """An uninterrupted run of ``RUN + args`` on ``ranks`` processes, shared by every test of the session
    that asks for the same one (the runs are deterministic). A one-process run starts in the background
    (it leaves the second core of a 2-core machine to the job the test runs meanwhile); a multi-process
    one runs at once. Returns a function that waits for it, asserts every rank exited 0 and returns its
    run directory."""
    key = (str(data), tuple(args), ranks)
    if key not in _REFERENCES:
        workdir = tmp_path_factory.mktemp(f"reference{ranks}")
        future: Future = _POOL.submit(run_job, workdir, data, args, ranks)
        if ranks > 1:  # nothing to gain from overlapping jobs that already fill the cores
            future.exception()
        _REFERENCES[key] = workdir, future
    workdir, future = _REFERENCES[key]

    def wait() -> Path:
        for status, _, err in future.result():
            assert status == 0, err[-3000:]
        return run_path(workdir, ranks)
    return wait


def run_path(workdir: Path, ranks: int, num: str = "00", device: str = "CPU") -> Path:
    """The run directory of a job of ``ranks`` processes on ``device`` (``CPU`` or ``GPU``)."""
    return workdir / "runs" / "tiny" / f"{ranks}{device}" / num


def final_state(run_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's latest checkpoint (model, optimizer, ...), by ``/``-joined key."""
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    out = tmp_path / f"{run_dir.parents[3].name}_{run_dir.parent.name}_{run_dir.name}_{latest}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / latest, out)
    return dict(_tensors(torch.load(out, weights_only=False)))


def _tensors(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def assert_same_state(run_dir: Path, reference: Path, tmp_path: Path) -> None:
    """Bitwise-equal checkpoints (parameters and optimizer states) and identical metrics."""
    assert metrics(run_dir) == metrics(reference)
    got, want = final_state(run_dir, tmp_path), final_state(reference, tmp_path)
    assert got.keys() == want.keys() and any("optim" in k for k in got)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def metrics(run_dir: Path) -> list[dict]:
    """The reproducible part of ``metrics.jsonl``: losses, RMSE/ACC and learning rate by epoch."""
    keep = ("epoch", "iteration", "loss/train", "loss/valid", "rmse/u10m", "acc/sp", "lr", "train/rollout_steps")
    return [{k: r.get(k) for k in keep} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def run_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())
