"""tilefx.all_reduce / tilefx.all_gather on 2 ranks (torchrun): shared memory and gloo, against the exact fp32
sum and the concatenation of the ranks' fresh random inputs, eager and compiled; the groups' shared-memory segments
are gone when the ranks end (theirs: other tests may open groups meanwhile)."""

from __future__ import annotations

import os

from tests.test_tp import shm_files_named_in, torchrun


def test_collectives_on_two_ranks():
    done = torchrun("tests/custom_ops/collectives_worker.py", timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "rank 0: 0 failures" in done.stdout and "rank 1: 0 failures" in done.stdout
    segments = shm_files_named_in(done.stdout)  # (every rank prints its groups' files)
    assert len(segments) == 4, done.stdout
    assert not any(os.path.exists(s) for s in segments)
