"""The packing ops: what the passes insert in graphs (run once when a graph is compiled; their results become
graph inputs, compiler/pass_manager.py ``packings_as_inputs``). Each serves its request with ``registry.pack``,
which returns the packing the loader made where one exists; its fake gives the layout's shape, its reference
(``pack_<op>_reference``, bf16) is ``fill.pack_reference``."""

from __future__ import annotations

import torch

from tilefx.custom_ops.weights import fill, formats, layouts, registry


def _fake(layout: str, weights, args: tuple = (), format: str = "bf16") -> torch.Tensor:
    weights = list(weights)
    layouts.check_sources(layout, weights)
    torch._check(format in formats.FORMATS, lambda: f"pack ({layout}): unknown format {format!r}")
    if layout.startswith("mla"):
        layouts.mla_part(weights[0], *args, value=layout == "mla_value")  # its shape check
    shape = formats.stored_shape(layouts.layout_shape(layout, weights, args), format)
    return weights[0].new_empty(shape, dtype=formats.FORMATS[format])


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
        return fill.pack_reference(layout, weights, args)
    return call


def _packed_scales_fake(packed: torch.Tensor) -> torch.Tensor:
    format = formats.format_of(packed)
    torch._check(format != "bf16", lambda: "tilefx.packed_scales: a bf16 packing has no scales")
    return packed.new_empty(formats.scales_shape(tuple(packed.shape), format), dtype=formats.SCALE_DTYPES[format])


_LIB = torch.library.Library("tilefx", "FRAGMENT")
for _name, (_schema, _request) in _REQUESTS.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _serving(registry.pack, _request), "CPU")
    torch.library.register_fake(f"tilefx::{_name}", _serving(_fake, _request), lib=_LIB)
# The scales of a quantized packing, as a graph reads them: ``packed_scales(pack_linear_weight(W, "int8"))``.
_LIB.define("packed_scales(Tensor packed) -> Tensor")
_LIB.impl("packed_scales", registry.scales_of, "CPU")
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
