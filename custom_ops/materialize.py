"""``tilefx::materialize(x) -> Tensor``: a copy of ``x`` that Inductor cannot fuse into its readers.

Inductor inlines a pointwise value into every kernel that reads it unless it judges the value
expensive, and it judges by how many ops the value takes: ``cos`` and ``sin`` count as one each.
A value computed once per forward and read by every layer (RoPE's cos/sin tables) is then
recomputed inside every layer's kernels, per element of each query and key head. Reading it
through this op (an extern call Inductor cannot look into) makes Inductor compute it once into a
buffer; the copy itself is the size of the table (compiler/passes/compute_once.py).
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("tilefx", "FRAGMENT")
_LIB.define("materialize(Tensor x) -> Tensor")


def _materialize(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def _materialize_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_LIB.impl("materialize", _materialize, "CPU")
torch.library.register_fake("tilefx::materialize", _materialize_fake, lib=_LIB)

materialize = torch.ops.tilefx.materialize.default
