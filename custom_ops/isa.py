"""Which kernel path the native ops take: ``amx``, ``avx512_bf16``, ``avx2`` or ``reference``.

The native library (``tilefx.custom_ops._C``) is one binary for every x86-64 CPU; each
path lives in its own translation unit and runs only where CPUID says it can. The
native CPU kernels are registered with the dispatcher directly (no Python per
call) and read the current path: by default the fastest this CPU supports. One
table in ``csrc/dispatch.cpp`` says which unit each op family runs on each path
(``kernel_units(path)`` reads it): on amx, the linear ops and experts of more than 4 rows
run oneDNN's brgemm on AMX tiles by default (``tuning`` may choose brgemm on other
AVX512-BF16 CPUs too) and everything else, attention included, the AVX512-BF16 units every
AMX CPU also has (attention: or its brgemm kernels or PyTorch's SDPA where tuning finds them
faster); ``reference``
runs the ``*_portable`` ops written in PyTorch.
``TILEFX_ISA=<path>`` forces a path for the whole process, ``forced(path)`` for a
block (tests and benchmarks).

int4 decode reads x as 15-bit words by default. ``TILEFX_INT4_ACTIVATIONS=int8`` (or
``forced_int4_activations("int8")`` for a block) makes the native units read it as int8 per
32 inputs, llama.cpp's activations: half the multiplies per weight byte, so the GEMV streams
instead of computing (AVX512-BF16), at a measured 0.2-0.3% of perplexity on a trained model
(docs/PERFORMANCE.md).

An int8 or int4 GEMM (a prompt's linears and experts, more than 4 rows) on the units' own GEMM multiplies integers
by default: on the AVX512-BF16 units x as int8 per 32 inputs (``vpdpbusd``: int8 1.4x the bf16 GEMM's rate on Zen
4, for +0.25% of perplexity over weight-only int8 on a trained model), on AVX2 as int16 per row (``vpmaddwd``, what
int8 decode reads: +0.09%).
``TILEFX_INT8_ACTIVATIONS=bf16`` (or ``forced_int8_activations("bf16")``) keeps x bf16 over dequantized blocks in
both formats' GEMMs, the weight-only numerics. Where tuning chooses oneDNN's brgemm for a format (AMX), x is bf16.

``avx512_bf16_emulated`` is a path for tests only: the AVX512-BF16 units built on
SIMDe's portable intrinsics (where simde-py was installed at build time), so its
code runs, slowly, on CPUs without AVX512. It is never chosen by default.
"""

from __future__ import annotations

import contextlib
import os

PATHS = ("amx", "avx512_bf16", "avx2", "reference")  # fastest first

def version_mismatch(built: str | None, running: str) -> str | None:
    """Why a native library built against torch ``built`` (major.minor; None: a tilefx too old to say) cannot
    serve torch ``running``, or None where it can. One built against another minor version imports, but its
    ops register under the wrong dispatch keys (the enum changes between versions) and fail at their first
    call, so it is refused up front."""
    version = ".".join(running.split("+")[0].split(".")[:2])
    if built == version:
        return None
    return (f"tilefx's native library was built against torch {built or 'of an older tilefx'} and this is torch "
            f"{running}: rebuild it (`make clean install`, or `pip install --no-build-isolation -e .`)")


try:
    from tilefx.custom_ops import _C as native
except ImportError as error:  # a source checkout that was never built: reference kernels only
    native = None
    NATIVE_IMPORT_ERROR: str | None = f"{error}; run `make install`"
else:
    import torch

    NATIVE_IMPORT_ERROR = version_mismatch(getattr(native, "torch_version", None), torch.__version__)
    if NATIVE_IMPORT_ERROR is not None:
        native = None

# Paths with kernels in this build.
BUILT = ("amx", "avx512_bf16", "avx2") if native is not None else ()
EMULATED_AVX512 = "avx512_bf16_emulated"


def unsupported_reason(path: str) -> str | None:
    """Why ``path`` cannot run here, or None when it can."""
    if path not in PATHS and path != EMULATED_AVX512:
        return f"unknown kernel path {path!r}; expected one of {', '.join(PATHS)}"
    if path == "reference":
        return None
    if native is None:
        return f"the native library is not loaded: {NATIVE_IMPORT_ERROR}"
    if path == EMULATED_AVX512:
        if not getattr(native, "avx512_emulation", False):
            return "this build has no emulated AVX512-BF16 unit (install simde-py, then `make install`)"
        return None if native.cpu_has("avx2") else "its other ops run AVX2 kernels, which this CPU lacks"
    if path not in BUILT:
        return f"this build has no {path} kernels"
    if not native.cpu_has(path):
        return f"this CPU lacks {path}" + (" (oneDNN brgemm cannot use AMX tiles here)" if path == "amx" else "")
    return None


def supported() -> tuple[str, ...]:
    """The paths that run on this CPU with this build, fastest first (always ends with reference)."""
    return tuple(path for path in PATHS if unsupported_reason(path) is None)


def kernel_units(path: str) -> dict[str, str]:
    """The unit each op family runs on ``path`` in this build, from the native table (empty for reference).

    The table is read whether or not this CPU runs ``path``."""
    if path not in PATHS and path != EMULATED_AVX512:
        raise ValueError(f"unknown kernel path {path!r}; expected one of {', '.join(PATHS)}")
    if path == "reference" or native is None:
        return {}
    if path == EMULATED_AVX512 and not getattr(native, "avx512_emulation", False):
        raise RuntimeError(f"kernel path {path}: this build has no emulated AVX512-BF16 unit")
    return dict(native.kernel_units(path))


def _from_environment() -> str:
    path = os.environ.get("TILEFX_ISA", "").strip().lower()
    if not path:
        return supported()[0]
    reason = unsupported_reason(path)
    if reason is not None:
        raise RuntimeError(f"TILEFX_ISA={path}: {reason}. Unset TILEFX_ISA or choose one of {', '.join(supported())}.")
    return path


def _set(path: str) -> None:
    global _current
    _current = path
    if native is not None:  # the native CPU kernels read the path on every call
        native.set_path(path if path in BUILT or path == EMULATED_AVX512 else "reference")


_current = ""
_set(_from_environment())


# How the native units read x where a weight format gives them a choice, per process: (environment variable, the
# forms (the default first), what reads it). custom_ops/csrc/activations.h has what each means.
_ACTIVATION_CHOICES = {
    "int4": ("TILEFX_INT4_ACTIVATIONS", ("int16", "int8"), "int4 decode reads x"),
    "int8": ("TILEFX_INT8_ACTIVATIONS", ("int8", "bf16"), "int8 and int4 GEMMs read x"),
}
INT4_ACTIVATIONS = _ACTIVATION_CHOICES["int4"][1]
INT8_ACTIVATIONS = _ACTIVATION_CHOICES["int8"][1]


def _from_environment_for(format: str) -> str:
    variable, forms, what = _ACTIVATION_CHOICES[format]
    form = os.environ.get(variable, forms[0]).strip().lower() or forms[0]
    if form not in forms:
        raise RuntimeError(f"{variable}={form}: {what} as one of {', '.join(forms)}")
    return form


def _int4_from_environment() -> str:
    return _from_environment_for("int4")


def _int8_from_environment() -> str:
    return _from_environment_for("int8")


def _native_form(format: str) -> str:
    return getattr(native, f"get_{format}_activations")()


@contextlib.contextmanager
def _forced_form(format: str, form: str):
    _, forms, what = _ACTIVATION_CHOICES[format]
    if form not in forms:
        raise ValueError(f"{what} as one of {', '.join(forms)}, not {form!r}")
    setter = getattr(native, f"set_{format}_activations")
    previous = _native_form(format)
    setter(form)
    try:
        yield
    finally:
        setter(previous)


def int4_activations() -> str:
    """How int4 decode reads x on the native paths: ``int16`` (15-bit words per row) or ``int8`` (per 32 inputs)."""
    return _native_form("int4") if native is not None else "int16"


def forced_int4_activations(form: str):
    """Run a block with int4 decode reading x as ``form`` (``int16`` or ``int8``)."""
    return _forced_form("int4", form)


def int8_activations() -> str:
    """How an int8 or int4 GEMM (more than 4 rows) on the units' own GEMM reads x: ``int8`` (integer products: int8
    per 32 inputs on the AVX512-BF16 units, ``vpdpbusd``; int16 per row on AVX2, ``vpmaddwd``) or
    ``bf16`` (over dequantized blocks, the weight-only numerics)."""
    return _native_form("int8") if native is not None else "bf16"


def forced_int8_activations(form: str):
    """Run a block with int8 and int4 GEMMs reading x as ``form`` (``int8`` or ``bf16``)."""
    return _forced_form("int8", form)


if native is not None:
    native.set_int4_activations(_int4_from_environment())
    native.set_int8_activations(_int8_from_environment())


def current() -> str:
    """The path ops start from (the fastest supported one unless forced)."""
    return _current


@contextlib.contextmanager
def forced(path: str):
    """Run a block with every op starting from ``path`` (which must be supported here)."""
    reason = unsupported_reason(path)
    if reason is not None:
        raise RuntimeError(f"kernel path {path}: {reason}")
    previous = _current
    _set(path)
    try:
        yield
    finally:
        _set(previous)


def define_native_op(lib, name: str, schema: str, reference, fake) -> None:
    """Define ``tilefx::<name>`` (its CPU kernel is native, registered from C++ by custom_ops/__init__.py,
    and takes the current kernel path) and ``tilefx::<name>_portable`` (the reference, which the native
    kernel calls on the reference path). Without the native library ``<name>`` runs the reference."""
    import torch

    lib.define(f"{name}_portable{schema}")
    lib.impl(f"{name}_portable", reference, "CPU")
    lib.define(name + schema)
    if native is None:
        lib.impl(name, reference, "CPU")
    for op in (name, f"{name}_portable"):
        torch.library.register_fake(f"tilefx::{op}", fake, lib=lib)


def _native_stream_read() -> bool:
    return native is not None and native.cpu_has("avx2")


def stream_probe(size_mib: int = 1024):
    """A function that runs one streaming-read pass over a buffer allocated once, returning GB/s:
    for benchmarks that pair each kernel measurement with one.

    Calls alternate one and two streams per thread (which is faster depends on the CPU),
    so a pass is one sample, as each kernel measurement it is paired with: taking the
    better of two passes every time would bias the probe's median upward. Without the
    native library a pass is an fp32 sum over the buffer.
    """
    import itertools
    import time

    import torch

    if _native_stream_read():  # in huge pages, as the weights are held
        buffer = native.huge_page_empty([size_mib * 2**20 // 4], torch.float32).fill_(1.0)
        streams = itertools.cycle((1, 2))
        return lambda: native.stream_read_gbps(buffer, next(streams))
    buffer = torch.ones(size_mib * 2**20 // 4)

    def fp32_sum_pass() -> float:
        start = time.perf_counter()
        buffer.sum()
        return buffer.nbytes / (time.perf_counter() - start) / 1e9

    return fp32_sum_pass


def stream_read_gbps(size_mib: int = 1024, repeats: int = 5) -> float:
    """Streaming-read bandwidth of this machine, GB/s, over a ``size_mib`` buffer.

    The native probe reads with every thread, each a contiguous slice, with the same
    vector loads as the kernels, as one and as two concurrent streams per thread
    (the GEMV reads two). The result is the best pass of either pattern over
    ``repeats`` passes each, as STREAM reports: on a shared machine a median mixes in
    other tenants' traffic and yields a floor that kernels can beat. Without the
    native library an fp32 sum stands in (best of ``repeats`` after one warm-up).
    """
    probe = stream_probe(size_mib)
    if not _native_stream_read():
        probe()  # warm-up: the first sum's timing is not kept
        return max(probe() for _ in range(repeats))
    return max(probe() for _ in range(2 * repeats))  # the patterns alternate: `repeats` passes of each

