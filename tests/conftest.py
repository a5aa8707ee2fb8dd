import atexit
import os
import shutil
import tempfile

# Two pytest-xdist workers (`make test`) and the ranks they start share the cores: OpenMP threads that sleep when
# idle, rather than spin (libgomp reads this as torch loads it, in every process the suite starts too).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TILEFX_QUIET", "1")
# tilefx's graph cache starts empty every session (Inductor's stays warm): each run of the suite traces what it
# compiles the first time, as on a fresh machine, and a second compile of the same model in the session loads it.
_GRAPH_CACHE = tempfile.mkdtemp(prefix="tilefx-graph-cache-")
os.environ["TILEFX_GRAPH_CACHE_DIR"] = _GRAPH_CACHE
atexit.register(shutil.rmtree, _GRAPH_CACHE, ignore_errors=True)
torch.set_num_threads(max(1, os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compiles real models (seconds to minutes)")


# tuning's helpers that force a kernel choice (the choice their second argument)
_FORCING = ("forced_attention", "forced_prefill", "forced_decode_attention", "forced_gemm", "forced_decode_gemm")


@pytest.fixture(autouse=True)
def brgemm_where_it_runs(monkeypatch):
    """A test that forces oneDNN's brgemm (tuning's forced_* helpers, the choice their second argument) is skipped
    where brgemm cannot run at all (tuning.brgemm_runs: torch refuses it on a CPU without AVX512), rather than
    failing on that refusal. Tuning never picks it there, so nothing else reaches it."""
    from tilefx.custom_ops import isa, tuning

    if isa.native is None or tuning.brgemm_has_kernel():
        return
    # Asked here, before the test runs and before forced_* are wrapped: a test that patches brgemm_has_kernel
    # would otherwise have the (cached) probe answer for the whole worker, and the probe's own forced_gemm would
    # call back into the wrapper. A test that patches it to True times fake calls (nothing reaches brgemm): it
    # runs.
    runs = tuning.brgemm_runs()

    def guarded(force):
        def forcing(*args, **kwargs):
            choice = args[1] if len(args) > 1 else kwargs.get("kernel", kwargs.get("gemm"))
            if choice == "brgemm" and not runs and not tuning.brgemm_has_kernel():
                pytest.skip("oneDNN's brgemm does not run on this CPU (torch 2.13 refuses it without AVX512)")
            return force(*args, **kwargs)
        return forcing

    for name in _FORCING:
        monkeypatch.setattr(tuning, name, guarded(getattr(tuning, name)))


@pytest.fixture
def seeded():
    torch.manual_seed(1234)


# The modules that take longest, longest first (a cold suite's timeline: docs/PERFORMANCE.md): `make test` runs
# the suite on two pytest-xdist workers, one module to a worker at a time in this order (`--no-loadscope-reorder`;
# by default xdist sorts modules by their number of tests, which puts the native ops' many small tests first), so
# the short modules fill the end and no long one runs alone there.
LONGEST_FIRST = ("test_tp.py", "test_fp8_checkpoint.py", "test_generate.py", "test_generate_quantized.py",
                 "test_scripts.py", "test_graph_cache.py", "test_memory.py", "test_int4_checkpoint.py",
                 "test_generate_moe.py", "test_quality.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # (stable: each module's tests keep their order)
