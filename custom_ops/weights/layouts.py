"""Packed layouts: the one home of their shape arithmetic and element orders.

The base layout is ``W [N, K]`` -> ``[ceil(N / BLOCK_N), ceil(K / 2), BLOCK_N, 2]``, zero
padded: blocks of ``BLOCK_N`` output columns, each a VNNI matrix (the values of rows
``k`` and ``k + 1`` side by side for every column). The layouts built on it:

- ``linear``: one weight, or sibling weights sharing an input (q/k/v) one after
  another: the blocks of each follow the previous one's (every N but the last a
  multiple of BLOCK_N), so each member's own packing is a contiguous slice.
- ``gate_up``: gate and up ``[I, K]`` interleaved block by block (gate 0, up 0, gate 1,
  ...) for ``tilefx.linear_silu_mul``'s SiLU-and-mul epilogue.
- ``expert_gate_up`` / ``expert_down``: HF's fused 3-D experts, per expert the
  ``gate_up`` / ``linear`` layout.
- ``mla_key`` / ``mla_value``: DeepSeek's ``kv_b_proj`` split per head into ``W_uk^T
  [R, nope]`` or ``W_uv [v, R]``, per head the ``linear`` layout.

Every caller that needs a packed shape, a block count or the gate/up interleave asks
this module (C++: ``csrc/layout.h``). ``can_pack`` is the one place that says what a
layout accepts; the formats a layout may hold are ``formats.QUANTIZED_LAYOUTS``.
"""

from __future__ import annotations

import torch

BLOCK_N = 32  # output columns per packed block (csrc/kernels.h kBlockN)

LAYOUTS = ("linear", "gate_up", "expert_gate_up", "expert_down", "mla_key", "mla_value")


def blocks_of(features: int) -> int:
    """Packed blocks that hold ``features`` output columns."""
    return -(-features // BLOCK_N)


def is_block_aligned(features: int) -> bool:
    """Whether ``features`` output columns fill whole blocks (a sibling that is not the last, gate and up)."""
    return features % BLOCK_N == 0


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
    """The ``linear`` layout of one ``[out_features, in_features]`` weight."""
    return (blocks_of(out_features), -(-in_features // 2), BLOCK_N, 2)


def gate_up_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
    """The ``gate_up`` layout of a gate and an up ``[out_features, in_features]``."""
    blocks, pairs, _, _ = packed_shape(out_features, in_features)
    return (2 * blocks, pairs, BLOCK_N, 2)


def expert_gate_up_shape(experts: int, intermediate: int, hidden: int) -> tuple[int, ...]:
    """The ``expert_gate_up`` layout of HF's ``gate_up_proj [E, 2I, H]``."""
    return (experts, *gate_up_shape(intermediate, hidden))


def expert_down_shape(experts: int, hidden: int, intermediate: int) -> tuple[int, ...]:
    """The ``expert_down`` layout of HF's ``down_proj [E, H, I]`` (also the per-head layout)."""
    return (experts, *packed_shape(hidden, intermediate))


def expert_intermediate(w13_shape) -> int:
    """The intermediate size of an ``expert_gate_up`` packing (``[E, 2 * I/32, ...]``)."""
    return w13_shape[1] // 2 * BLOCK_N


def is_linear_packing(shape) -> bool:
    return len(shape) == 4 and tuple(shape[2:]) in ((BLOCK_N, 2), (BLOCK_N // 2, 2))


def is_per_head_packing(shape) -> bool:
    return len(shape) == 5 and tuple(shape[3:]) in ((BLOCK_N, 2), (BLOCK_N // 2, 2))


def in_features_of(shape) -> int:
    """The (even-padded) input features a packing of ``shape`` reads: twice its K pairs."""
    return 2 * shape[-3]


def gate_up_columns(out_features: int) -> tuple[int, int, int]:
    """How the ``2 * out_features`` columns of a plain linear over a ``gate_up`` packing unflatten:
    ``[..., blocks, 2, BLOCK_N]``, index 0 of the middle dim the gate's columns, 1 the up's."""
    return (out_features // BLOCK_N, 2, BLOCK_N)


def row_positions(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where output row ``rows`` of a weight sits in its ``linear`` packing: (block, column within the block)."""
    return torch.div(rows, BLOCK_N, rounding_mode="floor"), torch.remainder(rows, BLOCK_N)


def member_blocks(source_shapes, first: int, last: int) -> tuple[int, int]:
    """The block range ``[begin, end)`` that sources ``first..last`` of a ``linear`` packing fill."""
    blocks = [blocks_of(shape[0]) for shape in source_shapes]
    return sum(blocks[:first]), sum(blocks[: last + 1])


def layout_shape(layout: str, weights, args: tuple) -> tuple[int, ...]:
    """The packed shape of ``weights`` in ``layout`` (``args``: mla_*'s heads and nope_dim)."""
    if layout == "linear":
        return packed_shape(sum(w.shape[0] for w in weights), weights[0].shape[1])
    if layout == "gate_up":
        return gate_up_shape(*weights[0].shape)
    if layout == "expert_gate_up":
        experts, two_inter, hidden = weights[0].shape
        return expert_gate_up_shape(experts, two_inter // 2, hidden)
    if layout == "expert_down":
        return expert_down_shape(*weights[0].shape)
    if layout in ("mla_key", "mla_value"):
        heads, nope_dim = args
        rows, rank = weights[0].shape
        shape = (rows // heads - nope_dim, rank) if layout == "mla_value" else (rank, nope_dim)
        return (heads, *packed_shape(*shape))
    raise ValueError(f"unknown packed layout {layout!r}")


# -- can_pack: what a layout accepts --------------------------------------------------------------------------


def siblings_problem(layout: str, weights) -> str | None:
    """Why 2-D ``weights`` cannot share one ``linear`` (or ``mla``) or ``gate_up`` packing, or None: every
    block but a linear's last must be whole, so each sibling's packing is a contiguous slice."""
    if any(w.dim() != 2 for w in weights):
        return f"weights must be 2-D, got {[tuple(w.shape) for w in weights]}"
    if any(w.shape[1] != weights[0].shape[1] for w in weights):  # no set: symbolic sizes do not hash
        return f"siblings differ in in_features: {[tuple(w.shape) for w in weights]}"
    gate_up = layout == "gate_up"
    if any(not is_block_aligned(w.shape[0]) for w in (weights if gate_up else weights[:-1])):
        which = "gate and up" if gate_up else "siblings but the last"
        return f"out_features {[w.shape[0] for w in weights]}: {which} need multiples of {BLOCK_N}"
    if gate_up and (len(weights) != 2 or weights[0].shape != weights[1].shape):
        return f"gate/up must be two weights of one shape, got {[tuple(w.shape) for w in weights]}"
    return None


def shape_problem(layout: str, weights) -> str | None:
    """Why ``weights``' shapes do not fit ``layout`` (``can_pack`` adds the dtype and format rules), or None.
    ``experts`` is can_pack's name for the pair (gate_up_proj, down_proj)."""
    if layout in ("linear", "gate_up", "mla"):
        return siblings_problem(layout, weights)
    if layout in ("expert_gate_up", "expert_down"):  # one of the pair, as pack() checks it
        return None if weights[0].dim() == 3 else f"{layout}: a 3-D [E, N, K] weight, got {tuple(weights[0].shape)}"
    if layout == "experts":
        if len(weights) != 2 or any(w.dim() != 3 for w in weights):
            return "experts are gate_up_proj [E, 2I, H] and down_proj [E, H, I]"
        gate_up, down = weights
        experts, hidden, inter = down.shape
        if tuple(gate_up.shape) != (experts, 2 * inter, hidden):
            return f"experts gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} do not match"
        if not is_block_aligned(inter):
            return f"expert intermediate size {inter}: need a multiple of {BLOCK_N}"
        return None
    raise ValueError(f"unknown packed layout {layout!r}")


def check_sources(layout: str, weights) -> None:
    """Shapes only (the references pack any dtype; ``can_pack`` says what the kernels take)."""
    what = f"pack ({layout})"
    torch._check(len(weights) >= 1, lambda: f"{what}: no weights")
    if layout in ("linear", "gate_up"):
        problem = siblings_problem(layout, weights)
        torch._check(problem is None, lambda: f"{what}: {problem}")
        torch._check(len({w.dtype for w in weights}) == 1,
                     lambda: f"{what}: weights must share a dtype, got {[w.dtype for w in weights]}")
    elif layout == "expert_gate_up":
        torch._check(weights[0].dim() == 3 and weights[0].shape[1] % (2 * BLOCK_N) == 0,
                     lambda: f"pack_expert_gate_up_weight: gate_up_proj must be [E, 2I, H] with I a multiple of "
                             f"{BLOCK_N}, got {tuple(weights[0].shape)}")
    elif layout == "expert_down":
        torch._check(weights[0].dim() == 3, lambda: f"pack_expert_down_weight: down_proj must be [E, H, I], got "
                                                    f"{tuple(weights[0].shape)}")


# -- element orders: views (a copy only where padding is needed) ----------------------------------------------


def _pad2(weight: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    n, k = weight.shape[-2:]
    return weight if (n, k) == (rows, cols) else torch.nn.functional.pad(weight, (0, cols - k, 0, rows - n))


def linear_order(weight: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` as ``[..., N/32, K/2, 32, 2]`` (a view unless N or K needs padding)."""
    blocks, pairs, _, _ = packed_shape(*weight.shape[-2:])
    padded = _pad2(weight, blocks * BLOCK_N, 2 * pairs)
    lead = padded.shape[:-2]
    return padded.reshape(*lead, blocks, BLOCK_N, pairs, 2).transpose(-3, -2)


# int4's nibble order (csrc/kernels.h): K pairs 2t and 2t + 1 of a block (inputs 4t..4t+3) are 16 lanes of 4
# bytes; byte j of lane l holds input 4t + j of column l in its low nibble and of column l + 16 in its high one.


def int4_interleave(values: torch.Tensor) -> torch.Tensor:
    """Nibble values ``[..., blocks, pairs, 32, 2]`` (uint8 in [0, 16), ``linear_order``'s element order, pairs
    even) as the int4 packing's bytes ``[..., blocks, pairs, 16, 2]``."""
    *lead, blocks, pairs, _, _ = values.shape
    # [..., t, pair parity, column half, lane, value] -> [..., t, lane, parity, value]: byte j = 2 parity + value
    parts = values.reshape(*lead, blocks, pairs // 2, 2, 2, BLOCK_N // 2, 2)
    low, high = parts.select(-3, 0), parts.select(-3, 1)  # [..., t, parity, lane, value]
    lanes = (low | (high << 4)).movedim(-2, -3)  # [..., t, lane, parity, value]
    return lanes.reshape(*lead, blocks, pairs, BLOCK_N // 2, 2)


def int4_values(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``int4_interleave``: the nibbles of an int4 packing as ``[..., blocks, pairs, 32, 2]`` uint8."""
    *lead, blocks, pairs, _, _ = packed.shape
    lanes = packed.reshape(*lead, blocks, pairs // 2, BLOCK_N // 2, 2, 2).movedim(-3, -2)  # [..., t, parity, lane, value]
    halves = torch.stack([lanes & 0xF, lanes >> 4], dim=-3)  # [..., t, parity, half, lane, value]
    return halves.reshape(*lead, blocks, pairs, BLOCK_N, 2)


def gate_up_halves(packed: torch.Tensor) -> torch.Tensor:
    """A ``gate_up`` packing (or anything in its block order, such as its scales) as ``[blocks, 2, ...]``:
    ``[:, 0]`` the gate's blocks, ``[:, 1]`` the up's."""
    return packed.view(-1, 2, *packed.shape[1:])


def expert_gate_up_halves(packed: torch.Tensor) -> torch.Tensor:
    """An ``expert_gate_up`` packing (or its scales) as ``[E, blocks, 2, ...]``, as ``gate_up_halves`` per expert."""
    return packed.view(packed.shape[0], -1, 2, *packed.shape[2:])


def mla_part(kv_b_weight: torch.Tensor, heads: int, nope_dim: int, value: bool) -> torch.Tensor:
    """``kv_b_proj [H * (nope + v), R]`` as per-head ``W_uk^T [H, R, nope]`` or ``W_uv [H, v, R]``."""
    rows, rank = kv_b_weight.shape
    torch._check(rows % heads == 0 and 0 < nope_dim < rows // heads,
                 lambda: f"pack_mla_absorbed_weight: kv_b_proj {tuple(kv_b_weight.shape)} does not split into "
                         f"{heads} heads with {nope_dim} key rows")
    per_head = kv_b_weight.view(heads, rows // heads, rank)
    return per_head[:, nope_dim:] if value else per_head[:, :nope_dim].transpose(1, 2)


def unpack_linear_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of the ``linear`` layout (also per expert / head: ``[..., N, K]``)."""
    *lead, blocks, pairs, _, _ = packed.shape
    whole = packed.transpose(-3, -2).reshape(*lead, blocks * BLOCK_N, 2 * pairs)
    return whole[..., :out_features, :in_features]


def unpack_gate_up_weight(packed: torch.Tensor, out_features: int, in_features: int):
    """The inverse of the ``gate_up`` layout: ``(gate, up)``, each ``[I, K]``."""
    interleaved = gate_up_halves(packed)
    return tuple(unpack_linear_weight(interleaved[:, i], out_features, in_features) for i in (0, 1))


def unpack_expert_gate_up_weight(packed: torch.Tensor, hidden: int) -> torch.Tensor:
    """The inverse of the ``expert_gate_up`` layout: ``[E, 2I, H]``."""
    experts = packed.shape[0]
    halves = expert_gate_up_halves(packed).transpose(1, 2)  # [E, 2, blocks, pairs, 32, 2]
    return unpack_linear_weight(halves, expert_intermediate(packed.shape), hidden).reshape(experts, -1, hidden)


def unpack_expert_down_weight(packed: torch.Tensor, hidden: int, inter: int) -> torch.Tensor:
    """The inverse of the ``expert_down`` (and per-head) layout: ``[E, H, I]``."""
    return unpack_linear_weight(packed, hidden, inter)
