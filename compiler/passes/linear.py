"""Linear pass: ``linear(x, W, b)`` -> ``tilefx.linear(x, tilefx.pack_linear_weight(W), b, N)``.

Matches every ``torch._C._nn.linear`` / ``F.linear`` call of the Dynamo (Torch IR)
graph. With Inductor's freezing, parameters are constants, so the inserted
``pack_linear_weight`` is constant-folded: each weight is packed once when the
graph is compiled, the graph keeps only the packed copy, and the graphs of one
model share it (packing is memoized per weight, custom_ops/linear.py).

Preconditions (else the linear is left alone and the reason recorded): freezing
on (otherwise packing would run every call), the weight is a 2-D bf16 model
parameter, x is bf16, the bias (if any) is a 1-D bf16 parameter.
"""

from __future__ import annotations

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass, example_value

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


def _parameter(node) -> torch.nn.Parameter | None:
    """The model parameter a node stands for: a graph attribute (freezing at trace time) or a Dynamo input."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "get_attr":
        value = getattr(node.graph.owning_module, node.target, None)
    elif node.op == "placeholder" and node.meta.get("grapharg") is not None:
        value = node.meta["grapharg"].example
    else:
        return None
    return value if isinstance(value, torch.nn.Parameter) else None


def _is_parameter(node) -> bool:
    return _parameter(node) is not None


def _linear_args(node: torch.fx.Node):
    """(x, weight, bias) of a linear call, positional or keyword."""
    args = list(node.args) + [None] * 2
    return node.kwargs.get("input", args[0]), node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])


class LinearPass(TilefxPass):
    name = "linear"

    def __init__(self, freezing: bool = True):
        self.freezing = freezing

    def option_key(self) -> str:
        return f"freezing={self.freezing}"

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        packed_weights = {}
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _LINEAR]:
            x, weight, bias = _linear_args(node)
            why = self._rewrite(graph, node, x, weight, bias)
            if why is None:
                result.rewritten += 1
                packed_weights[weight] = _parameter(weight)
            else:
                result.skip(node.name, why)
        pack = torch.ops.tilefx.pack_linear_weight.default
        for weight, parameter in packed_weights.items():
            only_packed = all(user.op == "call_function" and user.target is pack for user in weight.users)
            (result.packed_exclusively if only_packed else result.packed_shared).add(id(parameter))
        return result

    def _rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node, x, weight, bias) -> str | None:
        if not self.freezing:
            return "freezing is off: weights are not constants, packing would run every call"
        x_val, w_val = example_value(x), example_value(weight)
        if not _is_parameter(weight) or w_val is None or w_val.dim() != 2:
            return "weight is not a 2-D model parameter"
        if w_val.dtype != torch.bfloat16 or x_val is None or x_val.dtype != torch.bfloat16:
            return f"dtype {w_val.dtype} (x {None if x_val is None else x_val.dtype}): packed linear is bf16 only"
        if bias is not None and not (_is_parameter(bias) and example_value(bias).dtype == torch.bfloat16):
            return "bias is not a bf16 model parameter"
        with graph.inserting_before(node):
            packed = graph.call_function(torch.ops.tilefx.pack_linear_weight.default, (weight,))
            fused = graph.call_function(torch.ops.tilefx.linear.default, (x, packed, bias, int(w_val.shape[0])))
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        return None
