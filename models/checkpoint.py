"""Write a preset as an HF directory (config, safetensors, tokenizer) that from_pretrained loads."""

from __future__ import annotations

import errno
import json
import pathlib
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tilefx.custom_ops import weights
from tilefx.models import int4
from tilefx.models.adapters import adapter_for
from tilefx.models.packing import narrow_exact_routers
from tilefx.models.presets import build_model

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "tilefx compiles Hugging Face language models for fast decoding on CPUs.",
    "Attention, mixture of experts and latent caches become native kernels.",
    "Once upon a time there was a small model that generated text one token at a time.",
    "0123456789 +-*/=()[]{}<>,.;:!?'\" \n\t",
]

CHECKPOINT_FORMATS = ("bf16", "fp8", "gptq", "gptq-asym", "awq")
# What GPTQ-Int4 / AWQ checkpoints on the hub ship: the same decoder linears in 4 bits, groups of 128 inputs
# (models/int4.py has the layouts); GPTQ symmetric (zero point 8) or not, AWQ with zero points.
INT4_QUANTIZATION_CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "gptq-asym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
                  "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}
# What DeepSeek-V3 / Qwen3-FP8 ship: every linear of the decoder layers (attention and MLP projections, shared
# and routed experts; Mixtral's experts are w1 / w2 / w3) in e4m3 with a fp32 `weight_scale_inv` per 128 x 128
# block; embeddings, norms, routers and the lm_head in bf16.
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                           "activation_scheme": "dynamic"}


def build_tokenizer(vocab_size: int, *, bos: str = "<s>", eos: str = "</s>", pad: str = "<pad>"):
    """A byte-level BPE tokenizer trained on a small built-in text: every string encodes, ids < vocab_size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 1024),
        special_tokens=[pad, bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=pad)


def write_checkpoint(preset: str, out: str | pathlib.Path, *, layers: int | None = None, seed: int = 0,
                     weights: str = "bf16") -> pathlib.Path:
    """Write ``preset`` (random weights) to ``out``; ``weights="fp8"``: in the hub's FP8 layout; ``"gptq"``,
    ``"gptq-asym"``, ``"awq"``: its decoder linears in that 4-bit layout (round to nearest, groups of 128)."""
    if weights not in CHECKPOINT_FORMATS:
        raise ValueError(f"weights={weights!r}: a checkpoint is written in one of {', '.join(CHECKPOINT_FORMATS)}")
    out = pathlib.Path(out)
    model = build_model(preset, layers=layers, seed=seed)
    _check_free_space(out, model, quantized=weights != "bf16")
    tokenizer = build_tokenizer(model.config.vocab_size)
    # the tokenizer's special ids are the model's
    for config in (model.config, model.generation_config):
        for token in ("pad", "bos", "eos"):
            setattr(config, f"{token}_token_id", getattr(tokenizer, f"{token}_token_id"))
    bf16_linears = []
    if weights == "fp8":
        bf16_linears = sorted(name for name, module in model.named_modules()
                              if type(module) is torch.nn.Linear and not is_fp8_linear(name))
        model.config.quantization_config = dict(FP8_QUANTIZATION_CONFIG, modules_to_not_convert=bf16_linears)
    elif weights in INT4_QUANTIZATION_CONFIGS:
        model.config.quantization_config = dict(INT4_QUANTIZATION_CONFIGS[weights])
    # the hub ships DeepSeek's router weights in bf16, not as transformers 5.24 holds them
    narrow_exact_routers(model, adapter_for(model.config))
    # Shards of at most 2 GB, as the hub ships large models: saving copies one shard at a time.
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    del model
    if weights == "fp8":
        _quantize_shards(out)
    elif weights in INT4_QUANTIZATION_CONFIGS:
        _quantize_shards(out, weights)
    tokenizer.save_pretrained(out)
    return out


def _check_free_space(out: pathlib.Path, model: torch.nn.Module, *, quantized: bool) -> None:
    """Refuse before writing anything where the disk under ``out`` cannot hold the checkpoint: its bf16 shards, and
    while a quantized format rewrites them one at a time, one more shard (the 2 GB cap)."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    needed = nbytes + (min(nbytes, 2 * 10**9) if quantized else 0) + 2**26  # 64 MiB: tokenizer, config, slack
    existing = next(d for d in (out, *out.parents) if d.exists())
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"writing this checkpoint needs about {needed / 1e9:.1f} GB free under "
                                    f"{existing}; {free / 1e9:.1f} GB are", str(out))


def write_repeated_int4_checkpoint(preset: str, out: str | pathlib.Path, *, layers: int, layout: str = "gptq",
                                   seed: int = 0) -> pathlib.Path:
    """``preset`` at ``layers`` layers in a 4-bit ``layout``, too large to build in memory (Qwen3-30B-A3B at full
    depth is 61 GB in bf16): one random decoder layer is built and quantized, then written ``layers`` times, one
    layer a shard, beside the embeddings and the lm_head. Decode cost and memory do not depend on the values."""
    out = pathlib.Path(out)
    one = out / "one-layer"
    write_checkpoint(preset, one, layers=1, seed=seed, weights=layout)
    config = json.loads((one / "config.json").read_text())
    config["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists, where the family has them
        if isinstance(config.get(key), list) and len(config[key]) == 1:
            config[key] = config[key] * layers
    index = {"metadata": {}, "weight_map": {}}
    layer, rest = {}, {}
    for path in sorted(one.glob("*.safetensors")):
        with safe_open(path, "pt") as source:
            for n in source.keys():
                (layer if n.startswith("model.layers.0.") else rest)[n] = source.get_tensor(n)
    for i in range(layers):
        shard = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        tensors = {n.replace("model.layers.0.", f"model.layers.{i}.", 1): t for n, t in layer.items()}
        save_file(tensors, out / shard, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, shard))
    shard = f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors"
    save_file(rest, out / shard, metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(rest, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in one.iterdir():
        if file.suffix != ".safetensors" and file.name not in ("config.json", "model.safetensors.index.json"):
            (out / file.name).write_bytes(file.read_bytes())
    for file in one.iterdir():
        file.unlink()
    one.rmdir()
    return out


def is_fp8_linear(name: str) -> bool:
    """Whether the hub's FP8 checkpoints quantize the linear (module or weight name) ``name``."""
    name = name.removesuffix(".weight")
    last = name.rsplit(".", 1)[-1]
    return ".layers." in f".{name}" and (last.endswith(("_proj", "_proj_with_mqa")) or last in ("w1", "w2", "w3"))


def _quantize_shards(out: pathlib.Path, int4_layout: str | None = None) -> None:
    """Rewrite each shard of ``out`` with its FP8 linears as e4m3 ``weight`` + fp32 ``weight_scale_inv`` (or, with
    ``int4_layout``, as that 4-bit layout's ``qweight``, ``qzeros``, ``scales``...), one shard in memory at a time,
    and the index's weight map to match."""
    scheme = int4.scheme_of(INT4_QUANTIZATION_CONFIGS[int4_layout]) if int4_layout else None
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for shard in sorted(out.glob("*.safetensors")):
        tensors = {}
        with safe_open(shard, "pt") as source:
            metadata = source.metadata()
            for key in source.keys():
                tensor = source.get_tensor(key)
                if key.endswith(".weight") and tensor.dim() == 2 and is_fp8_linear(key) and scheme is not None:
                    module = key.removesuffix(".weight")
                    for name, value in int4.write_int4(tensor, scheme, symmetric=int4_layout != "gptq-asym").items():
                        tensors[f"{module}.{name}"] = value
                        if index is not None:
                            index["weight_map"][f"{module}.{name}"] = shard.name
                    if index is not None:
                        del index["weight_map"][key]
                    continue
                if key.endswith(".weight") and tensor.dim() == 2 and is_fp8_linear(key):
                    tensor, tensors[f"{key}_scale_inv"] = weights.quantize_rows(tensor, "fp8")
                    tensor = tensor.contiguous()
                    if index is not None:
                        index["weight_map"][f"{key}_scale_inv"] = shard.name
                tensors[key] = tensor
        save_file(tensors, shard, metadata=metadata)
        del tensors
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
