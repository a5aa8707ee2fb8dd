"""Loading MoE checkpoints: transformers 5.x save_pretrained directories and hand-written per-expert files."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import tilefx
from tilefx.models.checkpoint import write_checkpoint
from tilefx.models.load import load_model
from tilefx.models.presets import build_model

from helpers import assert_greedy_matches, padded_batch

FAMILIES = ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2", "tiny-deepseek-v3"]


def _assert_same_model(loaded, reference):
    want = reference.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        # DeepSeek-V3 keeps e_score_correction_bias in fp32 when loading (_keep_in_fp32_modules_strict)
        assert torch.equal(got[name].to(tensor.dtype), tensor), name
    ids = torch.randint(3, 500, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads_through_tilefx(family, tmp_path):
    path = write_checkpoint(family, tmp_path / family, seed=5)
    _assert_same_model(load_model(path), build_model(family, seed=5))


def _per_expert_layout(state_dict: dict, intermediate: int, mixtral: bool) -> dict:
    """The fused 3-D experts split back into one linear per expert, as checkpoints on the hub store them."""
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, tensor in state_dict.items():
        if mixtral:
            name = name.replace(".mlp.", ".block_sparse_moe.")
        prefix = name.rpartition(".")[0]
        if name.endswith("experts.gate_up_proj"):
            for expert, weight in enumerate(tensor):
                out[f"{prefix}.{expert}.{gate}.weight"] = weight[:intermediate].clone()
                out[f"{prefix}.{expert}.{up}.weight"] = weight[intermediate:].clone()
        elif name.endswith("experts.down_proj"):
            for expert, weight in enumerate(tensor):
                out[f"{prefix}.{expert}.{down}.weight"] = weight.clone()
        else:
            out[name] = tensor.clone()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_checkpoint_is_converted_by_transformers(family, tmp_path):
    reference = build_model(family, seed=11)
    config = reference.config
    intermediate = reference.model.layers[-1].mlp.experts.gate_up_proj.shape[1] // 2
    tensors = _per_expert_layout(reference.state_dict(), intermediate, config.model_type == "mixtral")
    assert any(re.search(r"experts\.3\.(down_proj|w2)\.weight$", name) for name in tensors)
    assert not any("gate_up_proj" in name for name in tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp_path)
    _assert_same_model(load_model(tmp_path), reference)


def test_compile_saved_deepseek_v3_checkpoint_generates_like_eager(tmp_path):
    path = write_checkpoint("tiny-deepseek-v3", tmp_path / "ckpt", seed=5)
    model = tilefx.compile_model(str(path), max_seq_len=32, max_batch=1, warmup=False)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # a trained-like bias, loaded in fp32
    ids, mask = padded_batch([torch.randint(3, 500, (6,), generator=torch.Generator().manual_seed(2)).tolist()])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert assert_greedy_matches(reference, ids, mask, out) >= 7
