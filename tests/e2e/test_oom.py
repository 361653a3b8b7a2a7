"""Out of memory: a ``torch.OutOfMemoryError`` in a phase of training ends every rank of the job with one
line naming the rank, phase, local batch and remedies, and a status of its own (training/monitor/oom.py)."""

import re
import time

import pytest

from tests.jobs import ROOT, run_job
from utils.core.errors import EXIT_OUT_OF_MEMORY
from training.monitor.oom import OOM_REMEDIES

OOM_AT = [str(ROOT / "tests" / "oom_at_step.py"), "3"]


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("phase", ["forward", "validation"])
def test_an_oom_is_one_line_with_its_own_status(tiny_data, tmp_path, phase):
    (status, _, stderr), = run_job(tmp_path, tiny_data, [], 1, entry=OOM_AT, OOM_PHASE=phase)
    lines = error_lines(stderr)
    assert status == EXIT_OUT_OF_MEMORY and len(lines) == 1, stderr[-3000:]
    assert re.match(rf"error: rank 0 ran out of cpu memory in {phase} at local batch 8 trying to allocate 9.30 GiB",
                    lines[0]), lines[0]
    assert all(remedy in lines[0] for remedy in OOM_REMEDIES)


def test_an_oom_on_one_rank_stops_both_with_the_oom_status(tiny_data, tmp_path):
    t0 = time.monotonic()
    results = run_job(tmp_path, tiny_data, ["--collective_timeout_s", "60"], 2, entry=OOM_AT, OOM_RANKS="1")
    assert time.monotonic() - t0 < 60  # the other rank left its collective, long before the timeout
    lines = []
    for rank, (status, _, stderr) in enumerate(results):
        lines += error_lines(stderr)
        assert status == EXIT_OUT_OF_MEMORY and len(lines) == rank + 1, (rank, stderr[-3000:])
        assert "rank 1 ran out of cpu memory in forward at local batch 4" in lines[rank]
    assert lines[0].endswith("(on rank 1; stopping rank 0)")  # rank 0 heard it from rank 1
