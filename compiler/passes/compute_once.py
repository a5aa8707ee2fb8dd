"""Compute-once pass: a transcendental table read by several nodes -> read through ``tilefx.materialize``.

Every HF family computes RoPE's tables once per forward, from the positions and ``inv_freq``:

    emb = cat(freqs, freqs) ; cos = emb.cos() * scaling ; cos = cos.to(bf16)   # (sin alike)
    q_embed = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)       # in every layer

(DeepSeek-V2: ``freqs_cis = torch.polar(ones, freqs) * scaling``, a complex table). Inductor
inlines a pointwise value into each kernel that reads it unless the value takes many ops, and
``cos`` counts as one: every layer's RoPE kernel recomputed cos and sin per element of every query
and key head (5% of a Llama-3.2-1B prefill of 1024 tokens on AMX; docs/PERFORMANCE.md). This pass
follows each ``cos``, ``sin`` or ``polar`` forward through ops with one reader that do not grow it
(the scaling, the cast) to the first value with several readers, and routes those readers through
``tilefx.materialize`` (custom_ops/materialize.py): Inductor then computes the table once into a
buffer, and the layers read it. Nothing else changes; a value that feeds one reader only, or grows on
the way (broadcast into a per-head tensor), is left alone.
"""

from __future__ import annotations

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import example_value, run_fake
from tilefx.custom_ops import materialize

_METHODS = {"cos", "sin"}
_FUNCTIONS = {torch.cos, torch.sin, torch.polar}


def _is_table_source(node: torch.fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _METHODS) or (
        node.op == "call_function" and node.target in _FUNCTIONS)


def _shared_value(source: torch.fx.Node) -> torch.fx.Node | None:
    """The first value computed from ``source`` alone that several nodes read, or None (also where the
    walk meets a table already materialized: two sources of one value)."""
    node, size = source, example_value(source).numel()
    while len(node.users) == 1:
        user = next(iter(node.users))
        value = example_value(user)
        if (user.op not in ("call_function", "call_method") or user.target is materialize.materialize
                or value is None or value.numel() > size):
            return None
        node = user
    return node if len(node.users) > 1 else None


class ComputeOncePass(TilefxPass):
    name = "compute_once"

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        for source in [n for n in graph.nodes if _is_table_source(n) and example_value(n) is not None]:
            shared = _shared_value(source)
            if shared is None:
                result.skip(source.name, "no value of it alone read by several nodes (nothing recomputed)")
                continue
            with graph.inserting_after(shared):
                once = run_fake(graph.call_function(materialize.materialize, (shared,)))
            shared.replace_all_uses_with(once, delete_user_cb=lambda user: user is not once)
            result.rewritten += 1
        return result
