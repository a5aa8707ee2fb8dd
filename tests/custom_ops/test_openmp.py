"""custom_ops/openmp.py: which OpenMP runtime is loaded, and whether its idle workers sleep between ops."""

from __future__ import annotations

import os

import pytest
import torch  # noqa: F401  (loads the OpenMP runtime torch links)

from tilefx.custom_ops import openmp


@pytest.mark.parametrize("environ, sleeps", [
    ({}, None),
    ({"OMP_WAIT_POLICY": "active"}, None),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "OMP_WAIT_POLICY=passive"),
    ({"OMP_WAIT_POLICY": " passive "}, "OMP_WAIT_POLICY=passive"),
    ({"GOMP_SPINCOUNT": "0"}, "GOMP_SPINCOUNT=0"),
    ({"GOMP_SPINCOUNT": "1000"}, None),  # ~us of spinning: measured as fast as the default (docs/PERFORMANCE.md)
    ({"GOMP_SPINCOUNT": "infinite"}, None),
    ({"KMP_BLOCKTIME": "0"}, None),  # Intel's variable: GNU libgomp ignores it
])
def test_gnu_runtime_sleeps_only_where_told_to(environ, sleeps):
    wait = openmp.idle_wait(environ, runtime="GNU libgomp")
    assert wait.sleeps == sleeps
    assert ("sleep between ops" in wait.line()) == (sleeps is not None)
    assert (openmp.warning(wait) is None) == (sleeps is None)


@pytest.mark.parametrize("runtime", ["Intel OpenMP", "LLVM OpenMP"])
def test_intel_and_llvm_runtimes_read_kmp_blocktime(runtime):
    assert openmp.idle_wait({"KMP_BLOCKTIME": "0"}, runtime=runtime).sleeps == "KMP_BLOCKTIME=0"
    assert openmp.idle_wait({"KMP_BLOCKTIME": "0ms"}, runtime=runtime).sleeps == "KMP_BLOCKTIME=0ms"
    assert openmp.idle_wait({"KMP_BLOCKTIME": "200"}, runtime=runtime).sleeps is None
    assert openmp.idle_wait({"GOMP_SPINCOUNT": "0"}, runtime=runtime).sleeps is None


def test_an_unknown_runtime_counts_every_runtimes_variables():
    assert openmp.idle_wait({"GOMP_SPINCOUNT": "0"}, runtime=None).sleeps == "GOMP_SPINCOUNT=0"
    assert openmp.idle_wait({"KMP_BLOCKTIME": "0"}, runtime=None).sleeps == "KMP_BLOCKTIME=0"
    assert "not identified" in openmp.idle_wait({}, runtime=None).line()


def test_the_runtime_is_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 00:00 0 /usr/lib/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 00:00 0 /site-packages/torch.libs/libgomp-a34b3233.so.1.0.0\n")
    assert openmp.loaded_runtime(str(maps)) == "GNU libgomp"
    maps.write_text("7f02-7f03 r-xp 00000000 00:00 0 /opt/intel/lib/libiomp5.so\n")
    assert openmp.loaded_runtime(str(maps)) == "Intel OpenMP"
    maps.write_text("7f02-7f03 r-xp 00000000 00:00 0 /usr/lib/llvm/libomp.so.5\n")
    assert openmp.loaded_runtime(str(maps)) == "LLVM OpenMP"
    maps.write_text("7f00-7f01 r-xp 00000000 00:00 0 /usr/lib/libc.so.6\n")
    assert openmp.loaded_runtime(str(maps)) is None
    assert openmp.loaded_runtime(str(tmp_path / "absent")) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_this_process_has_a_runtime_torch_loaded():
    # PyTorch's CPU wheels link GNU libgomp; other builds link Intel's or LLVM's: any of them, identified.
    assert openmp.loaded_runtime() in {name for _, name, _ in openmp._LIBRARIES}
