"""``tilefx::linear`` over a weight packed once, and ``tilefx::pack_linear_weight``.

Packed layout (one for every kernel path; csrc/kernels.h explains why):
``W [N, K]`` -> ``[ceil(N / BLOCK_N), ceil(K / 2), BLOCK_N, 2]`` bf16, zero padded:
blocks of ``BLOCK_N`` output columns, each a VNNI matrix (the two values of rows
``k`` and ``k + 1`` side by side for every column).

The linear pass inserts ``pack_linear_weight(weight)`` in front of every
``tilefx.linear``; Inductor's freezing constant-folds it, so each weight is packed
once when the graph is compiled. Every graph of a model (prefill, decode, each
batch size) gets the same packed tensor: packing is memoized per source weight.
"""

from __future__ import annotations

import weakref

import torch

from tilefx.custom_ops import isa

BLOCK_N = 32


def _packed_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
    return (-(-out_features // BLOCK_N), -(-in_features // 2), BLOCK_N, 2)


# (storage address, offset, shape, stride, version) -> (weakref to the source weight, packed)
_packed_cache: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}


def pack_linear_weight_reference(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> packed ``[N/BLOCK_N, K/2, BLOCK_N, 2]`` (a new tensor, zero padded)."""
    torch._check(weight.dim() == 2, lambda: f"pack_linear_weight: weight must be 2-D, got {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    blocks, pairs, _, _ = _packed_shape(out_features, in_features)
    padded = torch.nn.functional.pad(weight, (0, 2 * pairs - in_features, 0, blocks * BLOCK_N - out_features))
    return padded.view(blocks, BLOCK_N, pairs, 2).permute(0, 2, 1, 3).contiguous()


def unpack_linear_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of packing: ``[N, K]``."""
    blocks, pairs, _, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK_N, 2 * pairs)[:out_features, :in_features]


def _key(weight: torch.Tensor) -> tuple:
    return (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(),
            weight._version)


def _pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    packed = packed_copy(weight)
    if packed is not None:
        return packed
    packed = pack_linear_weight_reference(weight)
    _packed_cache[_key(weight)] = (weakref.ref(weight), packed)
    for stale in [k for k, (source, _) in _packed_cache.items() if source() is None or _key(source()) != k]:
        del _packed_cache[stale]
    return packed


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy made of ``weight`` by the last pack_linear_weight call, if it is current."""
    key = _key(weight)
    hit = _packed_cache.get(key)
    if hit is None:
        return None
    source = hit[0]()
    # The source must still live in the same storage: an address can be reused by a new tensor.
    return hit[1] if source is not None and _key(source) == key else None


def keep_only_packed(weight: torch.nn.Parameter) -> int:
    """Release ``weight``'s unpacked storage: its data becomes a view of its packed copy.

    Afterwards memory holds the weight once. The parameter keeps its shape but its
    values are in packed order, so only tilefx graphs (where every use of it was
    packed) may read it; packing it again returns the same packed tensor, so a graph
    compiled later still computes correctly. Returns the bytes released (0 when the
    packed copy is padded and cannot stand in for the parameter).
    """
    packed = packed_copy(weight)
    if packed is None or packed.numel() != weight.numel():
        return 0
    if packed.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        return 0  # already released
    released = weight.untyped_storage().nbytes()
    del _packed_cache[_key(weight)]
    weight.data = packed.view(weight.shape)
    _packed_cache[_key(weight)] = (weakref.ref(weight), packed)
    return released


def linear_reference(x, packed_weight, bias, out_features):
    """The specification: ``x @ W.T + bias`` in fp32, rounded to x's dtype."""
    _check(x, packed_weight, bias, out_features)
    weight = unpack_linear_weight(packed_weight, out_features, x.shape[-1])
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _check(x, packed_weight, bias, out_features) -> None:
    torch._check(packed_weight.dim() == 4 and packed_weight.shape[2:] == (BLOCK_N, 2),
                 lambda: f"tilefx.linear: weight is not packed (shape {tuple(packed_weight.shape)}); "
                         "use tilefx.custom_ops.linear.pack_linear_weight")
    torch._check(packed_weight.shape == _packed_shape(out_features, x.shape[-1]),
                 lambda: f"tilefx.linear: packed weight {tuple(packed_weight.shape)} does not fit "
                         f"x [..., {x.shape[-1]}] -> {out_features} features")


def _linear_fake(x, packed_weight, bias, out_features):
    _check(x, packed_weight, bias, out_features)
    return x.new_empty((*x.shape[:-1], out_features))


def _pack_fake(weight):
    return weight.new_empty(_packed_shape(*weight.shape))


_LINEAR_SCHEMA = "(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor"
_LIB = torch.library.Library("tilefx", "FRAGMENT")
_LIB.define("pack_linear_weight(Tensor weight) -> Tensor")
_LIB.impl("pack_linear_weight", lambda weight: _pack_linear_weight(weight), "CPU")
torch.library.register_fake("tilefx::pack_linear_weight", _pack_fake, lib=_LIB)
# linear: the native CPU kernel (registered by custom_ops/__init__.py) takes the current
# kernel path; on the reference path, or without the native library, linear_portable runs.
_LIB.define("linear_portable" + _LINEAR_SCHEMA)
_LIB.impl("linear_portable", linear_reference, "CPU")
_LIB.define("linear" + _LINEAR_SCHEMA)
if isa.native is None:
    _LIB.impl("linear", linear_reference, "CPU")
for _name in ("linear", "linear_portable"):
    torch.library.register_fake(f"tilefx::{_name}", _linear_fake, lib=_LIB)

pack_linear_weight = torch.ops.tilefx.pack_linear_weight.default
linear = torch.ops.tilefx.linear.default
