"""tilefx.all_reduce / tilefx.all_gather on 2 ranks (torchrun): shared memory and gloo, against the exact fp32
sum and the concatenation of the ranks' fresh random inputs, eager and compiled; segments are cleaned up."""

from __future__ import annotations

import os

from tests.test_tp import _tilefx_segments, torchrun


def test_collectives_on_two_ranks():
    before = _tilefx_segments()
    done = torchrun("tests/custom_ops/collectives_worker.py", timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "rank 0: 0 failures" in done.stdout and "rank 1: 0 failures" in done.stdout
    assert _tilefx_segments() <= before
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("tilefx-") and n not in before]
