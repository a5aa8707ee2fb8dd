"""MLA pass: DeepSeek's latent attention -> weight-absorbed, head-folded ``tilefx.mla_attention``.

HF's DeepSeek-V2/V3 attention caches the normalized latent ``c`` (``kv_lora_rank`` R
values per token) and the shared rope key, then every step expands the *whole*
cache through ``kv_b_proj`` into per-head keys and values:

    latent[:B].index_copy_(2, positions, c_new) ; rope[:B].index_copy_(2, positions, k_pe_new)
    kv = linear(latent[:B], W_kvb).view(B, T, H, dn + dv).transpose(1, 2)   # T = max_seq_len
    k_nope, v = kv.split([dn, dv], -1) ; K = [k_nope | rope.expand(H)]
    out = scaled_dot_product_attention(cat(q_nope, q_pe), K, v, attn_mask=mask, scale=s)

``W_kvb`` per head h is ``[W_uk[h] (dn x R); W_uv[h] (dv x R)]``, so
``q_nope . (W_uk c) = (W_uk^T q_nope) . c`` and ``sum_t p_t W_uv c_t = W_uv sum_t p_t c_t``:
the pass absorbs ``W_uk`` into the query and ``W_uv`` into the output,

    q_latent = tilefx.linear_per_head(q_nope, pack(W_uk^T))       # q_nope @ W_uk: [B, H, S, R]
    o_latent = tilefx.mla_attention(q_latent, q_pe, c_new, k_pe_new, latent, rope, positions, mask, s)
    out      = tilefx.linear_per_head(o_latent, pack(W_uv))        # o_latent @ W_uv^T: [B, H, S, dv]

and every head attends the one latent "head" (head folding: the cache is read once
for all heads, over the valid prefix only). Nothing is expanded: per token the
step reads ``kv_b_proj`` once instead of computing it over the whole cache. Both
halves are packed per head when the graph is compiled (``pack_mla_absorbed_weight``,
run once and made a graph input by the backend, memoized on the weight).

That is the decode graph's form (one new token). A prefill graph (the prompt length a
symbol) gets the three steps as one op, ``tilefx.mla_prefill(q_nope, q_pe, ..., w_uk, w_uv,
W_kvb)``, which runs them as above or, for a prompt over a short prefix where the brgemm
attention kernel runs MLA prefill, expands the valid prefix's latent through ``W_kvb`` and
attends per head (HF's math without the padding): with a 4096-token prompt that is a third
of the absorbed form's multiply-adds (custom_ops/attention.py).
Preconditions (else the region is left alone and the reason recorded): the expanded
keys come from a bias-free linear over a cache buffer written by one ``index_copy_``,
the rope key buffer is written at the same positions, the query is ``cat(q_nope, q_pe)``,
and a boolean mask and a constant scale are given.
"""

from __future__ import annotations


import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import (LINEAR, SDPA, cache_writes, erase_region, example_value, first_user,
                                                 run_fake, view_source)


class MlaPass(TilefxPass):
    name = "mla"

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        writes = cache_writes(graph)
        expansions = [n for n in graph.nodes if n.op == "call_function" and n.target in LINEAR
                      and view_source(n.args[0])[0] in writes]
        for index, expand in enumerate(expansions):
            why = self._rewrite(graph, expand, writes)
            if why is None:
                result.rewritten += 1
            else:
                result.skip(f"latent attention #{index}", why)
        return result

    def _rewrite(self, graph: torch.fx.Graph, expand: torch.fx.Node, writes) -> str | None:
        latent_buf, _ = view_source(expand.args[0])
        latent_writes = writes[latent_buf]
        if len(latent_writes) != 1:
            return f"expected one write of the latent cache, found {len(latent_writes)}"
        latent_write = latent_writes[0]
        positions = latent_write.args[2]
        rope_writes = [w for buf, ws in writes.items() if buf is not latent_buf for w in ws if w.args[2] is positions]
        if len(rope_writes) != 1:
            return "no rope-key cache write at the latent's positions"
        rope_write = rope_writes[0]
        rope_buf, _ = view_source(rope_write.args[0])
        if latent_buf.op != "placeholder" or rope_buf.op != "placeholder":
            return "latent / rope key are not graph-input cache buffers"
        weight = expand.args[1]
        if (len(expand.args) > 2 and expand.args[2] is not None) or expand.kwargs.get("bias") is not None:
            return "kv_b_proj has a bias (absorption assumes none)"
        sdpa = first_user(expand, lambda n: n.op == "call_function" and n.target in SDPA)
        if sdpa is None:
            return "no attention reads the expanded latent"
        if len(sdpa.args) != 3 or sdpa.kwargs.get("dropout_p", 0.0) not in (0, 0.0) or sdpa.kwargs.get("is_causal"):
            return "attention call form not understood (positional mask, dropout or is_causal)"
        query, mask, scale = sdpa.args[0], sdpa.kwargs.get("attn_mask"), sdpa.kwargs.get("scale")
        if not (query.op == "call_function" and query.target is torch.cat and len(query.args[0]) == 2
                and query.kwargs.get("dim", query.args[1] if len(query.args) > 1 else 0) in (-1, 3)):
            return "the query is not cat(q_nope, q_pe) along the head dimension"
        q_nope, q_pe = query.args[0]
        mask_val = example_value(mask)
        if mask_val is None or mask_val.dtype != torch.bool or mask_val.dim() != 4:
            return "no boolean 4-D attention mask"
        if not isinstance(scale, (int, float)):
            return "attention scale is not a constant"
        q_val, w_val, latent_val = example_value(q_nope), example_value(weight), example_value(latent_buf)
        out_val = example_value(sdpa)
        if q_val is None or w_val is None or latent_val is None or out_val is None:
            return "shapes unknown (no example values)"
        heads, nope, rank, v_dim = q_val.shape[1], q_val.shape[-1], latent_val.shape[-1], out_val.shape[-1]
        if tuple(w_val.shape) != (heads * (nope + v_dim), rank) or latent_val.shape[1] != 1:
            return (f"kv_b_proj {tuple(w_val.shape)} does not split into {heads} heads of "
                    f"{nope} key + {v_dim} value rows over a rank-{rank} latent")

        ops = torch.ops.tilefx
        new_latent, new_rope = latent_write.args[3], rope_write.args[3]
        decode = not isinstance(q_val.shape[2], torch.SymInt) and q_val.shape[2] == 1
        with graph.inserting_before(sdpa):
            w_uk = run_fake(graph.call_function(ops.pack_mla_absorbed_weight.default, (weight, heads, nope, False)))
            w_uv = run_fake(graph.call_function(ops.pack_mla_absorbed_weight.default, (weight, heads, nope, True)))
            if decode:
                q_latent = run_fake(graph.call_function(ops.linear_per_head.default, (q_nope, w_uk, rank)))
                o_latent = run_fake(graph.call_function(ops.mla_attention.default, (
                    q_latent, q_pe, new_latent, new_rope, latent_buf, rope_buf, positions, mask, float(scale))))
                out = graph.call_function(ops.linear_per_head.default, (o_latent, w_uv, v_dim))
            else:
                out = graph.call_function(ops.mla_prefill.default, (
                    q_nope, q_pe, new_latent, new_rope, latent_buf, rope_buf, positions, mask, float(scale), w_uk,
                    w_uv, weight))
        out.meta.update(sdpa.meta)
        sdpa.replace_all_uses_with(out)
        erase_region(graph, [sdpa, latent_write, rope_write], keep={latent_buf, rope_buf})
        return None
