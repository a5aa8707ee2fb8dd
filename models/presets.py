"""Presets: real architectures with random weights.

There is no hub access on the development machines, and decode cost does not
depend on weight values, so benchmarks build these from their published configs.
Each can be cut to fewer layers (``layers=N``). The ``tiny-*`` presets keep each
family's features (GQA, llama3 RoPE, qkv bias, q/k norm) at test size, with a
large init so greedy logits are well separated.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    hf_id: str  # the published model whose architecture this is
    model_type: str
    config: dict
    logit_scale: float = 1.0  # multiplies lm_head after init: test models get well-separated logits

    def build_config(self, layers: int | None = None) -> PretrainedConfig:
        fields = dict(self.config)
        if layers is not None:
            if not 1 <= layers <= fields["num_hidden_layers"]:
                raise ValueError(f"layers={layers}: {self.name} has 1..{fields['num_hidden_layers']} layers")
            fields["num_hidden_layers"] = layers
        return AutoConfig.for_model(self.model_type, **fields)


def _dense(hidden, inter, layers, heads, kv, head_dim, **family):
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=True,
        **family,
    )


_LLAMA3 = dict(
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters=_LLAMA3_ROPE,
    bos_token_id=128000,
    eos_token_id=128001,
)
_QWEN = dict(
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters=_QWEN_ROPE,
    bos_token_id=151643,
    eos_token_id=151643,
)


def _tiny(model_type: str, **extra) -> dict:
    return dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "llama", _dense(2048, 8192, 16, 32, 8, 64, **_LLAMA3)),
        Preset("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "llama", _dense(3072, 8192, 28, 24, 8, 128, **_LLAMA3)),
        Preset("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", "qwen2", _dense(1536, 8960, 28, 12, 2, 128, **_QWEN)),
        Preset("qwen3-1.7b", "Qwen/Qwen3-1.7B", "qwen3", _dense(2048, 6144, 28, 16, 8, 128, **_QWEN)),
        Preset(
            "tiny-llama",
            "-",
            "llama",
            _tiny("llama", rope_parameters=dict(_LLAMA3_ROPE, original_max_position_embeddings=1024)),
            logit_scale=16.0,
        ),
        Preset("tiny-qwen2", "-", "qwen2", _tiny("qwen2", rope_parameters=_QWEN_ROPE), logit_scale=16.0),
        Preset("tiny-qwen3", "-", "qwen3", _tiny("qwen3", rope_parameters=_QWEN_ROPE), logit_scale=16.0),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}") from None


def build_model(name: str, *, layers: int | None = None, dtype=torch.bfloat16, seed: int = 0):
    """A randomly initialized model of preset ``name`` (same seed, same weights)."""
    preset = get_preset(name)
    config = preset.build_config(layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if preset.logit_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(preset.logit_scale)
    return model.eval()
