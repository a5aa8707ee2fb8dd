"""Presets: random models of real architectures that spend a prompt's work where a trained model does."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tilefx.models.presets import PRESETS, _query_weights, build_model, get_preset


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_query_weights_are_one_module_a_layer(preset):
    """Each layer's query scale is set by one module: Qwen3's q_norm (after q_proj), MLA's q_b_proj where the query
    is compressed, else q_proj and its bias."""
    config = get_preset(preset).build_config(layers=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    weights = _query_weights(model)
    owners = {name.rsplit(".", 2)[-2] for name, tensor in model.named_parameters()
              if any(tensor is weight for weight in weights)}
    expected = "q_norm" if "qwen3" in config.model_type else "q_b_proj" if getattr(config, "q_lora_rank", None) \
        else "q_proj"
    assert owners == {expected}
    has_bias = getattr(getattr(model.model.layers[0].self_attn, expected), "bias", None) is not None
    assert len(weights) == 2 * (2 if has_bias else 1)


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
