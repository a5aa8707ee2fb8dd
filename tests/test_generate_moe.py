"""End to end for the MoE families: compiled greedy tokens equal HF eager's (batch 2, left padding).

Each tiny model compiles once (module-scoped fixture) and only the two graphs one
batch-2 request needs (no warm-up): MoE graphs take Inductor a while on a small
machine. Families whose first layer is already sparse run with one layer.
"""

from __future__ import annotations

import pytest
import torch

import tilefx
from tilefx.models.adapters import adapter_for
from tilefx.models.presets import build_model

from helpers import (assert_draws_from_reference_logits, assert_greedy_matches,
                     assert_greedy_matches_on_emulated_avx512, assert_recycling_changes_nothing, padded_batch,
                     reference_sequence_logprobs)

# preset -> layers (DeepSeek-V3's first layer is dense: it needs two for a sparse one)
FAMILIES = {"tiny-qwen2-moe": 1, "tiny-qwen3-moe": 1, "tiny-mixtral": 1, "tiny-deepseek-v2": 1, "tiny-deepseek-v3": 2}
MAX_SEQ_LEN = 32


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request):
    """(eager reference, compiled model) with identical weights; compiled once per family."""
    layers = FAMILIES[request.param]
    reference = build_model(request.param, layers=layers, seed=7)
    compiled = tilefx.compile_model(build_model(request.param, layers=layers, seed=7), max_seq_len=MAX_SEQ_LEN,
                                    max_batch=2, warmup=False)
    return reference, compiled


def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=generator).tolist()


def test_greedy_batch2_padded_matches_eager(pair):
    reference, compiled = pair
    config = compiled.config
    assert adapter_for(config).moe_layers(config)  # the model under test routes tokens
    ids, mask = padded_batch([_prompt(9, 1), _prompt(4, 2)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert out.shape == (2, 19)
    exact = assert_greedy_matches(reference, ids, mask, out)
    assert exact >= 16  # well-separated logits: near-ties (bf16-equal logits) are rare
    report = compiled.tilefx.report
    assert [g.phase for g in report.graphs] == ["prefill", "decode"] and report.graph_breaks == 0


def test_greedy_on_the_avx512_unit_matches_eager(pair):
    """The linears, experts and MLA projections on the AVX512-BF16 unit."""
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(9, 1), _prompt(4, 2)])
    assert assert_greedy_matches_on_emulated_avx512(reference, compiled, ids, mask, new_tokens=10) >= 16


def test_recycled_buffers_change_no_token_or_logit(pair):
    """fused_moe's routed rows and the attention's packed keys and values come from PyTorch's CPU allocator too."""
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(9, 1), _prompt(4, 2)])
    assert_recycling_changes_nothing(compiled, ids, mask)


def test_a_sequence_continued_by_several_tokens_matches_eager(pair):
    """A forward of several tokens after a cached prefix (a chat's next turn; assisted generation's draft check):
    the prompt graph over a nonzero past, with MLA's latent cache and the experts."""
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(9, 1), _prompt(4, 2)])
    more = torch.tensor([_prompt(3, 3), _prompt(3, 4)])
    whole_ids, whole_mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    with torch.no_grad():
        first = compiled(input_ids=ids, attention_mask=mask, logits_to_keep=1)
        got = compiled(input_ids=more, attention_mask=whole_mask, logits_to_keep=1, cache=first.cache).logits
        want = reference(input_ids=whole_ids, attention_mask=whole_mask, logits_to_keep=1).logits
    assert compiled.tilefx.cache.seq_len == 12
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_beam_search_scores_each_beam_as_the_reference_does(pair):
    """Two beams, the batch-2 graphs: the cache's rows (MLA's latent ones too) reordered every step; each beam's
    score as the run summed it equals its tokens' log-probs under the reference."""
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(7, 5)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=2,
                            num_return_sequences=2, length_penalty=0.0, output_scores=True,
                            return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences_scores, reference_sequence_logprobs(reference, out.sequences, 7), rtol=0,
                               atol=0.1)


def test_sampling_draws_from_the_references_distribution(pair):
    """Sampled tokens route where greedy ones never go: each step's logits equal the reference's after the drawn
    prefix (but for one step a row, where a near-tied router may choose another expert), a padded batch of 2, two
    seeds."""
    reference, compiled = pair
    ids, mask = padded_batch([_prompt(9, 1), _prompt(4, 2)])
    for seed in range(2):
        torch.manual_seed(seed)
        out = compiled.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=4,
                                output_logits=True, return_dict_in_generate=True)
        assert_draws_from_reference_logits(reference, ids, mask, out, 4, routing_flips=1)


def test_explain_says_what_was_left_alone(pair):
    _, compiled = pair
    text = tilefx.explain(compiled)
    layers = compiled.config.num_hidden_layers
    mla = adapter_for(compiled.config).mla
    if mla:  # DeepSeek: the attention pass leaves the latent attention to the MLA pass, which absorbs it
        assert text.count("left for the MLA pass") == 2 * layers
        assert "tilefx.decode_attention" not in text
        assert f"tilefx.mla_attention x{layers}" in text
    else:
        assert f"tilefx.decode_attention x{layers}" in text
    moe_layers = len(adapter_for(compiled.config).moe_layers(compiled.config))
    router_op = adapter_for(compiled.config).routing(compiled.config).op
    for phase in compiled.tilefx.report.graphs:  # prefill and decode: every MoE block through tilefx ops
        assert phase.tilefx_ops.get("tilefx.fused_moe") == moe_layers, phase.tilefx_ops
        assert phase.tilefx_ops.get(f"tilefx.{router_op}") == moe_layers, phase.tilefx_ops
        if mla:  # prefill: one op that runs the absorbed steps or the expanded form; decode: the absorbed steps
            mla_op = "tilefx.mla_prefill" if phase.phase == "prefill" else "tilefx.mla_attention"
            assert phase.tilefx_ops.get(mla_op) == layers, phase.tilefx_ops
            assert phase.tilefx_ops.get("tilefx.linear_float") == moe_layers, phase.tilefx_ops  # fp32 routers
