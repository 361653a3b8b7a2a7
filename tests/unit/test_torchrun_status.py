"""tools/torchrun.py's exit status names the rank whose failure caused the job's end."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from tools.torchrun import exit_status


def failed(code: int, at: int) -> SimpleNamespace:  # the agent's ProcessFailure: exit code, whole-second timestamp
    return SimpleNamespace(exitcode=code, timestamp=at)


@pytest.mark.parametrize("failures,rank,signame", [
    ({0: failed(-signal.SIGTERM, 100), 1: failed(-signal.SIGKILL, 100)}, 1, "SIGKILL"),  # agent stopped rank 0
    ({0: failed(-signal.SIGTERM, 101), 1: failed(-signal.SIGKILL, 100)}, 1, "SIGKILL"),
    ({0: failed(-signal.SIGTERM, 100), 1: failed(-signal.SIGKILL, 131)}, 0, "SIGTERM"),  # rank 0 died first
    ({0: failed(-signal.SIGSEGV, 100), 1: failed(-signal.SIGTERM, 100), 2: failed(-signal.SIGTERM, 100)}, 0,
     "SIGSEGV"),
])
def test_the_failure_named_is_the_cause_not_the_agents_sigterm(failures, rank, signame, capsys):
    assert exit_status(failures) == 2
    assert f"error: rank {rank} was killed by {signame}" in capsys.readouterr().err


def test_a_worker_status_passes_through_and_preemption_wins():
    assert exit_status({0: failed(3, 100), 1: failed(-signal.SIGTERM, 100)}) == 3
    assert exit_status({0: failed(75, 100), 1: failed(-signal.SIGKILL, 90)}) == 75
