"""Build script. Package metadata lives in pyproject.toml; this adds the native kernels.

The extension builds against the torch already installed (pip --no-build-isolation).
One binary serves every x86-64 CPU: ISA-specific units carry their own
``#pragma GCC target`` and ops.cpp calls them only where CPUID says they run.
"""

import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

native = CppExtension(
    name="tilefx.custom_ops._C",
    sources=sorted(glob.glob("custom_ops/csrc/*.cpp")),
    # -fopenmp: without it at::parallel_for compiles to a serial loop in this library.
    extra_compile_args=["-O3", "-fno-math-errno", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[native], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
