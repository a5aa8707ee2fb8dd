"""tilefx.all_reduce / tilefx.all_gather on 2 ranks (torchrun): shared memory and gloo, against the exact fp32
sum and the concatenation of the ranks' fresh random inputs, eager and compiled; the groups' shared-memory segments
are gone when the ranks end (theirs: other tests may open groups meanwhile)."""

from __future__ import annotations

import os

from tests.test_tp import launch_ranks, shm_files_named_in, torchrun


def test_collectives_on_two_ranks():
    done = torchrun("tests/custom_ops/collectives_worker.py", timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "rank 0: 0 failures" in done.stdout and "rank 1: 0 failures" in done.stdout
    segments = shm_files_named_in(done.stdout)  # (every rank prints its groups' files)
    assert len(segments) == 4, done.stdout
    assert not any(os.path.exists(s) for s in segments)


def test_groups_are_closed_before_the_interpreter_finalizes(tmp_path):
    """A rank that ends without closing its groups (as every tensor-parallel script does) has them closed by an
    atexit handler, while the interpreter is still whole: the gloo communicator and its hold on the process group
    are gone before finalization. (Held until finalization, gloo's worker threads were destroyed there and one
    could abort the process.) The check runs after tilefx's handler: atexit runs handlers last-registered first."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import atexit, sys, weakref\n"
        "seen = {}\n"
        "def report():\n"
        "    groups = sys.modules['tilefx.custom_ops.collectives']._GROUPS\n"
        "    print('open at exit:', sorted(groups), 'communicator alive:', seen['ref']() is not None, flush=True)\n"
        "atexit.register(report)\n"
        "import torch, torch.distributed as dist\n"
        "import tilefx.custom_ops\n"
        "from tilefx.custom_ops import collectives\n"
        "dist.init_process_group('gloo')\n"
        "seen['ref'] = weakref.ref(collectives.open_group('g', 'gloo'))\n"
        "print('sum', torch.ops.tilefx.all_reduce(torch.ones(8), 'g').tolist(), flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    (done,) = launch_ranks(script, nproc=1)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "sum [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]" in done.stdout, done.stdout
    assert "open at exit: [] communicator alive: False" in done.stdout, done.stdout
