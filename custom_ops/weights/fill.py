"""Writing weights into a packed layout, a chunk of rows at a time, quantizing or dequantizing as they go.

No copy of a whole weight is ever made: pages of a source mapped from a file are dropped as soon as
they are packed, so packing a lazily loaded weight holds it about once, not twice.
"""

from __future__ import annotations

import torch

from tilefx.custom_ops import isa
from tilefx.custom_ops.weights import formats, layouts, memory
from tilefx.custom_ops.weights.layouts import BLOCK_N

CHUNK_BYTES = 64 << 20  # source bytes packed at a time: a file-backed source's pages are dropped after each


def write_blocks(out: torch.Tensor, rows: torch.Tensor, native: bool) -> None:
    """``out [blocks, pairs, 32, 2] = rows [n, k]`` in ``linear`` order (zero padded): the native copy
    (csrc/memory.cpp, every thread) where it applies, else torch's copy of the permuted view."""
    if (native and isa.native is not None and rows.element_size() in (1, 2) and rows.stride(-1) == 1
            and out.stride()[1:] == (2 * BLOCK_N, 2, 1)):
        isa.native.pack_vnni_blocks(out, rows)
    else:
        out.copy_(layouts.linear_order(rows))


def write_int4_blocks(out: torch.Tensor, values: torch.Tensor, native: bool, two_a_byte: bool = False) -> None:
    """``out [blocks, pairs, 16, 2] = values`` (uint8 nibbles ``[n, k]`` one a byte, or two a byte: ``[n, k / 2]``
    or words ``[n, k / 8, 4]``, ``formats.int4_rows``) in the int4 packing's order (zero padded): the native copy
    (csrc/memory.cpp, every thread) where it applies, else torch's copy of ``layouts.int4_interleave``."""
    if native and isa.native is not None and values.stride(-1) == 1 and out.stride()[1:] == (BLOCK_N, 2, 1):
        isa.native.pack_int4_blocks(out, values, two_a_byte)
    else:
        ones = formats.split_nibbles(formats.int4_rows(values)) if two_a_byte else values
        out.copy_(layouts.int4_interleave(layouts.linear_order(ones)))


def _fill_linear(out: torch.Tensor, weight: torch.Tensor, mapped, native: bool, scales=None,
                 source_scales=None, int4=None) -> None:
    """``out[b] = blocks b of weight`` in ``linear`` order, a chunk of rows at a time; quantized (``scales``: its
    rows of the packing's scales) where ``out`` holds a quantized format. ``weight`` may be a quantized
    checkpoint's: fp8 with its 128 x 128 block ``source_scales``, or int4 whose rows ``int4`` (``formats.Int4Rows``)
    reads here, with its per-row group scales and zeros. Those are copied as they are into a packing of their own
    format, else dequantized a chunk at a time."""
    source_format = "int4" if int4 is not None else None if source_scales is None else "fp8"
    nibbles = None
    if source_format == "fp8":
        formats.check_checkpoint_scales(weight, source_scales)
    elif source_format == "int4":
        nibbles, source_scales = int4.read_checked(weight.shape[-1])
    step = formats.FP8_GROUP if scales is not None or source_format else BLOCK_N  # chunks never split a scale block
    row_bytes = weight[0].numel() * (4 if source_format else weight.element_size())  # dequantized in fp32
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, row_bytes) // step) * step
    out_format = formats.format_of(out)
    for row in range(0, weight.shape[0], rows_per_chunk):
        source = weight[row : row + rows_per_chunk]
        block = row // BLOCK_N
        blocks = layouts.blocks_of(source.shape[0])
        values, row_scales = source, None
        if source_format == "fp8":
            formats.refuse_nan_codes(source)
            groups = source_scales[row // formats.FP8_GROUP : -(-(row + source.shape[0]) // formats.FP8_GROUP)]
            if out_format == "fp8":  # the checkpoint's own values and scales
                row_scales = groups
            else:
                values = formats.dequantize_blocks(source, groups)
        elif source_format == "int4":
            values = nibbles[row : row + source.shape[0]]  # two a byte, or a GPTQ file's words
            params = source_scales[row : row + source.shape[0]]
            if out_format == "int4":
                row_scales = params
            else:
                values = formats.dequantize_int4_rows(formats.split_nibbles(formats.int4_rows(values)), params)
        if scales is not None and row_scales is None:
            values, row_scales = formats.quantize_rows(values, out_format)
        if scales is None:
            write_blocks(out[block : block + blocks], values, native)
        elif out_format == "int4":  # nibbles (the checkpoint's two a byte, or the quantizer's one) in the int4 order
            write_int4_blocks(out[block : block + blocks], values, native, two_a_byte=source_format == "int4")
            formats.write_scales(scales[block : block + blocks], row_scales)
        else:
            write_blocks(out[block : block + blocks].view(torch.uint8), values.view(torch.uint8), native)
            formats.write_scales(scales[block : block + blocks], row_scales)
        memory.drop_file_pages(source, mapped)
    if nibbles is not None:  # a GPTQ file's words read in place: their pages are packed (rows chunks interleave them)
        memory.drop_file_pages(nibbles, mapped)


def _per_expert_scales(weight: torch.Tensor) -> list:
    scales = formats.checkpoint_scales(weight)
    return [None] * weight.shape[0] if scales is None else list(scales)


def _per_expert_int4(weight: torch.Tensor) -> list:
    """Each expert's int4 parts (a tuple of ``formats.Int4Rows``), or Nones."""
    parts = formats.checkpoint_int4(weight)
    return [None] * weight.shape[0] if parts is None else parts


def _halves(groups):
    return (None, None) if groups is None else groups.chunk(2)


def _int4_halves(parts, k: int):
    """An expert's gate and up rows: its two parts as the loader read them, or its one part's halves."""
    if parts is None:
        return None, None
    if len(parts) == 2 and parts[0].rows == parts[1].rows:
        return parts
    nibbles, params = formats.joined_int4(parts, k).read_checked(k)
    return tuple(formats.Int4Rows.of(n, p) for n, p in zip(nibbles.chunk(2), params.chunk(2)))


def _joined(parts, k: int):
    return None if parts is None else formats.joined_int4(parts, k)


def _matrix_int4(weight: torch.Tensor):
    """A 2-D int4 checkpoint weight's rows (``formats.Int4Rows``), or None."""
    parts = formats.checkpoint_int4(weight)
    return None if parts is None else formats.joined_int4(parts[0], weight.shape[-1])


def fill(layout: str, weights, args: tuple, out: torch.Tensor, native: bool = True, scales=None) -> torch.Tensor:
    """Write ``weights`` into ``out`` in ``layout``'s element order, a chunk at a time. ``native=False``: torch
    copies only (the reference). ``scales``: a quantized packing's scales, written with its values."""
    mapped = memory.file_mappings()
    if layout == "linear":
        start = 0
        for weight in weights:
            blocks = layouts.blocks_of(weight.shape[0])
            part = None if scales is None else scales[start : start + blocks]
            _fill_linear(out[start : start + blocks], weight, mapped, native, part, formats.checkpoint_scales(weight),
                         _matrix_int4(weight))
            start += blocks
    elif layout == "gate_up":
        pairs = layouts.gate_up_halves(out)
        scale_pairs = None if scales is None else layouts.gate_up_halves(scales)
        for i in (0, 1):
            _fill_linear(pairs[:, i], weights[i], mapped, native, None if scales is None else scale_pairs[:, i],
                         formats.checkpoint_scales(weights[i]), _matrix_int4(weights[i]))
    elif layout == "expert_gate_up":  # per expert, the gate_up layout of its [2I, H] (gate rows, then up rows)
        source_scales = _per_expert_scales(weights[0])
        halves = layouts.expert_gate_up_halves(out)
        scale_halves = [None] * out.shape[0] if scales is None else layouts.expert_gate_up_halves(scales)
        k = weights[0].shape[-1]
        for expert, source, groups, expert_scales, parts in zip(halves, weights[0], source_scales, scale_halves,
                                                                _per_expert_int4(weights[0])):
            for i, (half, half_groups, half_int4) in enumerate(zip(source.chunk(2), _halves(groups),
                                                                   _int4_halves(parts, k))):
                _fill_linear(expert[:, i], half, mapped, native, None if expert_scales is None else expert_scales[:, i],
                             half_groups, half_int4)
    elif layout == "expert_down":
        expert_scales = [None] * out.shape[0] if scales is None else scales
        for expert, source, groups, part, parts in zip(out, weights[0], _per_expert_scales(weights[0]), expert_scales,
                                                       _per_expert_int4(weights[0])):
            _fill_linear(expert, source, mapped, native, part, groups, _joined(parts, weights[0].shape[-1]))
    elif layout in ("mla_key", "mla_value"):
        out.copy_(layouts.linear_order(layouts.mla_part(weights[0], *args, value=layout == "mla_value")))
    else:
        raise ValueError(f"unknown packed layout {layout!r}")
    return out


def pack_reference(layout: str, weights, args: tuple = ()) -> torch.Tensor:
    """The specification of ``layout``: a new (ordinary) tensor holding ``weights`` packed."""
    layouts.check_sources(layout, weights)
    shape = layouts.layout_shape(layout, weights, args)
    return fill(layout, weights, args, torch.zeros(shape, dtype=weights[0].dtype), native=False)


def dequantize_checkpoint_weight(weight: torch.Tensor, dtype=torch.bfloat16) -> None:
    """Turn a quantized checkpoint weight (fp8 or int4) that no packing reads into ``dtype`` in place (one 2-D
    slice at a time alongside the result)."""
    if not formats.is_checkpoint_quantized(weight):
        return
    values = weight.data
    out = torch.empty(values.shape, dtype=dtype)
    flat_out = out.reshape(-1, *out.shape[-2:])
    mapped = memory.file_mappings()
    if formats.checkpoint_format(weight) == "int4":  # the parts hold nibbles and per-row params
        k = values.shape[-1]
        for rows, o in zip(formats.checkpoint_int4(weight), flat_out):
            nibbles, params = formats.joined_int4(rows, k).read_checked(k)
            o.copy_(formats.dequantize_int4_rows(formats.split_nibbles(formats.int4_rows(nibbles)), params, dtype))
            memory.drop_file_pages(nibbles, mapped)
    else:
        scales = formats.checkpoint_scales(weight)
        flat_values, flat_scales = (t.reshape(-1, *t.shape[-2:]) for t in (values, scales))
        halves = 2 if values.dim() == 3 and scales.shape[-2] != -(-values.shape[-2] // formats.FP8_GROUP) else 1
        for v, s, o in zip(flat_values, flat_scales, flat_out):
            for part_v, part_s, part_o in zip(v.chunk(halves), s.chunk(halves), o.chunk(halves)):
                formats.check_checkpoint_scales(part_v, part_s)
                formats.refuse_nan_codes(part_v)
                part_o.copy_(formats.dequantize_blocks(part_v, part_s, dtype))
    weight.data = out
    formats.forget_checkpoint_scales(weight)
    memory.drop_file_pages(values, mapped)
