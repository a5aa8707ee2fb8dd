"""Attention pass: HF attention over the tilefx cache -> ``tilefx.decode_attention`` / ``tilefx.extend_attention``.

Matches, in the Dynamo (Torch IR) graph, a region of the shape every HF family
produces with a static-shape cache (``TilefxCache``):

    keys[:B].index_copy_(2, positions, k_new)          # cache write
    values[:B].index_copy_(2, positions, v_new)
    K = repeat_kv(keys[:B]) ; V = repeat_kv(values[:B])  # views / expand / reshape
    out = scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=s)

and replaces it by one op that writes K/V in place and attends over the valid
prefix only, without repeating K/V for GQA. Preconditions (else the region is
left alone and the reason recorded): K and V trace back to whole cache buffers
through views only, both are written by one ``index_copy_`` along the sequence
with the same positions, a boolean 4-D mask is given, no dropout, not causal-flag.
DeepSeek's MLA fails the first: HF caches the latent and expands it to K/V with
``kv_b_proj`` over the whole cache every step; that region is the MLA pass's.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import (
    SDPA,
    cache_writes,
    computed_from_cache,
    erase_unused,
    example_value,
    view_source,
)

class AttentionPass(TilefxPass):
    name = "attention"

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        writes = cache_writes(graph)
        for index, sdpa in enumerate([n for n in graph.nodes if n.op == "call_function" and n.target in SDPA]):
            where = f"attention #{index}"
            why = self._rewrite(graph, sdpa, writes)
            if why is None:
                result.rewritten += 1
            else:
                result.skip(where, why)
        return result

    def _rewrite(self, graph: torch.fx.Graph, sdpa: torch.fx.Node, writes) -> str | None:
        args = list(sdpa.args) + [None] * 3
        q, key, value = (sdpa.kwargs.get(k, args[i]) for i, k in enumerate(("query", "key", "value")))
        mask = sdpa.kwargs.get("attn_mask", args[3])
        if sdpa.kwargs.get("dropout_p", 0.0) not in (0, 0.0) or sdpa.kwargs.get("is_causal", False):
            return "dropout or is_causal flag (expected a mask over a static cache)"
        if len(sdpa.args) > 3:
            return "positional mask/dropout arguments (unexpected call form)"
        mask_val = example_value(mask)
        if mask_val is None or mask_val.dtype != torch.bool or mask_val.dim() != 4:
            return "no boolean 4-D attention mask (cache not owned by tilefx?)"
        k_base, k_chain = view_source(key)
        v_base, v_chain = view_source(value)
        if k_base.op != "placeholder" or v_base.op != "placeholder":
            if computed_from_cache(key, writes) or computed_from_cache(value, writes):
                return ("K/V are computed from the cache, not views of it (MLA: the latent is expanded by "
                        "kv_b_proj over the whole cache); left for the MLA pass")
            return "K/V are not views of graph-input cache buffers"
        k_buf, q_val, key_val = example_value(k_base), example_value(q), example_value(key)
        if k_buf is None or k_buf.dim() != 4 or key_val.shape[2] != k_buf.shape[2] or mask_val.shape[-1] != k_buf.shape[2]:
            return "K does not span the whole cache sequence dimension"
        k_writes, v_writes = writes.get(k_base, []), writes.get(v_base, [])
        if len(k_writes) != 1 or len(v_writes) != 1:
            return f"expected one cache write per K/V buffer, found {len(k_writes)}/{len(v_writes)}"
        k_write, v_write = k_writes[0], v_writes[0]
        positions = k_write.args[2]
        if v_write.args[2] is not positions:
            return "K and V written at different positions"
        scale = sdpa.kwargs.get("scale")
        if scale is None:
            scale = 1.0 / math.sqrt(q_val.shape[-1])
        if not isinstance(scale, (int, float)):
            return "attention scale is not a constant"
        op = torch.ops.tilefx.decode_attention.default
        if not (isinstance(q_val.shape[2], int) and q_val.shape[2] == 1):
            op = torch.ops.tilefx.extend_attention.default
        with graph.inserting_before(sdpa):
            fused = graph.call_function(
                op, (q, k_write.args[3], v_write.args[3], k_base, v_base, positions, mask, float(scale))
            )
        fused.meta.update(sdpa.meta)
        sdpa.replace_all_uses_with(fused)
        graph.erase_node(sdpa)
        for write in (k_write, v_write):
            target = write.args[0]
            graph.erase_node(write)
            erase_unused(graph, view_source(target)[1])
        erase_unused(graph, k_chain + v_chain)
        return None


