"""The GPU tests' training runs (``train.py`` as a user starts it: one process, or torchrun on 2 GPUs), started
side by side when the session starts; each test waits for its own.

A test of this folder that trains names its runs with ``@pytest.mark.runs(NAME, ...)`` and defines them in its
module's ``RUNS`` (NAME -> :class:`Run`); ``tests/gpu/conftest.py`` starts every run of the selected tests that
will not skip before the first test, and the ``train_run`` fixture waits for one by name. The runs are
independent processes (each its own directory, port and model; nothing in them depends on timing), so running
them side by side changes no assertion: their exit status, output and logged losses are those of the same run
alone. It changes the suite's wall time from the sum of the runs (process start, CUDA and NCCL set-up, a cold
``torch.compile``: over 7 minutes on a fresh 2-GPU machine) to about its longest run
(docs/speed.md, "The GPU suite in one run")."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tests.dist_utils import subprocess_env
from tests.jobs import with_args

ROOT = Path(__file__).resolve().parents[2]
# tiny on 64 samples: 8 steps, one epoch and its validation
BASE = ["--config", "tiny", "--num_iters", "8", "--limit_nsamples", "64", "--log_every", "1000"]
# inductor's compile workers per compiling process (its default is one per core): several runs compile at once
COMPILE_THREADS = "4"
TIMEOUT = 600


@dataclass(frozen=True)
class Run:
    """``train.py BASE + args`` on ``gpus`` GPUs (2: torchrun, one process per GPU), or ``job(workdir, data)`` (a
    test's own sequence of jobs, run in a thread of its own). ``needs``: modules the run imports (its test skips
    without them); ``hopper``: needs compute capability 9.0 or newer."""
    args: tuple[str, ...] = ()
    gpus: int = 1
    needs: tuple[str, ...] = ()
    hopper: bool = False
    job: Callable[[Path, Path], Any] | None = None

    def possible(self) -> bool:
        return (torch.cuda.is_available() and torch.cuda.device_count() >= self.gpus
                and (not self.hopper or torch.cuda.get_device_capability() >= (9, 0))
                and all(importlib.util.find_spec(name) is not None for name in self.needs))


@dataclass
class Done:
    """A finished ``train.py`` run: its process (status, stdout, stderr) and its experiment directory."""
    proc: subprocess.CompletedProcess
    expdir: Path
    gpus: int

    def ok(self) -> bool:
        return self.proc.returncode == 0

    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def failure(self) -> str:
        return self.proc.stdout[-3000:] + self.proc.stderr[-3000:]

    def last_record(self) -> dict:
        return last_record(self.expdir, self.gpus)


def last_record(expdir: Path, gpus: int) -> dict:
    return json.loads(next(expdir.glob(f"tiny/{gpus}GPU/*/metrics.jsonl")).read_text().splitlines()[-1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all bound at once, so no two runs started together get the same one."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Runs:
    """The session's runs by (module, name): started once, in threads that wait for their processes."""

    def __init__(self, root: Path, data: Path):
        self.root, self.data = root, data
        self.futures: dict[tuple[str, str], Future] = {}
        self.procs: list[subprocess.Popen] = []
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="gpu-run")
        self.started = 0

    def start(self, wanted: list[tuple[str, str, Run]]) -> None:
        """Start each (module, name, run) not started yet, all at once: 2-GPU and compiled runs first."""
        wanted = [w for w in dict.fromkeys(wanted) if (w[0], w[1]) not in self.futures]
        wanted.sort(key=lambda w: (-w[2].gpus, "--enable_jit" not in w[2].args))
        ports = iter(free_ports(sum(1 for *_, run in wanted if run.gpus > 1 and run.job is None)))
        for module, name, run in wanted:
            port = next(ports) if run.gpus > 1 and run.job is None else None
            workdir = self.root / f"{module.rsplit('.', 1)[-1]}-{name}"
            workdir.mkdir(parents=True)
            gpu = self.started % max(torch.cuda.device_count(), 1)
            self.started += 1
            self.futures[module, name] = self.pool.submit(self._run, run, workdir, port, gpu)

    def result(self, module: str, name: str, run: Run):
        if (module, name) not in self.futures:  # a test asked for a run its marker does not name
            self.start([(module, name, run)])
        return self.futures[module, name].result()

    def _run(self, run: Run, workdir: Path, port: int | None, gpu: int):
        if run.job is not None:
            return run.job(workdir, self.data)
        expdir = workdir / "runs"
        env = {"TORCHINDUCTOR_COMPILE_THREADS": COMPILE_THREADS}
        if run.gpus > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={run.gpus}",
                        f"--master_port={port}"]
        else:  # one-GPU runs take turns over the GPUs
            launcher, env["CUDA_VISIBLE_DEVICES"] = [sys.executable], str(gpu)
        command = [*launcher, str(ROOT / "train.py"),
                   *with_args(BASE, ["--data_path", str(self.data), "--expdir", str(expdir), *run.args])]
        with self.lock:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=subprocess_env(**env), start_new_session=True)  # killed as a group
            self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, err = proc.communicate()
            err += f"\n(killed after {TIMEOUT} s)"
        return Done(subprocess.CompletedProcess(command, proc.returncode, out, err), expdir, run.gpus)

    def close(self) -> None:
        """Stop what still runs (a session cut short) and wait for the threads."""
        with self.lock:
            for proc in self.procs:
                if proc.poll() is None:
                    _kill(proc)
        self.pool.shutdown(wait=True, cancel_futures=True)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a run's process group: torchrun and its ranks alike."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
