"""Every rank watches every other: on 2 and 3 gloo ranks, each rank in turn is stopped (SIGSTOP) or
killed (SIGKILL) while the job runs collectives (ten jobs, run at once); every surviving rank must print one
line naming it and exit non-zero within ``--collective_timeout_s`` plus 10 s, with no gloo traceback and no
process left.

Run as a script, ``python tests/e2e/test_rank_loss.py`` is one rank (``RANK``, ``WORLD_SIZE``,
``MASTER_PORT`` in its environment) inside :func:`distributed.world.distributed_session`, the wrapper
``train.py`` uses, doing all-reduces as training does.
"""

from __future__ import annotations

import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# --collective_timeout_s: silence for 3/4 of it (9 s) declares a rank lost; above gVisor's 5 s store stalls
# (docs/launching.md)
TIMEOUT_S = 12


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


def lose_a_rank(procs: list, victim: int, sig: str) -> tuple[dict[int, str], float]:
    """Once every rank is ready, signal rank ``victim``; each survivor's stderr, and the seconds from the signal
    until the last survivor exited."""
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.communicate(timeout=30)
    procs[victim].send_signal(getattr(signal, "SIG" + sig))
    t0 = time.monotonic()
    outputs = {r: p.communicate(timeout=TIMEOUT_S + 10 + 20)[1] for r, p in enumerate(procs) if r != victim}
    return outputs, time.monotonic() - t0


def test_every_survivor_names_the_lost_rank():
    """Every case of :data:`CASES` at once, each its own job on its own port: the seconds each spends waiting
    for the silence overlap (one case at a time left both cores of the suite idle for a minute)."""
    worlds, victims, sigs = zip(*CASES)
    jobs = [start_ranks(world) for world in worlds]
    try:
        with ThreadPoolExecutor(len(CASES)) as pool:
            results = list(pool.map(lose_a_rank, jobs, victims, sigs))
    finally:
        for p in (p for job in jobs for p in job):
            p.kill()
            p.communicate()
    for (world_size, victim, sig), job, (outputs, waited) in zip(CASES, jobs, results):
        case = f"{world_size} ranks, SIG{sig} to rank {victim}"
        for r, err in outputs.items():
            assert job[r].returncode not in (0, None), f"{case}, rank {r}: {err}"
            lines = [line for line in err.splitlines() if line.startswith("error:")]
            assert len(lines) == 1, f"{case}, rank {r}: {err[-3000:]}"
            assert f"rank {victim} of {world_size}" in lines[0], f"{case}, rank {r}: {lines[0]}"
            assert "Traceback" not in err and "gloo" not in err.lower(), f"{case}, rank {r}: {err[-3000:]}"
        assert waited < TIMEOUT_S + 10, f"{case}: the survivors took {waited:.1f} s"


if __name__ == "__main__":
    run_rank()
