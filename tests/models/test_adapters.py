"""Family adapters describe the HF models they name: classes, sparse layers, expert and cache dims."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tilefx.models.adapters import ADAPTERS, adapter_for
from tilefx.models.presets import PRESETS, get_preset

MOE_PRESETS = [name for name, preset in PRESETS.items() if ADAPTERS[preset.model_type].moe is not None]


def _meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@pytest.mark.parametrize("model_type", sorted(ADAPTERS))
def test_named_classes_exist(model_type):
    adapter = ADAPTERS[model_type]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    names = [adapter.causal_lm_class, adapter.attention_class, adapter.decoder_layer_class]
    if adapter.moe is not None:
        names += [adapter.moe.block_class, adapter.moe.router_class, adapter.moe.experts_class]
    for name in names:
        assert hasattr(module, name), f"{model_type}: transformers has no {name}"


@pytest.mark.parametrize("preset", [name for name in PRESETS if name.startswith("tiny")])
def test_structure_names_the_model_modules(preset):
    """The adapter's paths (layers, embedding, lm_head, KV linears, MoE blocks, tensor-parallel extras) name modules
    the HF model has."""
    config = get_preset(preset).build_config()
    adapter = adapter_for(config)
    model = _meta_model(config)
    modules = dict(model.named_modules())
    layers = modules[adapter.layers]
    assert isinstance(layers, torch.nn.ModuleList) and len(layers) == config.num_hidden_layers
    assert type(layers[0]).__name__ == adapter.decoder_layer_class
    assert isinstance(modules[adapter.embedding], torch.nn.Embedding) and modules[adapter.embedding] is (
        model.get_input_embeddings())
    assert modules[adapter.lm_head] is model.get_output_embeddings()
    assert type(modules[adapter.base_model]).__name__ == type(model.base_model).__name__
    attention = next(m for m in layers[0].modules() if type(m).__name__ == adapter.attention_class)
    if adapter.mla:
        assert isinstance(getattr(attention, adapter.mla_absorbed), torch.nn.Linear)
    else:
        assert all(isinstance(getattr(attention, name), torch.nn.Linear) for name in adapter.kv_linears)
    for path, block in adapter.moe_blocks(config).items():
        assert type(modules[path]).__name__ == adapter.moe.block_class
        assert type(modules[block.experts]).__name__ == adapter.moe.experts_class
        assert type(modules[block.router]).__name__ == adapter.moe.router_class
    # every tensor-parallel extra names a module or parameter of some layer (the experts' fused gate_up_proj and
    # down_proj are parameters; DeepSeek's q_proj or q_b_proj: one of the two)
    in_layers = {name for layer in layers for name, _ in (*layer.named_modules(), *layer.named_parameters())}
    missing = [pattern for pattern, _ in adapter.tp_extras if pattern not in in_layers]
    assert missing in ([], ["self_attn.q_proj"], ["self_attn.q_b_proj"]), missing


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_moe_dims_and_sparse_layers_match_the_model(preset):
    config = get_preset(preset).build_config(layers=None if preset.startswith("tiny") else 4)
    adapter = adapter_for(config)
    model = _meta_model(config)
    sparse = [i for i, layer in enumerate(model.model.layers) if type(layer.mlp).__name__ == adapter.moe.block_class]
    assert sparse == adapter.moe_layers(config) and sparse
    dims = adapter.moe_dims(config)
    block = model.model.layers[sparse[0]].mlp
    experts, hidden, intermediate = dims["num_experts"], dims["hidden"], dims["intermediate"]
    assert type(block.gate).__name__ == adapter.moe.router_class
    assert type(block.experts).__name__ == adapter.moe.experts_class
    assert block.experts.gate_up_proj.shape == (experts, 2 * intermediate, hidden)
    assert block.experts.down_proj.shape == (experts, hidden, intermediate)
    assert adapter.routing(config).top_k == dims["top_k"] == config.num_experts_per_tok
    if adapter.moe.shared_experts == "none":
        assert adapter.moe.shared_module is None and dims["shared_intermediate"] == 0
    else:
        shared = getattr(block, adapter.moe.shared_module)
        assert shared.gate_proj.weight.shape == (dims["shared_intermediate"], hidden)
        assert hasattr(block, "shared_expert_gate") == (adapter.moe.shared_experts == "sigmoid_gated")


@pytest.mark.parametrize("overrides,sparse", [
    (dict(decoder_sparse_step=2), [1, 3]),
    (dict(mlp_only_layers=[0, 2]), [1, 3]),
    (dict(decoder_sparse_step=2, mlp_only_layers=[1]), [3]),
])
def test_qwen_sparse_layer_rule(overrides, sparse):
    preset = get_preset("tiny-qwen2-moe")
    config = AutoConfig.for_model(preset.model_type, **dict(preset.config, num_hidden_layers=4, **overrides))
    assert adapter_for(config).moe_layers(config) == sparse
    model = _meta_model(config)
    assert [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")] == sparse


@pytest.mark.parametrize("preset", ["tiny-deepseek-v2", "deepseek-v2-lite", "moonlight-16b-a3b"])
def test_mla_cache_holds_the_latent_and_the_rope_key(preset):
    config = get_preset(preset).build_config(layers=2)
    adapter = adapter_for(config)
    assert adapter.mla
    attention = adapter.attention_dims(config)
    assert attention["head_dim"] == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert attention["v_head_dim"] == config.v_head_dim and attention["kv_heads"] == config.num_attention_heads
    assert adapter.cache_dims(config) == {"layers": 2, "kv_heads": 1, "k_head_dim": config.kv_lora_rank,
                                          "v_head_dim": config.qk_rope_head_dim}
    assert adapter.mla_dims(config)["kv_lora_rank"] == config.kv_lora_rank


def test_published_routing_of_the_real_presets():
    routing = {name: adapter_for(c).routing(c) for name in MOE_PRESETS if not name.startswith("tiny")
               for c in [get_preset(name).build_config(layers=1)]}
    assert routing["qwen3-30b-a3b"].top_k == 8 and routing["qwen3-30b-a3b"].renormalize
    assert routing["qwen1.5-moe-a2.7b"].top_k == 4 and not routing["qwen1.5-moe-a2.7b"].renormalize
    assert routing["mixtral-8x7b"].top_k == 2 and routing["mixtral-8x7b"].renormalize
    lite = routing["deepseek-v2-lite"]
    assert (lite.op, lite.top_k, lite.num_expert_group, lite.scoring_func, lite.renormalize) == (
        "grouped_topk", 6, 1, "softmax", False)
    moonlight = routing["moonlight-16b-a3b"]
    assert (moonlight.scoring_func, moonlight.correction_bias, moonlight.renormalize) == ("sigmoid", True, True)
    assert moonlight.routed_scaling_factor == pytest.approx(2.446)


def test_unsupported_moe_settings_fail_with_what_to_do():
    config = get_preset("tiny-mixtral").build_config()
    config.sliding_window = 4096
    with pytest.raises(ValueError, match="sliding_window=4096.*null"):
        adapter_for(config)
    config = get_preset("tiny-qwen3-moe").build_config()
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'.*SiLU"):
        adapter_for(config)
