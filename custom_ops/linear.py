"""``tilefx::linear`` (and ``linear_float``, its fp32 result), ``tilefx::linear_silu_mul`` and
``tilefx::linear_per_head`` over packed weights (custom_ops/weights/: layouts, packing,
the descriptor), and ``tilefx::packed_embedding``, the embedding lookup over a packed
weight (an input embedding tied to the ``lm_head`` is held once, packed).

- ``linear(x, pack_linear_weight(W), b, N)``: ``x @ W.T + b``; over a ``linear`` packing
  of siblings (``pack_fused_linear_weight([Wq, Wk, Wv])``) it computes all of them at once.
- ``linear_silu_mul(x, pack_gate_up_weight(G, U), I)``: ``silu(x @ G.T) * (x @ U.T)``,
  SiLU-and-mul in the GEMV/GEMM epilogue.
- ``linear_per_head(x, pack_mla_absorbed_weight(...), N)``: head ``h``'s weight applied to
  ``x[..., h, :, :]`` (MLA's absorbed ``kv_b_proj``).

``linear``, ``linear_float``, ``linear_silu_mul`` and ``packed_embedding`` read any weight
format (custom_ops/weights/): a quantized packing comes with its ``scales``
(``packed_scales(packed)``), and the result is the fp32 product with the dequantized
weight ``values * scales``, which the references compute as written.
"""

from __future__ import annotations

import torch

from tilefx.custom_ops import isa
from tilefx.custom_ops.weights import layouts
from tilefx.custom_ops.weights.formats import FP8_GROUP, check_scales, dequantize, format_of, logical_shape
from tilefx.custom_ops.weights.layouts import (
    gate_up_shape,
    in_features_of,
    packed_shape,
    unpack_expert_down_weight,
    unpack_gate_up_weight,
    unpack_linear_weight,
)


def linear_reference(x, packed_weight, bias, out_features, scales=None):
    """The specification: ``x @ W.T + bias`` in fp32, rounded to x's dtype."""
    _check(x, packed_weight, bias, out_features, scales)
    weight = unpack_linear_weight(dequantize(packed_weight, scales), out_features, x.shape[-1])
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def linear_float_reference(x, packed_weight, bias, out_features, scales=None):
    """The specification: ``x @ W.T + bias`` in fp32, kept in fp32 (HF's fp32 routers over bf16 weights)."""
    _check(x, packed_weight, bias, out_features, scales)
    weight = unpack_linear_weight(dequantize(packed_weight, scales), out_features, x.shape[-1])
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


def linear_silu_mul_reference(x, packed_gate_up, out_features, scales=None):
    """The specification: ``silu(x @ gate.T) * (x @ up.T)`` in fp32, rounded to x's dtype."""
    _check_gate_up(x, packed_gate_up, out_features, scales)
    gate, up = unpack_gate_up_weight(dequantize(packed_gate_up, scales), out_features, x.shape[-1])
    xf = x.float()
    return (torch.nn.functional.silu(xf @ gate.float().T) * (xf @ up.float().T)).to(x.dtype)


def linear_per_head_reference(x, packed_weight, out_features):
    """The specification: ``y[..., h, s, :] = x[..., h, s, :] @ W_h.T`` in fp32, rounded to x's dtype."""
    _check_per_head(x, packed_weight, out_features)
    weight = unpack_expert_down_weight(packed_weight, out_features, x.shape[-1])  # [H, N, K]
    return torch.matmul(x.float(), weight.float().transpose(1, 2)).to(x.dtype)


def _check_per_head(x, packed_weight, out_features) -> None:
    torch._check(layouts.is_per_head_packing(packed_weight.shape),
                 lambda: f"tilefx.linear_per_head: weight is not packed per head (shape {tuple(packed_weight.shape)})")
    torch._check(x.dim() >= 3 and x.shape[-3] == packed_weight.shape[0]
                 and packed_weight.shape[1:] == packed_shape(out_features, x.shape[-1]),
                 lambda: f"tilefx.linear_per_head: packed weight {tuple(packed_weight.shape)} does not fit "
                         f"x {tuple(x.shape)} -> {out_features} features")


def _check(x, packed_weight, bias, out_features, scales=None) -> None:
    check_scales("linear", packed_weight, scales)
    torch._check(layouts.is_linear_packing(packed_weight.shape),
                 lambda: f"tilefx.linear: weight is not packed (shape {tuple(packed_weight.shape)}); "
                         "use tilefx.custom_ops.weights.pack_linear_weight")
    torch._check(logical_shape(packed_weight) == packed_shape(out_features, x.shape[-1]),
                 lambda: f"tilefx.linear: packed weight {tuple(packed_weight.shape)} does not fit "
                         f"x [..., {x.shape[-1]}] -> {out_features} features")


def _check_gate_up(x, packed_gate_up, out_features, scales=None) -> None:
    check_scales("linear_silu_mul", packed_gate_up, scales)
    torch._check(logical_shape(packed_gate_up) == gate_up_shape(out_features, x.shape[-1]),
                 lambda: f"tilefx.linear_silu_mul: packed weight {tuple(packed_gate_up.shape)} does not fit "
                         f"x [..., {x.shape[-1]}] -> {out_features} features; use pack_gate_up_weight")


def _linear_fake(x, packed_weight, bias, out_features, scales=None):
    _check(x, packed_weight, bias, out_features, scales)
    return x.new_empty((*x.shape[:-1], out_features))


def _linear_float_fake(x, packed_weight, bias, out_features, scales=None):
    _check(x, packed_weight, bias, out_features, scales)
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32)


def _linear_silu_mul_fake(x, packed_gate_up, out_features, scales=None):
    _check_gate_up(x, packed_gate_up, out_features, scales)
    return x.new_empty((*x.shape[:-1], out_features))


def _linear_per_head_fake(x, packed_weight, out_features):
    _check_per_head(x, packed_weight, out_features)
    return x.new_empty((*x.shape[:-1], out_features))


def packed_embedding_reference(ids, packed_weight, embedding_dim, scales=None):
    """The specification: row ``ids[...]`` of the weight held in the ``linear`` layout (``W[ids]``), dequantized
    to bf16 where the weight is quantized."""
    blocks, pairs, _, _ = packed_weight.shape
    block, column = layouts.row_positions(ids)
    if format_of(packed_weight) == "int4":  # the looked-up rows' blocks, dequantized
        flat_block, flat_column = block.reshape(-1), column.reshape(-1)
        values = dequantize(packed_weight[flat_block], scales[flat_block])  # [n, pairs, 32, 2]
        rows = values[torch.arange(flat_block.numel()), :, flat_column, :].to(torch.bfloat16)
        return rows.reshape(*ids.shape, in_features_of(logical_shape(packed_weight)))[..., :embedding_dim]
    # Each pair of values as one wider word, so a row is one gather of `pairs` words (~5x faster than indexing
    # the pairs of values: 3.4 vs 19 ms for 1024 rows of Llama-3.2-1B's packed embedding, Emerald Rapids).
    words = packed_weight.view({1: torch.int16, 2: torch.int32}[packed_weight.element_size()]).squeeze(-1)
    rows = words.transpose(1, 2)[block, column].unsqueeze(-1).view(packed_weight.dtype)  # [*ids, pairs, 2]
    if scales is not None:  # only the rows looked up are dequantized
        if format_of(packed_weight) == "int8":
            rows = rows.float() * scales[block, column][..., None, None]
        else:
            per_pair = scales[block].repeat_interleave(FP8_GROUP // 2, dim=-1)[..., :pairs]
            rows = rows.float() * per_pair[..., None]
        rows = rows.to(torch.bfloat16)
    return rows.reshape(*ids.shape, in_features_of(packed_weight.shape))[..., :embedding_dim]


def _packed_embedding_fake(ids, packed_weight, embedding_dim, scales=None):
    torch._check(layouts.is_linear_packing(packed_weight.shape)
                 and in_features_of(packed_weight.shape) >= embedding_dim,
                 lambda: f"tilefx.packed_embedding: weight {tuple(packed_weight.shape)} is not a packed "
                         f"[vocab, {embedding_dim}] weight")
    check_scales("packed_embedding", packed_weight, scales)
    return ids.new_empty((*ids.shape, embedding_dim), dtype=torch.bfloat16)


_LIB = torch.library.Library("tilefx", "FRAGMENT")
_LIB.define("packed_embedding(Tensor ids, Tensor packed_weight, int embedding_dim, Tensor? scales=None) -> Tensor")
_LIB.impl("packed_embedding", packed_embedding_reference, "CPU")
torch.library.register_fake("tilefx::packed_embedding", _packed_embedding_fake, lib=_LIB)

# linear, linear_silu_mul: native CPU kernels, the references as *_portable ops (isa.define_native_op).
isa.define_native_op(_LIB, "linear", "(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, Tensor? scales=None) -> Tensor",
                     linear_reference, _linear_fake)
isa.define_native_op(_LIB, "linear_silu_mul", "(Tensor x, Tensor packed_gate_up, int out_features, Tensor? scales=None) -> Tensor",
                     linear_silu_mul_reference, _linear_silu_mul_fake)
isa.define_native_op(_LIB, "linear_float",
                     "(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, Tensor? scales=None) -> Tensor",
                     linear_float_reference, _linear_float_fake)
isa.define_native_op(_LIB, "linear_per_head", "(Tensor x, Tensor packed_weight, int out_features) -> Tensor",
                     linear_per_head_reference, _linear_per_head_fake)

linear = torch.ops.tilefx.linear.default
linear_silu_mul = torch.ops.tilefx.linear_silu_mul.default
linear_per_head = torch.ops.tilefx.linear_per_head.default
linear_float = torch.ops.tilefx.linear_float.default
packed_embedding = torch.ops.tilefx.packed_embedding.default
