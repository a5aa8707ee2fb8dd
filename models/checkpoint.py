"""Write a preset as an HF directory (config, safetensors, tokenizer) that from_pretrained loads."""

from __future__ import annotations

import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tilefx.models.presets import build_model

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "tilefx compiles Hugging Face language models for fast decoding on CPUs.",
    "Attention, mixture of experts and latent caches become native kernels.",
    "Once upon a time there was a small model that generated text one token at a time.",
    "0123456789 +-*/=()[]{}<>,.;:!?'\" \n\t",
]


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


def write_checkpoint(preset: str, out: str | pathlib.Path, *, layers: int | None = None, seed: int = 0) -> pathlib.Path:
    out = pathlib.Path(out)
    model = build_model(preset, layers=layers, seed=seed)
    tokenizer = build_tokenizer(model.config.vocab_size)
    # the tokenizer's special ids are the model's
    for config in (model.config, model.generation_config):
        for token in ("pad", "bos", "eos"):
            setattr(config, f"{token}_token_id", getattr(tokenizer, f"{token}_token_id"))
    # Shards of at most 2 GB, as the hub ships large models: saving copies one shard at a time.
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    tokenizer.save_pretrained(out)
    return out
