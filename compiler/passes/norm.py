"""Norm pass: a prompt's RMSNorms of the hidden states -> ``tilefx.add_rms_norm`` / ``tilefx.rms_norm``.

Matches, in the Dynamo (Torch IR) graph, what HF's ``RMSNorm.forward`` of every family traces to:

    wide = x.to(float32) ; scale = rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * (wide * scale).to(x.dtype)

and replaces it by ``tilefx.rms_norm(x, weight, eps)`` or, where x is the residual add that feeds it
(``x = residual + h``: every norm but a model's first), by ``tilefx.add_rms_norm(residual, h, weight, eps)``,
whose first output takes the sum's place for its other readers (the next residual add) and whose second is the
norm (custom_ops/norm.py). Inductor's kernels of these regions keep the residual stream as fp32 sums of several
layers' outputs and pass over each sum twice; the op reads a row's two inputs once and writes the sum (bf16,
as HF's add rounds it) and the norm once. Qwen3's per-head q/k norms (rows of heads inside a fused projection's
rows) are the same op on rows at two strides. Preconditions (else the region is left alone and the reason
recorded): bf16 throughout (the native kernel's dtype), and more than one new token: a decode step's norms (one
row) stay in Inductor's kernels, fused with their neighbours, where an op call would cost more than it saves (the
same rule as the RoPE pass).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import ADD, MUL, calls, erase_unused, example_value, only_user, run_fake
from tilefx.custom_ops import norm

# a decode step's regions, reported once a graph (a model has two or more a layer)
_DECODE = "one new token (decode): left to Inductor's kernels, fused with their neighbours"


def _method(node, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name


def _other_factor(mul: torch.fx.Node, factor: torch.fx.Node) -> torch.fx.Node | None:
    """b where ``mul`` is ``factor * b`` or ``b * factor``, else None."""
    if not calls(mul, MUL) or len(mul.args) != 2 or factor not in mul.args:
        return None
    other = mul.args[1] if mul.args[0] is factor else mul.args[0]
    return other if isinstance(other, torch.fx.Node) else None


@dataclasses.dataclass
class Norm:
    """One matched RMSNorm: its input, weight and eps, and its nodes from the output back to the widening (the
    order they can be erased in once the output's readers read the op)."""

    x: torch.fx.Node
    weight: torch.fx.Node
    eps: float
    nodes: list[torch.fx.Node]


def match(rsqrt: torch.fx.Node) -> Norm | None:
    """The RMSNorm whose ``rsqrt`` this is, else None."""
    if not calls(rsqrt, {torch.rsqrt}) or len(rsqrt.args) != 1:
        return None
    shifted = rsqrt.args[0]
    if not calls(shifted, ADD) or len(shifted.args) != 2 or not isinstance(shifted.args[1], float):
        return None
    mean, eps = shifted.args
    if not (_method(mean, "mean") and mean.args[1:] in ((-1,), ([-1],)) and mean.kwargs == {"keepdim": True}):
        return None
    squares = mean.args[0]
    if not (_method(squares, "pow") and squares.args[1:] == (2,) and not squares.kwargs):
        return None
    wide = squares.args[0]
    if not (_method(wide, "to") and wide.args[1:] == (torch.float32,) and not wide.kwargs):
        return None
    scaled = only_user(rsqrt)
    if scaled is None or _other_factor(scaled, rsqrt) is not wide or set(wide.users) != {squares, scaled}:
        return None
    x = wide.args[0]
    narrow = only_user(scaled)
    if not (_method(narrow, "to") and len(narrow.args) == 2 and not narrow.kwargs):
        return None
    out = only_user(narrow)
    weight = _other_factor(out, narrow) if out is not None else None
    if weight is None:
        return None
    return Norm(x, weight, eps, [out, narrow, scaled, rsqrt, shifted, mean, squares, wide])


def _residual_add(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(a, b) where ``x`` is ``a + b`` of two tensors of x's shape and dtype, else None."""
    if not calls(x, ADD) or len(x.args) != 2 or not all(isinstance(a, torch.fx.Node) for a in x.args):
        return None
    value = example_value(x)
    for term in x.args:
        other = example_value(term)
        if other is None or other.shape != value.shape or other.dtype != value.dtype:
            return None
    return x.args[0], x.args[1]


def _refusal(x, weight, normed) -> str | None:
    """Why the norm ops should not take these example values, or None."""
    if x is None or weight is None or normed is None:
        return "no example values"
    if {x.dtype, weight.dtype, normed.dtype} != {torch.bfloat16}:
        return f"x {x.dtype}, weight {weight.dtype}: the native kernel is bf16's"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return f"weight {tuple(weight.shape)} is not x {tuple(x.shape)}'s last dim"
    if x.dim() >= 3 and isinstance(x.shape[1], int) and x.shape[1] == 1:
        return _DECODE
    return None


class NormPass(TilefxPass):
    name = "norm"

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        norms = [found for node in graph.nodes if (found := match(node)) is not None]
        for index, found in enumerate(norms):
            output = found.nodes[0]
            why = _refusal(example_value(found.x), example_value(found.weight), example_value(output))
            if why == _DECODE:
                result.skip_counted("norm", why)
                continue
            if why is not None:
                result.skip(f"norm #{index}", why)
                continue
            terms = _residual_add(found.x)
            if terms is None:
                with graph.inserting_before(output):
                    normed = run_fake(graph.call_function(norm.rms_norm, (found.x, found.weight, found.eps)))
                output.replace_all_uses_with(normed)
                erase_unused(graph, found.nodes)
            else:
                with graph.inserting_after(found.x):
                    fused = run_fake(graph.call_function(norm.add_rms_norm, (*terms, found.weight, found.eps)))
                with graph.inserting_after(fused):
                    total = graph.call_function(operator.getitem, (fused, 0))
                with graph.inserting_after(total):
                    normed = graph.call_function(operator.getitem, (fused, 1))
                for index, node in enumerate((total, normed)):  # the op's outputs, as its fake impl gave them
                    node.meta["example_value"] = fused.meta["example_value"][index]
                output.replace_all_uses_with(normed)
                erase_unused(graph, found.nodes)
                found.x.replace_all_uses_with(total)
                erase_unused(graph, [found.x, total])  # the sum stays where the next residual add reads it
            result.rewritten += 1
        return result
