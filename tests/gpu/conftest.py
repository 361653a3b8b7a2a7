"""The GPU tests' training runs start together before the first test (``tests/gpu/background.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.background import Runs


def pytest_configure(config):
    config.addinivalue_line("markers", "runs(*names): the test waits for these runs of its module's RUNS "
                                       "(tests/gpu/background.py), started when the session starts")


def _skipped(item) -> bool:
    if any(True for _ in item.iter_markers("skip")):
        return True
    return any(m.args and m.args[0] is True or m.kwargs.get("condition") is True
               for m in item.iter_markers("skipif"))


@pytest.fixture(scope="session")
def gpu_runs(tiny_data, tmp_path_factory):
    runs = Runs(tmp_path_factory.mktemp("gpu_runs"), tiny_data)
    yield runs
    runs.close()


@pytest.fixture(scope="session", autouse=True)
def _start_gpu_runs(request):
    """Every run of the session's selected tests that will not skip, started before the first test."""
    if not torch.cuda.is_available():
        return
    wanted = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is None or _skipped(item):
            continue
        for marker in item.iter_markers("runs"):
            for name in marker.args:
                run = module.RUNS[name]
                if run.possible():
                    wanted.append((module.__name__, name, run))
    if wanted:
        request.getfixturevalue("gpu_runs").start(wanted)


@pytest.fixture
def train_run(request, gpu_runs):
    """``train_run(NAME)``: the finished run NAME of the test's module's RUNS (a :class:`background.Done`, or
    what the run's job returned)."""
    module = request.module
    return lambda name: gpu_runs.result(module.__name__, name, module.RUNS[name])
