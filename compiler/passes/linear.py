"""Linear pass: every ``linear(x, W, b)`` -> ``tilefx.linear`` over a packed weight.

Matches every ``torch._C._nn.linear`` / ``F.linear`` call of the Dynamo (Torch IR)
graph. The packing op it inserts runs once, when the graph is compiled: the backend
turns it into a graph input holding the packed tensor (compiler/pass_manager.py,
``packings_as_inputs``), and the graphs of one model share it (packing is memoized,
custom_ops/weights/).

Sibling linears, several weights applied to one input, become one call (``fuse``):
decode then streams them as one weight, and small projections (k/v: 0.5-2 MB,
where a call's fixed cost is a large part) stop being separate calls.

- ``silu(linear(x, G)) * linear(x, U)`` (a gated MLP, also a shared expert) ->
  ``tilefx.linear_silu_mul(x, pack_gate_up_weight(G, U), I)``: SiLU-and-mul is the
  GEMM's epilogue, the gate and up outputs never go to memory.
- other siblings (q/k/v) -> one ``tilefx.linear`` over ``pack_fused_linear_weight``
  whose output is narrowed back into each linear's result.

An fp32 linear of bf16 values (``linear(x.float(), W.float())``, HF's DeepSeek
routers) -> ``tilefx.linear_float(x, pack_linear_weight(W))``: the same fp32
products from the packed bf16 weight, result in fp32.

Weights the loader packed already (models/packing.py) are grouped as they were
packed: the pass asks custom_ops/weights/ how each is held (``packings_of``) and
reads it that way, in its format, so a graph never asks for a packing that memory
does not hold. A quantized packing's scales come from ``tilefx.packed_scales`` of the
packing op and go to the linear op as its ``scales``.
Other weights are grouped here and packed when the graph is compiled. An input
embedding whose weight was packed (tied to the ``lm_head``) becomes
``tilefx.packed_embedding`` over that packed tensor: memory holds it once.

Preconditions (else the linear is left alone and the reason recorded): the weight is a 2-D model parameter
and ``weights.can_pack`` accepts it and x, the bias (if any) is a 1-D bf16 parameter.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import (
    LINEAR, example_value, is_parameter, linear_args, model_parameter, only_user, packing_node, replace,
)
from tilefx.custom_ops import weights as packed_weights
from tilefx.custom_ops.weights import layouts



def _is_silu(node) -> bool:
    return node.op == "call_function" and node.target in (torch.nn.functional.silu, torch._C._nn.silu) and not (
        node.kwargs.get("inplace") or (len(node.args) > 1 and node.args[1]))


class LinearPass(TilefxPass):
    name = "linear"

    def __init__(self, fuse: bool = True):
        self.fuse = fuse

    def option_key(self) -> str:
        return f"fuse={self.fuse}"

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        siblings: dict[tuple, list[torch.fx.Node]] = {}  # (x, has bias) -> packable linears, in graph order
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in LINEAR]:
            why = self._why_not(*linear_args(node))
            if why is None:
                x, _, bias = linear_args(node)
                siblings.setdefault((x, bias is not None), []).append(node)
            elif (weight := self._float_of_bf16(graph, node)) is not None:
                result.rewritten += 1
                used_only_packed = len(weight.users) == 1
                (result.packed_exclusively if used_only_packed else result.packed_shared).add(id(model_parameter(weight)))
            else:
                result.skip(node.name, why)
        weights = []
        for (x, _), nodes in siblings.items():
            prepacked = [n for n in nodes if packed_weights.packings_of(model_parameter(linear_args(n)[1]))]
            rest = [n for n in nodes if n not in prepacked]
            groups = self._groups(rest) if self.fuse else [("single", [n]) for n in rest]
            for kind, group in _as_packed(prepacked) + groups:
                weights += [linear_args(n)[1] for n in group]
                result.rewritten += len(group)
                if kind == "gate_up":
                    self._gate_up(graph, x, *group)
                elif kind == "gate_up_parts":
                    self._gate_up_parts(graph, x, group)
                elif len(group) == 1:
                    self._single(graph, group[0])
                else:
                    self._fused(graph, x, group)
        self._packed_embeddings(graph, result)
        packing = {torch.ops.tilefx.pack_linear_weight.default, torch.ops.tilefx.pack_fused_linear_weight.default,
                   torch.ops.tilefx.pack_gate_up_weight.default}
        for weight in weights:
            only_packed = all(user.op == "call_function" and user.target in packing for user in weight.users)
            (result.packed_exclusively if only_packed else result.packed_shared).add(id(model_parameter(weight)))
        return result

    def _why_not(self, x, weight, bias) -> str | None:
        x_val, w_val = example_value(x), example_value(weight)
        if not is_parameter(weight) or w_val is None or w_val.dim() != 2:
            return "weight is not a 2-D model parameter"
        why = packed_weights.can_pack("linear", [w_val], None if x_val is None else x_val.dtype)
        if why is not None or x_val is None:
            return why or "x has no example value"
        if bias is not None and not (is_parameter(bias) and example_value(bias).dtype == torch.bfloat16):
            return "bias is not a bf16 model parameter"
        return None

    def _float_of_bf16(self, graph, node) -> torch.fx.Node | None:
        """``linear(x.float(), W.float())`` of a bf16 x and a bf16 parameter W (HF's fp32 routers) ->
        ``tilefx.linear_float(x, pack(W))``: the same fp32 products, without an fp32 weight. Returns W."""
        x, weight, bias = linear_args(node)
        x16, w16 = _bf16_source(x), _bf16_source(weight)
        if bias is not None or x16 is None or w16 is None or not is_parameter(w16):
            return None
        if example_value(w16).dim() != 2:
            return None
        with graph.inserting_before(node):
            packed, scales = packing_node(graph, packed_weights.pack_linear_weight, (w16,), w16)
            fused = graph.call_function(torch.ops.tilefx.linear_float.default,
                                        (x16, packed, None, int(example_value(w16).shape[0]), *scales))
        replace(graph, node, fused)
        for cast in (x, weight):
            if not cast.users:
                graph.erase_node(cast)
        return w16

    @staticmethod
    def _groups(nodes: list[torch.fx.Node]) -> list[tuple[str, list[torch.fx.Node]]]:
        """Gate/up pairs (``silu(a) * b``), then the rest as one group (the block-aligned ones first)."""
        groups, taken = [], set()
        for gate in nodes:
            up = _gated_partner(gate)
            if up in nodes and up not in taken and gate not in taken and layouts.is_block_aligned(example_value(gate).shape[-1]):
                groups.append(("gate_up", [gate, up]))
                taken |= {gate, up}
        rest = [n for n in nodes if n not in taken]
        aligned = [n for n in rest if layouts.is_block_aligned(example_value(n).shape[-1])]
        ragged = [n for n in rest if n not in aligned]
        if len(aligned) > 1 or (aligned and ragged):
            groups.append(("fused", aligned + ragged[:1]))
            ragged = ragged[1:]
        else:
            ragged = aligned + ragged
        return groups + [("single", [n]) for n in ragged]

    @staticmethod
    def _single(graph, node) -> None:
        x, weight, bias = linear_args(node)
        with graph.inserting_before(node):
            packed, scales = packing_node(graph, packed_weights.pack_linear_weight, (weight,), weight)
            fused = graph.call_function(torch.ops.tilefx.linear.default,
                                        (x, packed, bias, int(example_value(weight).shape[0]), *scales))
        replace(graph, node, fused)

    @staticmethod
    def _gate_up(graph, x, gate, up) -> None:
        mul = only_user(up)
        width = int(example_value(gate).shape[-1])
        pair = [linear_args(gate)[1], linear_args(up)[1]]
        with graph.inserting_before(mul):
            packed, scales = packing_node(graph, packed_weights.pack_gate_up_weight, tuple(pair), pair[0])
            fused = graph.call_function(torch.ops.tilefx.linear_silu_mul.default, (x, packed, width, *scales))
        silu = only_user(gate)
        replace(graph, mul, fused)
        graph.erase_node(silu)
        graph.erase_node(gate)
        graph.erase_node(up)

    @staticmethod
    def _gate_up_parts(graph, x, group) -> None:
        """Gate and up weights packed together but not used as ``silu(gate) * up``: one linear over both,
        then each linear's columns picked out of the interleaved blocks."""
        gate, up = (linear_args(n)[1] for n in sorted(group, key=lambda n: _packed_index(n)))
        width = int(example_value(gate).shape[0])
        first = min(group, key={node: i for i, node in enumerate(graph.nodes)}.__getitem__)
        with graph.inserting_before(first):
            packed, scales = packing_node(graph, packed_weights.pack_gate_up_weight, (gate, up), gate)
            both = graph.call_function(torch.ops.tilefx.linear.default, (x, packed, None, 2 * width, *scales))
            blocks = graph.call_method("unflatten", (both, -1, layouts.gate_up_columns(width)))
            for node in group:
                part = graph.call_method("flatten", (graph.call_method("select", (blocks, -2, _packed_index(node))),
                                                     -2))
                replace(graph, node, part)

    @staticmethod
    def _packed_embeddings(graph, result: PassResult) -> None:
        """``embedding(ids, W)`` where W was packed and released (an input embedding tied to the lm_head)."""
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target is torch.nn.functional.embedding]:
            ids, weight = node.args[:2]
            param = model_parameter(weight)
            packings = packed_weights.packings_of(param) if param is not None else []
            if not any(p.released for p, _ in packings):
                continue
            max_norm = node.args[3] if len(node.args) > 3 else node.kwargs.get("max_norm")  # padding_idx: grads only
            if len(packings) != 1 or packings[0][0].layout != "linear" or max_norm is not None:
                result.skip(node.name, "embedding over a packed weight in a form packed_embedding does not cover")
                continue
            with graph.inserting_before(node):
                packed, scales = packing_node(graph, packed_weights.pack_linear_weight, (weight,), weight)
                lookup = graph.call_function(torch.ops.tilefx.packed_embedding.default,
                                             (ids, packed, int(example_value(weight).shape[1]), *scales))
            replace(graph, node, lookup)
            result.rewritten += 1

    @staticmethod
    def _fused(graph, x, group) -> None:
        weights = [linear_args(n)[1] for n in group]
        biases = [linear_args(n)[2] for n in group]
        widths = [int(example_value(w).shape[0]) for w in weights]
        order = {node: i for i, node in enumerate(graph.nodes)}
        first = min(group, key=order.__getitem__)
        for const in [*weights, *biases]:  # Dynamo puts frozen parameters' get_attr right before their use
            if const is not None and order[const] > order[first]:
                first.prepend(const)
        with graph.inserting_before(first):
            packed, scales = packing_node(graph, packed_weights.pack_fused_linear_weight, (weights,), weights[0])
            bias = None if biases[0] is None else graph.call_function(torch.cat, (biases,))
            fused = graph.call_function(torch.ops.tilefx.linear.default, (x, packed, bias, sum(widths), *scales))
            fused.meta["example_value"] = example_value(x).new_empty((*example_value(x).shape[:-1], sum(widths)))
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            parts = [graph.call_function(torch.narrow, (fused, -1, o, w)) for o, w in zip(offsets, widths)]
        for node, part in zip(group, parts):
            replace(graph, node, part)


def _packed_index(node: torch.fx.Node) -> int:
    """The index of a linear's weight among the sources of the (one) packing the loader made of it."""
    return packed_weights.packings_of(model_parameter(linear_args(node)[1]))[0][1]


def _gated_partner(gate: torch.fx.Node) -> torch.fx.Node | None:
    """``up`` where ``gate`` is used only as ``silu(gate) * up`` and both are bias-free linears of one width."""
    silu = only_user(gate)
    mul = only_user(silu) if silu is not None and _is_silu(silu) else None
    if mul is None or mul.target is not operator.mul or len(mul.args) != 2 or mul.kwargs:
        return None
    up = mul.args[1] if mul.args[0] is silu else mul.args[0]
    if (not isinstance(up, torch.fx.Node) or up is gate or up.target not in LINEAR or only_user(up) is not mul
            or linear_args(gate)[2] is not None or linear_args(up)[2] is not None
            or example_value(up).shape[-1] != example_value(gate).shape[-1]):
        return None
    return up


def _as_packed(nodes: list[torch.fx.Node]) -> list[tuple[str, list[torch.fx.Node]]]:
    """Linears whose weights the loader packed, grouped as they were packed: siblings packed together and
    used together are one call; gate/up packed together is ``linear_silu_mul`` where the graph computes
    ``silu(gate) * up``; a sibling used alone reads its own slice."""
    by_packing: dict[int, list[torch.fx.Node]] = {}
    layout = {}
    for node in nodes:
        packing = packed_weights.packings_of(model_parameter(linear_args(node)[1]))[0][0]
        by_packing.setdefault(id(packing), []).append(node)
        layout[id(packing)] = packing.layout
    groups = []
    for key, members in by_packing.items():
        members.sort(key=_packed_index)
        indices = [_packed_index(n) for n in members]
        if layout[key] == "gate_up":
            gate_up = len(members) == 2 and indices == [0, 1] and _gated_partner(members[0]) is members[1]
            groups.append(("gate_up" if gate_up else "gate_up_parts", members))
        elif indices == list(range(indices[0], indices[0] + len(members))):
            groups.append(("fused" if len(members) > 1 else "single", members))
        else:
            groups += [("single", [n]) for n in members]
    return groups


def _bf16_source(node) -> torch.fx.Node | None:
    """The bf16 tensor that ``node`` casts to fp32 (``.float()``, ``.to(torch.float32)``, ``.type(...)``), else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in ("float", "to", "type")):
        return None
    source, cast = node.args[0], example_value(node)
    if cast is None or cast.dtype != torch.float32 or example_value(source) is None:
        return None
    if example_value(source).dtype != torch.bfloat16 or example_value(source).shape != cast.shape:
        return None
    return source


