"""tilefx custom ops: schema, fake impl, reference impl and dispatch, one module per op family.

Importing this package registers every op under the ``tilefx`` namespace.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib

from tilefx.custom_ops import attention, buffers, collectives, isa, linear, materialize, moe, norm, rope, tuning, weights  # noqa: F401  (importing defines the ops)

if isa.native is not None:
    isa.native.register_cpu_kernels()  # after the schemas above are defined

__all__ = ["attention", "buffers", "collectives", "isa", "linear", "materialize", "moe", "norm", "rope", "source_hash", "tuning", "weights"]


@functools.cache
def source_hash() -> str:
    """Hash of every op definition and native kernel source, for compiled-graph cache keys."""
    root = pathlib.Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("**/*.py"), *root.glob("csrc/**/*")]):
        if path.is_file():
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
