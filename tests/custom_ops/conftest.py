import contextlib

import pytest

from tilefx.custom_ops import isa, tuning


@pytest.fixture(params=isa.PATHS + (isa.EMULATED_AVX512,))
def kernel_path(request):
    """Run the test once per kernel path, and on the AVX512-BF16 unit emulated by SIMDe (its code on any CPU);
    paths this CPU or build cannot run are skipped with the reason. The prefill choices tuning makes (brgemm,
    SDPA) are reset to the paths' defaults for the test: tests that cover them force them."""
    reason = isa.unsupported_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    with isa.forced(request.param), tuning.untuned() if isa.native is not None else contextlib.nullcontext():
        yield request.param


@pytest.fixture(params=isa.INT4_ACTIVATIONS)
def int4_x(request):
    """Run an int4 test with decode reading x as each form (int16 words, the default; int8 per 32 inputs, which the
    native units read where asked: isa.forced_int4_activations)."""
    if isa.native is None:
        pytest.skip("the reference path reads x as it is")
    with isa.forced_int4_activations(request.param):
        yield request.param
