import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("TILEFX_QUIET", "1")
# tilefx's graph cache starts empty every session (Inductor's stays warm): each run of the suite traces what it
# compiles the first time, as on a fresh machine, and a second compile of the same model in the session loads it.
_GRAPH_CACHE = tempfile.mkdtemp(prefix="tilefx-graph-cache-")
os.environ["TILEFX_GRAPH_CACHE_DIR"] = _GRAPH_CACHE
atexit.register(shutil.rmtree, _GRAPH_CACHE, ignore_errors=True)
torch.set_num_threads(max(1, os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compiles real models (seconds to minutes)")


@pytest.fixture
def seeded():
    torch.manual_seed(1234)
