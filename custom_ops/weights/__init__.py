"""Packed weights: one descriptor, one family of packing ops, one ``can_pack``, one release policy.

Every kernel that reads a weight reads it packed (docs/ARCHITECTURE.md, "Packed weights").
The package is split by concern; each name below has its home in one module:

- ``layouts``: the packed layouts' shapes, block counts, gate/up interleave and element orders
  (``BLOCK_N``, ``packed_shape``, ``unpack_*``); the C++ side's one home is ``csrc/layout.h``;
- ``formats``: bf16, int8, fp8, int4; quantizing, dequantizing, scales; quantized checkpoints'
  scales (fp8 blocks, int4 groups); ``can_pack``;
- ``fill``: writing sources into a layout a chunk at a time (the reference packing too);
- ``registry``: ``PackedWeight``, ``pack``, ``release``, the tensor-parallel ``Shard``;
- ``memory``: huge pages, never-touched zeros, the pages of safetensors mappings;
- ``ops``: the ``tilefx.pack_*_weight`` / ``tilefx.packed_scales`` graph ops.

The loader packs and releases layer by layer (models/packing.py); the graph's packing ops,
run once when a graph is compiled, find those packed tensors in the registry and return them
instead of packing again.
"""

from __future__ import annotations

from tilefx.custom_ops.weights import fill, formats, layouts, memory, ops, registry
from tilefx.custom_ops.weights.fill import CHUNK_BYTES, dequantize_checkpoint_weight, pack_reference
from tilefx.custom_ops.weights.formats import (
    FORMATS,
    FP8_GROUP,
    FP8_MAX,
    INT4_GROUP,
    QUANTIZED_DTYPES,
    SCALE_DTYPES,
    QUANTIZED_LAYOUTS,
    Int4Rows,
    attach_checkpoint_int4,
    attach_int4_parts,
    attach_checkpoint_scales,
    checkpoint_int4,
    can_pack,
    check_scales,
    checkpoint_format,
    checkpoint_scales,
    dequantize,
    dequantize_int4_rows,
    dequantize_blocks,
    format_of,
    is_checkpoint_quantized,
    logical_shape,
    pair_nibbles,
    split_nibbles,
    quantize_rows,
    scales_shape,
)
from tilefx.custom_ops.weights.layouts import (
    BLOCK_N,
    packed_shape,
    unpack_expert_down_weight,
    unpack_expert_gate_up_weight,
    unpack_gate_up_weight,
    unpack_linear_weight,
)
from tilefx.custom_ops.weights.memory import (
    checkpoint_pages_bounded,
    drop_unused_file_pages,
    huge_page_empty,
    untouched_zeros,
)
from tilefx.custom_ops.weights.ops import (
    PACKING_OPS,
    pack_expert_down_weight,
    pack_expert_down_weight_reference,
    pack_expert_gate_up_weight,
    pack_expert_gate_up_weight_reference,
    pack_fused_linear_weight,
    pack_fused_linear_weight_reference,
    pack_gate_up_weight,
    pack_gate_up_weight_reference,
    pack_linear_weight,
    pack_linear_weight_reference,
    pack_mla_absorbed_weight,
    pack_mla_absorbed_weight_reference,
    packed_scales,
)
from tilefx.custom_ops.weights.registry import (
    PackedWeight,
    Shard,
    attach_shard,
    is_released,
    pack,
    packed_copy,
    packing_of,
    packings_of,
    registered,
    release,
    release_sources,
    scales_of,
    shard_of,
)
