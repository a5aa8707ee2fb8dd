"""Loading: local checkpoints, bad sources, unsupported families; the checkpoint writer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import tilefx
from tilefx.models import checkpoint as checkpoint_module
from tilefx.models.adapters import ADAPTERS, adapter_for
from tilefx.models.checkpoint import write_checkpoint
from tilefx.models.load import ModelNotFoundError, load_model
from tilefx.models.presets import PRESETS, build_model, get_preset

from helpers import adapter_lookups, run_script


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint("tiny-qwen2", tmp_path_factory.mktemp("ckpt") / "tiny-qwen2", seed=5)


def test_checkpoint_is_an_ordinary_hf_directory(checkpoint):
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    assert ids.numel() > 0 and int(ids.max()) < model.config.vocab_size
    assert tokenizer.decode(ids[0]) == "Once upon a time"
    reference = build_model("tiny-qwen2", seed=5)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_compile_local_directory_generates_like_eager(checkpoint):
    model = tilefx.compile_model(str(checkpoint), max_seq_len=32, max_batch=1)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    want = reference.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, want)


def test_load_model_is_bf16_eval_and_sdpa(checkpoint):
    model = load_model(checkpoint)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not model.training and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("source", ["directory", "built tiny-deepseek-v3"])
def test_adapter_is_resolved_once_per_compile(checkpoint, source):
    """The loader, packing, the runtime and the KV cache get the family adapter compile_model resolved; none looks
    it up again (tensor parallel: tests/test_tp.py)."""
    model = str(checkpoint) if source == "directory" else build_model("tiny-deepseek-v3", seed=1)
    with adapter_lookups() as lookups:
        compiled = tilefx.compile_model(model, max_seq_len=16, warmup=False, progress=False)
    assert lookups == [compiled.config.model_type]


def test_unreachable_hub_id_says_what_to_do():
    with pytest.raises(ModelNotFoundError, match="could not load 'nobody/no-such-model-xyz'.*local-dir"):
        tilefx.compile_model("nobody/no-such-model-xyz", local_files_only=True)


def test_missing_local_path():
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        load_model("./does/not/exist")


def test_unsupported_family_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    supported = "deepseek_v2, deepseek_v3, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe"
    with pytest.raises(ValueError, match=f"'gpt2' is not supported.*{supported}"):
        tilefx.compile_model(str(tmp_path))
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="not supported"):
        tilefx.compile_model(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)))


def test_unknown_option_names_the_options_before_loading():
    """A misspelt option fails at once (no load, no compile) and lists what compile_model takes."""
    with pytest.raises(TypeError, match="unknown option 'fuse_linear'; expected one of .*fuse_linears"):
        tilefx.compile_model("./does/not/exist", fuse_linear=False)


@pytest.mark.parametrize("chunk", [-1, 2.5, True])
def test_a_bad_prefill_chunk_fails_before_loading(chunk):
    with pytest.raises(ValueError, match=f"prefill_chunk={chunk!r}: expected a token count"):
        tilefx.compile_model("./does/not/exist", prefill_chunk=chunk)


@pytest.mark.parametrize("setting", ["cpp_wrapper", "freezing"])
def test_inductors_settings_without_inductor_fail_before_loading(setting):
    with pytest.raises(ValueError, match=f"{setting}=True is an Inductor setting: it needs inductor=True"):
        tilefx.compile_model("./does/not/exist", inductor=False, **{setting: True})


def test_every_preset_family_has_an_adapter():
    for preset in PRESETS.values():
        assert preset.model_type in ADAPTERS
        config = preset.build_config(layers=1)
        dims = adapter_for(config).attention_dims(config)
        assert dims["layers"] == 1 and dims["q_heads"] % dims["kv_heads"] == 0


def test_preset_layers_are_checked():
    with pytest.raises(ValueError, match="1..16"):
        get_preset("llama-3.2-1b").build_config(layers=99)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("gpt-5")


def test_scripts_make_checkpoint_and_generate(tmp_path, capsys):
    out = tmp_path / "ckpt"
    run_script("make_checkpoint.py", ["--preset", "tiny-llama", str(out)])
    run_script("generate.py", [str(out), "--prompt", "Once upon", "--max-new-tokens", "5", "--max-seq-len", "32",
                               "--local-files-only"])
    captured = capsys.readouterr()
    assert "Once upon" in captured.out and "5 tokens in" in captured.err


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_make_checkpoint_refuses_a_disk_too_small_before_writing(tmp_path, monkeypatch, weights):
    """The suite writes checkpoints of real architectures (up to 2.5 GB): where the disk cannot hold one, the
    writer says how much it needs instead of failing half-written."""
    real = shutil.disk_usage
    total_bytes = sum(p.numel() * p.element_size() for p in build_model("tiny-llama").parameters())
    # room for the bf16 shards, but not for a quantized format's extra shard while it rewrites them
    free = total_bytes + 2**26 + total_bytes // 2
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=free))
    out = tmp_path / "deep" / "ckpt"
    if weights == "bf16":
        assert write_checkpoint("tiny-llama", out, weights=weights) == out
        return
    with pytest.raises(OSError, match=r"needs about .* GB free under .*; .* GB are"):
        write_checkpoint("tiny-llama", out, weights=weights)
    assert not out.exists()


def test_loading_shows_a_bar_where_progress_is_on_and_none_where_it_is_off(checkpoint, tmp_path, capfd, monkeypatch):
    """A bar over the weights read: transformers' for a bf16 checkpoint, the shard loader's for a 4-bit one (a 30B
    one takes a minute or more); with progress=False no bar at all, transformers' included."""
    monkeypatch.delenv("TILEFX_QUIET", raising=False)
    gptq = write_checkpoint("tiny-llama-w256", tmp_path / "gptq", seed=1, weights="gptq")
    for directory, bar in ((checkpoint, "Loading weights"), (gptq, "tilefx: loading weights")):
        tilefx.compile_model(directory, max_seq_len=32, warmup=False, tune=False)
        shown = capfd.readouterr().err
        assert bar in shown and "tilefx: packing weights" in shown, shown
        tilefx.compile_model(directory, max_seq_len=32, warmup=False, tune=False, progress=False)
        hidden = capfd.readouterr().err
        assert "%|" not in hidden, hidden  # no tqdm bar of anyone's
