"""Packing as the weights load: what the plan packs how, per family and options; sources released."""

from __future__ import annotations

import pytest
import torch

from tilefx.compiler import CompileOptions
from tilefx.custom_ops import weights
from tilefx.models.packing import pack_model, plan
from tilefx.models.presets import build_model


def _groups(model, **options):
    return {(g.layout, g.names) for _, groups in plan(model, CompileOptions(**options)) for g in groups}


def test_dense_plan_fuses_siblings_and_gate_up_per_layer():
    model = build_model("tiny-llama")
    groups = _groups(model)
    layer = "model.layers.0"
    assert ("linear", tuple(f"{layer}.self_attn.{p}_proj.weight" for p in "qkv")) in groups
    assert ("gate_up", (f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight")) in groups
    assert ("linear", (f"{layer}.self_attn.o_proj.weight",)) in groups and ("linear", ("lm_head.weight",)) in groups
    assert len(groups) == 4 * model.config.num_hidden_layers + 1
    parts = [part for part, _ in plan(model, CompileOptions())]
    assert parts == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)] + ["model"]


def test_plan_follows_the_options():
    model = build_model("tiny-llama")
    assert all(len(names) == 1 for _, names in _groups(model, fuse_linears=False))
    assert len(_groups(model, fuse_linears=False)) == 7 * model.config.num_hidden_layers + 1
    assert _groups(model, linear=False) == set() and _groups(model, freezing=False) == set()
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


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-mixtral", "tiny-deepseek-v2"])
def test_pack_model_releases_every_source_and_round_trips(family):
    model = build_model(family, seed=2)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    summary = pack_model(model, CompileOptions(), progress=False)
    planned = [g for _, groups in plan(build_model(family, seed=2), CompileOptions()) for g in groups]
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

