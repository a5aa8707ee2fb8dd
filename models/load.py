"""Loading: a hub id, an HF cache entry, a local directory or an already-built model."""

from __future__ import annotations

import contextlib
import os
import pathlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tilefx.custom_ops import weights
from tilefx.models import fp8
from tilefx.models.adapters import adapter_for


class ModelNotFoundError(OSError):
    """The model could be found neither locally, in the HF cache, nor on a reachable hub."""


def load_model(
    source: str | os.PathLike | PreTrainedModel,
    *,
    dtype: torch.dtype = torch.bfloat16,
    trust_remote_code: bool = False,
    revision: str | None = None,
    local_files_only: bool = False,
) -> PreTrainedModel:
    """Load ``source`` for inference in ``dtype``, safetensors only; fail early for unsupported families and
    quantizations. An FP8 checkpoint stays FP8 (models/fp8.py): its linears and experts hold the checkpoint's
    e4m3 values, marked with their scales, until packing reads them."""
    if isinstance(source, PreTrainedModel):
        adapter = adapter_for(source.config)
        fp8.checkpoint_format(source.config)  # refuses quantizations it cannot run
        if any(parameter.is_inference() for parameter in source.parameters()):
            raise ValueError(
                "this model's weights are inference tensors (it was built or loaded under torch.inference_mode): "
                "tilefx packs them in place, which inference tensors refuse. Build or load it outside "
                "inference_mode, or pass its hub id or directory (compile_model itself may be called inside it)."
            )
        fp8.adopt_fp8_modules(source, adapter.moe and adapter.moe.experts_class)
        if any(weights.checkpoint_scales(p) is not None for p in source.parameters()):
            for tensor in [*source.parameters(), *source.buffers()]:  # .to(dtype) would cast the e4m3 values too
                if tensor.is_floating_point() and weights.checkpoint_scales(tensor) is None:
                    tensor.data = tensor.data.to(dtype)
            return source.eval()
        return source.to(dtype).eval()
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source
    config, kwargs = load_config(name, trust_remote_code=trust_remote_code, revision=revision,
                                 local_files_only=local_files_only)
    adapter = adapter_for(config)
    quantized = fp8.checkpoint_format(config) == "fp8"
    with weights.checkpoint_pages_bounded(), fp8.loading_quantized() if quantized else contextlib.nullcontext():
        # the packing that follows reads the rest once, chunk by chunk
        model = AutoModelForCausalLM.from_pretrained(
            name, config=config, dtype=dtype, use_safetensors=True, attn_implementation="sdpa", **kwargs
        ).eval()
    if quantized:
        fp8.adopt_fp8_modules(model, adapter.moe and adapter.moe.experts_class)
    return model


def load_config(source, *, trust_remote_code: bool = False, revision: str | None = None,
                local_files_only: bool = False):
    """``(config, from_pretrained keyword arguments)`` of a hub id or local directory, with errors that say where
    the model was looked for."""
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"expected a hub id, a local directory or a PreTrainedModel, got {type(source).__name__}")
    name = os.fspath(source)
    is_local = pathlib.Path(name).is_dir()
    if not is_local and (pathlib.Path(name).exists() or name.startswith((".", "/", "~"))):
        raise ModelNotFoundError(f"{name!r} is not a directory holding a Hugging Face model (config.json + safetensors)")
    kwargs = dict(trust_remote_code=trust_remote_code, revision=revision, local_files_only=local_files_only or is_local)
    try:
        return AutoConfig.from_pretrained(name, **kwargs), kwargs
    except OSError as error:
        if is_local:
            raise ModelNotFoundError(f"{name!r} has no readable config.json: {error}") from error
        raise ModelNotFoundError(
            f"could not load {name!r}: it is not a local directory, not in the Hugging Face cache, and the hub "
            f"could not be reached ({type(error).__name__}). Download it on a machine with access "
            f"(`hf download {name} --local-dir DIR`) and pass DIR, or point HF_HOME at a cache that holds it."
        ) from error


def load_shard(source, config, plan, ctx, *, dtype: torch.dtype = torch.bfloat16, revision: str | None = None,
               local_files_only: bool = False) -> PreTrainedModel:
    """Tensor parallel rank ``ctx.rank``'s part of ``source`` (models/tp.py): only its slices are read."""
    from tilefx.models import tp

    directory = tp.resolve_directory(os.fspath(source), revision=revision, local_files_only=local_files_only)
    with weights.checkpoint_pages_bounded():  # what the rank reads of the files, it copies: the mapped pages go
        return tp.load_shard(directory, config, plan, ctx, dtype)
