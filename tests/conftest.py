import os

import pytest
import torch

os.environ.setdefault("TILEFX_QUIET", "1")
torch.set_num_threads(max(1, os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compiles real models (seconds to minutes)")


@pytest.fixture
def seeded():
    torch.manual_seed(1234)
