import pytest

from tilefx.custom_ops import isa


@pytest.fixture(params=isa.PATHS)
def kernel_path(request):
    """Run the test once per kernel path; paths this CPU or build cannot run are skipped with the reason."""
    reason = isa.unsupported_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    with isa.forced(request.param):
        yield request.param
