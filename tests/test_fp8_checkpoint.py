"""FP8 checkpoints in the hub's layout (make_checkpoint --weights fp8): loaded without dequantizing, packed as
they are, generating what transformers' own (dequantizing) load of the same files generates."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import tilefx
from tilefx.custom_ops import weights
from tilefx.models.adapters import adapter_for
from tilefx.models.checkpoint import write_checkpoint
from tilefx.models.fp8 import SCALES, UnsupportedCheckpointError, weight_formats
from tilefx.models.load import load_config
from tilefx.models.shard_loading import checkpoint_files, load_shard
from tilefx.models import tp

from helpers import assert_generates_like, assert_greedy_matches, padded_batch, random_prompt, run_script

FAMILIES = ("tiny-llama", "tiny-qwen3-moe", "tiny-deepseek-v3")


def _hf_load(path):
    """transformers' own load: on a machine without a GPU it dequantizes every fp8 weight to bf16."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's FP8 checkpoint, with one linear stored in bf16 (``BF16_LINEARS``) as hub checkpoints keep some."""
    root = tmp_path_factory.mktemp("fp8")
    paths = {}
    for family in FAMILIES:
        all_fp8 = write_checkpoint(family, root / f"{family}-all-fp8", seed=5, weights="fp8")
        module, listed = BF16_LINEARS[family]

        def list_it(quantization, module=module, listed=listed):
            if listed:
                quantization["modules_to_not_convert"] = [*(quantization.get("modules_to_not_convert") or []), module]

        paths[family] = _copy_with(all_fp8, root / family, config_edit=list_it, tensor_edit=_stored_in_bf16(module))
        shutil.rmtree(all_fp8)
    return paths


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, checkpoints):
    """``(family, path, transformers' load, compiled)``: compiled once per family for the whole module. (The dense
    family without Inductor: its fp8 graphs under Inductor are test_generate_quantized.py's tiny-llama-fp8.)"""
    path = checkpoints[request.param]
    return request.param, path, _hf_load(path), tilefx.compile_model(
        path, max_seq_len=48, max_batch=2, inductor=request.param != "tiny-llama", progress=False)


def test_checkpoint_is_in_the_hub_layout(checkpoints):
    path = checkpoints["tiny-deepseek-v3"]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert {k: config[k] for k in ("quant_method", "fmt", "weight_block_size", "activation_scheme")} == {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    with safe_open(next(path.glob("*.safetensors")), "pt") as f:
        keys = set(f.keys())
        for key in ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.experts.3.up_proj.weight",
                    "model.layers.1.mlp.shared_experts.down_proj.weight"):
            assert f.get_tensor(key).dtype == torch.float8_e4m3fn
            assert f.get_tensor(f"{key}_scale_inv").dtype == torch.float32
        for key in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                    "model.norm.weight"):
            assert f.get_tensor(key).dtype == torch.bfloat16 and f"{key}_scale_inv" not in keys


def test_greedy_matches_transformers_own_load(loaded):
    _, _, reference, compiled = loaded
    assert_generates_like(reference, compiled)


def test_linears_keep_the_checkpoints_bytes(loaded):
    """weights="auto" packs an fp8 checkpoint's linears in fp8 from its own values and scales, untouched."""
    _, path, _, compiled = loaded
    formats = compiled.tilefx.report.packing.formats
    assert set(formats) == {"fp8", "bf16"} and "fp8" in tilefx.explain(compiled)
    name = "model.layers.0.self_attn.o_proj.weight"
    packed = weights.packing_of(compiled.get_parameter(name))
    assert packed.format == "fp8"
    with safe_open(next(path.glob("*.safetensors")), "pt") as f:
        values, scale_inv = f.get_tensor(name), f.get_tensor(f"{name}_scale_inv")
    own = weights.unpack_linear_weight(packed.data.view(torch.uint8), *values.shape)
    assert torch.equal(own, values.view(torch.uint8))
    assert torch.equal(packed.scales[0], scale_inv[0])
    text = tilefx.explain(compiled)
    if compiled.config.model_type == "deepseek_v3":  # read unpacked by the MLA pass: dequantized as it loaded
        assert "MLA's absorbed kv_b_proj; any linear with linear=False): dequantized to bf16 at load" in text
    if compiled.config.model_type != "llama":  # experts in fp8 too, from the checkpoint's bytes
        experts = weights.packing_of(compiled.get_parameter("model.layers.1.mlp.experts.down_proj"))
        assert experts.format == "fp8" and "MoE experts" not in text


@pytest.mark.parametrize("format", ["bf16", "int8"])
def test_other_formats_dequantize_the_checkpoint(checkpoints, format):
    path = checkpoints["tiny-llama"]
    reference = _hf_load(path)
    compiled = tilefx.compile_model(path, max_seq_len=32, weights=format, progress=False)
    assert set(compiled.tilefx.report.packing.formats) == {format}
    if format == "bf16":  # exactly transformers' dequantized weights
        name = "model.layers.1.mlp.down_proj.weight"
        packed = weights.packing_of(compiled.get_parameter(name))
        expected = reference.get_parameter(name).data
        assert torch.equal(weights.unpack_linear_weight(packed.data, *expected.shape), expected)
    ids, mask = padded_batch([random_prompt(9, 3)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert assert_greedy_matches(reference, ids, mask, out) >= 6


def test_make_checkpoint_writes_fp8(tmp_path):
    run_script("make_checkpoint.py", ["--preset", "tiny-qwen3-moe", "--layers", "1", "--weights", "fp8",
                                   str(tmp_path / "ckpt")])
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    with safe_open(next((tmp_path / "ckpt").glob("*.safetensors")), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight").dtype == torch.float8_e4m3fn


def _copy_with(source, target, config_edit=None, tensor_edit=None):
    target.mkdir()
    for file in source.iterdir():
        if file.suffix == ".safetensors" and tensor_edit is not None:
            with safe_open(file, "pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            tensor_edit(tensors)
            save_file(tensors, target / file.name, metadata={"format": "pt"})
        elif file.name == "config.json" and config_edit is not None:
            config = json.loads(file.read_text())
            config_edit(config["quantization_config"])
            (target / file.name).write_text(json.dumps(config))
        else:
            (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.mark.parametrize("edit, named", [
    (lambda q: q.update(quant_method="bitsandbytes", bits=4), "quant_method='bitsandbytes'"),
    (lambda q: q.update(weight_block_size=[64, 64]), "weight_block_size=[64, 64]"),
    (lambda q: q.update(activation_scheme="static"), "activation_scheme='static'"),
])
def test_refuses_quantizations_it_cannot_run(checkpoints, tmp_path, edit, named):
    path = _copy_with(checkpoints["tiny-llama"], tmp_path / "ckpt", config_edit=edit)
    with pytest.raises(UnsupportedCheckpointError, match="quantized \\(.*" + named.replace("[", "\\[")) as error:
        tilefx.compile_model(path, progress=False)
    assert "weight_block_size [128, 128]" in str(error.value)  # names what it supports


def test_refuses_nan_codes(checkpoints, tmp_path):
    name = "model.layers.1.self_attn.q_proj.weight"

    def poison(tensors):
        tensors[name].view(torch.uint8)[3, 5] = 0xFF

    path = _copy_with(checkpoints["tiny-llama"], tmp_path / "ckpt", tensor_edit=poison)
    with pytest.raises(ValueError, match=f"{name}.*NaN e4m3 codes"):
        tilefx.compile_model(path, progress=False)


def test_a_model_tilefx_loaded_compiles_in_fp8(checkpoints):
    """compile_model(PreTrainedModel) keeps an FP8 model's e4m3 weights (a bf16 cast would scramble them)."""
    from tilefx.models.load import load_model

    path = checkpoints["tiny-llama"]
    model = load_model(path)
    assert any(weights.checkpoint_scales(p) is not None for p in model.parameters())
    compiled = tilefx.compile_model(model, max_seq_len=32, progress=False)
    assert "fp8" in compiled.tilefx.report.packing.formats
    reference = _hf_load(path)
    ids, mask = padded_batch([random_prompt(5, 9)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert_greedy_matches(reference, ids, mask, out)


def test_weights_no_pass_packs_are_dequantized_in_place(checkpoints):
    """With the linear and MoE passes off nothing packs the fp8 weights: each is dequantized to bf16 as it
    loaded (the experts' gate_up by halves), which is exactly transformers' own dequantized model. (Without
    Inductor: the load is under test, and Inductor would compile HF's loop over the experts.)"""
    path = checkpoints["tiny-qwen3-moe"]
    reference = _hf_load(path)
    compiled = tilefx.compile_model(path, max_seq_len=32, linear=False, moe=False, inductor=False, progress=False)
    for name, param in reference.named_parameters():
        assert torch.equal(compiled.get_parameter(name).data, param.data), name
    assert "dequantized to bf16 at load" in tilefx.explain(compiled)
    ids, mask = padded_batch([random_prompt(6, 4)])
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert assert_greedy_matches(reference, ids, mask, out) >= 5


# -- no silent misreads: each tensor read in the format the files hold it in ------------------------------------

# One linear in each family's checkpoint stored bf16 without scales: DeepSeek's kv_a_proj_with_mqa listed in
# modules_to_not_convert as the hub lists such layers (beside its fp8 sibling q_a_proj); a Qwen3-MoE k_proj listed
# (beside its fp8 siblings q_proj and v_proj); a Llama o_proj not listed, which transformers alone would load into an
# e4m3 linear with made-up scales. (The other layers' linears are all fp8.)
BF16_LINEARS = {"tiny-deepseek-v3": ("model.layers.0.self_attn.kv_a_proj_with_mqa", True),
                "tiny-qwen3-moe": ("model.layers.1.self_attn.k_proj", True),
                "tiny-llama": ("model.layers.1.self_attn.o_proj", False)}
MISSING_SCALES = "model.layers.1.self_attn.q_proj.weight"


def _stored_in_bf16(module):
    """A ``_copy_with`` tensor edit: linear ``module``'s weight stored as the bf16 of its fp8 values, no scales."""
    def edit(tensors):
        key = f"{module}.weight"
        tensors[key] = weights.dequantize_blocks(tensors[key], tensors.pop(f"{key}{SCALES}")).contiguous()
    return edit


def _rank_model(path, monkeypatch):
    """The tensor-parallel shard loader's model of ``path``, one rank of one: every tensor goes through its reads.
    (The tiny presets' dims are under one 128-row scale block, which plan_for refuses to split; one rank splits
    none.)"""
    monkeypatch.setattr(tp, "_fp8_straddles", lambda *args: [])
    config, _ = load_config(path)
    adapter = adapter_for(config)
    context = tp.TPContext(rank=0, world_size=1, local_rank=0, local_world_size=1, same_host=True)
    return load_shard(path, config, adapter, tp.plan_for(config, adapter, 1), context, torch.bfloat16)


def test_a_bf16_linear_of_an_fp8_checkpoint_is_bf16(loaded):
    family, path, reference, compiled = loaded
    name = f"{BF16_LINEARS[family][0]}.weight"
    with safe_open(next(path.glob("*.safetensors")), "pt") as f:
        stored = f.get_tensor(name)
    assert stored.dtype == torch.bfloat16
    assert torch.equal(reference.get_parameter(name).data, stored)  # the oracle: transformers' bf16 of every weight
    packed = weights.packing_of(compiled.get_parameter(name))
    assert packed.format == "bf16"
    assert torch.equal(weights.unpack_linear_weight(packed.data, *stored.shape), stored)
    assert "fp8" in compiled.tilefx.report.packing.formats  # the others keep the checkpoint's e4m3 bytes
    assert re.search(f"bf16 as the quantized checkpoint stores them: .*{re.escape(name)}", tilefx.explain(compiled))
    # (its tokens: test_greedy_matches_transformers_own_load, on this same model)


def test_the_shard_loader_reads_a_bf16_linear_as_bf16(loaded, monkeypatch):
    family, path, reference, _ = loaded
    module = BF16_LINEARS[family][0]
    model = _rank_model(path, monkeypatch)
    param = model.get_parameter(f"{module}.weight")
    assert param.dtype == torch.bfloat16 and weights.checkpoint_scales(param) is None
    assert torch.equal(param.data, reference.get_parameter(f"{module}.weight").data)
    quantized = model.get_parameter("model.layers.0.self_attn.o_proj.weight")
    assert quantized.dtype == torch.float8_e4m3fn and weights.checkpoint_scales(quantized) is not None


@pytest.fixture(scope="module")
def scales_missing(checkpoints, tmp_path_factory):
    """An FP8 checkpoint one of whose e4m3 tensors has no ``weight_scale_inv``."""
    return _copy_with(checkpoints["tiny-llama"], tmp_path_factory.mktemp("no-scales") / "ckpt",
                      tensor_edit=lambda tensors: tensors.pop(f"{MISSING_SCALES}{SCALES}"))


def test_refuses_an_e4m3_tensor_without_its_scales(scales_missing, monkeypatch):
    name = re.escape(MISSING_SCALES)
    named = f"{name} is float8_e4m3fn but the checkpoint has no {name}{SCALES}"
    with pytest.raises(ValueError, match=named):
        tilefx.compile_model(scales_missing, progress=False)
    with pytest.raises(ValueError, match=named):
        _rank_model(scales_missing, monkeypatch)


def test_refuses_a_layers_experts_in_two_formats(checkpoints, tmp_path):
    module = "model.layers.0.mlp.experts.3.up_proj"
    path = _copy_with(checkpoints["tiny-qwen3-moe"], tmp_path / "ckpt", tensor_edit=_stored_in_bf16(module))
    with pytest.raises(UnsupportedCheckpointError, match=f"model.layers.0.mlp.experts: .*{module}.weight is bf16"):
        weight_formats(checkpoint_files(path))
