"""tilefx MoE ops against transformers' own routers and experts (the oracle), crafted routing cases, opcheck."""

from __future__ import annotations

import importlib

import pytest
import torch

from tilefx.custom_ops import weights as packed_weights

import tilefx.custom_ops  # noqa: F401
from tilefx.models.adapters import adapter_for
from tilefx.models.presets import get_preset

FAMILIES = ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2", "tiny-deepseek-v3"]


def _hf_class(config, name):
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    return getattr(module, name)


def _config(preset, **overrides):
    config = get_preset(preset).build_config()
    for field, value in overrides.items():
        setattr(config, field, value)
    return config


def _hf_router(config, seed=0, duplicate=()):
    """The family's HF router module with random bf16 weights; ``duplicate`` pairs (a, b) copy row a to row b."""
    router = _hf_class(config, adapter_for(config).moe.router_class)(config).to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        for a, b in duplicate:
            router.weight[b] = router.weight[a]
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.05 * torch.randn(router.weight.shape[0], generator=g))
    return router


def _route(config, router, hidden):
    """(HF logits, HF weights, HF ids, tilefx weights, tilefx ids) for ``hidden [T, H]``."""
    with torch.no_grad():
        logits, weights, ids = router(hidden)
    bias = getattr(router, "e_score_correction_bias", None)
    got_weights, got_ids = adapter_for(config).routing(config).route(logits, bias)
    return logits, weights, ids, got_weights, got_ids


def _assert_same_routing(config, weights, ids, got_weights, got_ids):
    routing = adapter_for(config).routing(config)
    assert got_weights.dtype == torch.float32 and got_ids.dtype == torch.int32
    assert got_ids.shape == ids.shape
    if routing.weights_in_model_dtype:  # Qwen: HF rounds the weights to bf16 right away
        assert weights.dtype == torch.bfloat16
        got_weights = got_weights.to(torch.bfloat16)
    else:
        assert weights.dtype == torch.float32
    if routing.op == "topk_softmax":  # HF sorts (torch.topk sorted=True): same order, same ties
        assert torch.equal(got_ids.long(), ids)
        assert torch.equal(got_weights, weights)
    else:  # torch.topk(sorted=False): compare as sets, weights matched by expert id
        got_order, order = got_ids.long().sort(dim=-1), ids.sort(dim=-1)
        assert torch.equal(got_order.values, order.values)
        assert torch.equal(got_weights.gather(1, got_order.indices), weights.gather(1, order.indices))


# -- routers vs HF ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_router_equals_hf(family, tokens):
    config = _config(family)
    router = _hf_router(config, seed=tokens)
    hidden = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(100 + tokens))
    _assert_same_routing(config, *_route(config, router, hidden.to(torch.bfloat16))[1:])


@pytest.mark.parametrize("family", FAMILIES)
def test_router_equals_hf_on_ties(family):
    """Equal router rows give exactly tied scores (and, for DeepSeek, tied groups); zero input ties every expert."""
    config = _config(family)
    experts = adapter_for(config).moe_dims(config)["num_experts"]
    duplicate = [(0, 1), (0, experts - 1), (2, experts // 2)]
    router = _hf_router(config, seed=3, duplicate=duplicate)
    if hasattr(router, "e_score_correction_bias"):
        with torch.no_grad():
            bias = router.e_score_correction_bias
            bias[[1, experts - 1]] = bias[0].item()
            bias[experts // 2] = bias[2].item()
    hidden = torch.randn(32, config.hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    hidden[:4] = 0  # all logits 0
    logits, *result = _route(config, router, hidden)
    assert (logits[:, 0] == logits[:, 1]).all() and (logits[:4] == 0).all()
    _assert_same_routing(config, *result)


@pytest.mark.parametrize("family", ["tiny-qwen2-moe", "tiny-qwen3-moe"])
def test_qwen_renormalization_follows_config(family):
    for norm in (False, True):
        config = _config(family, norm_topk_prob=norm)
        assert adapter_for(config).routing(config).renormalize is norm
        hidden = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        logits, *result = _route(config, _hf_router(config, seed=2), hidden)
        _assert_same_routing(config, *result)
        sums = result[2].sum(-1)
        assert torch.allclose(sums, torch.ones_like(sums)) is norm


@pytest.mark.parametrize("topk_method,n_group,topk_group", [("greedy", 4, 2), ("group_limited_greedy", 4, 2),
                                                             ("group_limited_greedy", 2, 1),
                                                             ("group_limited_greedy", 1, 1),
                                                             # one group of 2 for 3 experts: HF fills in a
                                                             # masked expert of score 0
                                                             ("group_limited_greedy", 4, 1)])
def test_deepseek_v2_topk_methods_equal_hf(topk_method, n_group, topk_group):
    config = _config("tiny-deepseek-v2", topk_method=topk_method, n_group=n_group, topk_group=topk_group,
                     num_experts_per_tok=3)
    routing = adapter_for(config).routing(config)
    assert routing.num_expert_group == (n_group if topk_method == "group_limited_greedy" else 1)
    hidden = torch.randn(40, config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    logits, *result = _route(config, _hf_router(config, seed=4), hidden)
    _assert_same_routing(config, *result)
    group_size = 8 // n_group
    if topk_method == "group_limited_greedy" and topk_group * group_size >= 3:  # experts lie in topk_group groups
        groups = result[3].long() // group_size
        assert all(len(set(row)) <= topk_group for row in groups.tolist())
    if topk_group * group_size < 3:
        assert (result[2] == 0).sum() == 40


@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (4, 1, False), (2, 2, True), (1, 1, True)])
def test_deepseek_v3_noaux_tc_equals_hf(n_group, topk_group, norm):
    config = _config("tiny-deepseek-v3", n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    hidden = torch.randn(40, config.hidden_size, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    logits, *result = _route(config, _hf_router(config, seed=6), hidden)
    _assert_same_routing(config, *result)
    groups = result[3].long() // (16 // n_group)
    assert all(len(set(row)) <= topk_group for row in groups.tolist())


def test_deepseek_v2_unsupported_topk_method_fails_at_load():
    config = _config("tiny-deepseek-v2", topk_method="noaux_tc")
    with pytest.raises(ValueError, match="topk_method='noaux_tc'.*greedy"):
        adapter_for(config)


# -- routers on crafted logits (semantics independent of HF) -----------------------------------
def test_topk_softmax_crafted():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    weights, ids = torch.ops.tilefx.topk_softmax(logits, 2, False)
    probs = logits.softmax(-1)
    assert ids[0].tolist() == [1, 2] and torch.allclose(weights[0], probs[0, [1, 2]])
    assert sorted(ids[1].tolist()) == [0, 1]
    weights, _ = torch.ops.tilefx.topk_softmax(logits, 2, True)
    assert torch.allclose(weights.sum(-1), torch.ones(2)) and torch.allclose(weights[1], torch.full((2,), 0.5))


def test_group_limit_excludes_the_global_best():
    # 4 groups of 2. Group maxima 5, 4.85, 4.95, 0: the best 2 groups are 0 and 2, so expert 3
    # (4.85, third best overall) is out and expert 1 (1.0) is in.
    logits = torch.tensor([[5.0, 1.0, 4.8, 4.85, 4.95, -10.0, 0.0, 0.0]])
    _, ids = torch.ops.tilefx.grouped_topk(logits, None, 3, 1, 1, "softmax", False, 1.0)
    assert sorted(ids[0].tolist()) == [0, 3, 4]
    weights, ids = torch.ops.tilefx.grouped_topk(logits, None, 3, 4, 2, "softmax", False, 2.0)
    assert sorted(ids[0].tolist()) == [0, 1, 4]
    probs = logits.softmax(-1)[0]
    assert torch.allclose(weights[0], 2.0 * probs[ids[0].long()])


def test_correction_bias_chooses_but_does_not_weight():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 0.4, -2.0, -3.0]])
    bias = torch.zeros(8)
    bias[3] = 3.0
    weights, ids = torch.ops.tilefx.grouped_topk(logits, bias, 2, 1, 1, "sigmoid", False, 1.0)
    assert sorted(ids[0].tolist()) == [0, 3]  # expert 3 only through its bias
    assert torch.allclose(weights[0], logits[0, ids[0].long()].sigmoid())
    weights, _ = torch.ops.tilefx.grouped_topk(logits, bias, 2, 1, 1, "sigmoid", True, 2.5)
    assert torch.allclose(weights.sum(-1), torch.tensor([2.5]))


def test_noaux_tc_scores_a_group_by_its_two_best():
    # group 0: one strong expert (0.982 + 0.0001); group 1: two good ones (0.731 + 0.711)
    logits = torch.tensor([[4.0, -9.0, 1.0, 0.9, -9.0, -9.0, -9.0, -9.0]])
    _, ids = torch.ops.tilefx.grouped_topk(logits, torch.zeros(8), 2, 4, 1, "sigmoid", False, 1.0)
    assert sorted(ids[0].tolist()) == [2, 3]
    _, ids = torch.ops.tilefx.grouped_topk(logits, None, 2, 4, 1, "sigmoid", False, 1.0)  # no bias: its best
    assert sorted(ids[0].tolist()) == [0, 1]


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(4, 8), None, 9, 1, 1, "softmax", False, 1.0), "top_k=9 must be in 1..8"),
    ((torch.zeros(4, 8), None, 2, 3, 1, "softmax", False, 1.0), "do not split into num_expert_group=3"),
    ((torch.zeros(4, 8), None, 2, 4, 5, "softmax", False, 1.0), "topk_group=5 must be in 1..4"),
    ((torch.zeros(4, 8), None, 2, 1, 1, "tanh", False, 1.0), "scoring_func='tanh'"),
    ((torch.zeros(4, 8), torch.zeros(7), 2, 1, 1, "sigmoid", False, 1.0), "correction_bias shape"),
    ((torch.zeros(4, 8), torch.zeros(8), 2, 8, 2, "sigmoid", False, 1.0), "at least 2"),
])
def test_grouped_topk_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.tilefx.grouped_topk(*args)


# -- fused_moe vs HF experts ------------------------------------------------------------------
def _hf_experts(config, implementation, seed=0):
    config._experts_implementation = implementation
    experts = _hf_class(config, adapter_for(config).moe.experts_class)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in (experts.gate_up_proj, experts.down_proj):
            parameter.copy_(0.1 * torch.randn(parameter.shape, generator=g))
    return experts.to(torch.bfloat16)


def _packed(gate_up_proj, down_proj):
    return (packed_weights.pack_expert_gate_up_weight_reference(gate_up_proj),
            packed_weights.pack_expert_down_weight_reference(down_proj))


def _rel_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _routing_case(case, tokens, experts, top_k, g):
    if case == "random":
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    elif case == "one_expert_idle":  # every expert but the last is used
        ids = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] for _ in range(tokens)])
    elif case == "all_on_one":  # every token's first choice is expert 3
        ids = torch.stack([torch.cat([torch.tensor([3]), (torch.randperm(experts - 1, generator=g)[: top_k - 1] + 4)
                                      % experts]) for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return weights, ids


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3"])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("tokens,case", [(1, "random"), (10, "random"), (6, "one_expert_idle"), (9, "all_on_one"),
                                         (2 * 5, "batch")])
def test_fused_moe_equals_hf_experts(kernel_path, family, implementation, tokens, case):
    config = _config(family)
    dims = adapter_for(config).moe_dims(config)
    experts = _hf_experts(config, implementation, seed=tokens)
    g = torch.Generator().manual_seed(tokens)
    if case == "batch":  # a [2, 5, H] batch flattened, routed by the family's own router
        hidden = torch.randn(2, 5, config.hidden_size, generator=g).to(torch.bfloat16).view(tokens, -1)
        router = _hf_router(config, seed=tokens)
        with torch.no_grad():
            _, weights, ids = router(hidden)
    else:
        hidden = torch.randn(tokens, config.hidden_size, generator=g).to(torch.bfloat16)
        weights, ids = _routing_case(case, tokens, dims["num_experts"], dims["top_k"], g)
    if case == "one_expert_idle":
        assert (ids != dims["num_experts"] - 1).all()
    with torch.no_grad():
        want = experts(hidden, ids, weights)
    got = torch.ops.tilefx.fused_moe(hidden, *_packed(experts.gate_up_proj.data, experts.down_proj.data), weights,
                                     ids.to(torch.int32))
    assert got.dtype == hidden.dtype and got.shape == hidden.shape
    assert _rel_error(got, want) < 1e-2


@pytest.mark.parametrize("family", ["tiny-mixtral", "tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_reference_rounds_where_hf_grouped_mm_rounds(family):
    """With fp32 routing weights the reference is HF's default experts path up to matmul summation order."""
    from tilefx.custom_ops.moe import experts_reference

    config = _config(family)
    experts, router = _hf_experts(config, "grouped_mm", seed=1), _hf_router(config, seed=1)
    hidden = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        _, weights, ids = router(hidden)
        want = experts(hidden, ids, weights)
    assert weights.dtype == torch.float32
    got = experts_reference(hidden, experts.gate_up_proj.data, experts.down_proj.data, weights, ids.to(torch.int32))
    assert (got == want).float().mean() > 0.99  # bitwise, but for a rare accumulation-order difference
    scale = want.abs().max().item()  # ... of about one bf16 ulp (of the output's scale where terms cancel)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * scale)


def test_experts_reference_is_the_silu_gated_sum():
    """Independent of HF: per token, sum_k w_k * down_e(silu(gate_e x) * up_e x) with gate rows first."""
    from tilefx.custom_ops.moe import experts_reference

    g = torch.Generator().manual_seed(0)
    experts, hidden_size, inter, tokens = 4, 16, 8, 3
    w13 = torch.randn(experts, 2 * inter, hidden_size, generator=g)
    w2 = torch.randn(experts, hidden_size, inter, generator=g)
    x = torch.randn(tokens, hidden_size, generator=g)
    ids = torch.tensor([[0, 2], [1, 0], [3, 3 - 1]], dtype=torch.int32)
    weights = torch.rand(tokens, 2, generator=g)
    got = experts_reference(x, w13, w2, weights, ids)
    for t in range(tokens):
        want = sum(weights[t, k] * w2[e] @ (torch.nn.functional.silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t]))
                   for k, e in enumerate(ids[t].tolist()))
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens,hidden_size,inter", [(1, 64, 32), (3, 30, 64), (40, 96, 96)])
def test_packed_experts_round_trip_and_fused_moe_matches(kernel_path, tokens, hidden_size, inter):
    """Packed experts unpack to HF's; the op on them equals the reference (odd H, prefill-sized T)."""
    from tilefx.custom_ops.moe import experts_reference

    g = torch.Generator().manual_seed(tokens)
    experts = 6
    gate_up = (torch.randn(experts, 2 * inter, hidden_size, generator=g) / hidden_size**0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden_size, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    w13, w2 = _packed(gate_up, down)
    assert torch.equal(packed_weights.unpack_expert_gate_up_weight(w13, hidden_size), gate_up)
    assert torch.equal(packed_weights.unpack_expert_down_weight(w2, hidden_size, inter), down)
    x = torch.randn(tokens, hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, 3, generator=g) + 0.1
    want = experts_reference(x, gate_up, down, weights, ids)
    got = torch.ops.tilefx.fused_moe(x, w13, w2, weights, ids)
    assert _rel_error(got, want) < 1e-2


@pytest.mark.parametrize("format", ["bf16", "int8"])
def test_fused_moe_experts_on_each_prefill_gemm(kernel_path, format):
    """Experts with more than 4 rows (150 tokens, top 3 of 6: ~75 rows an expert) on the unit's GEMM, on oneDNN's
    brgemm and, on AMX CPUs, on tilefx's tile kernel (row tiles of 16: an expert's ~75 rows in full tiles and a
    short one, past the 64 rows from which it streams its output), all equal the reference."""
    from tilefx.custom_ops import tuning
    from tilefx.custom_ops.moe import experts_reference

    if kernel_path == "reference":
        pytest.skip("the reference path runs PyTorch's matmul; the GEMM is a native path's choice")
    g = torch.Generator().manual_seed(5)
    experts, tokens, hidden_size, inter = 6, 150, 128, 64
    gate_up = (torch.randn(experts, 2 * inter, hidden_size, generator=g) / hidden_size**0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden_size, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    w13 = packed_weights.pack_expert_gate_up_weight(gate_up, format)
    w2 = packed_weights.pack_expert_down_weight(down, format)
    scales = {} if format == "bf16" else {"w13_scales": packed_weights.packed_scales(w13),
                                          "w2_scales": packed_weights.packed_scales(w2)}
    x = torch.randn(tokens, hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, 3, generator=g) + 0.1
    want = experts_reference(x, gate_up, down, weights, ids)
    gemms = [("unit", None), ("brgemm", (64, 1024, "brgemm"))] if tuning.brgemm_runs() else [("unit", None)]
    if tuning.amx_tiles_run():
        gemms.append(("brgemm", (16, 64, "tiles")))
    for gemm, tiling in gemms:
        with tuning.forced_gemm(format, gemm), tuning.forced_gemm_tiling(*(tiling or tuning.GEMM_TILING_DEFAULT)):
            got = torch.ops.tilefx.fused_moe(x, w13, w2, weights, ids, **scales)
        assert _rel_error(got, want) < 2e-2, (gemm, tiling)


def test_fused_moe_rejects_bad_arguments(kernel_path):
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    w13, w2 = _packed(torch.zeros(4, 64, 16, dtype=torch.bfloat16), torch.zeros(4, 16, 32, dtype=torch.bfloat16))
    weights, ids = torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.tilefx.fused_moe(x, w13, w2, weights, ids.long())
    with pytest.raises(RuntimeError, match="w2"):
        torch.ops.tilefx.fused_moe(x, w13, w2.transpose(2, 3), weights, ids)
    with pytest.raises((RuntimeError, ValueError), match="0..3|outside"):
        torch.ops.tilefx.fused_moe(x, w13, w2, weights, ids + 4)


# -- opcheck ----------------------------------------------------------------------------------
def _opcheck_cases():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 16, generator=g)
    bias = 0.1 * torch.randn(16, generator=g)
    hidden = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    w13, w2 = _packed(torch.randn(16, 2 * 32, 32, generator=g).to(torch.bfloat16),
                      torch.randn(16, 32, 32, generator=g).to(torch.bfloat16))
    weights, ids = torch.ops.tilefx.topk_softmax(logits, 4, True)
    return [
        ("topk_softmax", (logits.to(torch.bfloat16), 4, False)),
        ("topk_softmax", (logits, 4, True)),
        ("grouped_topk", (logits, None, 4, 4, 2, "softmax", False, 1.5)),
        ("grouped_topk", (logits, bias, 4, 4, 2, "sigmoid", True, 2.5)),
        ("fused_moe", (hidden, w13, w2, weights, ids)),
        ("fused_moe", (hidden[:1], w13, w2, weights[:1].to(torch.bfloat16), ids[:1])),
        ("pack_expert_gate_up_weight", (w13[:0].new_zeros(3, 64, 32),)),
        ("pack_expert_down_weight", (w13[:0].new_zeros(3, 32, 31),)),
    ]


@pytest.mark.parametrize("name,args", _opcheck_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.tilefx, name).default, args)


@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_is_the_reference_on_every_path(kernel_path, renormalize):
    """The native router makes the reference's ATen calls from C++: the same bits and tie order."""
    from tilefx.custom_ops.moe import topk_softmax_reference

    g = torch.Generator().manual_seed(int(renormalize))
    logits = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    logits[:4, 10:14] = logits[:4, 20:24] = 3.0  # ties at the top
    got_weights, got_ids = torch.ops.tilefx.topk_softmax(logits, 8, renormalize)
    want_weights, want_ids = topk_softmax_reference(logits, 8, renormalize)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_weights, want_weights)


@pytest.mark.parametrize("bias,groups,topk_group,scoring,renormalize,scale", [
    (False, 1, 1, "softmax", False, 1.0),  # DeepSeek-V2 greedy
    (False, 4, 2, "softmax", False, 1.5),  # group-limited greedy
    (True, 4, 2, "sigmoid", True, 2.5),  # DeepSeek-V3 noaux_tc
    (True, 1, 1, "sigmoid", False, 1.0),
])
def test_grouped_topk_is_the_reference_on_every_path(kernel_path, bias, groups, topk_group, scoring, renormalize,
                                                     scale):
    from tilefx.custom_ops.moe import grouped_topk_reference

    g = torch.Generator().manual_seed(groups)
    logits = torch.randn(29, 16, generator=g)
    logits[:3, 4:8] = 2.0  # ties
    correction = 0.1 * torch.randn(16, generator=g) if bias else None
    args = (logits, correction, 4, groups, topk_group, scoring, renormalize, scale)
    got_weights, got_ids = torch.ops.tilefx.grouped_topk(*args)
    want_weights, want_ids = grouped_topk_reference(*args)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_weights, want_weights)
