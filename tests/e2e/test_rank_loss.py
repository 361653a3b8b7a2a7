"""Every rank watches every other: on 2 and 3 gloo ranks, each rank in turn is stopped (SIGSTOP) or
killed (SIGKILL) while the job runs collectives; every surviving rank must print one line naming it and
exit non-zero within ``--collective_timeout_s`` plus 10 s, with no gloo traceback and no process left.

Run as a script, ``python tests/e2e/test_rank_loss.py`` is one rank (``RANK``, ``WORLD_SIZE``,
``MASTER_PORT`` in its environment) inside :func:`distributed.world.distributed_session`, the wrapper
``train.py`` uses, doing all-reduces as training does.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TIMEOUT_S = 6  # --collective_timeout_s: silence for 3/4 of it (4.5 s) declares a rank lost


def run_rank() -> None:
    import torch
    import torch.distributed as dist

    from distributed.launch import detect_launch
    from distributed.world import distributed_session
    from utils.config.schema import ParallelConfig
    from utils.core.errors import run_cli

    def loop(argv: list[str]) -> int:
        with distributed_session(ParallelConfig(collective_timeout_s=TIMEOUT_S), detect_launch()) as world:
            for step in range(100000):
                world.channel.note_step(step)
                t = torch.ones(1)
                dist.all_reduce(t)
                if step == 3:
                    print("ready", flush=True)
                time.sleep(0.01)
        return 0
    sys.exit(run_cli(loop))


def start_ranks(world_size: int) -> list:
    """``python tests/e2e/test_rank_loss.py`` once per rank, forked (``tests/forked.py``): real processes,
    without the seconds of importing torch in each."""
    from tests.dist_utils import free_port, subprocess_env
    from tests.forked import ForkedPopen
    env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size))
    return [ForkedPopen([__file__], ROOT, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world_size)]


CASES = [(world, victim, sig) for world in (2, 3) for victim in range(world) for sig in ("STOP", "KILL")]


@pytest.mark.parametrize("world_size,victim,sig", CASES, ids=[f"{w}ranks-{s}{v}" for w, v, s in CASES])
def test_every_survivor_names_the_lost_rank(world_size, victim, sig):
    procs = start_ranks(world_size)
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.communicate(timeout=30)
        procs[victim].send_signal(getattr(signal, "SIG" + sig))
        t0 = time.monotonic()
        survivors = [(r, p) for r, p in enumerate(procs) if r != victim]
        outputs = {r: p.communicate(timeout=TIMEOUT_S + 10 + 20)[1] for r, p in survivors}
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    for r, err in outputs.items():
        assert procs[r].returncode not in (0, None), err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, err[-3000:]
        assert f"rank {victim} of {world_size}" in lines[0], lines[0]
        assert "Traceback" not in err and "gloo" not in err.lower(), err[-3000:]
    assert waited < TIMEOUT_S + 10, waited


if __name__ == "__main__":
    run_rank()
