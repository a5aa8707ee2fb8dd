"""The recycler of large CPU blocks (custom_ops/buffers.py, csrc/recycling.cpp): what a hold keeps, what it hands
back, and that nothing is kept once the outermost hold ends."""

from __future__ import annotations

import pytest
import torch

from tilefx.custom_ops import buffers, isa

pytestmark = pytest.mark.skipif(isa.native is None, reason="the recycler is the native library's")

MIB = 1 << 20


def _block(bytes_: int) -> torch.Tensor:
    return torch.empty(bytes_, dtype=torch.uint8)


def _delta(before: dict[str, int]) -> dict[str, int]:
    now = buffers.stats()
    return {k: now[k] - before[k] for k in ("reused", "made")}


def test_a_freed_block_serves_a_later_request_of_its_size_within_a_hold():
    start = buffers.stats()
    with buffers.recycled():
        first = _block(8 * MIB)
        address = first.data_ptr()
        first.fill_(7)
        del first
        assert buffers.stats()["kept_blocks"] == 1 and buffers.stats()["kept_bytes"] == 8 * MIB
        again = _block(8 * MIB - MIB // 2)  # up to an eighth smaller takes the kept block
        assert again.data_ptr() == address
        assert buffers.stats()["kept_blocks"] == 0
        del again
        other = _block(6 * MIB)  # more than an eighth smaller does not: a new block
        assert other.data_ptr() != address
        larger = _block(9 * MIB)  # nor does a larger request
        assert larger.data_ptr() != address
        assert _delta(start) == {"reused": 1, "made": 3}
        del other, larger
        assert buffers.stats()["kept_blocks"] == 3
    assert buffers.stats()["kept_blocks"] == 0 and buffers.stats()["kept_bytes"] == 0


def test_small_blocks_and_blocks_freed_outside_a_hold_are_not_kept():
    with buffers.recycled(min_bytes=4 * MIB):
        small = _block(MIB)
        del small
        assert buffers.stats()["kept_blocks"] == 0
        outlives = _block(8 * MIB)  # made in the hold, freed after it
    del outlives
    assert buffers.stats()["kept_blocks"] == 0
    made_outside = _block(8 * MIB)
    del made_outside
    assert buffers.stats()["kept_blocks"] == 0


def test_holds_nest_and_the_outermost_frees_what_is_kept():
    with buffers.recycled():
        with buffers.recycled(min_bytes=64 * MIB):  # the outer hold's min_bytes stays
            del_me = _block(2 * MIB)
            del del_me
            assert buffers.stats()["holds"] == 2 and buffers.stats()["kept_blocks"] == 1
        assert buffers.stats()["holds"] == 1 and buffers.stats()["kept_blocks"] == 1  # the inner one kept it
    assert buffers.stats() | {"reused": 0, "made": 0} == dict(holds=0, kept_blocks=0, kept_bytes=0, reused=0, made=0)


def test_a_bad_min_bytes_is_refused():
    with pytest.raises(RuntimeError, match="min_bytes must be at least 1"):
        with buffers.recycled(min_bytes=0):
            pass
    assert buffers.stats()["holds"] == 0
    with pytest.raises(RuntimeError, match="without a hold"):
        isa.native.release_recycled_buffers()
