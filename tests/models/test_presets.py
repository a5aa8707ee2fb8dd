"""Presets: random models of real architectures that spend a prompt's work where a trained model does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from tilefx.models.presets import PRESETS, _query_sources, _scale_queries, build_model, get_preset


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_query_sources_are_one_module_a_layer(preset):
    """Each layer's query scale is set by one module: Qwen3's q_norm (after q_proj), MLA's q_b_proj where the query
    is compressed, else q_proj."""
    config = get_preset(preset).build_config(layers=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    expected = "q_norm" if "qwen3" in config.model_type else "q_b_proj" if getattr(config, "q_lora_rank", None) \
        else "q_proj"
    attention = [layer.self_attn for layer in model.model.layers]
    assert _query_sources(model) == [getattr(module, expected) for module in attention]


def test_scale_queries_scales_each_query_and_nothing_else():
    """_scale_queries multiplies each layer's whole query (Qwen2's q_proj: weight and bias) and no other weight."""
    model = build_model("tiny-qwen2")
    layers = model.model.layers
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.q_proj.bias.normal_()  # (HF's init leaves them 0)
        queries = [layer.self_attn.q_proj(x) for layer in layers]
        others = {name: p.clone() for name, p in model.named_parameters() if ".q_proj." not in name}
        _scale_queries(model, 4.0)
        for layer, query in zip(layers, queries):
            torch.testing.assert_close(layer.self_attn.q_proj(x), 4 * query)
    assert all(torch.equal(p, others[name]) for name, p in model.named_parameters() if name in others)


def test_a_presets_query_scale_is_applied_at_build(monkeypatch):
    """build_model gives a preset with query_scale the same weights as the preset without it, queries scaled."""
    scaled_by_hand = build_model("tiny-qwen2")
    with torch.no_grad():
        _scale_queries(scaled_by_hand, 4.0)
    monkeypatch.setitem(PRESETS, "tiny-qwen2", dataclasses.replace(PRESETS["tiny-qwen2"], query_scale=4.0))
    built = build_model("tiny-qwen2")
    assert all(torch.equal(a, b) for a, b in zip(scaled_by_hand.parameters(), built.parameters()))


def test_moe_preset_spreads_a_prompt_over_its_experts():
    """Qwen3-30B-A3B's first layer routes a 512-token random prompt over all 128 experts, none with 3x the mean's
    rows (1.8x; a trained router's spread). At HF's init (query_scale 1) its near-uniform attention sent the same
    prompt to 123 experts with up to 6.1x the mean's rows (coefficient of variation 1.09 against 0.27 here)."""
    assert get_preset("qwen3-30b-a3b").query_scale == 4.0
    model = build_model("qwen3-30b-a3b", layers=1)
    router = model.model.layers[0].mlp.gate
    chosen = []
    router.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
    torch.manual_seed(2)
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, 512)))
    rows = torch.bincount(chosen[0].flatten(), minlength=128).float()
    assert bool((rows > 0).all()), f"{int((rows == 0).sum())} experts got no rows"
    assert float(rows.std() / rows.mean()) < 0.5 and float(rows.max()) < 3 * float(rows.mean()), rows.tolist()
