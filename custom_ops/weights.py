"""Packed weights: one descriptor, one family of packing ops, one ``can_pack``, one release policy.

Every kernel that reads a weight reads it packed (docs/ARCHITECTURE.md, "Packed
layouts"): ``W [N, K]`` -> ``[ceil(N / BLOCK_N), ceil(K / 2), BLOCK_N, 2]`` bf16, zero
padded: blocks of ``BLOCK_N`` output columns, each a VNNI matrix (the values of rows
``k`` and ``k + 1`` side by side for every column). The layouts built on it:

- ``linear``: one weight, or sibling weights sharing an input (q/k/v) one after
  another: the blocks of each follow the previous one's (every N but the last a
  multiple of BLOCK_N), so each member's own packing is a contiguous slice.
- ``gate_up``: gate and up ``[I, K]`` interleaved block by block (gate 0, up 0, gate 1,
  ...) for ``tilefx.linear_silu_mul``'s SiLU-and-mul epilogue.
- ``expert_gate_up`` / ``expert_down``: HF's fused 3-D experts, per expert the
  ``gate_up`` / ``linear`` layout (quantized too: scales ``[E, ...]``, gate and up
  quantized as separate weights).
- ``mla_key`` / ``mla_value``: DeepSeek's ``kv_b_proj`` split per head into ``W_uk^T
  [R, nope]`` or ``W_uv [v, R]``, per head the ``linear`` layout.

A ``PackedWeight`` describes one packed tensor: layout, format, scales, the shard it
holds, its sources. Formats (``FORMATS``): ``bf16``; ``int8`` (symmetric, one fp32 scale
per output channel); ``fp8`` (e4m3, one fp32 scale per 128 x 128 block of the source,
the hub's ``weight_scale_inv``: ``W = q * scale``). A quantized packing holds its 1-byte
values in the same element order as bf16 (``[blocks, K/2, 32, 2]``) and its scales in
packed-block order, ``[blocks, 32]`` (int8: per packed column) or ``[blocks, K/128]``
(fp8: per block and 128 inputs), so kernels never map a block back to its source rows
and gate/up interleaving or sibling fusion need no scale bookkeeping of their own. ``pack()`` makes one (or returns
the one that exists for the same sources), ``release()`` hands the sources' memory
back: each source parameter becomes a view of its part of the packed tensor, so
memory holds the weight once (its values are then in packed order: only tilefx
graphs, which read it packed, may use it). The loader packs and releases layer by
layer (models/packing.py); the graph's packing ops, run once when a graph is compiled
(compiler/pass_manager.py, ``packings_as_inputs``), find those packed tensors here and
return them instead of packing again.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import mmap
import threading
import weakref

import torch

from tilefx.custom_ops import isa

BLOCK_N = 32  # output columns per packed block (csrc/kernels.h: one block is 2 x 4 AVX2 registers wide)
# format -> the packed tensor's dtype (the kernels read the format from it)
FORMATS = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
FP8_GROUP = 128  # fp8 scale blocks: 128 output channels x 128 inputs (the hub's weight_block_size)
FP8_MAX = 448.0  # largest finite e4m3 value
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
# what the quantized kernels read (MLA's per-head halves: bf16); "experts" is can_pack's name for the pair
QUANTIZED_LAYOUTS = ("linear", "gate_up", "experts", "expert_gate_up", "expert_down")


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
    return (-(-out_features // BLOCK_N), -(-in_features // 2), BLOCK_N, 2)


# -- can_pack: the one place that says what a packed layout accepts ----------------------------------------


def can_pack(layout: str, weights, x_dtype: torch.dtype | None = None, format: str = "bf16") -> str | None:
    """Why ``weights`` (tensors or example values) cannot be packed in ``layout`` and ``format``, or None when
    they can.

    Passes and the loader ask this instead of checking dtypes and block sizes themselves.
    """
    weights = list(weights)
    if any(w is None for w in weights):
        return "weight value unknown"
    if format not in FORMATS:
        raise ValueError(f"unknown weight format {format!r}; expected one of {', '.join(FORMATS)}")
    if format != "bf16" and layout not in QUANTIZED_LAYOUTS:
        return f"{format} weights: the {layout} kernels read bf16 only"
    dtypes = {w.dtype for w in weights}
    if any(w.dtype != torch.bfloat16 and checkpoint_scales(w) is None for w in weights):
        return (f"dtype {sorted(map(str, dtypes))}: packed weights are packed from bf16 or from an fp8 checkpoint's "
                f"weights (with their scales)")
    if len(dtypes) > 1 and layout != "experts":  # experts: gate_up and down are packed apart
        return f"siblings of different dtypes {sorted(map(str, dtypes))}"
    if x_dtype is not None and x_dtype != torch.bfloat16:
        return f"activations are {x_dtype}: packed linears take bf16 activations"
    if layout in ("linear", "gate_up", "mla"):
        return _siblings_problem(layout, weights)
    if layout in ("expert_gate_up", "expert_down"):  # one of the pair, as pack() checks it
        return None if weights[0].dim() == 3 else f"{layout}: a 3-D [E, N, K] weight, got {tuple(weights[0].shape)}"
    if layout == "experts":
        if len(weights) != 2 or any(w.dim() != 3 for w in weights):
            return "experts are gate_up_proj [E, 2I, H] and down_proj [E, H, I]"
        gate_up, down = weights
        experts, hidden, inter = down.shape
        if tuple(gate_up.shape) != (experts, 2 * inter, hidden):
            return f"experts gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} do not match"
        if inter % BLOCK_N:
            return f"expert intermediate size {inter}: need a multiple of {BLOCK_N}"
        return None
    raise ValueError(f"unknown packed layout {layout!r}")


def _siblings_problem(layout: str, weights) -> str | None:
    """Why 2-D ``weights`` cannot share one ``linear`` (or ``mla``) or ``gate_up`` packing, or None: every
    block but a linear's last must be whole, so each sibling's packing is a contiguous slice."""
    if any(w.dim() != 2 for w in weights):
        return f"weights must be 2-D, got {[tuple(w.shape) for w in weights]}"
    if any(w.shape[1] != weights[0].shape[1] for w in weights):  # no set: symbolic sizes do not hash
        return f"siblings differ in in_features: {[tuple(w.shape) for w in weights]}"
    gate_up = layout == "gate_up"
    if any(w.shape[0] % BLOCK_N for w in (weights if gate_up else weights[:-1])):
        which = "gate and up" if gate_up else "siblings but the last"
        return f"out_features {[w.shape[0] for w in weights]}: {which} need multiples of {BLOCK_N}"
    if gate_up and (len(weights) != 2 or weights[0].shape != weights[1].shape):
        return f"gate/up must be two weights of one shape, got {[tuple(w.shape) for w in weights]}"
    return None


# -- layouts: element orders as views (a copy only where padding is needed) ---------------------------------


def _pad2(weight: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    n, k = weight.shape[-2:]
    return weight if (n, k) == (rows, cols) else torch.nn.functional.pad(weight, (0, cols - k, 0, rows - n))


def _linear_order(weight: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` as ``[..., N/32, K/2, 32, 2]`` (a view unless N or K needs padding)."""
    blocks, pairs, _, _ = packed_shape(*weight.shape[-2:])
    padded = _pad2(weight, blocks * BLOCK_N, 2 * pairs)
    lead = padded.shape[:-2]
    return padded.reshape(*lead, blocks, BLOCK_N, pairs, 2).transpose(-3, -2)


def _mla_part(kv_b_weight: torch.Tensor, heads: int, nope_dim: int, value: bool) -> torch.Tensor:
    rows, rank = kv_b_weight.shape
    torch._check(rows % heads == 0 and 0 < nope_dim < rows // heads,
                 lambda: f"pack_mla_absorbed_weight: kv_b_proj {tuple(kv_b_weight.shape)} does not split into "
                         f"{heads} heads with {nope_dim} key rows")
    per_head = kv_b_weight.view(heads, rows // heads, rank)
    return per_head[:, nope_dim:] if value else per_head[:, :nope_dim].transpose(1, 2)


def _layout_shape(layout: str, weights, args: tuple) -> tuple[int, ...]:
    if layout == "linear":
        return packed_shape(sum(w.shape[0] for w in weights), weights[0].shape[1])
    if layout == "gate_up":
        blocks, pairs, _, _ = packed_shape(*weights[0].shape)
        return (2 * blocks, pairs, BLOCK_N, 2)
    if layout == "expert_gate_up":
        experts, two_inter, hidden = weights[0].shape
        return (experts, two_inter // BLOCK_N, -(-hidden // 2), BLOCK_N, 2)
    if layout == "expert_down":
        experts, hidden, inter = weights[0].shape
        return (experts, *packed_shape(hidden, inter))
    if layout in ("mla_key", "mla_value"):
        heads, nope_dim = args
        rows, rank = weights[0].shape
        shape = (rows // heads - nope_dim, rank) if layout == "mla_value" else (rank, nope_dim)
        return (heads, *packed_shape(*shape))
    raise ValueError(f"unknown packed layout {layout!r}")


CHUNK_BYTES = 64 << 20  # source bytes packed at a time: a file-backed source's pages are dropped after each


def _write_blocks(out: torch.Tensor, rows: torch.Tensor, native: bool) -> None:
    """``out [blocks, pairs, 32, 2] = rows [n, k]`` in ``linear`` order (zero padded): the native copy
    (csrc/memory.cpp, every thread) where it applies, else torch's copy of the permuted view."""
    if (native and isa.native is not None and rows.element_size() == 2 and rows.stride(-1) == 1
            and out.stride()[1:] == (2 * BLOCK_N, 2, 1)):
        isa.native.pack_vnni_blocks(out, rows)
    else:
        out.copy_(_linear_order(rows))


def _fill_linear(out: torch.Tensor, weight: torch.Tensor, mapped, native: bool, scales=None,
                 source_scales=None) -> None:
    """``out[b] = blocks b of weight`` in ``linear`` order, a chunk of rows at a time; quantized (``scales``: its
    rows of the packing's scales) where ``out`` holds a quantized format. ``source_scales``: ``weight`` is an fp8
    checkpoint's, with these 128 x 128 block scales: copied as they are into an fp8 packing, else dequantized a
    chunk at a time."""
    fp8_source = source_scales is not None
    if fp8_source:
        _check_checkpoint_scales(weight, source_scales)
    step = FP8_GROUP if scales is not None or fp8_source else BLOCK_N  # chunks never split an fp8 scale block
    row_bytes = weight[0].numel() * (4 if fp8_source else weight.element_size())  # fp8: dequantized in fp32
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, row_bytes) // step) * step
    for row in range(0, weight.shape[0], rows_per_chunk):
        source = weight[row : row + rows_per_chunk]
        block = row // BLOCK_N
        blocks = -(-source.shape[0] // BLOCK_N)
        values, row_scales = source, None
        if fp8_source:
            _refuse_nan_codes(source)
            groups = source_scales[row // FP8_GROUP : -(-(row + source.shape[0]) // FP8_GROUP)]
            if format_of(out) == "fp8":  # the checkpoint's own values and scales
                row_scales = groups
            else:
                values = dequantize_blocks(source, groups)
        if scales is not None and row_scales is None:
            values, row_scales = quantize_rows(values, format_of(out))
        if scales is None:
            _write_blocks(out[block : block + blocks], values, native)
        else:
            _write_blocks(out[block : block + blocks].view(torch.uint8), values.view(torch.uint8), native=False)
            _write_scales(scales[block : block + blocks], row_scales)
        _drop_file_pages(source, mapped)


def _write_scales(out: torch.Tensor, row_scales: torch.Tensor) -> None:
    """``quantize_rows``' scales of some rows into their blocks' packed-order scales ``out``."""
    if row_scales.dim() == 1:  # int8: one per row (padding rows: 0, their values are 0)
        padded = torch.zeros(out.shape[0] * BLOCK_N)
        padded[: row_scales.shape[0]] = row_scales
        out.copy_(padded.view(-1, BLOCK_N))
    else:  # fp8: a 128-row scale block covers 4 packed blocks
        out.copy_(row_scales.repeat_interleave(FP8_GROUP // BLOCK_N, dim=0)[: out.shape[0]])


def _fill(layout: str, weights, args: tuple, out: torch.Tensor, native: bool = True, scales=None) -> torch.Tensor:
    """Write ``weights`` into ``out`` in ``layout``'s element order, a chunk at a time (no copy of a whole
    weight): pages of a source mapped from a file are dropped as soon as they are packed, so packing a
    lazily loaded weight holds it about once, not twice. ``native=False``: torch copies only (the reference).
    ``scales``: a quantized packing's scales, written with its values."""
    mapped = _file_mappings()
    if layout == "linear":
        start = 0
        for weight in weights:
            blocks = -(-weight.shape[0] // BLOCK_N)
            part = None if scales is None else scales[start : start + blocks]
            _fill_linear(out[start : start + blocks], weight, mapped, native, part, checkpoint_scales(weight))
            start += blocks
    elif layout == "gate_up":
        pairs = out.view(-1, 2, *out.shape[1:])
        scale_pairs = None if scales is None else scales.view(-1, 2, *scales.shape[1:])
        for i in (0, 1):
            _fill_linear(pairs[:, i], weights[i], mapped, native, None if scales is None else scale_pairs[:, i],
                         checkpoint_scales(weights[i]))
    elif layout == "expert_gate_up":  # per expert, the gate_up layout of its [2I, H] (gate rows, then up rows)
        source_scales = _per_expert_scales(weights[0])
        halves = out.view(out.shape[0], -1, 2, *out.shape[2:])
        scale_halves = [None] * out.shape[0] if scales is None else scales.view(scales.shape[0], -1, 2, scales.shape[-1])
        for expert, source, groups, expert_scales in zip(halves, weights[0], source_scales, scale_halves):
            for i, (half, half_groups) in enumerate(zip(source.chunk(2), _halves(groups))):
                _fill_linear(expert[:, i], half, mapped, native, None if expert_scales is None else expert_scales[:, i],
                             half_groups)
    elif layout == "expert_down":
        expert_scales = [None] * out.shape[0] if scales is None else scales
        for expert, source, groups, part in zip(out, weights[0], _per_expert_scales(weights[0]), expert_scales):
            _fill_linear(expert, source, mapped, native, part, groups)
    elif layout in ("mla_key", "mla_value"):
        out.copy_(_linear_order(_mla_part(weights[0], *args, value=layout == "mla_value")))
    else:
        raise ValueError(f"unknown packed layout {layout!r}")
    return out


def _per_expert_scales(weight: torch.Tensor) -> list:
    scales = checkpoint_scales(weight)
    return [None] * weight.shape[0] if scales is None else list(scales)


def _halves(groups):
    return (None, None) if groups is None else groups.chunk(2)


# -- fp8 checkpoints: weights that arrive quantized ----------------------------------------------------------

_CHECKPOINT_SCALES = "_tilefx_weight_scale_inv"  # the attribute holding an fp8 checkpoint weight's scales


def attach_checkpoint_scales(weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Mark ``weight`` (e4m3 values as an fp8 checkpoint holds them) with its ``weight_scale_inv``: one fp32 per
    128 x 128 block (``[ceil(N / 128), ceil(K / 128)]``; 3-D experts ``[E, ...]`` per expert, and a fused
    gate_up ``[E, 2I, H]`` has the blocks of gate and up, each of its own rows). ``pack`` then reads it as is
    (fp8) or dequantizes it a chunk at a time (other formats), so no bf16 copy of it ever exists whole."""
    if weight.dtype != torch.float8_e4m3fn or scale_inv.dtype != torch.float32:
        raise ValueError(f"an fp8 checkpoint weight is float8_e4m3fn with float32 scales, got {weight.dtype} "
                         f"with {scale_inv.dtype}")
    if scale_inv.dim() != weight.dim() or scale_inv.shape[:-2] != weight.shape[:-2] or \
            scale_inv.shape[-1] != -(-weight.shape[-1] // FP8_GROUP):
        raise ValueError(f"weight_scale_inv {tuple(scale_inv.shape)} does not hold 128 x 128 blocks of a weight "
                         f"{tuple(weight.shape)}")
    setattr(weight, _CHECKPOINT_SCALES, scale_inv)


def checkpoint_scales(weight: torch.Tensor) -> torch.Tensor | None:
    """The block scales ``attach_checkpoint_scales`` gave ``weight``, or None (a bf16 weight)."""
    return getattr(weight, _CHECKPOINT_SCALES, None)


def _check_checkpoint_scales(weight: torch.Tensor, scales: torch.Tensor) -> None:
    expected = (-(-weight.shape[0] // FP8_GROUP), -(-weight.shape[1] // FP8_GROUP))
    if tuple(scales.shape) != expected:
        raise ValueError(f"fp8 weight {tuple(weight.shape)}: weight_scale_inv is {tuple(scales.shape)}, expected "
                         f"{expected} (one per 128 x 128 block)")


def _refuse_nan_codes(values: torch.Tensor) -> None:
    """e4m3 has two NaN codes (0x7F, 0xFF): no quantizer writes them, a corrupt checkpoint might. The kernels
    decode every other code, so a checkpoint weight holding one is refused rather than poisoning outputs.
    Checked 1 MiB at a time: temporaries the size of a whole chunk would stay in malloc's heap once freed."""
    flat = values.reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), 1 << 20):
        if ((flat[start : start + (1 << 20)] & 0x7F) == 0x7F).any():
            raise ValueError("an fp8 checkpoint weight holds NaN e4m3 codes (0x7F / 0xFF): the checkpoint is "
                             "corrupt or not e4m3")


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """``values [n, k]`` (e4m3) times their 128 x 128 block ``scales``, in ``dtype``: ``q * scale_inv`` in fp32,
    rounded once, as transformers dequantizes an fp8 checkpoint."""
    n, k = values.shape
    per_row = scales.repeat_interleave(FP8_GROUP, dim=0)[:n].repeat_interleave(FP8_GROUP, dim=1)[:, :k]
    return (values.float() * per_row).to(dtype)


def dequantize_checkpoint_weight(weight: torch.Tensor, dtype=torch.bfloat16) -> None:
    """Turn an fp8 checkpoint weight that no packing reads into ``dtype`` in place (one 2-D slice at a time
    alongside the result)."""
    scales = checkpoint_scales(weight)
    if scales is None:
        return
    values = weight.data
    out = torch.empty(values.shape, dtype=dtype)
    flat_values, flat_scales, flat_out = (t.reshape(-1, *t.shape[-2:]) for t in (values, scales, out))
    halves = 2 if values.dim() == 3 and scales.shape[-2] != -(-values.shape[-2] // FP8_GROUP) else 1
    for v, s, o in zip(flat_values, flat_scales, flat_out):
        for part_v, part_s, part_o in zip(v.chunk(halves), s.chunk(halves), o.chunk(halves)):
            _check_checkpoint_scales(part_v, part_s)
            _refuse_nan_codes(part_v)
            part_o.copy_(dequantize_blocks(part_v, part_s, dtype))
    weight.data = out
    delattr(weight, _CHECKPOINT_SCALES)
    _drop_file_pages(values, _file_mappings())


# -- quantized formats ---------------------------------------------------------------------------------------


def format_of(packed: torch.Tensor) -> str:
    """The format of a packed tensor (its dtype)."""
    for name, dtype in FORMATS.items():
        if packed.dtype == dtype:
            return name
    raise ValueError(f"{packed.dtype} is not a packed weight format ({', '.join(FORMATS)})")


def check_scales(op: str, packed: torch.Tensor, scales: torch.Tensor | None) -> None:
    """The scales an op was given for ``packed``: none for an unquantized weight, else ``packed_scales``'
    fp32 ``scales_shape``."""
    if packed.dtype not in QUANTIZED_DTYPES:
        torch._check(scales is None, lambda: f"tilefx.{op}: a {packed.dtype} weight takes no scales")
        return
    format = format_of(packed)
    want = scales_shape(tuple(packed.shape), format)
    torch._check(scales is not None and scales.dtype == torch.float32 and tuple(scales.shape) == want,
                 lambda: f"tilefx.{op}: a {format} weight needs its fp32 scales {list(want)} (packed_scales), got "
                         f"{None if scales is None else (scales.dtype, tuple(scales.shape))}")


def scales_shape(packed_shape: tuple[int, ...], format: str) -> tuple[int, ...]:
    """The scales of a packing of ``packed_shape`` (``[..., blocks, pairs, 32, 2]``) in ``format``: int8
    ``[..., blocks, 32]``, fp8 ``[..., blocks, ceil(K / 128)]``; bf16 has none (``()``)."""
    *lead, blocks, pairs, _, _ = packed_shape
    if format == "int8":
        return (*lead, blocks, BLOCK_N)
    if format == "fp8":
        return (*lead, blocks, -(-2 * pairs // FP8_GROUP))
    return ()


def quantize_rows(weight: torch.Tensor, format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [n, k]`` quantized: ``(values, scales)`` with ``weight ~ values * scales``.

    int8: symmetric per row, ``scale = max|w| / 127``, values rounded to nearest in [-127, 127], scales ``[n]``.
    fp8: e4m3 per 128 x 128 block, ``scale = max|w| / 448`` (the hub's ``weight_scale_inv``), values
    rounded to nearest e4m3, scales ``[ceil(n / 128), ceil(k / 128)]``. All-zero rows or blocks get scale 1.
    """
    w = weight.float()
    n, k = w.shape
    if format == "int8":
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale
    if format != "fp8":
        raise ValueError(f"quantize_rows: format {format!r} is not a quantized format (int8, fp8)")
    rows, cols = -(-n // FP8_GROUP), -(-k // FP8_GROUP)
    blocks = torch.nn.functional.pad(w, (0, cols * FP8_GROUP - k, 0, rows * FP8_GROUP - n))
    blocks = blocks.view(rows, FP8_GROUP, cols, FP8_GROUP)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(rows * FP8_GROUP, cols * FP8_GROUP)[:n, :k], scale


def dequantize(packed: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """A packed tensor's values in fp32, same shape and order (the references' first step; bf16: widened)."""
    if packed.dtype == torch.bfloat16:
        return packed.float()
    values = packed.float()
    if format_of(packed) == "int8":  # scales [..., blocks, 32]: per column of the block
        return values * scales[..., :, None, :, None]
    pairs = packed.shape[-3]  # fp8, scales [..., blocks, groups]: pair p lies in group 2p // 128
    per_pair = scales.repeat_interleave(FP8_GROUP // 2, dim=-1)[..., :pairs]
    return values * per_pair[..., None, None]


def pack_reference(layout: str, weights, args: tuple = ()) -> torch.Tensor:
    """The specification of ``layout``: a new (ordinary) tensor holding ``weights`` packed."""
    _check_sources(layout, weights)
    return _fill(layout, weights, args, torch.zeros(_layout_shape(layout, weights, args), dtype=weights[0].dtype),
                 native=False)


def unpack_linear_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of the ``linear`` layout (also per expert / head: ``[..., N, K]``)."""
    *lead, blocks, pairs, _, _ = packed.shape
    whole = packed.transpose(-3, -2).reshape(*lead, blocks * BLOCK_N, 2 * pairs)
    return whole[..., :out_features, :in_features]


def unpack_gate_up_weight(packed: torch.Tensor, out_features: int, in_features: int):
    """The inverse of the ``gate_up`` layout: ``(gate, up)``, each ``[I, K]``."""
    interleaved = packed.unflatten(0, (-1, 2))
    return tuple(unpack_linear_weight(interleaved[:, i], out_features, in_features) for i in (0, 1))


def unpack_expert_gate_up_weight(packed: torch.Tensor, hidden: int) -> torch.Tensor:
    """The inverse of the ``expert_gate_up`` layout: ``[E, 2I, H]``."""
    experts, two_blocks, pairs, _, _ = packed.shape
    halves = packed.view(experts, two_blocks // 2, 2, pairs, BLOCK_N, 2).transpose(1, 2)
    return unpack_linear_weight(halves, two_blocks // 2 * BLOCK_N, hidden).reshape(experts, -1, hidden)


def unpack_expert_down_weight(packed: torch.Tensor, hidden: int, inter: int) -> torch.Tensor:
    """The inverse of the ``expert_down`` (and per-head) layout: ``[E, H, I]``."""
    return unpack_linear_weight(packed, hidden, inter)


def _check_sources(layout: str, weights) -> None:
    """Shapes only (the references pack any dtype; ``can_pack`` says what the kernels take)."""
    what = f"pack ({layout})"
    torch._check(len(weights) >= 1, lambda: f"{what}: no weights")
    if layout in ("linear", "gate_up"):
        problem = _siblings_problem(layout, weights)
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


# -- the descriptor and the registry ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shard:
    """The part of a weight a tensor-parallel rank holds: ``index`` of ``count`` equal slices along ``dim`` of a
    weight ``size`` long there (models/tp.py). ``style``: the HF plan's name for the split (``colwise``: output
    rows, ``rowwise``: input columns, the partial sums added across ranks; ``vocab`` / ``colwise_gather_output``:
    vocabulary rows of the embedding / ``lm_head``, the last rank's padded with zeros)."""

    dim: int
    index: int
    count: int
    style: str = "colwise"
    size: int = 0


_SHARD = "_tilefx_shard"  # the attribute holding a tensor-parallel parameter's Shard


def attach_shard(weight: torch.Tensor, shard: Shard) -> None:
    """Mark ``weight`` as the part ``shard`` of a full weight; packings of it carry the mark (``PackedWeight.shard``)
    and the partition pass reads it."""
    setattr(weight, _SHARD, shard)


def shard_of(weight: torch.Tensor) -> Shard | None:
    return getattr(weight, _SHARD, None)


@dataclasses.dataclass(eq=False)
class PackedWeight:
    """One packed tensor the kernels read, and what it was made from."""

    layout: str
    data: torch.Tensor
    source_shapes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...] = ()  # the source parameters' names where the loader knows them
    args: tuple = ()  # layout arguments (mla_*: heads, nope_dim)
    format: str = "bf16"
    scales: torch.Tensor | None = None  # int8 / fp8: per channel or per block
    shard: Shard | None = None  # None: the whole weight
    released: bool = False  # the sources are views of ``data`` (their own memory handed back)
    _sources: tuple = ()  # weakrefs to the source tensors

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def members(self, first: int, last: int) -> torch.Tensor:
        """Sources ``first..last``'s own packing (``linear`` layout): the contiguous blocks they fill."""
        if self.layout != "linear":
            raise ValueError(f"{self.describe()}: only the linear layout has per-source slices")
        blocks = [-(-shape[0] // BLOCK_N) for shape in self.source_shapes]
        return self.data[sum(blocks[:first]) : sum(blocks[: last + 1])]

    def describe(self) -> str:
        names = ", ".join(self.names) or f"{len(self.source_shapes)} weight(s)"
        return f"{self.layout} {self.format} [{names}]"


def _key(weight: torch.Tensor) -> tuple:
    return (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(),
            weight._version)


# key of one source tensor -> the packings that hold it, each with the source's index among its sources
_registry: dict[tuple, list[tuple[PackedWeight, int]]] = {}


def _current(key: tuple, packed: PackedWeight, index: int) -> bool:
    """The source is alive and unchanged: an address can be reused by a new tensor, and weights edited in place."""
    source = packed._sources[index]()
    return source is not None and _key(source) == key


def _drop_stale() -> None:
    for key in list(_registry):
        _registry[key] = [hit for hit in _registry[key] if _current(key, *hit)]
        if not _registry[key]:
            del _registry[key]


def packings_of(weight: torch.Tensor) -> list[tuple[PackedWeight, int]]:
    """The PackedWeights that hold ``weight``, each with ``weight``'s index among its sources."""
    key = _key(weight)
    return [hit for hit in _registry.get(key, ()) if _current(key, *hit)]


def packing_of(weight: torch.Tensor) -> PackedWeight | None:
    """The one PackedWeight that holds ``weight`` (None if none or several do)."""
    hits = packings_of(weight)
    return hits[0][0] if len(hits) == 1 else None


def is_released(weight: torch.Tensor) -> bool:
    """``weight``'s data is a view of a packed tensor: only packing ops may read it."""
    return any(packed.released for packed, _ in packings_of(weight))


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed tensor that holds ``weight`` (alone or with its siblings), if exactly one does."""
    packed = packing_of(weight)
    return None if packed is None else packed.data


def _serve(layout: str, weights, args: tuple, format: str) -> torch.Tensor | None:
    """The existing packed tensor for this request, or None where the weights are to be packed (again)."""
    for packed, first in packings_of(weights[0]):
        indices = [next((i for p, i in packings_of(w) if p is packed), None) for w in weights]
        if None in indices or indices != list(range(first, first + len(weights))) or packed.format != format:
            continue
        if packed.layout == layout and packed.args == tuple(args) and len(weights) == len(packed.source_shapes):
            return packed.data
        if layout == "linear" == packed.layout:
            return packed.members(indices[0], indices[-1])  # some siblings of a fused packing, in order
    held = sorted({p.describe() for w in weights for p, _ in packings_of(w) if p.released})
    if held:  # their own data is gone: there is nothing to pack from
        raise ValueError(
            f"weights of shapes {[tuple(w.shape) for w in weights]} were packed as {'; '.join(held)} and released, "
            f"and cannot also be packed as {layout} {format}{list(args) if args else ''}: a graph must read a packed "
            f"weight the way it was packed (custom_ops/weights.py). Compile with fuse_linears=False if sibling "
            f"fusion differs."
        )
    return None


def pack(layout: str, weights, args: tuple = (), names: tuple[str, ...] = (), format: str = "bf16") -> torch.Tensor:
    """``weights`` packed in ``layout`` and ``format``: the existing packed tensor where one holds them, else
    packed now, once (into transparent huge pages: streamed every token), and registered. A quantized
    packing's scales: ``scales_of`` (or the graph op ``tilefx.packed_scales``)."""
    weights = list(weights)
    existing = _serve(layout, weights, tuple(args), format)
    if existing is not None:
        return existing
    _check_sources(layout, weights)
    if format != "bf16":
        why = can_pack(layout, weights, format=format)
        torch._check(why is None, lambda: f"pack ({layout}, {format}): {why}")
    shape = _layout_shape(layout, weights, args)
    scales = torch.zeros(scales_shape(shape, format)) if format != "bf16" else None
    data = _fill(layout, weights, tuple(args), isa.huge_page_empty(shape, FORMATS[format]), scales=scales)
    packed = PackedWeight(layout, data, tuple(tuple(w.shape) for w in weights), tuple(names), tuple(args),
                          format=format, scales=scales, shard=shard_of(weights[0]),
                          _sources=tuple(weakref.ref(w) for w in weights))
    _drop_stale()
    for index, weight in enumerate(weights):
        _registry.setdefault(_key(weight), []).append((packed, index))
    return data


def scales_of(data: torch.Tensor) -> torch.Tensor:
    """The scales of a quantized packed tensor ``pack`` returned (or of the slice it returned for some
    siblings of a fused packing): ``[..., blocks, 32]`` (int8) or ``[..., blocks, K/128]`` (fp8)."""
    for packed in registered():
        if packed.scales is None or packed.data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
            continue
        if data.shape == packed.data.shape:
            return packed.scales
        block_elems = packed.data[0].numel()
        first = (data.storage_offset() - packed.data.storage_offset()) // block_elems
        return packed.scales[first : first + data.shape[0]]
    raise ValueError(f"no quantized packing holds this tensor ({data.dtype} {tuple(data.shape)})")


def _packing_with_data(data: torch.Tensor) -> PackedWeight:
    for hits in _registry.values():
        for packed, _ in hits:
            if packed.data is data:
                return packed
    raise ValueError("not a packed tensor made by tilefx.custom_ops.weights.pack")


def release(packed_data: torch.Tensor) -> int:
    """The release policy: the sources of ``packed_data`` give their memory back.

    bf16: each source's data becomes a view of its own range of the packed tensor (same
    shape, values in packed order), so memory holds the weight once. Quantized: the packed
    tensor holds other values than the source, so each source's data becomes
    ``untouched_zeros`` of its shape (bf16 for an fp8 checkpoint's; shape and strides kept
    for the graphs that trace it; only packing ops may read it). Either way packing the same sources again returns the same
    packed tensor. Pages of a source mapped from a file (safetensors loaded lazily) are
    dropped from this process too. A source packed in two ways stays.
    Returns the bytes released.
    """
    packed = _packing_with_data(packed_data)
    if packed.released:
        return 0
    sources = [ref() for ref in packed._sources]
    if any(s is None for s in sources):
        raise ValueError(f"release: a source of {packed.describe()} is gone")
    if any(len(packings_of(s)) > 1 for s in sources):
        raise ValueError(f"release: a source of {packed.describe()} is packed in another way too")
    flat, offset, released, mapped = packed.data.view(-1), 0, 0, _file_mappings()
    for index, source in enumerate(sources):
        del _registry[_key(source)]
        old = source.data
        if old.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            released += old.numel() * old.element_size()
            _drop_file_pages(old, mapped)
        if packed.format == "bf16":
            source.data = flat[offset : offset + source.numel()].view(source.shape)
        else:  # an fp8 checkpoint's source: the bf16 it stands for in the graphs that trace it
            source.data = untouched_zeros(old.shape, torch.bfloat16 if old.dtype in QUANTIZED_DTYPES else old.dtype)
        if checkpoint_scales(source) is not None:
            delattr(source, _CHECKPOINT_SCALES)
        offset += source.numel()
        _registry[_key(source)] = [(packed, index)]
    packed.released = True
    return released


def untouched_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape`` with contiguous strides in memory never touched: an anonymous private mapping, whose
    pages cost nothing until written (reads see the kernel's zero page). What a released quantized source
    holds: graphs trace its shape and strides (HF's grouped_mm checks them), only packing ops use its data."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def release_sources(ids: set[int]) -> tuple[int, int]:
    """Release every packing not yet released whose sources' ``id``s are all in ``ids`` (read only packed)
    and packed in one way only. Returns (bytes released, sources in ``ids`` kept unpacked)."""
    released = kept = 0
    for packed in registered():
        sources = [ref() for ref in packed._sources]
        if packed.released or not any(id(s) in ids for s in sources):
            continue
        if all(id(s) in ids and len(packings_of(s)) == 1 for s in sources):
            released += release(packed.data)
        else:
            kept += sum(id(s) in ids for s in sources)
    return released, kept


def registered() -> list[PackedWeight]:
    """Every current packed weight (for reports)."""
    _drop_stale()
    return list({id(p): p for hits in _registry.values() for p, _ in hits}.values())


# -- file-backed sources -----------------------------------------------------------------------------------

_MADV_DONTNEED = 4
_libc = None


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process mapped from safetensors files (a lazy load keeps weights there)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip().endswith(".safetensors"):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def drop_unused_file_pages(live) -> int:
    """Drop from this process every page of its safetensors mappings that no tensor in ``live`` reads.

    Loading can read a checkpoint tensor without keeping it: transformers stacks per-expert
    weights into fused 3-D experts, and the per-expert bytes it read stay resident in the
    file's mapping (counted as this process's memory) while the mapping lives for the
    weights still read from it (norms, embeddings). Pages outside ``live`` serve no tensor,
    so dropping them changes nothing a tensor sees. Returns the bytes of the ranges advised.
    """
    page = mmap.PAGESIZE
    keep = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in live if t.numel())
    dropped = 0
    for lo, hi in _file_mappings():
        start = lo
        for begin, end in [r for r in keep if r[1] > lo and r[0] < hi] + [(hi, hi)]:
            first, last = start, begin // page * page  # pages wholly before this live range
            if last > first:
                _madvise_dontneed(first, last - first)
                dropped += last - first
            start = max(start, -(-end // page) * page)
    return dropped


@contextlib.contextmanager
def checkpoint_pages_bounded(every_seconds: float = 0.2):
    """While the block runs (a lazy load), drop this process's pages of safetensors mappings every
    ``every_seconds``: what loading reads and converts (per-expert tensors stacked into fused experts)
    then never sits in memory twice, mapped and converted. The pages stay in the page cache and a
    later read maps them again; the checkpoint's bytes are never written, so a read sees the file."""
    stop = threading.Event()

    def drop() -> None:
        while not stop.wait(every_seconds):
            for lo, hi in _file_mappings():
                _madvise_dontneed(lo, hi - lo)

    thread = threading.Thread(target=drop, name="tilefx-page-dropper", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _madvise_dontneed(address: int, length: int) -> None:
    global _libc
    _libc = _libc or ctypes.CDLL(None, use_errno=True)
    _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_DONTNEED)


def _drop_file_pages(tensor: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """Drop the pages of ``tensor``'s bytes from this process where they lie in one of the ``mapped`` file ranges:
    they stay in the page cache, but no longer count as this process's memory (a later read maps them again)."""
    if not tensor.numel():
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(lo <= start and end <= hi for lo, hi in mapped):
        return  # anonymous memory: freed when its last reference goes
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
    if last > first:
        _madvise_dontneed(first, last - first)


# -- the packing ops: what the passes insert in graphs (run once at compile time, their results graph inputs) --


def _fake(layout: str, weights, args: tuple = (), format: str = "bf16") -> torch.Tensor:
    weights = list(weights)
    _check_sources(layout, weights)
    torch._check(format in FORMATS, lambda: f"pack ({layout}): unknown format {format!r}")
    if layout.startswith("mla"):
        _mla_part(weights[0], *args, value=layout == "mla_value")  # its shape check
    return weights[0].new_empty(_layout_shape(layout, weights, args), dtype=FORMATS[format])


# Each packing op's schema, and how its arguments become one request (layout, weights, layout args, format): the
# op serves it with pack(), its fake with _fake(), its reference (pack_<op>_reference, bf16) with pack_reference().
_FORMAT = 'str format="bf16"'
_REQUESTS = {
    "pack_linear_weight": (f"(Tensor weight, {_FORMAT}) -> Tensor",
                           lambda w, format="bf16": ("linear", [w], (), format)),
    "pack_fused_linear_weight": (f"(Tensor[] weights, {_FORMAT}) -> Tensor",
                                 lambda ws, format="bf16": ("linear", list(ws), (), format)),
    "pack_gate_up_weight": (f"(Tensor gate, Tensor up, {_FORMAT}) -> Tensor",
                            lambda g, u, format="bf16": ("gate_up", [g, u], (), format)),
    "pack_expert_gate_up_weight": (f"(Tensor gate_up_proj, {_FORMAT}) -> Tensor",
                                   lambda w, format="bf16": ("expert_gate_up", [w], (), format)),
    "pack_expert_down_weight": (f"(Tensor down_proj, {_FORMAT}) -> Tensor",
                                lambda w, format="bf16": ("expert_down", [w], (), format)),
    "pack_mla_absorbed_weight": (
        "(Tensor kv_b_weight, int heads, int nope_dim, bool value) -> Tensor",
        lambda w, heads, nope_dim, value: ("mla_value" if value else "mla_key", [w], (heads, nope_dim), "bf16"),
    ),
}


def _serving(serve, request):
    def call(*op_args, **op_kwargs):
        layout, weights, args, format = request(*op_args, **op_kwargs)
        return serve(layout, weights, args, format=format)
    return call


def _reference(request):
    def call(*op_args, **op_kwargs):
        layout, weights, args, format = request(*op_args, **op_kwargs)
        torch._check(format == "bf16", lambda: "the reference packings are bf16 (quantize_rows is the reference "
                                               "of the quantized formats)")
        return pack_reference(layout, weights, args)
    return call


def _packed_scales_fake(packed: torch.Tensor) -> torch.Tensor:
    format = format_of(packed)
    torch._check(format != "bf16", lambda: "tilefx.packed_scales: a bf16 packing has no scales")
    return packed.new_empty(scales_shape(tuple(packed.shape), format), dtype=torch.float32)


_LIB = torch.library.Library("tilefx", "FRAGMENT")
for _name, (_schema, _request) in _REQUESTS.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _serving(pack, _request), "CPU")
    torch.library.register_fake(f"tilefx::{_name}", _serving(_fake, _request), lib=_LIB)
# The scales of a quantized packing, as a graph reads them: ``packed_scales(pack_linear_weight(W, "int8"))``.
_LIB.define("packed_scales(Tensor packed) -> Tensor")
_LIB.impl("packed_scales", scales_of, "CPU")
torch.library.register_fake("tilefx::packed_scales", _packed_scales_fake, lib=_LIB)

pack_linear_weight_reference = _reference(_REQUESTS["pack_linear_weight"][1])
pack_fused_linear_weight_reference = _reference(_REQUESTS["pack_fused_linear_weight"][1])
pack_gate_up_weight_reference = _reference(_REQUESTS["pack_gate_up_weight"][1])
pack_expert_gate_up_weight_reference = _reference(_REQUESTS["pack_expert_gate_up_weight"][1])
pack_expert_down_weight_reference = _reference(_REQUESTS["pack_expert_down_weight"][1])
pack_mla_absorbed_weight_reference = _reference(_REQUESTS["pack_mla_absorbed_weight"][1])

pack_linear_weight = torch.ops.tilefx.pack_linear_weight.default
pack_fused_linear_weight = torch.ops.tilefx.pack_fused_linear_weight.default
pack_gate_up_weight = torch.ops.tilefx.pack_gate_up_weight.default
pack_expert_gate_up_weight = torch.ops.tilefx.pack_expert_gate_up_weight.default
pack_expert_down_weight = torch.ops.tilefx.pack_expert_down_weight.default
pack_mla_absorbed_weight = torch.ops.tilefx.pack_mla_absorbed_weight.default
packed_scales = torch.ops.tilefx.packed_scales.default
PACKING_OPS = frozenset({pack_linear_weight, pack_fused_linear_weight, pack_gate_up_weight,
                         pack_expert_gate_up_weight, pack_expert_down_weight, pack_mla_absorbed_weight})
