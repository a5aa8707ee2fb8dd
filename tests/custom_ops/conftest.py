import pytest

from tilefx.custom_ops import isa


@pytest.fixture(params=isa.PATHS + (isa.EMULATED_AVX512,))
def kernel_path(request):
    """Run the test once per kernel path, and on the AVX512-BF16 unit emulated by SIMDe (its code on any CPU);
    paths this CPU or build cannot run are skipped with the reason."""
    reason = isa.unsupported_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    with isa.forced(request.param):
        yield request.param
