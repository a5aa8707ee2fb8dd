"""Packing as the weights load: what the plan packs how, per family and options; sources released."""

from __future__ import annotations

import pytest
import torch

from tilefx.compiler import CompileOptions
from tilefx.custom_ops import weights
from tilefx.models.adapters import adapter_for
from tilefx.models.packing import narrow_exact_routers, pack_model, plan
from tilefx.models.presets import build_model


def _groups(model, **options):
    parts = plan(model, adapter_for(model.config), CompileOptions(**options))
    return {(g.layout, g.names) for _, groups in parts for g in groups}


def test_dense_plan_fuses_siblings_and_gate_up_per_layer():
    model = build_model("tiny-llama")
    groups = _groups(model)
    layer = "model.layers.0"
    assert ("linear", tuple(f"{layer}.self_attn.{p}_proj.weight" for p in "qkv")) in groups
    assert ("gate_up", (f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight")) in groups
    assert ("linear", (f"{layer}.self_attn.o_proj.weight",)) in groups and ("linear", ("lm_head.weight",)) in groups
    assert len(groups) == 4 * model.config.num_hidden_layers + 1
    parts = [part for part, _ in plan(model, adapter_for(model.config), CompileOptions())]
    assert parts == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)] + ["model"]


def test_plan_follows_the_options():
    model = build_model("tiny-llama")
    assert all(len(names) == 1 for _, names in _groups(model, fuse_linears=False))
    assert len(_groups(model, fuse_linears=False)) == 7 * model.config.num_hidden_layers + 1
    assert _groups(model, linear=False) == set()
    model.float()
    assert _groups(model) == set()  # can_pack: bf16 only


def test_moe_and_mla_plans():
    qwen = _groups(build_model("tiny-qwen2-moe"))
    block = "model.layers.0.mlp"
    assert ("expert_gate_up", (f"{block}.experts.gate_up_proj",)) in qwen
    assert ("expert_down", (f"{block}.experts.down_proj",)) in qwen
    assert ("gate_up", (f"{block}.shared_expert.gate_proj.weight", f"{block}.shared_expert.up_proj.weight")) in qwen
    assert ("linear", (f"{block}.gate.weight",)) in qwen
    assert ("linear", (f"{block}.shared_expert_gate.weight",)) in qwen
    assert not any("experts" in n for _, names in _groups(build_model("tiny-qwen2-moe"), moe=False) for n in names)

    deepseek = _groups(build_model("tiny-deepseek-v3"))
    attention = "model.layers.0.self_attn"
    assert ("linear", (f"{attention}.q_a_proj.weight", f"{attention}.kv_a_proj_with_mqa.weight")) in deepseek
    assert not any("kv_b_proj" in n for _, names in deepseek for n in names)  # the MLA pass absorbs it
    assert any("kv_b_proj" in n for _, names in _groups(build_model("tiny-deepseek-v3"), mla=False)
               for n in names)


def test_routers_held_in_fp32_go_back_to_bf16_only_when_exact():
    """transformers 5.24 holds DeepSeek's router weights in fp32; the hub ships them in bf16."""
    model = build_model("tiny-deepseek-v2")
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    for router in routers:
        router.weight.data = router.weight.data.float()  # as transformers 5.24 loads a hub checkpoint
    exact = routers[0].weight.detach().clone()
    with torch.no_grad():
        routers[-1].weight.add_(torch.rand_like(routers[-1].weight) * 1e-4 + 1e-6)  # fp32 values bf16 cannot hold
    assert narrow_exact_routers(model, adapter_for(model.config)) == len(routers) - 1
    assert routers[0].weight.dtype == torch.bfloat16 and torch.equal(routers[0].weight.float(), exact)
    assert routers[-1].weight.dtype == torch.float32


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-mixtral", "tiny-deepseek-v2"])
def test_pack_model_releases_every_source_and_round_trips(family):
    model, fresh = build_model(family, seed=2), build_model(family, seed=2)
    for m in (model, fresh):
        # pack_model's first step, so that the plan of `fresh` is the one it packs
        narrow_exact_routers(m, adapter_for(m.config))
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    summary = pack_model(model, adapter_for(model.config), CompileOptions(), progress=False)
    planned = [g for _, groups in plan(fresh, adapter_for(fresh.config), CompileOptions()) for g in groups]
    assert summary.tensors == len(planned)
    assert summary.released_bytes == sum(reference[n].nbytes for g in planned for n in g.names)
    params = dict(model.named_parameters())
    for group in planned:
        names = group.names
        packed = weights.packed_copy(params[names[0]])
        assert all(weights.is_released(params[n]) for n in names)
        sources = [reference[n] for n in names]
        if group.layout == "linear":
            want = torch.cat(sources)
            assert torch.equal(weights.unpack_linear_weight(packed, *want.shape), want)
        elif group.layout == "gate_up":
            assert all(torch.equal(a, b) for a, b in zip(weights.unpack_gate_up_weight(packed, *sources[0].shape),
                                                          sources))
        elif group.layout == "expert_gate_up":
            assert torch.equal(weights.unpack_expert_gate_up_weight(packed, sources[0].shape[2]), sources[0])
        else:
            assert torch.equal(weights.unpack_expert_down_weight(packed, *sources[0].shape[1:]), sources[0])
    untouched = [n for n in params if not weights.packings_of(params[n])]
    assert untouched and all(torch.equal(params[n], reference[n]) for n in untouched)  # norms, embeddings



def _tied_tiny_llama(seed=5):
    model = build_model("tiny-llama", seed=seed)
    model.lm_head.weight = model.model.embed_tokens.weight  # as Llama-3.2-1B ties them
    model.config.tie_word_embeddings = True
    return model


@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 5)])
def test_passes_read_the_load_time_packings_and_match_eager(batch, seq):
    """Packed at load (q/k/v fused, gate/up, a tied lm_head whose embedding lookup reads the packed copy):
    the attention and linear passes run over those packings and the logits equal eager's."""
    from helpers import PassTestBackend, count, is_op, run

    from tilefx.compiler.passes.attention import AttentionPass
    from tilefx.compiler.passes.linear import LinearPass
    from tilefx.models.kv_cache import TilefxCache

    torch._dynamo.reset()
    model = _tied_tiny_llama()
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    pack_model(model, adapter_for(model.config), CompileOptions(), progress=False)
    assert weights.is_released(model.model.embed_tokens.weight)
    backend = PassTestBackend(AttentionPass(), LinearPass())
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=2, max_seq_len=32)
    cache.start(batch)
    got = run(model, cache, ids, backend)
    after, layers = backend.after[0], model.config.num_hidden_layers
    assert count(after, is_op("packed_embedding")) == 1
    assert count(after, lambda n: n.target is torch.nn.functional.embedding) == 0
    assert count(after, is_op("linear_silu_mul")) == layers and count(after, is_op("linear")) == 3 * layers + 1
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_a_released_weight_read_unpacked_is_an_error():
    """Without the linear pass the graph would multiply by packed-order values: the pass manager refuses."""
    from helpers import PassTestBackend, run

    from tilefx.compiler.pass_manager import check_released_weights_read_packed
    from tilefx.compiler.passes.attention import AttentionPass
    from tilefx.models.kv_cache import TilefxCache

    torch._dynamo.reset()
    model = build_model("tiny-llama", seed=5)
    pack_model(model, adapter_for(model.config), CompileOptions(), progress=False)
    backend = PassTestBackend(AttentionPass(), check_released_weights_read_packed)
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=1, max_seq_len=32)
    cache.start(1)
    with pytest.raises(Exception, match="packed at load"):
        run(model, cache, torch.randint(3, 500, (1, 4)), backend)
