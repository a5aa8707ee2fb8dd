"""Large CPU buffers kept for reuse within a forward (csrc/recycling.cpp).

Each layer of a prefill allocates the same large intermediates, and glibc maps every block over 32 MiB
afresh and unmaps it on free, so each layer faults (and the kernel zeroes) their pages again. Inside
``recycled()`` a freed block of at least ``min_bytes`` is kept and a later request of about its size
takes it back; the outermost ``recycled()`` frees what is kept as it exits. The runtime holds one around
every forward (``CompileOptions.recycle_buffers``). Without the native library it does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from tilefx.custom_ops import isa

DEFAULT_MIN_BYTES = 1 << 20


@contextlib.contextmanager
def recycled(min_bytes: int = DEFAULT_MIN_BYTES) -> Iterator[None]:
    """Keep freed CPU blocks of at least ``min_bytes`` for reuse until the outermost ``recycled()`` exits
    (nested holds keep the outer one's ``min_bytes``)."""
    if isa.native is None:
        yield
        return
    isa.native.hold_recycled_buffers(min_bytes)
    try:
        yield
    finally:
        isa.native.release_recycled_buffers()


def stats() -> dict[str, int]:
    """Open holds, blocks and bytes kept now, and since the process started the large requests made while
    held that a kept block served (``reused``) or that made a new block (``made``)."""
    if isa.native is None:
        return dict(holds=0, kept_blocks=0, kept_bytes=0, reused=0, made=0)
    holds, blocks, kept, reused, made = isa.native.recycled_buffer_stats()
    return dict(holds=holds, kept_blocks=blocks, kept_bytes=kept, reused=reused, made=made)
