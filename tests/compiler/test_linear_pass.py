"""The linear pass on captured graphs: every linear -> a tilefx op over a packed weight; outputs equal eager.

With sibling fusion (the default) each layer runs q/k/v as one tilefx.linear and
gate/up as one tilefx.linear_silu_mul; without it, one tilefx.linear per linear.
"""

from __future__ import annotations

import pytest
import torch

import tilefx.custom_ops  # noqa: F401
from helpers import PassTestBackend, count, is_op, run
from tilefx.compiler.passes.attention import AttentionPass
from tilefx.compiler.passes.linear import LinearPass
from tilefx.models.adapters import adapter_for
from tilefx.models.kv_cache import TilefxCache
from tilefx.models.packing import narrow_exact_routers
from tilefx.models.presets import build_model


def is_linear(n):
    return n.op == "call_function" and n.target is torch._C._nn.linear


def linears_per_model(config) -> int:
    """q, k, v, o, gate, up, down per layer, plus lm_head."""
    return 7 * config.num_hidden_layers + 1


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("batch,seq,fuse", [(1, 1, True), (1, 6, True), (2, 3, True), (2, 3, False)])
def test_rewrites_every_linear_and_matches_eager(family, batch, seq, fuse):
    torch._dynamo.reset()
    model = build_model(family, seed=5)
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits

    backend = PassTestBackend(AttentionPass(), LinearPass(fuse=fuse))
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=2, max_seq_len=32)
    cache.start(batch)
    got = run(model, cache, ids, backend)

    expected, layers = linears_per_model(model.config), model.config.num_hidden_layers
    before, after = backend.before[0], backend.after[0]
    assert count(before, is_linear) == expected
    assert count(after, is_linear) == 0
    if fuse:  # per layer: q/k/v fused, o, gate/up fused with SiLU-and-mul, down; then lm_head
        assert count(after, is_op("linear")) == 3 * layers + 1
        assert count(after, is_op("pack_fused_linear_weight")) == layers
        assert count(after, is_op("linear_silu_mul")) == count(after, is_op("pack_gate_up_weight")) == layers
        assert count(after, is_op("pack_linear_weight")) == 2 * layers + 1
        assert count(after, lambda n: n.target is torch.nn.functional.silu) == 0
    else:
        assert count(after, is_op("linear")) == expected and count(after, is_op("pack_linear_weight")) == expected
    linear_result = backend.results[1]
    assert linear_result.rewritten == expected and not linear_result.fallbacks
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_leaves_fp32_linears_alone():
    torch._dynamo.reset()
    model = build_model("tiny-llama", seed=5).float()
    ids = torch.randint(3, 500, (1, 4))
    backend = PassTestBackend(LinearPass())
    fn = torch.compile(type(model).forward.__get__(model), backend=backend, fullgraph=True)
    with torch.no_grad():
        got = fn(input_ids=ids, use_cache=False).logits
        want = model(input_ids=ids, use_cache=False).logits
    result = backend.results[0]
    assert result.rewritten == 0 and len(result.fallbacks) == linears_per_model(model.config)
    assert all("packed from bf16 or from a quantized checkpoint" in why for why in result.fallbacks), result.fallbacks[:2]
    assert count(backend.after[0], is_linear) == linears_per_model(model.config)
    torch.testing.assert_close(got, want)


def test_uuid_depends_on_fusion():
    assert LinearPass(fuse=True).uuid() != LinearPass(fuse=False).uuid()


def test_records_which_weights_are_read_only_packed():
    """A tied lm_head (as in Llama-3.2-1B) is also read by the embedding: its unpacked copy must stay."""
    torch._dynamo.reset()
    model = build_model("tiny-llama", seed=5)
    model.lm_head.weight = model.model.embed_tokens.weight
    backend = PassTestBackend(LinearPass())
    fn = torch.compile(type(model).forward.__get__(model), backend=backend, fullgraph=True)
    with torch.no_grad():
        fn(input_ids=torch.randint(3, 500, (1, 4)), use_cache=False)
    result = backend.results[0]
    assert result.packed_shared == {id(model.lm_head.weight)}
    layer = model.model.layers[0]
    assert {id(layer.self_attn.q_proj.weight), id(layer.mlp.down_proj.weight)} <= result.packed_exclusively
    assert len(result.packed_exclusively) == 7 * model.config.num_hidden_layers


def test_fp32_router_of_bf16_values_becomes_linear_float():
    """DeepSeek's router computes linear(h.float(), W.float()): a packed bf16 weight with an fp32 result."""
    torch._dynamo.reset()
    model = build_model("tiny-deepseek-v2", seed=5)
    narrow_exact_routers(model, adapter_for(model.config))  # as packing does (transformers 5.24 holds them in fp32)
    ids = torch.randint(3, 500, (1, 3))
    backend = PassTestBackend(LinearPass())
    fn = torch.compile(type(model).forward.__get__(model), backend=backend, fullgraph=True)
    with torch.no_grad():
        got = fn(input_ids=ids, use_cache=False).logits
        want = model(input_ids=ids, use_cache=False).logits
    layers = model.config.num_hidden_layers
    after, result = backend.after[0], backend.results[0]
    assert count(after, is_op("linear_float")) == layers  # one router per (sparse) layer
    assert count(after, is_linear) == 0 and not result.fallbacks
    routers = {id(layer.mlp.gate.weight) for layer in model.model.layers}
    assert routers <= result.packed_exclusively
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("format", ["int8", "fp8"])
def test_reads_quantized_packings_with_their_scales(format):
    """Weights the loader quantized are read in their format: each packing op asks for it and its scales
    reach the linear op; the logits equal eager over the same dequantized weights."""
    from tilefx.compiler import CompileOptions
    from tilefx.custom_ops import weights
    from tilefx.models.packing import pack_model

    from quantized import dequantize_like_packing

    torch._dynamo.reset()
    model, reference = build_model("tiny-llama", seed=5), build_model("tiny-llama", seed=5)
    dequantize_like_packing(reference, format)
    summary = pack_model(model, adapter_for(model.config), CompileOptions(weights=format), progress=False)
    assert summary.formats == {format: [summary.tensors, summary.packed_bytes]}
    ids = torch.randint(3, 500, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits

    backend = PassTestBackend(AttentionPass(), LinearPass())
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=1, max_seq_len=32)
    cache.start(1)
    got = run(model, cache, ids, backend)

    after, layers = backend.after[0], model.config.num_hidden_layers
    packings = [n for n in after.nodes if n.op == "call_function" and n.target in weights.PACKING_OPS]
    assert len(packings) == 4 * layers + 1 and all(format in n.args for n in packings)  # qkv, o, gate_up, down
    assert count(after, is_op("packed_scales")) == len(packings)
    readers = [n for n in after.nodes if n.op == "call_function" and n.target in (
        torch.ops.tilefx.linear.default, torch.ops.tilefx.linear_silu_mul.default)]
    assert len(readers) == 4 * layers + 1 and all(n.args[-1].target is torch.ops.tilefx.packed_scales.default
                                                  for n in readers)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
