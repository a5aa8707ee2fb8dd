"""Family adapters: a declarative description of each supported HF model family.

Adding a family means adding a row to ``ADAPTERS``, not editing passes. An adapter
names the HF classes that hold the regions the passes rewrite, the config fields
that give the attention dims, and what is special about the family's attention.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FamilyAdapter:
    model_type: str
    causal_lm_class: str
    attention_class: str
    decoder_layer_class: str
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k heads before RoPE (Qwen3)

    def attention_dims(self, config) -> dict[str, int]:
        heads = config.num_attention_heads
        return {
            "layers": config.num_hidden_layers,
            "q_heads": heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        }

    def tp_plan(self, config) -> dict[str, str]:
        return dict(getattr(config, "base_model_tp_plan", None) or {})


ADAPTERS: dict[str, FamilyAdapter] = {
    adapter.model_type: adapter
    for adapter in (
        FamilyAdapter("llama", "LlamaForCausalLM", "LlamaAttention", "LlamaDecoderLayer"),
        FamilyAdapter("qwen2", "Qwen2ForCausalLM", "Qwen2Attention", "Qwen2DecoderLayer", qkv_bias=True),
        FamilyAdapter("qwen3", "Qwen3ForCausalLM", "Qwen3Attention", "Qwen3DecoderLayer", qk_norm=True),
    )
}


def adapter_for(config) -> FamilyAdapter:
    model_type = getattr(config, "model_type", None)
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        raise ValueError(
            f"model_type {model_type!r} is not supported by tilefx; supported: {', '.join(sorted(ADAPTERS))}"
        )
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError(f"{model_type} with use_sliding_window=True is not supported by tilefx yet")
    return adapter
