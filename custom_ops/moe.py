"""Mixture of experts: router ops ``tilefx::topk_softmax`` / ``tilefx::grouped_topk`` and ``tilefx::fused_moe``.

Each reference implementation computes exactly what transformers 5.x computes (checked
on 5.24; tests/custom_ops/test_moe_ops.py compares them with the installed version's
modules), with the same torch calls in the same order, so expert ids, their order
within a row and tie-breaking (``torch.topk``'s) are HF's. Conventions:

- ``router_logits`` ``[T, E]``: the router linear's output, one row per token, any float
  dtype (Qwen-MoE and Mixtral compute it in the model dtype, DeepSeek in fp32).
- routers return ``(topk_weights, topk_ids)``, both ``[T, k]``: ``topk_weights`` float32,
  ``topk_ids`` int32. HF keeps the weights in fp32 too, except Qwen-MoE, which rounds them
  to the model dtype before the combine (``Routing.weights_in_model_dtype``, models/adapters.py).
  Row order: ``topk_softmax`` by descending weight (``torch.topk(sorted=True)``, as HF);
  ``grouped_topk`` as ``torch.topk(sorted=False)`` returns it, as HF (callers must not
  rely on an order there).
- ``fused_moe(hidden [T, H], w13, w2, topk_weights [T, k], topk_ids [T, k])`` runs the
  HF experts ``gate_up_proj [E, 2I, H]`` (rows ``[:I]`` gate, ``[I:]`` up) and
  ``down_proj [E, H, I]`` packed once (``w13 = pack_expert_gate_up_weight(gate_up_proj)``,
  ``w2 = pack_expert_down_weight(down_proj)``, custom_ops/weights/: per expert the
  layouts of ``tilefx.linear_silu_mul`` and ``tilefx.linear``); it returns
  ``sum_k topk_weights[:, k] * down(silu(gate(x)) * up(x))`` in ``hidden``'s dtype.
  ``experts_reference`` is the same on the unpacked HF parameters: the specification.

Numerics of the HF experts (default ``grouped_mm`` path, bf16 model), which the reference
follows (the native kernel keeps the gate/up/down results in fp32 instead, one rounding
at the end): each grouped matmul accumulates in fp32 and rounds its output to bf16; SiLU and
the gate*up product run on those bf16 values (rounded again); the weighted sum over the
k experts of a token is fp32 (``proj_out * weights`` with fp32 weights, ``.sum(dim=1)``),
rounded once to bf16. With fp32 routing weights (Mixtral, DeepSeek) the reference therefore
equals HF's output but for matmul summation order (>99% of elements bitwise, the rest one
bf16 ulp). With bf16 weights (Qwen-MoE) HF rounds each product to bf16 before summing; the
reference keeps the combine fp32 (one rounding fewer; ~2e-3 relative). HF's ``eager``
experts path instead accumulates the k terms in bf16 with ``index_add_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilefx.custom_ops import isa
from tilefx.custom_ops import weights as packed_weights
from tilefx.custom_ops.weights.layouts import (
    expert_down_shape,
    expert_gate_up_shape,
    expert_intermediate,
    unpack_expert_down_weight,
    unpack_expert_gate_up_weight,
)

SCORING_FUNCS = ("softmax", "sigmoid")

_TOPK_SOFTMAX_SCHEMA = "(Tensor router_logits, int top_k, bool renormalize) -> (Tensor, Tensor)"
_GROUPED_TOPK_SCHEMA = (
    "(Tensor router_logits, Tensor? correction_bias, int top_k, int num_expert_group, int topk_group, "
    "str scoring_func, bool renormalize, float routed_scaling_factor) -> (Tensor, Tensor)"
)
_FUSED_MOE_SCHEMA = ("(Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
                     "Tensor? w13_scales=None, Tensor? w2_scales=None) -> Tensor")


# -- routers ---------------------------------------------------------------------------------
def _check_logits(op: str, router_logits, top_k: int) -> None:
    torch._check(router_logits.dim() == 2,
                 lambda: f"tilefx.{op}: router_logits must be [tokens, experts], got {tuple(router_logits.shape)}")
    torch._check(router_logits.dtype.is_floating_point,
                 lambda: f"tilefx.{op}: router_logits dtype {router_logits.dtype}, expected a float dtype")
    torch._check(1 <= top_k <= router_logits.shape[1],
                 lambda: f"tilefx.{op}: top_k={top_k} must be in 1..{router_logits.shape[1]} (the number of experts)")


def topk_softmax_reference(router_logits, top_k, renormalize):
    """Qwen2-MoE / Qwen3-MoE (``renormalize = norm_topk_prob``) and Mixtral (``renormalize=True``)."""
    _check_logits("topk_softmax", router_logits, top_k)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _check_grouped(router_logits, correction_bias, top_k, num_expert_group, topk_group, scoring_func) -> None:
    _check_logits("grouped_topk", router_logits, top_k)
    experts = router_logits.shape[1]
    torch._check(scoring_func in SCORING_FUNCS,
                 lambda: f"tilefx.grouped_topk: scoring_func={scoring_func!r}, expected one of {SCORING_FUNCS}")
    torch._check(num_expert_group >= 1 and experts % num_expert_group == 0,
                 lambda: f"tilefx.grouped_topk: {experts} experts do not split into num_expert_group={num_expert_group}")
    torch._check(1 <= topk_group <= num_expert_group,
                 lambda: f"tilefx.grouped_topk: topk_group={topk_group} must be in 1..{num_expert_group}")
    if correction_bias is not None:
        torch._check(correction_bias.shape == (experts,),
                     lambda: f"tilefx.grouped_topk: correction_bias shape {tuple(correction_bias.shape)}, "
                             f"expected ({experts},)")
        torch._check(num_expert_group == 1 or experts // num_expert_group >= 2,
                     lambda: "tilefx.grouped_topk: with a correction bias a group is scored by its two best "
                             "experts, so each group needs at least 2")


def grouped_topk_reference(router_logits, correction_bias, top_k, num_expert_group, topk_group, scoring_func,
                           renormalize, routed_scaling_factor):
    """DeepSeek routing: top-k experts within the ``topk_group`` best of ``num_expert_group`` groups.

    Without ``correction_bias`` this is DeepSeek-V2's ``greedy`` (one group) and
    ``group_limited_greedy``: a group scores its best expert, experts outside the chosen
    groups score 0, the weights are the chosen scores. With it, DeepSeek-V3's ``noaux_tc``:
    experts are *chosen* by ``score + correction_bias`` (a group scores its two best such
    values, experts outside the chosen groups -inf) but weighted by the unbiased score.
    Then optionally renormalized (sum + 1e-20, as HF) and scaled by ``routed_scaling_factor``.
    """
    _check_grouped(router_logits, correction_bias, top_k, num_expert_group, topk_group, scoring_func)
    tokens, experts = router_logits.shape
    logits = router_logits.float()
    scores = logits.softmax(dim=-1, dtype=torch.float32) if scoring_func == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if num_expert_group > 1:
        group_size = experts // num_expert_group
        grouped = choice.view(tokens, num_expert_group, group_size)
        if correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(tokens, num_expert_group, group_size).reshape(tokens, experts)
        choice = choice.masked_fill(~score_mask.bool(), 0.0 if correction_bias is None else float("-inf"))
    if correction_bias is None:
        weights, ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)
    else:
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def _router_fake(router_logits, top_k, *args):
    tokens = router_logits.shape[0]
    return (router_logits.new_empty((tokens, top_k), dtype=torch.float32),
            router_logits.new_empty((tokens, top_k), dtype=torch.int32))


def _topk_softmax_fake(router_logits, top_k, renormalize):
    _check_logits("topk_softmax", router_logits, top_k)
    return _router_fake(router_logits, top_k)


def _grouped_topk_fake(router_logits, correction_bias, top_k, num_expert_group, topk_group, scoring_func,
                       renormalize, routed_scaling_factor):
    _check_grouped(router_logits, correction_bias, top_k, num_expert_group, topk_group, scoring_func)
    return _router_fake(router_logits, top_k)


# -- experts ---------------------------------------------------------------------------------
def _check_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids) -> None:
    torch._check(hidden_states.dim() == 2,
                 lambda: f"tilefx.fused_moe: hidden_states must be [tokens, hidden], got {tuple(hidden_states.shape)}")
    tokens, hidden = hidden_states.shape
    torch._check(gate_up_proj.dim() == 3 and gate_up_proj.shape[2] == hidden and gate_up_proj.shape[1] % 2 == 0,
                 lambda: f"tilefx.fused_moe: gate_up_proj {tuple(gate_up_proj.shape)}, expected "
                         f"[experts, 2 * intermediate, {hidden}]")
    experts, intermediate = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    torch._check(down_proj.shape == (experts, hidden, intermediate),
                 lambda: f"tilefx.fused_moe: down_proj {tuple(down_proj.shape)}, expected "
                         f"[{experts}, {hidden}, {intermediate}]")
    _check_routing(hidden_states, topk_weights, topk_ids)
    torch._check(gate_up_proj.dtype == hidden_states.dtype and down_proj.dtype == hidden_states.dtype,
                 lambda: f"tilefx.fused_moe: weights {gate_up_proj.dtype}/{down_proj.dtype} and hidden_states "
                         f"{hidden_states.dtype} must share one dtype")


def _check_routing(hidden_states, topk_weights, topk_ids) -> None:
    tokens = hidden_states.shape[0]
    torch._check(topk_ids.dim() == 2 and topk_ids.shape[0] == tokens,
                 lambda: f"tilefx.fused_moe: topk_ids {tuple(topk_ids.shape)}, expected [{tokens}, top_k]")
    torch._check(topk_ids.dtype == torch.int32,
                 lambda: f"tilefx.fused_moe: topk_ids dtype {topk_ids.dtype}, expected torch.int32 (the router ops' ids)")
    torch._check(topk_weights.shape == topk_ids.shape,
                 lambda: f"tilefx.fused_moe: topk_weights {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}")
    torch._check(topk_weights.dtype.is_floating_point,
                 lambda: f"tilefx.fused_moe: topk_weights dtype {topk_weights.dtype}, expected a float dtype")


def _check_packed(hidden_states, w13, w2, topk_weights, topk_ids, w13_scales=None, w2_scales=None) -> None:
    torch._check(hidden_states.dim() == 2,
                 lambda: f"tilefx.fused_moe: hidden_states must be [tokens, hidden], got {tuple(hidden_states.shape)}")
    hidden = hidden_states.shape[1]
    torch._check(w13.dim() == 5 and w13.shape[1] % 2 == 0
                 and packed_weights.logical_shape(w13) == expert_gate_up_shape(w13.shape[0],
                                                                               expert_intermediate(w13.shape), hidden),
                 lambda: f"tilefx.fused_moe: w13 {tuple(w13.shape)} is not a packed gate_up_proj for hidden size "
                         f"{hidden}; use tilefx.custom_ops.weights.pack_expert_gate_up_weight")
    experts, intermediate = w13.shape[0], expert_intermediate(w13.shape)
    torch._check(packed_weights.logical_shape(w2) == expert_down_shape(experts, hidden, intermediate),
                 lambda: f"tilefx.fused_moe: w2 {tuple(w2.shape)} is not a packed down_proj for {experts} experts, "
                         f"hidden {hidden}, intermediate {intermediate}; use pack_expert_down_weight")
    for name, packed, scales in (("w13", w13, w13_scales), ("w2", w2, w2_scales)):
        quantized = packed.dtype in packed_weights.QUANTIZED_DTYPES
        torch._check(packed.dtype == hidden_states.dtype or quantized and hidden_states.dtype == torch.bfloat16,
                     lambda: f"tilefx.fused_moe: weights {w13.dtype}/{w2.dtype} and hidden_states "
                             f"{hidden_states.dtype}: weights share the activations' dtype or are int8 / fp8 / int4")
        packed_weights.check_scales(f"fused_moe ({name})", packed, scales)
    _check_routing(hidden_states, topk_weights, topk_ids)


def _matmul(x, weight):
    """``x @ weight.T`` accumulated in fp32, rounded to x's dtype (as HF's grouped_mm returns it)."""
    return (x.float() @ weight.float().T).to(x.dtype)


def experts_reference(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids):
    """The specification, on HF's expert parameters: each token through its k experts, SiLU-gated,
    weighted sum in fp32."""
    _check_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)
    return _run_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)


def _run_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids):
    tokens, top_k = topk_ids.shape
    experts, intermediate = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    if tokens and not (0 <= int(topk_ids.min()) and int(topk_ids.max()) < experts):
        raise ValueError(f"tilefx.fused_moe: topk_ids must lie in 0..{experts - 1}, got "
                         f"{int(topk_ids.min())}..{int(topk_ids.max())}")
    per_slot = hidden_states.new_zeros((tokens, top_k, hidden_states.shape[1]), dtype=torch.float32)
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = _matmul(hidden_states[token], gate_up_proj[expert])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out = _matmul(act, down_proj[expert])
        per_slot[token, slot] = out.float() * topk_weights[token, slot].float().unsqueeze(-1)
    return per_slot.sum(dim=1).to(hidden_states.dtype)


def fused_moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, w13_scales=None, w2_scales=None):
    """``experts_reference`` on the unpacked experts (quantized: dequantized to fp32 first)."""
    _check_packed(hidden_states, w13, w2, topk_weights, topk_ids, w13_scales, w2_scales)
    hidden, intermediate = hidden_states.shape[1], expert_intermediate(w13.shape)
    if w13.dtype != hidden_states.dtype:
        w13, w2 = packed_weights.dequantize(w13, w13_scales), packed_weights.dequantize(w2, w2_scales)
    gate_up_proj = unpack_expert_gate_up_weight(w13, hidden)
    down_proj = unpack_expert_down_weight(w2, hidden, intermediate)
    return _run_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)


def _fused_moe_fake(hidden_states, w13, w2, topk_weights, topk_ids, w13_scales=None, w2_scales=None):
    _check_packed(hidden_states, w13, w2, topk_weights, topk_ids, w13_scales, w2_scales)
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


_LIB = torch.library.Library("tilefx", "FRAGMENT")
# Native CPU kernels, the references as *_portable ops (isa.define_native_op). The routers' kernels
# make the references' ATen calls from C++: the same bits, no Python frame per MoE layer.
isa.define_native_op(_LIB, "topk_softmax", _TOPK_SOFTMAX_SCHEMA, topk_softmax_reference, _topk_softmax_fake)
isa.define_native_op(_LIB, "grouped_topk", _GROUPED_TOPK_SCHEMA, grouped_topk_reference, _grouped_topk_fake)
isa.define_native_op(_LIB, "fused_moe", _FUSED_MOE_SCHEMA, fused_moe_reference, _fused_moe_fake)

topk_softmax = torch.ops.tilefx.topk_softmax.default
grouped_topk = torch.ops.tilefx.grouped_topk.default
fused_moe = torch.ops.tilefx.fused_moe.default
