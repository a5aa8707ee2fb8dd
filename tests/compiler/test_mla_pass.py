"""The MLA pass on captured graphs: every DeepSeek attention becomes one weight-absorbed
tilefx.mla_attention between two tilefx.linear_per_head (decode) or one tilefx.mla_prefill (prefill);
nothing expands the whole cache; outputs equal eager."""

from __future__ import annotations

import pytest
import torch

import tilefx.custom_ops  # noqa: F401
from helpers import PassTestBackend, count, is_index_copy, is_op, is_sdpa, run
from tilefx.compiler.passes.attention import AttentionPass
from tilefx.compiler.passes.mla import MlaPass
from tilefx.custom_ops import isa, tuning
from tilefx.models.adapters import adapter_for
from tilefx.models.kv_cache import TilefxCache
from tilefx.models.presets import build_model
from tilefx.models.runtime import cache_kwargs


def is_linear(n):
    return n.op == "call_function" and n.target is torch._C._nn.linear


def _logits_with_passes(model, ids, *passes, max_seq_len=32):
    backend = PassTestBackend(*passes)
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=2, max_seq_len=max_seq_len)
    cache.start(ids.shape[0])
    return run(model, cache, ids, backend), backend, cache


@pytest.mark.parametrize("family", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 5)])
def test_every_latent_attention_is_absorbed(family, batch, seq):
    torch._dynamo.reset()
    model = build_model(family, seed=3)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    got, backend, _ = _logits_with_passes(model, ids, AttentionPass(), MlaPass())
    before, after = backend.before[0], backend.after[0]
    assert count(before, is_sdpa) == layers and count(before, is_index_copy) == 2 * layers
    attention, mla = backend.results
    assert attention.rewritten == 0 and mla.rewritten == layers and not mla.fallbacks
    assert count(after, is_sdpa) == 0
    assert count(after, is_index_copy) == 0  # the op writes the latent and rope key itself
    if seq == 1:  # decode: the absorbed steps as three ops
        assert count(after, is_op("mla_attention")) == layers and count(after, is_op("mla_prefill")) == 0
        assert count(after, is_op("linear_per_head")) == 2 * layers  # q_nope -> latent, latent -> v
    else:  # prefill: one op that runs them or the expanded form
        assert count(after, is_op("mla_prefill")) == layers and count(after, is_op("mla_attention")) == 0
        assert count(after, is_op("linear_per_head")) == 0
    assert count(after, is_op("pack_mla_absorbed_weight")) == 2 * layers
    # kv_b_proj no longer runs as a linear over the cache: one linear fewer per layer
    assert count(after, is_linear) == count(before, is_linear) - layers
    assert count(after, lambda n: n.op == "call_method" and n.target in ("copy_", "new_empty")) == 0
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("family", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_prefill_on_the_brgemm_kernel_equals_eager(family):
    """With the brgemm kernel running MLA prefill, a prompt takes mla_prefill's expanded form (kv_b_proj over the
    valid prefix, every head over its own keys): the logits still equal eager's."""
    if isa.current() == "reference":
        pytest.skip("the forms are the native kernel's")
    torch._dynamo.reset()
    model = build_model(family, seed=3)
    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    with tuning.forced_attention("mla", "brgemm"):
        got, backend, _ = _logits_with_passes(model, ids, AttentionPass(), MlaPass())
    assert count(backend.after[0], is_op("mla_prefill")) == model.config.num_hidden_layers
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("decode", ["unit", "brgemm"])
def test_decode_over_a_prefix_equals_eager(decode):
    """Prefill, then one decode step over the cached latent (on the unit, or as flash decoding on brgemm tiles):
    the step's logits equal eager's for the whole sequence."""
    if decode != "unit" and isa.current() == "reference":
        pytest.skip("the decode kernel is a native path's choice")
    torch._dynamo.reset()
    model = build_model("tiny-deepseek-v2", seed=4)
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits[:, -1]
    backend = PassTestBackend(AttentionPass(), MlaPass())
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=1, max_seq_len=32)
    cache.start(1)
    fn = torch.compile(type(model).forward.__get__(model), backend=backend, fullgraph=True)
    mask = torch.zeros(1, 32, dtype=torch.long)
    with torch.no_grad(), tuning.forced_decode_attention("mla", decode):
        for start, stop in ((0, 7), (7, 8)):
            mask[:, :stop] = 1
            out = fn(input_ids=ids[:, start:stop], attention_mask=mask.clone(),
                     position_ids=torch.arange(start, stop)[None], use_cache=True, **cache_kwargs(cache))
            cache.advance(stop - start)
    assert [r.rewritten for r in backend.results if r.name == "mla"] == [2, 2]  # prefill and decode graphs
    got = out.logits[:, -1]
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_dense_attention_is_not_touched():
    torch._dynamo.reset()
    model = build_model("tiny-llama", seed=3)
    ids = torch.randint(3, 500, (1, 4), generator=torch.Generator().manual_seed(0))
    _, backend, _ = _logits_with_passes(model, ids, MlaPass())
    result = backend.results[0]
    assert result.rewritten == 0 and not result.fallbacks
    assert count(backend.after[0], is_sdpa) == count(backend.before[0], is_sdpa) > 0
