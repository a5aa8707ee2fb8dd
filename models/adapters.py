"""Family adapters: a declarative description of each supported HF model family.

Adding a family means adding a row to ``ADAPTERS``, not editing passes. An adapter
names the HF classes that hold the regions the passes rewrite, the config fields
that give the attention dims, and what is special about the family's attention
(MLA) and MoE blocks: which rule routes tokens (``ROUTING_RULES``), which layers
are sparse (``SPARSE_LAYER_RULES``) and how shared experts are added. It also owns
the model's structure as the loader, packing and tensor parallelism see it: where
the decoder layers, the embedding and the ``lm_head`` live, what the checkpoint calls
a tensor that transformers renames on load, the per-expert checkpoint tensors the
fused experts are stacked from, and what tilefx splits beyond HF's tensor-parallel
plan. ``compile_model`` resolves it once (``adapter_for``) and passes it down.

What the rows describe is transformers 5.x (read on 5.24; tests/custom_ops/test_moe_ops.py
runs the installed version's routers and experts against tilefx's): every MoE block holds
its experts as fused 3-D parameters, ``experts.gate_up_proj [E, 2I, H]`` (gate rows
first, then up rows) and ``experts.down_proj [E, H, I]``; ``experts(x, ids, weights)``
computes ``sum_k weights[:, k] * down(silu(gate(x)) * up(x))`` for the ids the
router chose; the router (``block.gate``) returns ``(logits, weights, ids)``.
"""

from __future__ import annotations

import dataclasses

import torch

from tilefx.custom_ops.tuning import AttentionShape


@dataclasses.dataclass(frozen=True)
class Routing:
    """The arguments of the tilefx router op that computes exactly what a family's HF router computes.

    ``op`` is ``"topk_softmax"`` or ``"grouped_topk"`` (custom_ops/moe.py documents both);
    the remaining fields are that op's arguments. ``correction_bias``: selection adds the
    router's ``e_score_correction_bias`` buffer (DeepSeek-V3 "noaux_tc").
    ``weights_in_model_dtype``: HF rounds the routing weights to the model dtype (bf16)
    before the expert combine (Qwen-MoE); otherwise they stay fp32 (Mixtral, DeepSeek).
    """

    op: str
    top_k: int
    renormalize: bool
    num_expert_group: int = 1
    topk_group: int = 1
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    weights_in_model_dtype: bool = False

    def route(self, router_logits, correction_bias=None):
        """(topk_weights fp32 [T, k], topk_ids int32 [T, k]) for ``router_logits [T, E]``, through the tilefx op."""
        import tilefx.custom_ops  # noqa: F401  (defines the ops)

        if self.correction_bias != (correction_bias is not None):
            raise ValueError(
                f"routing with correction_bias={self.correction_bias} got "
                f"{'a' if correction_bias is not None else 'no'} correction bias tensor; pass the router's "
                f"e_score_correction_bias exactly when the family uses one"
            )
        if self.op == "topk_softmax":
            return torch.ops.tilefx.topk_softmax(router_logits, self.top_k, self.renormalize)
        return torch.ops.tilefx.grouped_topk(
            router_logits, correction_bias, self.top_k, self.num_expert_group, self.topk_group,
            self.scoring_func, self.renormalize, self.routed_scaling_factor,
        )


def _topk_softmax_routing(config) -> Routing:  # Qwen2-MoE, Qwen3-MoE: renormalize per config
    return Routing("topk_softmax", config.num_experts_per_tok, bool(config.norm_topk_prob), weights_in_model_dtype=True)


def _mixtral_routing(config) -> Routing:  # always renormalized, no config field
    return Routing("topk_softmax", config.num_experts_per_tok, True)


def _deepseek_v2_routing(config) -> Routing:
    # HF 5.x DeepseekV2TopkRouter never renormalizes (it ignores norm_topk_prob) and
    # groups only for topk_method "group_limited_greedy" (group score = max in group).
    if config.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(
            f"deepseek_v2 topk_method={config.topk_method!r}: transformers routes only 'greedy' and "
            f"'group_limited_greedy'; use one of those (or model_type deepseek_v3 for 'noaux_tc')"
        )
    grouped = config.topk_method == "group_limited_greedy"
    return Routing(
        "grouped_topk",
        config.num_experts_per_tok,
        renormalize=False,
        num_expert_group=config.n_group if grouped else 1,
        topk_group=config.topk_group if grouped else 1,
        routed_scaling_factor=float(config.routed_scaling_factor),
    )


def _deepseek_v3_routing(config) -> Routing:
    # HF 5.x DeepseekV3TopkRouter is always "noaux_tc": sigmoid scores, + e_score_correction_bias
    # for choosing only, groups scored by their two best biased scores (topk_method and
    # scoring_func in the config are not read).
    return Routing(
        "grouped_topk",
        config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob),
        num_expert_group=config.n_group,
        topk_group=config.topk_group,
        scoring_func="sigmoid",
        routed_scaling_factor=float(config.routed_scaling_factor),
        correction_bias=True,
    )


ROUTING_RULES = {
    "topk_softmax": _topk_softmax_routing,
    "mixtral": _mixtral_routing,
    "deepseek_v2": _deepseek_v2_routing,
    "deepseek_v3": _deepseek_v3_routing,
}


def _every_layer(config, layer: int) -> bool:
    return True


def _decoder_sparse_step(config, layer: int) -> bool:  # Qwen-MoE
    return (
        layer not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (layer + 1) % config.decoder_sparse_step == 0
    )


def _after_first_k_dense(config, layer: int) -> bool:  # DeepSeek: the first k layers keep a dense MLP
    return layer >= config.first_k_dense_replace


SPARSE_LAYER_RULES = {
    "every_layer": _every_layer,
    "decoder_sparse_step": _decoder_sparse_step,
    "first_k_dense_replace": _after_first_k_dense,
}


@dataclasses.dataclass(frozen=True)
class MoeBlock:
    """One sparse MoE block of a model, as the MoE pass needs it: module paths and the routing rule."""

    experts: str  # module path of the experts (``model.layers.3.mlp.experts``)
    router: str  # module path of the router (``model.layers.3.mlp.gate``)
    routing: Routing


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """A family's sparse MoE block (``decoder_layer.mlp`` on the layers the sparse-layer rule picks)."""

    block_class: str  # the sparse block: router ``gate`` + ``experts`` (+ shared experts)
    router_class: str  # ``gate``: forward(x) -> (logits, topk_weights, topk_ids)
    experts_class: str  # ``experts``: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    routing: str  # key of ROUTING_RULES
    sparse_layers: str  # key of SPARSE_LAYER_RULES
    num_experts_field: str  # config field holding the number of routed experts
    expert_size_field: str  # config field holding I, each routed expert's intermediate size
    # "none"; "added": block output += shared(x) (DeepSeek ``shared_experts``);
    # "sigmoid_gated": += sigmoid(shared_expert_gate(x)) * shared_expert(x) (Qwen2-MoE, gate is Linear(H, 1))
    shared_experts: str = "none"
    shared_module: str | None = None  # attribute of the block holding the shared MLP
    block_module: str = "mlp"  # attribute of the decoder layer holding the sparse block
    experts_module: str = "experts"  # attribute of the block holding the experts
    router_module: str = "gate"  # attribute of the block holding the router
    # Each expert's (gate, up, down) tensors in a per-expert checkpoint, relative to the experts module as the
    # checkpoint names it (after FamilyAdapter.checkpoint_renames); transformers stacks them into the fused 3-D
    # gate_up_proj / down_proj on load, and so does tensor-parallel shard loading (models/shard_loading.py).
    expert_keys: tuple[str, str, str] = ("{e}.gate_proj.weight", "{e}.up_proj.weight", "{e}.down_proj.weight")

    def shared_intermediate_size(self, config) -> int:
        if self.shared_experts == "none":
            return 0
        if self.shared_experts == "sigmoid_gated":
            return config.shared_expert_intermediate_size
        return config.moe_intermediate_size * config.n_shared_experts


@dataclasses.dataclass(frozen=True)
class FamilyAdapter:
    model_type: str
    causal_lm_class: str
    attention_class: str
    decoder_layer_class: str
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k heads before RoPE (Qwen3)
    # Multi-head latent attention (DeepSeek): q/k heads are qk_nope + qk_rope wide, values
    # v_head_dim; HF caches only the normalized latent (kv_lora_rank) and the rope key.
    mla: bool = False
    mla_absorbed: str = "kv_b_proj"  # with mla: the attention's linear the MLA pass absorbs per head
    moe: MoeSpec | None = None
    # Linears of one module that read the same input, packed as one weight (models/packing.py):
    # the first tuple whose names are all Linear children of a module applies to it.
    sibling_linears: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"),)
    # (gate, up) Linear children computed as silu(gate(x)) * up(x): packed interleaved for the epilogue.
    gated_linears: tuple[str, str] = ("gate_proj", "up_proj")
    # -- structure: module paths from the causal LM (the names its parameters carry) ----------------------------
    base_model: str = "model"  # HF's base_model_prefix: base_model_tp_plan's patterns are relative to it
    layers: str = "model.layers"  # the decoder layers (a ModuleList): packing goes layer by layer
    embedding: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    kv_linears: tuple[str, ...] = ("k_proj", "v_proj")  # attention linears whose rows are KV heads
    # (model name part, checkpoint name part): names transformers renames on load (its conversion mapping);
    # a reader of the files themselves (tensor-parallel shard loading) looks a tensor up under the checkpoint's.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # Tensor parallel beyond HF's base_model_tp_plan: (module pattern relative to a decoder layer, HF style),
    # used where the plan has no entry for it (models/tp.py).
    tp_extras: tuple[tuple[str, str], ...] = ()

    def attention_dims(self, config) -> dict[str, int]:
        """The attention's head counts and widths (``head_dim`` of q and k, ``v_head_dim`` of v)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if self.mla:
            head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
            return {"layers": config.num_hidden_layers, "q_heads": heads, "kv_heads": kv_heads,
                    "head_dim": head_dim, "v_head_dim": config.v_head_dim}
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return {"layers": config.num_hidden_layers, "q_heads": heads, "kv_heads": kv_heads,
                "head_dim": head_dim, "v_head_dim": head_dim}

    def cache_dims(self, config) -> dict[str, int]:
        """What the KV cache holds per layer and token: ``kv_heads`` x (``k_head_dim`` + ``v_head_dim``).

        MLA: HF writes the latent as a one-head "key" and the shared rope key as a one-head
        "value" (``past_key_values.update(kv_latent, k_rope)``), so that is what is stored.
        """
        if self.mla:
            return {"layers": config.num_hidden_layers, "kv_heads": 1,
                    "k_head_dim": config.kv_lora_rank, "v_head_dim": config.qk_rope_head_dim}
        dims = self.attention_dims(config)
        return {"layers": dims["layers"], "kv_heads": dims["kv_heads"],
                "k_head_dim": dims["head_dim"], "v_head_dim": dims["v_head_dim"]}

    def prefill_attention(self, config, mla: bool = True) -> AttentionShape | None:
        """The shape the prefill attention op sees (``config``: a tensor-parallel rank's local one), for
        tuning; None where the attention is HF's (an MLA family compiled with ``mla=False``)."""
        if self.mla:
            return AttentionShape("mla", config.num_attention_heads, 1, config.kv_lora_rank, config.qk_rope_head_dim,
                                  config.qk_nope_head_dim, config.v_head_dim) if mla else None
        dims = self.attention_dims(config)
        return AttentionShape("extend", dims["q_heads"], dims["kv_heads"], dims["head_dim"])

    def mla_dims(self, config) -> dict[str, int | None]:
        if not self.mla:
            raise ValueError(f"{self.model_type} has no multi-head latent attention")
        return {name: getattr(config, name) for name in
                ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}

    # -- MoE -------------------------------------------------------------------------------
    def moe_layers(self, config) -> list[int]:
        """Indices of the decoder layers whose MLP is the sparse MoE block (the others are dense)."""
        if self.moe is None:
            return []
        rule = SPARSE_LAYER_RULES[self.moe.sparse_layers]
        return [layer for layer in range(config.num_hidden_layers) if rule(config, layer)]

    def moe_blocks(self, config) -> dict[str, MoeBlock]:
        """Module path of each sparse MoE block -> its ``MoeBlock`` (empty for dense models)."""
        if self.moe is None:
            return {}
        routing, spec = self.routing(config), self.moe
        blocks = {}
        for layer in self.moe_layers(config):
            path = f"{self.layers}.{layer}.{spec.block_module}"
            blocks[path] = MoeBlock(f"{path}.{spec.experts_module}", f"{path}.{spec.router_module}", routing)
        return blocks

    def routing(self, config) -> Routing:
        if self.moe is None:
            raise ValueError(f"{self.model_type} has no MoE layers")
        return ROUTING_RULES[self.moe.routing](config)

    def moe_dims(self, config) -> dict[str, int]:
        """Routed experts ``num_experts`` x ``intermediate`` (I), ``top_k`` per token, shared MLP width."""
        if self.moe is None:
            raise ValueError(f"{self.model_type} has no MoE layers")
        return {
            "num_experts": getattr(config, self.moe.num_experts_field),
            "top_k": config.num_experts_per_tok,
            "hidden": config.hidden_size,
            "intermediate": getattr(config, self.moe.expert_size_field),
            "shared_intermediate": self.moe.shared_intermediate_size(config),
        }

    # -- structure ---------------------------------------------------------------------------
    def checkpoint_names(self, name: str) -> list[str]:
        """Where a checkpoint may hold model tensor (or module) ``name``: under that name, then under each name
        transformers renames on load (Mixtral's ``block_sparse_moe``)."""
        return [name, *(name.replace(model_part, checkpoint_part)
                        for model_part, checkpoint_part in self.checkpoint_renames if model_part in name)]

    def tp_plan(self, config) -> dict[str, str]:
        """Parameter-name pattern (``model.layers.*.self_attn.q_proj``) -> HF tensor-parallel style, in the order
        they are matched: HF's ``base_model_tp_plan``, the family's ``tp_extras`` where that has no entry, and
        tilefx's vocabulary split of the embedding and the ``lm_head``."""
        plan = {f"{self.base_model}.{pattern}": style
                for pattern, style in (getattr(config, "base_model_tp_plan", None) or {}).items()}
        for pattern, style in self.tp_extras:
            plan.setdefault(f"{self.layers}.*.{pattern}", style)
        plan.update({self.embedding: "vocab", self.lm_head: "colwise_gather_output"})
        return plan


# DeepSeek's attention reads hidden_states with the query (compressed or not) and the latent projections.
_MLA_SIBLINGS = (("q_a_proj", "kv_a_proj_with_mqa"), ("q_proj", "kv_a_proj_with_mqa"))
# DeepSeek-V3's plan has no attention entries: the heads split (q, or q_b after the compressed query, kv_b,
# o_proj), while q_a_proj, kv_a_proj_with_mqa and their norms stay whole, so every rank holds the whole latent.
_MLA_TP = (("self_attn.q_proj", "colwise"), ("self_attn.q_b_proj", "colwise"), ("self_attn.kv_b_proj", "colwise"),
           ("self_attn.o_proj", "rowwise"))


# The routed experts split within each expert, as HF's plans did until transformers 5.25 (from 5.25 they leave
# the experts to an expert-parallel plan, base_model_ep_plan): each expert's gate and up rows, its down columns.
_EXPERTS_TP = (("mlp.experts.gate_up_proj", "packed_colwise"), ("mlp.experts.down_proj", "rowwise"))


def _gated_mlp_tp(path: str) -> tuple[tuple[str, str], ...]:
    """A gated MLP at ``path`` split as HF's plans split the dense one (HF's plans leave shared experts whole)."""
    return ((f"{path}.gate_proj", "colwise"), (f"{path}.up_proj", "colwise"), (f"{path}.down_proj", "rowwise"))


ADAPTERS: dict[str, FamilyAdapter] = {
    adapter.model_type: adapter
    for adapter in (
        FamilyAdapter("llama", "LlamaForCausalLM", "LlamaAttention", "LlamaDecoderLayer"),
        FamilyAdapter("qwen2", "Qwen2ForCausalLM", "Qwen2Attention", "Qwen2DecoderLayer", qkv_bias=True),
        FamilyAdapter("qwen3", "Qwen3ForCausalLM", "Qwen3Attention", "Qwen3DecoderLayer", qk_norm=True),
        FamilyAdapter(
            "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeAttention", "Qwen2MoeDecoderLayer", qkv_bias=True,
            moe=MoeSpec("Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", "Qwen2MoeExperts", routing="topk_softmax",
                        sparse_layers="decoder_sparse_step", num_experts_field="num_experts",
                        expert_size_field="moe_intermediate_size", shared_experts="sigmoid_gated",
                        shared_module="shared_expert"),
            tp_extras=_EXPERTS_TP + _gated_mlp_tp("mlp.shared_expert"),
        ),
        FamilyAdapter(
            "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeAttention", "Qwen3MoeDecoderLayer", qk_norm=True,
            moe=MoeSpec("Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeExperts", routing="topk_softmax",
                        sparse_layers="decoder_sparse_step", num_experts_field="num_experts",
                        expert_size_field="moe_intermediate_size"),
            tp_extras=_EXPERTS_TP,
        ),
        FamilyAdapter(
            "mixtral", "MixtralForCausalLM", "MixtralAttention", "MixtralDecoderLayer",
            moe=MoeSpec("MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralExperts", routing="mixtral",
                        sparse_layers="every_layer", num_experts_field="num_local_experts",
                        expert_size_field="intermediate_size",
                        expert_keys=("{e}.w1.weight", "{e}.w3.weight", "{e}.w2.weight")),
            checkpoint_renames=((".mlp.", ".block_sparse_moe."),),
            tp_extras=_EXPERTS_TP,
        ),
        FamilyAdapter(
            "deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Attention", "DeepseekV2DecoderLayer", mla=True,
            sibling_linears=_MLA_SIBLINGS,
            moe=MoeSpec("DeepseekV2Moe", "DeepseekV2TopkRouter", "DeepseekV2Experts", routing="deepseek_v2",
                        sparse_layers="first_k_dense_replace", num_experts_field="n_routed_experts",
                        expert_size_field="moe_intermediate_size", shared_experts="added",
                        shared_module="shared_experts"),
            tp_extras=_MLA_TP + _EXPERTS_TP + _gated_mlp_tp("mlp.shared_experts"),
        ),
        FamilyAdapter(
            "deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Attention", "DeepseekV3DecoderLayer", mla=True,
            sibling_linears=_MLA_SIBLINGS,
            moe=MoeSpec("DeepseekV3MoE", "DeepseekV3TopkRouter", "DeepseekV3Experts", routing="deepseek_v3",
                        sparse_layers="first_k_dense_replace", num_experts_field="n_routed_experts",
                        expert_size_field="moe_intermediate_size", shared_experts="added",
                        shared_module="shared_experts"),
            tp_extras=_MLA_TP + _EXPERTS_TP + _gated_mlp_tp("mlp.shared_experts"),
        ),
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
    if model_type == "mixtral" and getattr(config, "sliding_window", None):
        raise ValueError(
            f"mixtral with sliding_window={config.sliding_window} is not supported by tilefx yet; "
            f"set sliding_window to null in config.json"
        )
    if adapter.moe is not None and getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"{model_type} with hidden_act={config.hidden_act!r}: tilefx's MoE experts are SiLU-gated only"
        )
    if adapter.moe is not None:
        adapter.routing(config)  # an unsupported router setting fails here, at load time
    return adapter
