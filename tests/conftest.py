import sys
from pathlib import Path

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
