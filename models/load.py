"""Loading: a hub id, an HF cache entry, a local directory or an already-built model; under tensor parallelism,
a rank's slices of the files.

``compile_model`` loads in two steps. ``resolve_source`` decides what to load before any weight is read: the
config, the family adapter (resolved there once; every later step gets it as an argument) and, with ``tp``, the
rank's place in the process group and the split, checked from the config alone (models/tp.py).
``load_for_rank`` then loads it: the whole model, or the rank's shard (models/shard_loading.py) bound to its
cores, with the group's collectives opened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tilefx.custom_ops import weights
from tilefx.models import fp8, placement, shard_loading
from tilefx.models import tp as tensor_parallel
from tilefx.models.adapters import FamilyAdapter, adapter_for


class ModelNotFoundError(OSError):
    """The model could be found neither locally, in the HF cache, nor on a reachable hub."""


@dataclasses.dataclass(frozen=True)
class Source:
    """What to load, decided before any weight is read."""

    model_or_name: str | PreTrainedModel  # a hub id or directory, or a built model
    config: object
    adapter: FamilyAdapter
    checkpoint_format: str  # "bf16", "fp8" (models/fp8.py) or "int4" (GPTQ / AWQ, models/int4.py)
    from_pretrained: dict  # from_pretrained's keyword arguments (revision, local_files_only, trust_remote_code)
    tp: tensor_parallel.TPContext | None = None  # tensor parallel: this rank's place in the process group
    plan: tensor_parallel.Plan | None = None  # tensor parallel: how the model splits, the rank's local config

    @property
    def rank(self) -> int:
        return self.tp.rank if self.tp is not None else 0

    @property
    def world_size(self) -> int:
        return self.tp.world_size if self.tp is not None else 1

    @property
    def rank_config(self):
        """The config of what this rank computes: the local heads and widths with tensor parallelism."""
        return self.plan.local_config if self.plan is not None else self.config


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A rank's model, ready for packing, and where it runs."""

    model: PreTrainedModel
    cache_config: object  # what the KV cache is sized from: the model's config, or a tp rank's local heads
    placement: str | None = None  # tensor parallel: the rank's CPUs and why (Placement.describe())
    collectives: object | None = None  # tensor parallel: the group's communicator (models/tp.open_collectives)


def resolve_source(
    source: str | os.PathLike | PreTrainedModel,
    *,
    tp: int = 1,
    moe: bool = True,
    trust_remote_code: bool = False,
    revision: str | None = None,
    local_files_only: bool = False,
) -> Source:
    """``source``'s config and family adapter, and with ``tp`` != 1 the process group joined and the split planned
    (every rank calls this with the same arguments); fails, before any weight loads, for unsupported families,
    quantizations and splits. ``moe``: the compile option (tensor parallel needs the MoE pass)."""
    context = None
    if tp != 1:
        if not isinstance(source, (str, os.PathLike)):
            raise tensor_parallel.TensorParallelError(
                f"tp={tp}: pass a hub id or a directory (each rank reads only its slices of the files); a built "
                f"PreTrainedModel already holds every weight")
        context = tensor_parallel.join(tp)
    if isinstance(source, PreTrainedModel):
        config, kwargs = source.config, {}
    else:
        config, kwargs = load_config(source, trust_remote_code=trust_remote_code, revision=revision,
                                     local_files_only=local_files_only)
        source = os.fspath(source)
    adapter = adapter_for(config)
    checkpoint_format = fp8.checkpoint_format(config)  # refuses quantizations it cannot run
    plan = None
    if context is not None:
        plan = tensor_parallel.plan_for(config, adapter, tp)
        if moe is False and adapter.moe is not None:
            raise tensor_parallel.TensorParallelError(
                f"tp={tp} with moe=False: HF's experts code would read experts split across ranks as whole; "
                f"the MoE pass's fused_moe is what the partition pass reduces")
    return Source(source, config, adapter, checkpoint_format, kwargs, context, plan)


def place_rank(source: Source) -> placement.Placement | None:
    """Tensor parallel: bind this rank to its cores (and memory) before anything runs on them; None without tp."""
    if source.tp is None:
        return None
    placed = placement.bind(source.tp.local_rank, source.tp.local_world_size)
    tensor_parallel.log_placement(source.tp, placed, quiet=os.environ.get("TILEFX_QUIET") == "1")
    return placed


def load_for_rank(source: Source, *, dtype: torch.dtype = torch.bfloat16,
                  placed: placement.Placement | None = None, progress: bool = True) -> Loaded:
    """Load what ``resolve_source`` resolved: the whole model, or (tensor parallel, on the cores ``place_rank``
    bound) read only the rank's slices of the files and open the group's collectives. Attention runs as HF's
    sdpa, which the attention pass matches. ``progress``: a bar over the weights read (transformers' own, or the
    shard loader's); off, neither shows."""
    if source.tp is None:
        model = _load(source, dtype, progress)
        loaded = Loaded(model, model.config)
    else:
        placed = placed or place_rank(source)
        directory = shard_loading.resolve_directory(source.model_or_name, revision=source.from_pretrained["revision"],
                                                    local_files_only=source.from_pretrained["local_files_only"])
        scheme = fp8.int4_scheme(source.config) if source.checkpoint_format == "int4" else None
        with weights.checkpoint_pages_bounded():  # what the rank reads of the files, it copies: the mapped pages go
            model = shard_loading.load_shard(directory, source.config, source.adapter, source.plan, source.tp, dtype,
                                             scheme=scheme, progress=progress)
        loaded = Loaded(model, source.plan.local_config, placed.describe(),
                        tensor_parallel.open_collectives(source.tp))
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    return loaded


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
    return _load(resolve_source(source, trust_remote_code=trust_remote_code, revision=revision,
                                local_files_only=local_files_only), dtype)


def _load(resolved: Source, dtype: torch.dtype, progress: bool = True) -> PreTrainedModel:
    adapter, source = resolved.adapter, resolved.model_or_name
    if isinstance(source, PreTrainedModel):
        if any(parameter.is_inference() for parameter in source.parameters()):
            raise ValueError(
                "this model's weights are inference tensors (it was built or loaded under torch.inference_mode): "
                "tilefx packs them in place, which inference tensors refuse. Build or load it outside "
                "inference_mode, or pass its hub id or directory (compile_model itself may be called inside it)."
            )
        fp8.adopt_fp8_modules(source, adapter.moe and adapter.moe.experts_class)
        if any(weights.is_checkpoint_quantized(p) for p in source.parameters()):
            for tensor in [*source.parameters(), *source.buffers()]:  # .to(dtype) would cast the e4m3 values too
                if tensor.is_floating_point() and not weights.is_checkpoint_quantized(tensor):
                    tensor.data = tensor.data.to(dtype)
            return source.eval()
        return source.to(dtype).eval()
    if resolved.checkpoint_format == "int4":  # transformers would need a GPU kernel library: read the files here
        directory = shard_loading.resolve_directory(source, revision=resolved.from_pretrained["revision"],
                                                    local_files_only=resolved.from_pretrained["local_files_only"])
        with weights.checkpoint_pages_bounded():
            return shard_loading.load_shard(directory, resolved.config, adapter, tensor_parallel.Plan.whole(
                resolved.config), None, dtype, scheme=fp8.int4_scheme(resolved.config), progress=progress)
    quantized = resolved.checkpoint_format == "fp8"
    loading = contextlib.nullcontext()
    if quantized:  # each weight's format from the files themselves, before transformers reads one
        directory = shard_loading.resolve_directory(source, revision=resolved.from_pretrained["revision"],
                                                    local_files_only=resolved.from_pretrained["local_files_only"])
        formats = fp8.weight_formats(shard_loading.checkpoint_files(directory))
        loading = fp8.loading_quantized(fp8.modules_to_not_convert(formats, resolved.config, adapter.lm_head))
    # the mapped pages go as they are read; the packing that follows reads the rest once, chunk by chunk
    with weights.checkpoint_pages_bounded(), loading, _transformers_progress(progress):
        model, info = AutoModelForCausalLM.from_pretrained(
            source, config=resolved.config, dtype=dtype, use_safetensors=True, attn_implementation="sdpa",
            output_loading_info=True, **resolved.from_pretrained
        )
    if quantized:
        fp8.refuse_made_up_scales(info["missing_keys"], source)
        fp8.adopt_fp8_modules(model, adapter.moe and adapter.moe.experts_class)
    return model.eval()


@contextlib.contextmanager
def _transformers_progress(enabled: bool):
    """transformers' progress bars (from_pretrained's "Loading weights") off while the block runs, unless
    ``enabled``; as they were afterwards."""
    from transformers.utils import logging as hf_logging

    hide = not enabled and hf_logging.is_progress_bar_enabled()
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


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
