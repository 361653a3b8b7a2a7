import os
import sys
from pathlib import Path

# Inductor's C++ kernels for the CPU compile without its vector (AVX) code, here and in every process a test
# starts: the six largest compiled tests took 171 s instead of 212 s (cold cache, 2 cores, pytest -n 2). What they
# test is ours and Inductor's graph work (dynamo, AOT autograd, lowering, fusion), which is the same either way;
# GPUs compile Triton. TORCHINDUCTOR_VEC_ISA_OK=1 in the environment keeps the vector code.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small synthetic dataset in the training layout (4 channels, 32x64), shared by the session."""
    from utils.preprocess.synthetic_dataset import make_synthetic_dataset
    return make_synthetic_dataset(tmp_path_factory.mktemp("tiny") / "data", channels=4, img_size=(32, 64),
                                  train_years=2, valid_years=1, steps_per_year=48, seed=0)


@pytest.fixture(scope="session")
def forking_python(tmp_path_factory):
    """A ``python`` whose runs fork from a server with torch, dynamo and matplotlib imported (seconds of CPU less a
    run) and that otherwise acts as a fresh interpreter: ``tests/forked_python.py``'s ``ForkingPython``."""
    from tests.forked_python import ForkingPython, PythonServer, install
    server = PythonServer()
    yield ForkingPython(install(tmp_path_factory.mktemp("python_bin")), server.address)
    server.close()
