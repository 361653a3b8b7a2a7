"""What a process imports before it compiles anything: inductor (~1 s of CPU) only once a compiled run asks for
one of its settings, so an eager training run, an evaluation or an export starts without it."""

from __future__ import annotations

import subprocess
import sys

from tests.dist_utils import subprocess_env

STACK = ["training.loop.trainer", "training.evaluation.evaluate_run", "distributed.checkpoint.export",
         "distributed.parallelize"]
PROBE = f"""import sys
for module in {STACK!r}:
    __import__(module)
print(sorted(m for m in sys.modules if m.startswith("torch._inductor")))
from distributed.sequence_parallel import bucket_replicated_gradients
bucket_replicated_gradients()  # a compiled run's setting: inductor now, and the setting made
import torch._inductor.config
print(torch._inductor.config.bucket_all_reduces_fx)
"""


def test_the_training_and_evaluation_stack_imports_inductor_only_for_a_setting():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["[]", "all"], done.stdout
