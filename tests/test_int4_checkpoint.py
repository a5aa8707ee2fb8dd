"""4-bit checkpoints as the hub ships them (GPTQ symmetric and asymmetric, AWQ), dense and MoE, written here in
the hub's layout (models/checkpoint.py), loaded by tilefx as int4: greedy tokens like HF eager over the exactly
dequantized bf16 weights. The layouts' bit order is pinned by hand-made examples."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import tilefx
from tilefx.custom_ops import weights
from tilefx.models import int4
from tilefx.models.checkpoint import write_checkpoint

from helpers import assert_generates_like
from quantized import rounds_int4_inputs


def test_gptq_layout_by_hand():
    """GPTQ: qweight packs 8 inputs of one output a word, input 8r + j at bits 4j; qzeros 8 outputs a word,
    stored minus one (checkpoint_format gptq)."""
    k, n = 128, 8
    q = torch.zeros(k, n, dtype=torch.int64)
    q[1, 0], q[7, 0], q[8, 3] = 5, 15, 9  # input 1 and 7 of output 0 (word 0), input 8 of output 3 (word 1)
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    qweight[0, 0] = (5 << 4) | (15 << 28) - (1 << 32)  # bit 31 set: negative as int32
    qweight[1, 3] = 9
    assert torch.equal(int4._unpack(qweight.T.contiguous()).reshape(n, k).T.long(), q)
    qzeros = torch.tensor([[0x76543210 - 0]], dtype=torch.int32)  # outputs 0..7: stored 0..7, zero points 1..8
    scales = torch.full((1, n), 0.5, dtype=torch.float16)
    tensors = {"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": scales}

    nibbles, params = int4.read_int4(tensors.__getitem__, tensors, "m", int4.Int4Scheme("gptq", 128, zero_offset=1))
    assert params.shape == (n, 1, 2) and params[:, 0, 1].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    values = weights.split_nibbles(weights.formats.int4_rows(nibbles))  # [N, K]
    assert values[0, 1] == 5 and values[0, 7] == 15 and values[3, 8] == 9 and values[1].sum() == 0


def test_awq_layout_by_hand():
    """AWQ GEMM: qweight packs 8 outputs of one input a word in the order 0 2 4 6 1 3 5 7 (nibble i holds output
    AWQ_ORDER[i]); zero points in the same order, as they are."""
    k, n = 128, 8
    qweight = torch.zeros(k, n // 8, dtype=torch.int32)
    qweight[2, 0] = (3 << 4) | (11 << 16)  # nibble 1: output 2, nibble 4: output 1
    qzeros = torch.tensor([[(7 << 4) | 9]], dtype=torch.int32)  # nibble 0: output 0 -> 9, nibble 1: output 2 -> 7
    tensors = {"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": torch.ones(1, n, dtype=torch.float16)}

    nibbles, params = int4.read_int4(tensors.__getitem__, tensors, "m", int4.Int4Scheme("awq", 128))
    values = torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1).flatten(-2)
    assert values[2, 2] == 3 and values[1, 2] == 11 and values.sum() == 14
    assert params[0, 0, 1] == 9 and params[2, 0, 1] == 7 and params[1, 0, 1] == 0


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_nibbles_are_the_files_words_in_place(method):
    """A GPTQ linear's nibbles are its qweight's words read in place (a view of the file's tensor: loading copies
    none of its bytes; packing reads them), the same values as the ones written; AWQ's are unpacked into a tensor of
    their own (its words hold outputs, not inputs)."""
    n, k = 48, 256
    torch.manual_seed(3)
    scheme = int4.Int4Scheme(method, 128, zero_offset=1 if method == "gptq" else 0)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    tensors = {f"m.{name}": t for name, t in
               int4.pack_int4(q, torch.rand(n, 2) + 0.5, torch.randint(1, 16, (n, 2)), scheme).items()}
    nibbles, _ = int4.read_int4(tensors.__getitem__, tensors, "m", scheme)
    assert torch.equal(weights.split_nibbles(weights.formats.int4_rows(nibbles)), q)
    qweight = tensors["m.qweight"]
    in_place = qweight.data_ptr() <= nibbles.data_ptr() < qweight.data_ptr() + qweight.nbytes
    assert in_place == (method == "gptq")
    assert nibbles.shape == ((n, k // 8, 4) if method == "gptq" else (n, k // 2))


@pytest.mark.skipif(__import__("tilefx").custom_ops.isa.native is None, reason="native library not built")
@pytest.mark.parametrize("k, words", [(128, 37), (6, 1), (256, 16)])
def test_native_awq_transpose_equals_torchs(k, words):
    """awq_paired_nibbles natively (csrc/memory.cpp) against its torch ops, on random words (negative ones too),
    column tiles of 16 words and a ragged last tile."""
    qweight = torch.randint(-(1 << 31), 1 << 31, (k, words), generator=torch.Generator().manual_seed(k + words),
                            dtype=torch.int64).to(torch.int32)
    native = int4.awq_paired_nibbles(qweight)
    assert native.shape == (8 * words, k // 2) and torch.equal(native, int4.awq_paired_nibbles(qweight, native=False))


def _dequantized_reference(directory, layout: str):
    """HF eager over each 4-bit linear dequantized exactly, from the files, by the hub's formula (no tilefx code):
    ``W[n, k] = (q[k, n] - z[k // 128, n]) * s[k // 128, n]``, rounded to bf16 once."""
    state = {}
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = list(f.keys())
        for name in names:
            if not name.endswith(".qweight"):
                if not name.endswith((".qzeros", ".scales", ".g_idx")):
                    state[name] = f.get_tensor(name)
                continue
            module = name.removesuffix(".qweight")
            qweight, qzeros, scales = (f.get_tensor(f"{module}.{t}") for t in ("qweight", "qzeros", "scales"))
            bits = torch.arange(0, 32, 4)
            if layout == "awq":
                order = torch.tensor(int4.AWQ_ORDER).argsort()  # output j of a word at nibble order.index(j)
                q = (qweight[:, :, None] >> bits[order]) & 0xF  # [K, N/8, 8]
                z = (qzeros[:, :, None] >> bits[order]) & 0xF
                q, z = q.reshape(qweight.shape[0], -1), z.reshape(qzeros.shape[0], -1)
            else:
                q = ((qweight[:, None, :] >> bits[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])  # [K, N]
                z = (((qzeros[:, :, None] >> bits) & 0xF) + 1).reshape(qzeros.shape[0], -1)
            group = torch.arange(q.shape[0]) // 128
            weight = (q.float() - z[group].float()) * scales[group].float()
            state[f"{module}.weight"] = weight.T.to(torch.bfloat16)
    # a bf16 checkpoint of those weights, loaded by transformers (which fuses per-expert tensors as it loads)
    from safetensors.torch import save_file

    bf16 = directory / "dequantized"
    bf16.mkdir(exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config")
    (bf16 / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in state.items()}, bf16 / "model.safetensors", metadata={"format": "pt"})
    return rounds_int4_inputs(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16).eval())


CASES = [("tiny-llama-w256", "gptq"), ("tiny-llama-w256", "gptq-asym"), ("tiny-llama-w256", "awq"),
         ("tiny-qwen3-moe-w256", "gptq"), ("tiny-qwen3-moe-w256", "awq")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{p}-{w}" for p, w in CASES])
def int4_checkpoint(request, tmp_path_factory):
    preset, layout = request.param
    directory = write_checkpoint(preset, tmp_path_factory.mktemp(f"{preset}-{layout}"), seed=5, weights=layout)
    return directory, layout


def test_checkpoint_is_in_the_hub_layout(int4_checkpoint):
    directory, layout = int4_checkpoint
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == layout.split("-")[0] and config["bits"] == 4 and config["group_size"] == 128
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = set(f.keys())
        qweight = next(n for n in names if n.endswith("self_attn.q_proj.qweight"))
        module = qweight.removesuffix(".qweight")
        assert f.get_tensor(qweight).dtype == torch.int32 and f"{module}.weight" not in names
        assert f.get_tensor(f"{module}.scales").dtype == torch.float16
        hidden = f.get_slice(f"{module}.scales").get_shape()
        assert hidden[0] == 256 // 128  # groups of 128 inputs
    assert any(n.endswith("embed_tokens.weight") for n in names)  # embeddings and lm_head stay unquantized


def test_greedy_matches_the_dequantized_oracle(int4_checkpoint):
    directory, layout = int4_checkpoint
    compiled = tilefx.compile_model(directory, max_seq_len=48, max_batch=2)
    assert "int4" in compiled.tilefx.report.packing.formats
    assert_generates_like(_dequantized_reference(directory, layout), compiled)


def test_a_gptq_load_reads_no_4_bit_values(tmp_path):
    """Loading a 4-bit checkpoint reads none of its quantized linears: each weight's parts (a dense linear's one,
    each expert's gate and up, or down) are read when packing reads them. A GPTQ part's nibbles are then its file's
    words, in the file's mapping: no copy of them is ever made."""
    from tilefx.models.load import load_for_rank, resolve_source

    directory = write_checkpoint("tiny-qwen3-moe-w256", tmp_path / "ckpt", seed=1, weights="gptq")
    model = load_for_rank(resolve_source(directory), progress=False).model
    quantized = {name: p for name, p in model.named_parameters() if weights.checkpoint_format(p) == "int4"}
    assert any("q_proj" in name for name in quantized) and any("experts.gate_up_proj" in name for name in quantized)
    for name, param in quantized.items():
        parts = weights.formats.int4_parts(param)
        assert parts and all(part.held_bytes == 0 for part in parts), name  # deferred: nothing held
        if "experts.gate_up_proj" in name:
            assert all(len(expert) == 2 for expert in weights.checkpoint_int4(param)), name  # gate's, up's
        nibbles, params = parts[-1].read_checked(param.shape[-1])
        mapped = weights.memory.file_mappings()  # (the file opened by the read)
        assert weights.memory.in_file_mapping(nibbles, mapped) and params.dtype == torch.float16, name


def test_refuses_what_it_cannot_run(tmp_path):
    directory = write_checkpoint("tiny-llama-w256", tmp_path / "ckpt", seed=1, weights="gptq")
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    for edit, named in (({"bits": 8}, "bits=8"), ({"group_size": 32}, "group_size=32"),
                        ({"checkpoint_format": "marlin"}, "marlin")):
        config_path.write_text(json.dumps(dict(config, quantization_config=dict(config["quantization_config"], **edit))))
        with pytest.raises(ValueError, match=named):
            tilefx.compile_model(directory)
    config_path.write_text(json.dumps(config))
    # act-order: g_idx out of order
    from safetensors.torch import save_file

    with safe_open(directory / "model.safetensors", "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    g_idx = next(n for n in tensors if n.endswith("q_proj.g_idx"))
    tensors[g_idx] = tensors[g_idx].flip(0).contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="desc_act"):
        tilefx.compile_model(directory)
    del tensors[g_idx.replace("g_idx", "scales")]  # and a linear without its scales is refused by name
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="q_proj.scales"):
        tilefx.compile_model(directory)


def test_tensor_parallel_splits_whole_groups_only(tmp_path):
    """A row-parallel split of a 4-bit linear must leave each rank whole groups of 128 inputs; else it is refused,
    naming the dim. (tests/test_tp.py runs a GPTQ checkpoint under tp=2.)"""
    from tilefx.custom_ops.weights import Shard
    from tilefx.models import shard_loading

    directory = write_checkpoint("tiny-llama-w256", tmp_path / "ckpt", seed=1, weights="gptq")
    files = shard_loading.checkpoint_files(directory)
    scheme = int4.scheme_of(json.loads((directory / "config.json").read_text())["quantization_config"])
    key = next(n for n in files if n.endswith("mlp.down_proj.qweight")).replace(".qweight", ".weight")
    reader, shape = shard_loading._DeferredFiles(), (256, 512)

    def part(shard):
        return shard_loading._int4_part(reader, files, key, scheme, shard, shape).read()

    whole_nibbles, whole_params = part(None)  # words [256, 64, 4]
    whole = weights.formats.int4_rows(whole_nibbles)  # [256, 512 / 2]
    nibbles, params = part(Shard(1, 1, 2, "rowwise", 512))
    assert torch.equal(weights.formats.int4_rows(nibbles), whole[:, 128:]) and torch.equal(params, whole_params[:, 2:])
    rows, row_params = part(Shard(0, 1, 2, "colwise", 256))
    assert torch.equal(weights.formats.int4_rows(rows), whole[128:]) and torch.equal(row_params, whole_params[128:])
    with pytest.raises(ValueError, match="dim 1.*4-bit groups"):  # refused as it loads, before any read
        shard_loading._int4_part(reader, files, key, scheme, Shard(1, 0, 8, "rowwise", 512), shape)
