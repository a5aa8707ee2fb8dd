"""Build script. Package metadata lives in pyproject.toml; this adds the native kernels.

The extension builds against the torch already installed (pip --no-build-isolation).
One binary serves every x86-64 CPU: ISA-specific units carry their own
``#pragma GCC target`` and the ops call them only where CPUID says they run
(csrc/dispatch.cpp holds the table of which unit each op family runs on each path).

Where simde-py (SIMDe's headers) is installed, the AVX512-BF16 units are also built on
SIMDe's portable intrinsics (linear_avx512_emulated.cpp, attention_avx512_emulated.cpp), so the
tests check their code on CPUs without AVX512; without it those units are left out and their tests skip.
"""

import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

try:
    import simde_py
except ImportError:
    simde_py = None

EMULATED = ("custom_ops/csrc/linear_avx512_emulated.cpp", "custom_ops/csrc/attention_avx512_emulated.cpp")
sources = sorted(glob.glob("custom_ops/csrc/*.cpp"))
if simde_py is None:
    sources = [source for source in sources if source not in EMULATED]

native = CppExtension(
    name="tilefx.custom_ops._C",
    sources=sources,
    include_dirs=[simde_py.get_include()] if simde_py else [],
    define_macros=[("TILEFX_AVX512_EMULATION", "1")] if simde_py else [],
    # -fopenmp: without it at::parallel_for compiles to a serial loop in this library.
    # -Wno-psabi: the emulated unit passes 64-byte vectors between its inline helpers.
    # -g0: Python's own flags ask for debug info, which for ATen's templates costs ~40% of the build's time
    # (drop it here for a build to debug).
    extra_compile_args=["-O3", "-fno-math-errno", "-fopenmp", "-Wno-psabi", "-g0"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[native], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
