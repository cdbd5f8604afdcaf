import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)
