"""RoPE pass: HF's rotate-half rotary embedding of a prompt's queries and keys -> ``tilefx.rope``.

Matches, in the Dynamo (Torch IR) graph, what ``apply_rotary_pos_emb`` of the Llama, Qwen and Mixtral
families traces to, once for the queries and once for the keys:

    out = x * cos + cat((-x[..., D/2:], x[..., :D/2]), -1) * sin       # x [B, H, S, D], cos/sin [B, 1, S, D]

and replaces it by ``tilefx.rope(x, cos, sin)`` (custom_ops/rope.py), which reads each row once and writes
it once; Inductor's kernel of the region writes the concatenation out and reads it back. Preconditions
(else the region is left alone and the reason recorded): bf16 throughout (the native kernel's dtype), x
4-D, the tables of one batch row or x's, one head, x's tokens and width; and more than one new token: a
decode step's RoPE (one token, a few thousand values) stays in Inductor's kernel, fused with its
neighbours, where an op call would cost more than it saves. DeepSeek's forms do not match and stay
Inductor's: V2 rotates by complex numbers (``torch.polar``), V3 (``rope_interleave``) the pairs
``(x[0::2], x[1::2])``.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import ADD, MUL, calls, erase_unused, example_value, run_fake
from tilefx.custom_ops import rope

_NEG = (operator.neg, torch.neg)
# a decode step's regions, reported once a graph (a model has two or more a layer)
_DECODE = "one new token (decode): left to Inductor's kernel, fused with its neighbours"


def _half_slice(node, width: int) -> str | None:
    """"lo" for ``x[..., :width/2]``, "hi" for ``x[..., width/2:]``, else None."""
    if not calls(node, {operator.getitem}) or not isinstance(node.args[1], tuple) or len(node.args[1]) != 2:
        return None
    ellipsis, cut = node.args[1]
    if ellipsis is not Ellipsis or not isinstance(cut, slice) or cut.step not in (None, 1):
        return None
    half = width // 2
    if cut.start in (None, 0) and cut.stop == half:
        return "lo"
    if cut.start == half and cut.stop in (None, width):
        return "hi"
    return None


def rotated_source(node) -> torch.fx.Node | None:
    """x where ``node`` is ``cat((-x[..., D/2:], x[..., :D/2]), -1)`` (HF's ``rotate_half(x)``), else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is torch.cat):
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    value = example_value(node)
    if value is None or not isinstance(parts, (tuple, list)) or len(parts) != 2 or dim not in (-1, value.dim() - 1):
        return None
    negated, first = parts
    if not calls(negated, _NEG):
        return None
    second = negated.args[0]
    width = value.shape[-1]
    if not isinstance(width, int) or _half_slice(second, width) != "hi" or _half_slice(first, width) != "lo":
        return None
    source = first.args[0]
    return source if second.args[0] is source else None


def _product_of(node, pick) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(a, b) where ``node`` is ``a * b`` and ``pick(a)`` holds (either order), else None."""
    if not calls(node, MUL) or len(node.args) != 2:
        return None
    for a, b in (node.args, node.args[::-1]):
        if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and pick(a):
            return a, b
    return None


@dataclasses.dataclass
class Rotation:
    """One matched region: its inputs, and its nodes from the sum back to the slices (the order they can be
    erased in once the sum's readers read the op)."""

    x: torch.fx.Node
    cos: torch.fx.Node
    sin: torch.fx.Node
    nodes: list[torch.fx.Node]


def match(add: torch.fx.Node) -> Rotation | None:
    """The region where ``add`` is ``x * cos + rotate_half(x) * sin`` (terms and factors in any order), else None."""
    if not calls(add, ADD) or len(add.args) != 2:
        return None
    for straight, rotated in (add.args, add.args[::-1]):
        turned = _product_of(rotated, lambda a: rotated_source(a) is not None)
        if turned is None:
            continue
        cat, sin = turned
        source = rotated_source(cat)
        plain = _product_of(straight, lambda a: a is source)
        if plain is not None:
            negated, first = cat.args[0]
            return Rotation(source, plain[1], sin, [add, straight, rotated, cat, negated, negated.args[0], first])
    return None


def _refusal(x, cos, sin) -> str | None:
    """Why ``tilefx.rope`` should not take these example values, or None."""
    if x is None or cos is None or sin is None:
        return "no example values"
    if {x.dtype, cos.dtype, sin.dtype} != {torch.bfloat16}:
        return f"x {x.dtype}, tables {cos.dtype} / {sin.dtype}: the native kernel is bf16's"
    if x.dim() != 4:
        return f"x is {x.dim()}-D, not [B, H, S, D]"
    batch, _, seq, width = x.shape
    for table in (cos, sin):
        if table.dim() != 4 or table.shape[0] not in (1, batch) or table.shape[1] != 1 or table.shape[2:] != (seq, width):
            return f"table {tuple(table.shape)} is not [B or 1, 1, S, D] for x {tuple(x.shape)}"
    if isinstance(seq, int) and seq == 1:
        return _DECODE
    return None


class RopePass(TilefxPass):
    name = "rope"

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        regions = [region for node in graph.nodes if (region := match(node)) is not None]
        for index, region in enumerate(regions):
            why = _refusal(example_value(region.x), example_value(region.cos), example_value(region.sin))
            if why == _DECODE:
                result.skip_counted("rope", why)
                continue
            if why is not None:
                result.skip(f"rope #{index}", why)
                continue
            add = region.nodes[0]
            with graph.inserting_before(add):
                fused = run_fake(graph.call_function(rope.rope, (region.x, region.cos, region.sin)))
            add.replace_all_uses_with(fused)
            erase_unused(graph, region.nodes)  # a node something else still reads stays
            result.rewritten += 1
        return result
