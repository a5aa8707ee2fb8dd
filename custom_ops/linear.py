"""``tilefx::linear`` (and ``linear_float``, its fp32 result), ``tilefx::linear_silu_mul`` and
``tilefx::linear_per_head`` over weights packed once, and the packing ops.

Packed layout (one for every kernel path; csrc/kernels.h explains why):
``W [N, K]`` -> ``[ceil(N / BLOCK_N), ceil(K / 2), BLOCK_N, 2]`` bf16, zero padded:
blocks of ``BLOCK_N`` output columns, each a VNNI matrix (the two values of rows
``k`` and ``k + 1`` side by side for every column).

Sibling linears (one input, several weights: q/k/v, gate/up) are packed into one
tensor so decode streams them as one weight in one call:

- ``pack_fused_linear_weight([W1, W2, ...])`` packs ``cat([W1, W2, ...])``: the blocks
  of each weight follow the previous one's (every N but the last a multiple of BLOCK_N).
- ``pack_gate_up_weight(gate, up)`` interleaves blocks, gate block ``j`` then up block
  ``j``, so ``tilefx.linear_silu_mul`` computes ``silu(x @ gate.T) * (x @ up.T)`` for
  those columns while both are in registers (SiLU-and-mul as the GEMM's epilogue).

Per-head weights (MLA's absorbed ``kv_b_proj``) use the expert layout, one packed
linear per head: ``pack_mla_absorbed_weight(kv_b_proj.weight, heads, nope_dim, value)``
gives per head ``W_uk^T [R, nope]`` (the query side) or ``W_uv [v, R]`` (the output
side), and ``tilefx.linear_per_head`` applies head ``h``'s weight to ``x[..., h, :, :]``.

The passes insert a packing op in front of every linear; Inductor's freezing
constant-folds it, so each weight is packed once when the graph is compiled. Every
graph of a model (prefill, decode, each batch size) gets the same packed tensor:
packing is memoized per group of source weights.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref

import torch

from tilefx.custom_ops import isa

BLOCK_N = 32


def _packed_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
    return (-(-out_features // BLOCK_N), -(-in_features // 2), BLOCK_N, 2)


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


def _check_siblings(weights, what: str, last_may_be_partial: bool) -> None:
    torch._check(len(weights) >= 1 and all(w.dim() == 2 for w in weights),
                 lambda: f"{what}: weights must be 2-D, got {[tuple(w.shape) for w in weights]}")
    torch._check(all(w.shape[1] == weights[0].shape[1] and w.dtype == weights[0].dtype for w in weights),
                 lambda: f"{what}: weights must share in_features and dtype, got "
                         f"{[(tuple(w.shape), w.dtype) for w in weights]}")
    whole = weights[:-1] if last_may_be_partial else weights
    torch._check(all(w.shape[0] % BLOCK_N == 0 for w in whole),
                 lambda: f"{what}: out_features must be multiples of {BLOCK_N}, got {[w.shape[0] for w in weights]}")


def pack_fused_linear_weight_reference(weights: list[torch.Tensor]) -> torch.Tensor:
    """Sibling weights ``[N_i, K]`` -> the packed ``cat(weights)``."""
    _check_siblings(weights, "pack_fused_linear_weight", last_may_be_partial=True)
    return pack_linear_weight_reference(torch.cat(list(weights)))


def pack_gate_up_weight_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate, up [I, K]`` -> packed blocks gate 0, up 0, gate 1, up 1, ... (I a multiple of BLOCK_N)."""
    _check_siblings([gate, up], "pack_gate_up_weight", last_may_be_partial=False)
    torch._check(gate.shape == up.shape, lambda: f"pack_gate_up_weight: gate {tuple(gate.shape)} != up {tuple(up.shape)}")
    g, u = pack_linear_weight_reference(gate), pack_linear_weight_reference(up)
    return torch.stack([g, u], dim=1).flatten(0, 1)


def unpack_gate_up_weight(packed: torch.Tensor, out_features: int, in_features: int):
    """The inverse of gate/up packing: ``(gate, up)``, each ``[I, K]``."""
    interleaved = packed.unflatten(0, (-1, 2))
    return tuple(unpack_linear_weight(interleaved[:, i], out_features, in_features) for i in (0, 1))


def _expert_gate_up_order(gate_up_proj: torch.Tensor) -> torch.Tensor:
    """A view (a copy only if H is odd) of ``gate_up_proj`` whose element order is the packed layout."""
    torch._check(gate_up_proj.dim() == 3 and gate_up_proj.shape[1] % (2 * BLOCK_N) == 0,
                 lambda: f"pack_expert_gate_up_weight: gate_up_proj must be [E, 2I, H] with I a multiple of "
                         f"{BLOCK_N}, got {tuple(gate_up_proj.shape)}")
    experts, two_inter, hidden = gate_up_proj.shape
    blocks, pairs = two_inter // 2 // BLOCK_N, -(-hidden // 2)
    padded = gate_up_proj if 2 * pairs == hidden else torch.nn.functional.pad(gate_up_proj, (0, 1))
    # [E, (gate|up), I/32, 32, H/2, 2] -> [E, I/32, (gate|up), H/2, 32, 2]
    return padded.reshape(experts, 2, blocks, BLOCK_N, pairs, 2).permute(0, 2, 1, 4, 3, 5)


def _expert_gate_up_shape(gate_up_proj) -> tuple[int, ...]:
    experts, two_inter, hidden = gate_up_proj.shape
    return (experts, two_inter // BLOCK_N, -(-hidden // 2), BLOCK_N, 2)


def pack_expert_gate_up_weight_reference(gate_up_proj: torch.Tensor) -> torch.Tensor:
    """HF ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) -> per expert the
    ``pack_gate_up_weight`` layout: ``[E, 2 * I/BLOCK_N, ceil(H/2), BLOCK_N, 2]``."""
    return _expert_gate_up_order(gate_up_proj).reshape(_expert_gate_up_shape(gate_up_proj)).contiguous()


def _expert_down_order(down_proj: torch.Tensor) -> torch.Tensor:
    torch._check(down_proj.dim() == 3, lambda: f"pack_expert_down_weight: down_proj must be [E, H, I], got "
                                               f"{tuple(down_proj.shape)}")
    experts, hidden, inter = down_proj.shape
    blocks, pairs, _, _ = _packed_shape(hidden, inter)
    padded = down_proj
    if (2 * pairs, blocks * BLOCK_N) != (inter, hidden):
        padded = torch.nn.functional.pad(down_proj, (0, 2 * pairs - inter, 0, blocks * BLOCK_N - hidden))
    return padded.reshape(experts, blocks, BLOCK_N, pairs, 2).permute(0, 1, 3, 2, 4)


def pack_expert_down_weight_reference(down_proj: torch.Tensor) -> torch.Tensor:
    """HF ``experts.down_proj [E, H, I]`` -> per expert the packed linear layout ``[E, ceil(H/32), ceil(I/2), 32, 2]``."""
    return _expert_down_order(down_proj).contiguous()


def _mla_absorbed_order(kv_b_weight: torch.Tensor, heads: int, nope_dim: int, value: bool) -> torch.Tensor:
    rows, rank = kv_b_weight.shape
    torch._check(rows % heads == 0 and 0 < nope_dim < rows // heads,
                 lambda: f"pack_mla_absorbed_weight: kv_b_proj {tuple(kv_b_weight.shape)} does not split into "
                         f"{heads} heads with {nope_dim} key rows")
    per_head = kv_b_weight.view(heads, rows // heads, rank)
    part = per_head[:, nope_dim:] if value else per_head[:, :nope_dim].transpose(1, 2)
    return _expert_down_order(part)


def pack_mla_absorbed_weight_reference(kv_b_weight: torch.Tensor, heads: int, nope_dim: int,
                                       value: bool) -> torch.Tensor:
    """``kv_b_proj.weight [H * (nope + v), R]`` -> per head, packed: ``W_uk^T [R, nope]`` (value=False) or
    ``W_uv [v, R]`` (value=True), i.e. ``[H, N/32, K/2, 32, 2]``."""
    return _mla_absorbed_order(kv_b_weight, heads, nope_dim, value).contiguous()


def unpack_expert_gate_up_weight(packed: torch.Tensor, hidden: int) -> torch.Tensor:
    """The inverse of expert gate/up packing: ``[E, 2I, H]``."""
    experts, two_blocks, pairs, _, _ = packed.shape
    split = packed.view(experts, two_blocks // 2, 2, pairs, BLOCK_N, 2).permute(0, 2, 1, 4, 3, 5)
    return split.reshape(experts, two_blocks * BLOCK_N, 2 * pairs)[:, :, :hidden]


def unpack_expert_down_weight(packed: torch.Tensor, hidden: int, inter: int) -> torch.Tensor:
    """The inverse of expert down packing: ``[E, H, I]``."""
    experts, blocks, pairs, _, _ = packed.shape
    return packed.permute(0, 1, 3, 2, 4).reshape(experts, blocks * BLOCK_N, 2 * pairs)[:, :hidden, :inter]


@dataclasses.dataclass
class _Packing:
    """One packed tensor and the weights it was made from."""

    sources: tuple[weakref.ref, ...]
    packed: torch.Tensor


# (layout, source keys) -> _Packing. A key is (storage address, offset, shape, stride, version).
_packed_cache: dict[tuple, _Packing] = {}


def _key(weight: torch.Tensor) -> tuple:
    return (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(),
            weight._version)


def _current(entry_key: tuple, entry: _Packing) -> bool:
    """The sources are alive and unchanged: an address can be reused by a new tensor, and weights edited in place."""
    sources = [ref() for ref in entry.sources]
    return all(s is not None for s in sources) and tuple(_key(s) for s in sources) == entry_key[1]


def _memoized(layout: str, weights, pack, shape=None) -> torch.Tensor:
    """The packed tensor of ``weights`` in ``layout``: made by ``pack()`` (whose element order is the
    packed one; ``shape``, if given, is the packed shape) once, then shared while the weights are unchanged."""
    key = (layout, tuple(_key(w) for w in weights))
    hit = _packed_cache.get(key)
    if hit is not None and _current(key, hit):
        return hit.packed
    made = pack()  # a view where it can be: copied once, straight into huge pages (streamed every token)
    packed = isa.huge_page_empty(tuple(shape or made.shape), made.dtype)
    packed.view(made.shape).copy_(made)
    del made
    _packed_cache[key] = _Packing(tuple(weakref.ref(w) for w in weights), packed)
    for stale in [k for k, entry in _packed_cache.items() if not _current(k, entry)]:
        del _packed_cache[stale]
    return packed


def _pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    return _memoized("linear", [weight], lambda: pack_linear_weight_reference(weight))


def _pack_fused_linear_weight(weights: list[torch.Tensor]) -> torch.Tensor:
    return _memoized("fused", weights, lambda: pack_fused_linear_weight_reference(weights))


def _pack_gate_up_weight(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _memoized("gate_up", [gate, up], lambda: pack_gate_up_weight_reference(gate, up))


def _pack_expert_gate_up_weight(gate_up_proj: torch.Tensor) -> torch.Tensor:
    return _memoized("expert_gate_up", [gate_up_proj], lambda: _expert_gate_up_order(gate_up_proj),
                     _expert_gate_up_shape(gate_up_proj))


def _pack_expert_down_weight(down_proj: torch.Tensor) -> torch.Tensor:
    return _memoized("expert_down", [down_proj], lambda: _expert_down_order(down_proj))


def _pack_mla_absorbed_weight(kv_b_weight: torch.Tensor, heads: int, nope_dim: int, value: bool) -> torch.Tensor:
    return _memoized(f"mla_{'value' if value else 'key'}_{heads}_{nope_dim}", [kv_b_weight],
                     lambda: _mla_absorbed_order(kv_b_weight, heads, nope_dim, value))


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The current packed tensor that holds ``weight`` (alone or with its siblings), if any."""
    for key, entry in _packed_cache.items():
        if any(ref() is weight for ref in entry.sources) and _current(key, entry):
            return entry.packed
    return None


def keep_only_packed(exclusive: set[int]) -> tuple[int, int]:
    """Release the unpacked storage of packed parameters whose ``id`` is in ``exclusive``.

    Each such parameter's data becomes a view of its part of the packed tensor (the
    weights of a group lie one after another there, or interleaved block by block),
    so memory holds it once. The parameter keeps its shape but its values are in
    packed order: only tilefx graphs (where every use of it was packed) may read it.
    Packing the group again returns the same packed tensor, so a graph compiled later
    still computes correctly. Returns (bytes released, packed weights kept unpacked:
    padded packings, which cannot stand in for their parameters).
    """
    current = {key: entry for key, entry in _packed_cache.items() if _current(key, entry)}
    packings_of = collections.Counter(id(ref()) for entry in current.values() for ref in entry.sources)
    # A weight packed in two layouts stays: its data cannot be both packed tensors.
    exclusive = {i for i in exclusive if packings_of[i] == 1}
    released = kept = 0
    for key, entry in current.items():
        sources = [ref() for ref in entry.sources]
        if not any(id(s) in exclusive for s in sources):
            continue
        flat = entry.packed.view(-1)
        if flat.numel() != sum(s.numel() for s in sources):
            kept += sum(id(s) in exclusive for s in sources)
            continue
        offset = 0
        for source in sources:
            if id(source) in exclusive and source.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                released += source.untyped_storage().nbytes()
                source.data = flat[offset : offset + source.numel()].view(source.shape)
            offset += source.numel()
        del _packed_cache[key]
        _packed_cache[(key[0], tuple(_key(s) for s in sources))] = entry
    return released, kept


def linear_reference(x, packed_weight, bias, out_features):
    """The specification: ``x @ W.T + bias`` in fp32, rounded to x's dtype."""
    _check(x, packed_weight, bias, out_features)
    weight = unpack_linear_weight(packed_weight, out_features, x.shape[-1])
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def linear_float_reference(x, packed_weight, bias, out_features):
    """The specification: ``x @ W.T + bias`` in fp32, kept in fp32 (HF's fp32 routers over bf16 weights)."""
    _check(x, packed_weight, bias, out_features)
    weight = unpack_linear_weight(packed_weight, out_features, x.shape[-1])
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


def linear_silu_mul_reference(x, packed_gate_up, out_features):
    """The specification: ``silu(x @ gate.T) * (x @ up.T)`` in fp32, rounded to x's dtype."""
    _check_gate_up(x, packed_gate_up, out_features)
    gate, up = unpack_gate_up_weight(packed_gate_up, out_features, x.shape[-1])
    xf = x.float()
    return (torch.nn.functional.silu(xf @ gate.float().T) * (xf @ up.float().T)).to(x.dtype)


def linear_per_head_reference(x, packed_weight, out_features):
    """The specification: ``y[..., h, s, :] = x[..., h, s, :] @ W_h.T`` in fp32, rounded to x's dtype."""
    _check_per_head(x, packed_weight, out_features)
    weight = unpack_expert_down_weight(packed_weight, out_features, x.shape[-1])  # [H, N, K]
    return torch.matmul(x.float(), weight.float().transpose(1, 2)).to(x.dtype)


def _check_per_head(x, packed_weight, out_features) -> None:
    torch._check(packed_weight.dim() == 5 and packed_weight.shape[3:] == (BLOCK_N, 2),
                 lambda: f"tilefx.linear_per_head: weight is not packed per head (shape {tuple(packed_weight.shape)})")
    torch._check(x.dim() >= 3 and x.shape[-3] == packed_weight.shape[0]
                 and packed_weight.shape[1:] == _packed_shape(out_features, x.shape[-1]),
                 lambda: f"tilefx.linear_per_head: packed weight {tuple(packed_weight.shape)} does not fit "
                         f"x {tuple(x.shape)} -> {out_features} features")


def _check(x, packed_weight, bias, out_features) -> None:
    torch._check(packed_weight.dim() == 4 and packed_weight.shape[2:] == (BLOCK_N, 2),
                 lambda: f"tilefx.linear: weight is not packed (shape {tuple(packed_weight.shape)}); "
                         "use tilefx.custom_ops.linear.pack_linear_weight")
    torch._check(packed_weight.shape == _packed_shape(out_features, x.shape[-1]),
                 lambda: f"tilefx.linear: packed weight {tuple(packed_weight.shape)} does not fit "
                         f"x [..., {x.shape[-1]}] -> {out_features} features")


def _check_gate_up(x, packed_gate_up, out_features) -> None:
    blocks, pairs, _, _ = _packed_shape(out_features, x.shape[-1])
    torch._check(packed_gate_up.dim() == 4 and tuple(packed_gate_up.shape) == (2 * blocks, pairs, BLOCK_N, 2),
                 lambda: f"tilefx.linear_silu_mul: packed weight {tuple(packed_gate_up.shape)} does not fit "
                         f"x [..., {x.shape[-1]}] -> {out_features} features; use pack_gate_up_weight")


def _linear_fake(x, packed_weight, bias, out_features):
    _check(x, packed_weight, bias, out_features)
    return x.new_empty((*x.shape[:-1], out_features))


def _linear_float_fake(x, packed_weight, bias, out_features):
    _check(x, packed_weight, bias, out_features)
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32)


def _linear_silu_mul_fake(x, packed_gate_up, out_features):
    _check_gate_up(x, packed_gate_up, out_features)
    return x.new_empty((*x.shape[:-1], out_features))


def _linear_per_head_fake(x, packed_weight, out_features):
    _check_per_head(x, packed_weight, out_features)
    return x.new_empty((*x.shape[:-1], out_features))


def _pack_mla_absorbed_fake(kv_b_weight, heads, nope_dim, value):
    rows, rank = kv_b_weight.shape
    shape = (rows // heads - nope_dim, rank) if value else (rank, nope_dim)
    return kv_b_weight.new_empty((heads, *_packed_shape(*shape)))


def _pack_fake(weight):
    return weight.new_empty(_packed_shape(*weight.shape))


def _pack_fused_fake(weights):
    _check_siblings(weights, "pack_fused_linear_weight", last_may_be_partial=True)
    return weights[0].new_empty(_packed_shape(sum(w.shape[0] for w in weights), weights[0].shape[1]))


def _pack_expert_gate_up_fake(gate_up_proj):
    experts, two_inter, hidden = gate_up_proj.shape
    return gate_up_proj.new_empty((experts, two_inter // BLOCK_N, -(-hidden // 2), BLOCK_N, 2))


def _pack_expert_down_fake(down_proj):
    experts, hidden, inter = down_proj.shape
    return down_proj.new_empty((experts, *_packed_shape(hidden, inter)))


def _pack_gate_up_fake(gate, up):
    _check_siblings([gate, up], "pack_gate_up_weight", last_may_be_partial=False)
    blocks, pairs, _, _ = _packed_shape(*gate.shape)
    return gate.new_empty((2 * blocks, pairs, BLOCK_N, 2))


_LIB = torch.library.Library("tilefx", "FRAGMENT")
for _name, _schema, _impl, _fake in (
    ("pack_linear_weight", "(Tensor weight) -> Tensor", _pack_linear_weight, _pack_fake),
    ("pack_fused_linear_weight", "(Tensor[] weights) -> Tensor", _pack_fused_linear_weight, _pack_fused_fake),
    ("pack_gate_up_weight", "(Tensor gate, Tensor up) -> Tensor", _pack_gate_up_weight, _pack_gate_up_fake),
    ("pack_expert_gate_up_weight", "(Tensor gate_up_proj) -> Tensor", _pack_expert_gate_up_weight,
     _pack_expert_gate_up_fake),
    ("pack_expert_down_weight", "(Tensor down_proj) -> Tensor", _pack_expert_down_weight, _pack_expert_down_fake),
    ("pack_mla_absorbed_weight", "(Tensor kv_b_weight, int heads, int nope_dim, bool value) -> Tensor",
     _pack_mla_absorbed_weight, _pack_mla_absorbed_fake),
):
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _impl, "CPU")
    torch.library.register_fake(f"tilefx::{_name}", _fake, lib=_LIB)

# linear, linear_silu_mul: native CPU kernels, the references as *_portable ops (isa.define_native_op).
isa.define_native_op(_LIB, "linear", "(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor",
                     linear_reference, _linear_fake)
isa.define_native_op(_LIB, "linear_silu_mul", "(Tensor x, Tensor packed_gate_up, int out_features) -> Tensor",
                     linear_silu_mul_reference, _linear_silu_mul_fake)
isa.define_native_op(_LIB, "linear_float", "(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor",
                     linear_float_reference, _linear_float_fake)
isa.define_native_op(_LIB, "linear_per_head", "(Tensor x, Tensor packed_weight, int out_features) -> Tensor",
                     linear_per_head_reference, _linear_per_head_fake)

pack_linear_weight = torch.ops.tilefx.pack_linear_weight.default
pack_fused_linear_weight = torch.ops.tilefx.pack_fused_linear_weight.default
pack_gate_up_weight = torch.ops.tilefx.pack_gate_up_weight.default
pack_expert_gate_up_weight = torch.ops.tilefx.pack_expert_gate_up_weight.default
pack_expert_down_weight = torch.ops.tilefx.pack_expert_down_weight.default
pack_mla_absorbed_weight = torch.ops.tilefx.pack_mla_absorbed_weight.default
linear = torch.ops.tilefx.linear.default
linear_silu_mul = torch.ops.tilefx.linear_silu_mul.default
linear_per_head = torch.ops.tilefx.linear_per_head.default
linear_float = torch.ops.tilefx.linear_float.default
