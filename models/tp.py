"""Tensor parallelism, before anything compiles: the process group, each rank's place, its shard of the weights.

``compile_model(source, tp=N)`` under torchrun (SPMD: every rank runs the same script):

1. ``join`` joins the process group torchrun set up (or initialises one from torchrun's
   environment) and checks its size is N; ``plan_for`` checks, from the config alone,
   that the heads, KV heads and MLP width split N ways (KV heads fewer than N are
   replicated: N a multiple of them) and returns the rank's local config: the same
   model with ``heads / N``, ``kv_heads / N`` (at least 1) and ``intermediate / N``.
   Nothing is loaded before these checks pass.
2. ``bind`` gives each rank its cores and memory (models/placement.py).
3. ``load_shard`` builds the local model on the meta device and reads only the
   rank's slice of each tensor from the safetensors files: the HF plan
   (``base_model_tp_plan``; ``colwise`` rows, ``rowwise`` columns) decides the dim,
   tilefx adds the vocabulary split of the embedding and ``lm_head``. Each sharded
   parameter is marked with its ``weights.Shard``; the partition pass
   (compiler/passes/partition.py) reads those marks to insert the collectives.

Because the model is built from the local config, Dynamo traces each rank's own
graph (local head counts and shapes come from the module code itself); the partition
pass adds only what the split changes: the sums after row-parallel layers, the
masked embedding lookup and the logits' gather.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import contextlib
import functools
import json
import os
import pathlib

import torch

from tilefx.custom_ops import weights

# HF plan styles -> the dim split, counted from the end: -2 output rows (of each expert for 3-D experts), -1 inputs.
# packed_colwise: the experts' fused gate_up [E, 2I, H], each half split alike.
_STYLES = {"colwise": -2, "rowwise": -1, "colwise_gather_output": -2, "vocab": -2, "packed_colwise": -2}
# (mla_kv_a_proj: DeepSeek's latent projection, which every rank computes whole for its heads)
_REPLICATED = ("replicated", "replicated_with_grad_allreduce", "sequence_parallel", "moe_tp_experts", "mla_kv_a_proj")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TensorParallelError(ValueError):
    """tp= cannot run as asked (no process group, a world size other than tp, a model that does not split)."""


@dataclasses.dataclass(frozen=True)
class TPContext:
    rank: int
    world_size: int
    local_rank: int  # among the ranks on this host
    local_world_size: int
    same_host: bool  # every rank on this host: shared-memory collectives


def timeout_seconds() -> float:
    """How long a rank waits for another at a collective before it gives up (``TILEFX_TP_TIMEOUT``, seconds)."""
    return float(os.environ.get("TILEFX_TP_TIMEOUT", "300"))


def join(tp: int) -> TPContext:
    """The process group for ``tp`` ranks: the one that exists, or one initialised from torchrun's environment."""
    import torch.distributed as dist

    if not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"tp={tp!r}: expected a positive int")
    if not dist.is_available():
        raise TensorParallelError(f"tp={tp}: this torch build has no torch.distributed")
    if not dist.is_initialized():
        missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise TensorParallelError(
                f"tp={tp}: no process group, and {', '.join(missing)} not set: run under torchrun "
                f"(`torchrun --nproc-per-node {tp} script.py`) or call torch.distributed.init_process_group first"
            )
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_seconds()))
    world = dist.get_world_size()
    if world != tp:
        raise TensorParallelError(f"tp={tp} but the process group has {world} ranks: start {tp} ranks "
                                  f"(torchrun --nproc-per-node) or pass tp={world}")
    hosts = [None] * world
    dist.all_gather_object(hosts, os.uname().nodename)
    rank = dist.get_rank()
    here = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    return TPContext(rank=rank, world_size=world, local_rank=here.index(rank), local_world_size=len(here),
                     same_host=len(set(hosts)) == 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one model splits ``tp`` ways: each parameter's style, and the local config a rank builds."""

    tp: int
    styles: dict  # parameter-name pattern ("model.layers.*.self_attn.q_proj") -> HF style
    local_config: object
    kv_replicas: int  # ranks sharing one KV head (1: KV heads split evenly)

    def style_of(self, name: str) -> str | None:
        """The style of parameter ``name`` (``...q_proj.weight``; the plan names the module) or of a module's own
        parameter the plan names (``...experts.gate_up_proj``); None: replicated."""
        for path in (name, name.rsplit(".", 1)[0]):
            parts = path.split(".")
            for pattern, style in self.styles.items():
                wanted = pattern.split(".")
                if len(wanted) == len(parts) and all(w in ("*", p) for w, p in zip(wanted, parts)):
                    return style
        return None


def has_moe(config) -> bool:
    from tilefx.models.adapters import adapter_for

    return adapter_for(config).moe is not None


def plan_for(config, tp: int) -> Plan:
    """Check that ``config`` splits ``tp`` ways (from the config alone: before loading) and say how."""
    from tilefx.models import fp8
    from tilefx.models.adapters import adapter_for

    adapter = adapter_for(config)
    family = config.model_type
    quantized = fp8.checkpoint_format(config) == "fp8"
    dims = adapter.attention_dims(config)
    heads, kv_heads = dims["q_heads"], dims["kv_heads"]
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads {heads} is not divisible by {tp}")
    if kv_heads % tp and tp % kv_heads:
        problems.append(f"num_key_value_heads {kv_heads} is neither a multiple nor a divisor of {tp}")
    widths = {"intermediate_size": config.intermediate_size}  # the dense MLP's (Mixtral: each expert's)
    if adapter.moe is not None:
        widths[adapter.moe.expert_size_field] = getattr(config, adapter.moe.expert_size_field)
        if adapter.moe.shared_experts == "sigmoid_gated":
            widths["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
        # DeepSeek: n_shared_experts x moe_intermediate_size wide, split with it
    problems += [f"{field} {width} is not divisible by {tp}" for field, width in widths.items() if width % tp]
    if adapter.moe is not None and not problems:
        field = adapter.moe.expert_size_field
        if not weights.layouts.is_block_aligned(widths[field] // tp):
            problems.append(f"{field} {widths[field]} gives each rank {widths[field] // tp} columns of every expert; "
                            f"the fused experts take multiples of {weights.BLOCK_N}")
    if quantized and not problems:
        problems += _fp8_straddles(config, adapter, dims, widths, tp)
    if problems:
        raise TensorParallelError(f"tp={tp}: {family} does not split {tp} ways: {'; '.join(problems)}")
    styles = {f"model.{pattern}": style for pattern, style in adapter.tp_plan(config).items()}
    if adapter.mla:  # DeepSeek-V3's plan has no attention entries: heads split, the latent projections whole
        for module, style in (("q_proj", "colwise"), ("q_b_proj", "colwise"), ("kv_b_proj", "colwise"),
                              ("o_proj", "rowwise")):
            styles.setdefault(f"model.layers.*.self_attn.{module}", style)
    if adapter.moe is not None and adapter.moe.shared_module:  # HF's plans leave the shared experts whole
        shared = f"model.layers.*.{adapter.moe.block_module}.{adapter.moe.shared_module}"
        for module, style in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise")):
            styles.setdefault(f"{shared}.{module}", style)
    styles.update({"model.embed_tokens": "vocab", "lm_head": "colwise_gather_output"})
    unknown = sorted({s for s in styles.values() if s not in _STYLES and s not in _REPLICATED})
    if unknown:
        raise TensorParallelError(f"tp={tp}: {family}'s tp plan uses {', '.join(unknown)}, which tilefx does not "
                                  f"split; supported: {', '.join([*_STYLES, *_REPLICATED])}")
    local = copy.deepcopy(config)
    local.num_attention_heads = heads // tp
    local.num_key_value_heads = max(1, kv_heads // tp)
    for field, width in widths.items():
        setattr(local, field, width // tp)
    if not adapter.mla:  # (DeepSeek's head_dim is its rope width, which does not change)
        local.head_dim = dims["head_dim"]  # no longer hidden_size / heads
    return Plan(tp=tp, styles=styles, local_config=local, kv_replicas=max(1, tp // kv_heads))


def _fp8_straddles(config, adapter, dims, widths, tp: int) -> list[str]:
    """What each rank would hold of an FP8 checkpoint's linears along a split dim, where that is not whole 128-row
    scale blocks (a block's one scale cannot be split between ranks)."""
    heads, kv_heads, head_dim = dims["q_heads"] // tp, max(1, dims["kv_heads"] // tp), dims["head_dim"]
    if adapter.mla:
        parts = {"q_b_proj rows": heads * head_dim, "kv_b_proj rows": heads * (config.qk_nope_head_dim + config.v_head_dim),
                 "o_proj columns": heads * config.v_head_dim}
    else:
        parts = {"q_proj rows": heads * head_dim, "k_proj / v_proj rows": kv_heads * head_dim,
                 "o_proj columns": heads * head_dim}
    parts.update({f"{field} / {tp}": width // tp for field, width in widths.items()})
    bad = [f"{what} {size}" for what, size in parts.items() if size % weights.FP8_GROUP]
    if not bad:
        return []
    return [f"an FP8 checkpoint's 128 x 128 scale blocks would straddle ranks: each rank would hold {', '.join(bad)} "
            f"(not multiples of {weights.FP8_GROUP}); run with fewer ranks, or from a bf16 checkpoint "
            f"(weights='fp8' quantizes each rank's shard as it packs)"]


def _shard(plan: Plan, name: str, shape: tuple[int, ...], rank: int) -> weights.Shard | None:
    """The part of checkpoint tensor ``name`` (full ``shape``) rank ``rank`` holds."""
    style = plan.style_of(name)
    if style is None or style in _REPLICATED or (style == "rowwise" and name.endswith(".bias")):
        return None
    dim = max(0, len(shape) + _STYLES[style])  # a colwise bias: its only dim
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")) and plan.kv_replicas > 1:
        # fewer KV heads than ranks: each group of kv_replicas ranks holds one whole KV head
        return weights.Shard(dim, rank // plan.kv_replicas, plan.tp // plan.kv_replicas, style, shape[dim])
    return weights.Shard(dim, rank, plan.tp, style, shape[dim])


def _checkpoint_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            files.update({name: path for name in f.keys()})
    if not files:
        raise FileNotFoundError(f"{directory} holds no safetensors files")
    return files


def resolve_directory(name: str, *, revision=None, local_files_only=False) -> pathlib.Path:
    """A local directory as it is; a hub id through the HF cache (downloading its config and safetensors if
    allowed)."""
    if pathlib.Path(name).is_dir():
        return pathlib.Path(name)
    from huggingface_hub import snapshot_download

    return pathlib.Path(snapshot_download(name, revision=revision, local_files_only=local_files_only,
                                          allow_patterns=["*.json", "*.safetensors"]))


def load_shard(directory: pathlib.Path, config, plan: Plan, ctx: TPContext, dtype: torch.dtype):
    """The rank's model: built from ``plan.local_config`` on the meta device, every parameter read from the
    checkpoint as the rank's slice only (``get_slice``), marked with its ``weights.Shard``; ``model.config`` is the
    full model's config again afterwards."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(plan.local_config, dtype=dtype, attn_implementation="sdpa")
    files = _checkpoint_files(directory)
    aliases: dict[str, str] = {}  # model name -> checkpoint name, where they differ
    by_file: dict[pathlib.Path, list[str]] = {}
    params = dict(model.named_parameters())
    for name in params:  # checkpoint names transformers renames on load (its conversion mapping): the model's
        for model_part, checkpoint_part in _RENAMES.get(config.model_type, ()):
            renamed = name.replace(model_part, checkpoint_part)
            if name not in files and renamed in files:
                files[name] = files[renamed]
                aliases[name] = renamed
    experts = {}
    for name in params:
        if name not in files:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            sources = _expert_sources(name, files, params[name].shape[0])
            if sources is None:
                raise KeyError(f"{directory}: the checkpoint has no tensor {name}")
            experts[name] = sources
            continue
        by_file.setdefault(files[name], []).append(name)
    for name, sources in experts.items():
        _set(model, name, *_read_experts(name, sources, files, plan, ctx, dtype, tuple(params[name].shape)))
    for path, names in by_file.items():
        with _open_files() as opened:  # one file's tensors (and scales, which the hub may keep in another file)
            for name in names:
                tensor_slice = opened(path).get_slice(aliases.get(name, name))
                shape = tuple(tensor_slice.get_shape())
                shard = _shard(plan, name, shape, ctx.rank)
                value = _read(tensor_slice, shape, shard, name)
                scales = _read_scales(opened, files, aliases.get(name, name), shard)
                if scales is None:
                    value = value.to(dtype)
                expected = tuple(params[name].shape)
                if name.endswith(".bias") and plan.style_of(name) == "rowwise" and ctx.rank != 0:
                    value = torch.zeros_like(value)  # added once, by rank 0, before the sum
                if shard is not None and shard.style in ("vocab", "colwise_gather_output"):
                    expected = (value.shape[0],) + expected[1:]
                if tuple(value.shape) != expected:
                    raise ValueError(f"{name}: rank {ctx.rank}'s slice is {tuple(value.shape)}, the local model "
                                     f"expects {expected}")
                _set(model, name, value, shard, scales)
    # Persistent buffers the checkpoint holds (DeepSeek-V3's e_score_correction_bias): whole on every rank,
    # in the buffer's own dtype. (The others were computed when the model was built.)
    buffers = [name for name, _ in model.named_buffers() if name in model.state_dict() and name in files]
    with _open_files() as opened:
        for name in buffers:
            module_name, attr = name.rsplit(".", 1)
            module = model.get_submodule(module_name)
            module._buffers[attr] = opened(files[name]).get_tensor(name).to(module._buffers[attr].dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.config = config
    model.generation_config = _generation_config(directory, model.generation_config)
    return model.eval()


def _set(model, name: str, value: torch.Tensor, shard: weights.Shard | None = None, scales=None) -> None:
    """Parameter ``name`` of ``model`` becomes ``value`` (marked with ``shard``, and with its FP8 block ``scales``
    where it holds an FP8 checkpoint's e4m3 values: packing reads it as models/fp8.py's loads)."""
    module_name, attr = name.rsplit(".", 1)
    param = torch.nn.Parameter(value, requires_grad=False)
    if shard is not None:
        weights.attach_shard(param, shard)
    if scales is not None:
        weights.attach_checkpoint_scales(param, scales)
    setattr(model.get_submodule(module_name), attr, param)


@contextlib.contextmanager
def _open_files():
    """``opened(path)``: the safetensors file at ``path``, opened once for the block, all closed at its end."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        yield functools.cache(lambda path: stack.enter_context(safe_open(path, "pt")))


def _read_scales(opened, files: dict, key: str, shard: weights.Shard | None):
    """The rank's ``weight_scale_inv`` blocks of FP8 checkpoint tensor ``key`` (None: not an FP8 weight): the blocks
    of its rows / columns (plan_for checked each rank holds whole blocks). ``opened``: ``_open_files``'s."""
    scale_key = f"{key}_scale_inv"
    if not key.endswith(".weight") or scale_key not in files:
        return None
    return _scale_blocks(opened(files[scale_key]).get_slice(scale_key), shard)


def _scale_blocks(scales, shard: weights.Shard | None) -> torch.Tensor:
    shape = tuple(scales.get_shape())
    if shard is None:
        return scales[:].float()
    group = weights.FP8_GROUP
    size = shard.size
    per_rank = size // shard.count
    begin, end = shard.index * per_rank // group, -(-(shard.index + 1) * per_rank // group)
    index = tuple(slice(None) if d != shard.dim else slice(begin, end) for d in range(len(shape)))
    return scales[index].float().clone()


# (model name part, checkpoint name part) of the renames transformers applies on load, per family.
_RENAMES = {"mixtral": ((".mlp.", ".block_sparse_moe."),)}

# Per-expert checkpoint tensors of the fused 3-D experts transformers builds: (gate, up, down) name templates
# relative to the experts module (Qwen-MoE, DeepSeek) or to Mixtral's block_sparse_moe.experts.
_EXPERT_KEYS = (("{prefix}.{e}.gate_proj.weight", "{prefix}.{e}.up_proj.weight", "{prefix}.{e}.down_proj.weight"),
                ("{mixtral}.{e}.w1.weight", "{mixtral}.{e}.w3.weight", "{mixtral}.{e}.w2.weight"))


def _expert_sources(name: str, files: dict, num_experts: int):
    """``(kind, per-expert checkpoint names)`` that hold fused expert parameter ``name``
    (``...experts.gate_up_proj``: gate and up; ``...experts.down_proj``: down), or None."""
    prefix, attr = name.rsplit(".", 1)
    if attr not in ("gate_up_proj", "down_proj"):
        return None
    mixtral = prefix.replace(".mlp.experts", ".block_sparse_moe.experts")
    for gate, up, down in _EXPERT_KEYS:
        templates = (gate, up) if attr == "gate_up_proj" else (down,)
        names = [[t.format(prefix=prefix, mixtral=mixtral, e=e) for t in templates] for e in range(num_experts)]
        if all(n in files for row in names for n in row):
            return attr, names
    return None


def _read_experts(name: str, sources, files: dict, plan: Plan, ctx: TPContext, dtype, expected):
    """Fused experts parameter ``name`` of the rank's model, stacked from the per-expert tensors' slices: each
    expert's gate and up rows (``packed_colwise``), or its down columns (``rowwise``). Returns it, its Shard and
    its FP8 checkpoint scales (None for a bf16 checkpoint)."""
    attr, names = sources
    style = plan.style_of(name)
    quantized = f"{names[0][0]}_scale_inv" in files
    out = torch.empty(expected, dtype=torch.float8_e4m3fn if quantized else dtype)
    scales = None
    with _open_files() as opened:
        for e, row in enumerate(names):
            parts, part_scales = [], []
            for key in row:
                tensor_slice = opened(files[key]).get_slice(key)
                shape = tuple(tensor_slice.get_shape())
                shard = _shard(plan, name, shape, ctx.rank)  # each expert's 2-D part, split as the fused one
                value = _read(tensor_slice, shape, shard, key)
                parts.append(value if quantized else value.to(dtype))
                if quantized:  # the fused gate_up's scales: gate's blocks, then up's (as transformers stacks them)
                    part_scales.append(_read_scales(opened, files, key, shard))
            out[e] = torch.cat(parts, dim=0)
            if quantized:
                expert_scales = torch.cat(part_scales, dim=0)
                if scales is None:
                    scales = torch.empty((len(names), *expert_scales.shape), dtype=torch.float32)
                scales[e] = expert_scales
    if style is None:
        return out, None, scales
    dim = len(expected) + _STYLES[style]
    return out, weights.Shard(dim, ctx.rank, plan.tp, style, expected[dim] * plan.tp), scales


def _generation_config(directory: pathlib.Path, default):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:
        return default


def _read(tensor_slice, shape: tuple[int, ...], shard: weights.Shard | None, name: str) -> torch.Tensor:
    """The shard's part of a checkpoint tensor; the vocabulary split pads the last rank's rows with zeros."""
    if shard is None:
        return tensor_slice[:]
    size = shape[shard.dim]
    per_rank = -(-size // shard.count)
    begin, end = shard.index * per_rank, min(size, (shard.index + 1) * per_rank)
    if shard.style not in ("vocab", "colwise_gather_output") and size % shard.count:
        raise ValueError(f"{name}: dim {shard.dim} ({size}) does not split {shard.count} ways")
    index = tuple(slice(None) if d != shard.dim else slice(begin, end) for d in range(len(shape)))
    value = tensor_slice[index]
    if value.untyped_storage().nbytes() > value.nbytes:  # a view into the file's whole tensor: own the rows
        value = value.clone()
    if end - begin < per_rank:  # vocabulary rows past the end
        pad = list(value.shape)
        pad[shard.dim] = per_rank - (end - begin)
        value = torch.cat([value, value.new_zeros(pad)], dim=shard.dim)
    return value


def open_collectives(ctx: TPContext):
    """The tensor-parallel group's communicator: shared memory where every rank is on this host, else gloo
    (``TILEFX_TP_COMM=gloo`` forces gloo). Every rank calls it."""
    from tilefx.custom_ops import collectives

    kind = os.environ.get("TILEFX_TP_COMM") or ("shm" if ctx.same_host else "gloo")
    if kind == "shm" and not ctx.same_host:
        raise TensorParallelError("TILEFX_TP_COMM=shm: the ranks are on several hosts; shared memory needs one")
    collectives.close_group(collectives.TP_GROUP)  # a model compiled earlier in this process
    return collectives.open_group(collectives.TP_GROUP, kind, timeout_s=timeout_seconds())


def log_placement(ctx: TPContext, placement, quiet: bool = False) -> None:
    """Rank 0 prints every rank's placement (each rank's report keeps its own)."""
    import sys

    import torch.distributed as dist

    placements = [None] * ctx.world_size
    dist.all_gather_object(placements, (os.uname().nodename, placement.describe()))
    if ctx.rank == 0 and not quiet:
        lines = [f"  rank {r}: {host} {where}" for r, (host, where) in enumerate(placements)]
        print(f"tilefx tp={ctx.world_size}:\n" + "\n".join(lines), file=sys.stderr)
