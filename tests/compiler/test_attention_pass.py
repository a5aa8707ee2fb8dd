"""The attention pass on captured graphs: op counts before/after, outputs equal to eager, fallbacks."""

from __future__ import annotations

import pytest
import torch

import tilefx.custom_ops  # noqa: F401
from helpers import PassTestBackend, count, is_index_copy, is_op, is_sdpa, run
from tilefx.compiler import CompileOptions
from tilefx.compiler.passes.attention import AttentionPass
from tilefx.models.adapters import adapter_for
from tilefx.models.kv_cache import TilefxCache
from tilefx.models.presets import build_model

@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("batch,seq", [(1, 1), (1, 7), (2, 5)])
def test_rewrites_every_attention_and_matches_eager(family, batch, seq):
    torch._dynamo.reset()
    model = build_model(family, seed=3)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():  # HF eager without any cache is the reference
        want = model(input_ids=ids, use_cache=False).logits

    backend = PassTestBackend(AttentionPass())
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=2, max_seq_len=32)
    cache.start(batch)
    got = run(model, cache, ids, backend)

    before, after = backend.before[0], backend.after[0]
    assert count(before, is_sdpa) == layers and count(before, is_index_copy) == 2 * layers
    assert count(after, is_sdpa) == 0 and count(after, is_index_copy) == 0
    op = "decode_attention" if seq == 1 else "extend_attention"
    assert count(after, is_op(op)) == layers
    assert backend.results[0].rewritten == layers and not backend.results[0].fallbacks
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert all(layer.keys[:batch, :, :seq].abs().sum() > 0 for layer in cache.layers)  # K written in place


def test_leaves_attention_without_cache_alone():
    """HF attention with no tilefx cache (no mask, is_causal): not rewritten, reason recorded."""
    torch._dynamo.reset()
    model = build_model("tiny-llama", seed=3)
    backend = PassTestBackend(AttentionPass())
    ids = torch.randint(3, 500, (1, 6))
    fn = torch.compile(type(model).forward.__get__(model), backend=backend, fullgraph=True)
    with torch.no_grad():
        got = fn(input_ids=ids, use_cache=False).logits
        want = model(input_ids=ids, use_cache=False).logits
    result = backend.results[0]
    assert result.rewritten == 0 and len(result.fallbacks) == model.config.num_hidden_layers
    print(result.fallbacks)
    assert all(why.startswith("attention #") and "cache" in why for why in result.fallbacks)
    assert count(backend.after[0], is_sdpa) == model.config.num_hidden_layers
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_leaves_mla_attention_alone_and_says_why(family):
    """DeepSeek expands the cached latent with kv_b_proj: not this pass's region; the cache write stays."""
    torch._dynamo.reset()
    model = build_model(family, seed=3)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    backend = PassTestBackend(AttentionPass())
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=2, max_seq_len=32)
    assert cache.layers[0].keys.shape == (2, 1, 32, model.config.kv_lora_rank)  # the latent, one head
    assert cache.layers[0].values.shape == (2, 1, 32, model.config.qk_rope_head_dim)  # the rope key
    cache.start(2)
    got = run(model, cache, ids, backend)
    result = backend.results[0]
    assert result.rewritten == 0 and len(result.fallbacks) == layers
    assert all("computed from the cache" in why and "MLA" in why for why in result.fallbacks)
    after = backend.after[0]
    assert count(after, is_sdpa) == layers and count(after, is_index_copy) == 2 * layers
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_uuid_changes_with_options():
    from tilefx.compiler import PassManager

    a = PassManager(CompileOptions(max_seq_len=64)).uuid()
    b = PassManager(CompileOptions(max_seq_len=128)).uuid()
    c = PassManager(CompileOptions(max_seq_len=64, tp_rank=1, tp_world_size=2)).uuid()
    assert len({a, b, c}) == 3 and a == PassManager(CompileOptions(max_seq_len=64)).uuid()
