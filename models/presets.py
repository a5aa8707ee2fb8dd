"""Presets: real architectures with random weights.

There is no hub access on the development machines, and decode cost does not
depend on weight values, so benchmarks build these from their published configs
(``config.json`` of the hub id named in each row). Each can be cut to fewer layers
(``layers=N``). The ``tiny-*`` presets keep each family's features (GQA, llama3
RoPE, qkv bias, q/k norm; MoE routing rules, shared experts, dense first layers,
MLA) at test size, with a large init so greedy logits are well separated.
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
    # DeepSeek-V3 routers: HF initializes e_score_correction_bias to zeros, trained models
    # have nonzero biases that change which experts are chosen; tests draw them N(0, std).
    correction_bias_std: float = 0.0
    # Multiplies each attention layer's queries after init. At HF's init a random model's attention is near
    # uniform: every token takes in the prompt's mean, which grows to most of each token's hidden state (72-86% of
    # its energy in Qwen3-30B-A3B's layers 1-3), so a MoE router sends a whole prompt to the same few experts (40 of
    # 128 used, the busiest with 15x the mean's rows). A trained model's attention picks out a few keys and its
    # router is trained to spread a prompt; with the queries 4x, a prompt's tokens spread over every expert (the
    # busiest 2-3x the mean), so a prefill reads and multiplies what a trained model's does.
    query_scale: float = 1.0

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


def _moe(hidden, inter, layers, heads, kv, vocab, **family):
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=False,
        **family,
    )


# Qwen/Qwen1.5-MoE-A2.7B: 60 routed experts (4 per token, not renormalized) + one shared
# expert of 4 x 1408 behind a sigmoid gate, in every layer.
_QWEN1_5_MOE = dict(
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_parameters=_QWEN_ROPE,
    bos_token_id=151643,
    eos_token_id=151643,
    num_experts=60,
    num_experts_per_tok=4,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632,
    norm_topk_prob=False,
    decoder_sparse_step=1,
)
# Qwen/Qwen3-30B-A3B: 128 experts, 8 per token, renormalized, no shared expert.
_QWEN3_MOE = dict(
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters=_QWEN_ROPE,
    bos_token_id=151643,
    eos_token_id=151645,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    decoder_sparse_step=1,
)
# mistralai/Mixtral-8x7B-v0.1: 8 experts of 14336, 2 per token.
_MIXTRAL = dict(
    head_dim=128,
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    bos_token_id=1,
    eos_token_id=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=None,
)
# deepseek-ai/DeepSeek-V2-Lite: MLA without q compression, 64 routed experts (6 per token,
# greedy, softmax) + 2 shared, layer 0 dense, YaRN RoPE.
_DEEPSEEK_V2_LITE = dict(
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    moe_intermediate_size=1408,
    first_k_dense_replace=1,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    bos_token_id=100000,
    eos_token_id=100001,
)
# moonshotai/Moonlight-16B-A3B (deepseek_v3 architecture): MLA without q compression,
# 64 routed experts (6 per token, sigmoid "noaux_tc", renormalized, x2.446) + 2 shared,
# layer 0 dense.
_MOONLIGHT = dict(
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    moe_intermediate_size=1408,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.446,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    bos_token_id=163584,
    eos_token_id=163585,
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


def _tiny_mla(model_type: str, **extra) -> dict:
    """Tiny DeepSeek: MLA (kv heads = heads; q/k 16 + 16 wide, v 16; the native MLA kernel takes
    multiples of 16), shared experts."""
    fields = _tiny(model_type, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                   n_shared_experts=1, **extra)
    fields.update(num_key_value_heads=fields["num_attention_heads"])
    del fields["head_dim"]  # DeepSeek configs derive it (qk_rope_head_dim)
    return fields


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "llama", _dense(2048, 8192, 16, 32, 8, 64, **_LLAMA3)),
        Preset("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "llama", _dense(3072, 8192, 28, 24, 8, 128, **_LLAMA3)),
        Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "llama",
               dict(_dense(4096, 14336, 32, 32, 8, 128, **_LLAMA3), tie_word_embeddings=False,
                    rope_parameters=dict(_LLAMA3_ROPE, factor=8.0))),
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
        # one KV head (multi-query attention): a tensor-parallel split replicates it
        Preset("tiny-qwen2-mqa", "-", "qwen2", dict(_tiny("qwen2", rope_parameters=_QWEN_ROPE), num_key_value_heads=1),
               logit_scale=16.0),
        Preset("tiny-qwen3", "-", "qwen3", _tiny("qwen3", rope_parameters=_QWEN_ROPE), logit_scale=16.0),
        # inputs of whole 128-wide groups, as 4-bit checkpoints (GPTQ / AWQ, group_size 128) need them, also
        # split two ways (tensor parallel)
        Preset("tiny-llama-w256", "-", "llama",
               dict(_tiny("llama", rope_parameters=dict(_LLAMA3_ROPE, original_max_position_embeddings=1024)),
                    hidden_size=256, intermediate_size=512, head_dim=64),
               logit_scale=16.0),
        Preset("qwen1.5-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", "qwen2_moe",
               _moe(2048, 5632, 24, 16, 16, 151936, **_QWEN1_5_MOE), query_scale=4.0),
        Preset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "qwen3_moe", _moe(2048, 6144, 48, 32, 4, 151936, **_QWEN3_MOE),
               query_scale=4.0),
        Preset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", "mixtral",
               _moe(4096, 14336, 32, 32, 8, 32000, **_MIXTRAL), query_scale=4.0),
        Preset("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", "deepseek_v2",
               _moe(2048, 10944, 27, 16, 16, 102400, **_DEEPSEEK_V2_LITE), query_scale=4.0),
        Preset("moonlight-16b-a3b", "moonshotai/Moonlight-16B-A3B", "deepseek_v3",
               _moe(2048, 11264, 27, 16, 16, 163840, **_MOONLIGHT), query_scale=4.0),
        Preset(
            "tiny-qwen2-moe",
            "-",
            "qwen2_moe",
            _tiny("qwen2_moe", rope_parameters=_QWEN_ROPE, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=64, shared_expert_intermediate_size=64, norm_topk_prob=False),
            logit_scale=16.0,
        ),
        Preset(
            "tiny-qwen3-moe",
            "-",
            "qwen3_moe",
            _tiny("qwen3_moe", rope_parameters=_QWEN_ROPE, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=64, norm_topk_prob=True),
            logit_scale=16.0,
        ),
        Preset(  # 4-bit checkpoints' whole 128-wide groups (as tiny-llama-w256)
            "tiny-qwen3-moe-w256",
            "-",
            "qwen3_moe",
            dict(_tiny("qwen3_moe", rope_parameters=_QWEN_ROPE, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=256, norm_topk_prob=True), hidden_size=256, intermediate_size=512,
                 head_dim=64),
            logit_scale=16.0,
        ),
        Preset(
            "tiny-mixtral",
            "-",
            "mixtral",
            _tiny("mixtral", rope_parameters=_QWEN_ROPE, num_local_experts=4, num_experts_per_tok=2),
            logit_scale=16.0,
        ),
        Preset(  # group-limited greedy: 4 groups of 2 experts, the best 2 groups, YaRN as V2-Lite
            "tiny-deepseek-v2",
            "-",
            "deepseek_v2",
            _tiny_mla("deepseek_v2", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
                      first_k_dense_replace=0,
                      rope_parameters=dict(_DEEPSEEK_V2_LITE["rope_parameters"], factor=4.0,
                                           original_max_position_embeddings=1024)),
            logit_scale=16.0,
        ),
        Preset(  # noaux_tc over 4 groups of 4 experts, the best 2 groups; q compression; layer 0 dense
            "tiny-deepseek-v3",
            "-",
            "deepseek_v3",
            _tiny_mla("deepseek_v3", q_lora_rank=32, n_routed_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=64, n_group=4, topk_group=2, norm_topk_prob=True,
                      routed_scaling_factor=2.5, first_k_dense_replace=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
            logit_scale=16.0,
            correction_bias_std=0.05,
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}") from None


def _query_sources(model) -> list[torch.nn.Module]:
    """The module that sets each attention layer's query scale: the query's norm where it has one (Qwen3's
    ``q_norm``, after its projection), else the projection that makes the query (MLA's ``q_b_proj`` after its
    compression, else ``q_proj``)."""
    sources = []
    for module in model.modules():
        source = next((getattr(module, name) for name in ("q_norm", "q_b_proj", "q_proj")
                       if isinstance(getattr(module, name, None), torch.nn.Module)), None)
        if source is not None:
            sources.append(source)
    return sources


def _scale_queries(model, scale: float) -> None:
    """Multiplies each attention layer's query by ``scale`` (``_query_sources``: the weight, and the bias where
    there is one)."""
    sources = _query_sources(model)
    if len(sources) != model.config.num_hidden_layers:
        raise ValueError(f"found {len(sources)} query modules to scale in {type(model).__name__}, expected one a "
                         f"layer ({model.config.num_hidden_layers})")
    for source in sources:
        source.weight.mul_(scale)
        if getattr(source, "bias", None) is not None:
            source.bias.mul_(scale)


def build_model(name: str, *, layers: int | None = None, dtype=torch.bfloat16, seed: int = 0):
    """A randomly initialized model of preset ``name`` (same seed, same weights)."""
    preset = get_preset(name)
    config = preset.build_config(layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        if preset.logit_scale != 1.0:
            model.get_output_embeddings().weight.mul_(preset.logit_scale)
        if preset.query_scale != 1.0:
            _scale_queries(model, preset.query_scale)
        # What loading a hub checkpoint (every weight shipped in bf16) gives: transformers 5.24 holds
        # DeepSeek's router weights in fp32 (_keep_in_fp32_modules_strict), as fp32 copies of bf16 values.
        if dtype != torch.float32:
            for param in model.parameters():
                if param.dtype == torch.float32 and param.dim() == 2:
                    param.copy_(param.to(dtype).float())
        if preset.correction_bias_std:
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(torch.randn(buffer.shape) * preset.correction_bias_std)
    return model.eval()
