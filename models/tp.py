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
import json
import logging
import os
import pathlib

import torch

from tilefx.custom_ops import weights

log = logging.getLogger("tilefx")

# HF plan styles -> the dim of the weight that is split (None: every rank holds all of it).
_STYLES = {"colwise": 0, "rowwise": 1, "colwise_gather_output": 0, "vocab": 0}
_REPLICATED = ("replicated", "replicated_with_grad_allreduce", "sequence_parallel")
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
        """The style of parameter ``name`` (``...q_proj.weight``) or None (replicated)."""
        module = name.rsplit(".", 1)[0]
        parts = module.split(".")
        for pattern, style in self.styles.items():
            wanted = pattern.split(".")
            if len(wanted) == len(parts) and all(w in ("*", p) for w, p in zip(wanted, parts)):
                return style
        return None


def plan_for(config, tp: int) -> Plan:
    """Check that ``config`` splits ``tp`` ways (from the config alone: before loading) and say how."""
    from tilefx.models.adapters import adapter_for

    adapter = adapter_for(config)
    family = config.model_type
    if adapter.moe is not None or adapter.mla:
        raise TensorParallelError(
            f"tp={tp}: {family} is {'an MLA' if adapter.mla else 'a MoE'} family; tensor parallelism runs the dense "
            f"families so far (llama, qwen2, qwen3). Run it with tp=1."
        )
    from tilefx.models import fp8

    if fp8.checkpoint_format(config) != "bf16":
        raise TensorParallelError(f"tp={tp}: FP8 checkpoints are not split yet; run with tp=1 or from a bf16 "
                                  f"checkpoint (weights='fp8' quantizes each rank's shard as it packs)")
    dims = adapter.attention_dims(config)
    heads, kv_heads = dims["q_heads"], dims["kv_heads"]
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads {heads}")
    if kv_heads % tp and tp % kv_heads:
        problems.append(f"num_key_value_heads {kv_heads} (neither a multiple nor a divisor of tp)")
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size {config.intermediate_size}")
    if problems:
        raise TensorParallelError(f"tp={tp}: {family} does not split {tp} ways: {'; '.join(problems)} not divisible "
                                  f"by {tp}")
    styles = {f"model.{pattern}": style for pattern, style in adapter.tp_plan(config).items()}
    styles.update({"model.embed_tokens": "vocab", "lm_head": "colwise_gather_output"})
    unknown = sorted({s for s in styles.values() if s not in _STYLES and s not in _REPLICATED})
    if unknown:
        raise TensorParallelError(f"tp={tp}: {family}'s tp plan uses {', '.join(unknown)}, which tilefx does not "
                                  f"split; supported: {', '.join([*_STYLES, *_REPLICATED])}")
    local = copy.deepcopy(config)
    local.num_attention_heads = heads // tp
    local.num_key_value_heads = max(1, kv_heads // tp)
    local.intermediate_size = config.intermediate_size // tp
    local.head_dim = dims["head_dim"]  # no longer hidden_size / heads
    return Plan(tp=tp, styles=styles, local_config=local, kv_replicas=max(1, tp // kv_heads))


def _shard(plan: Plan, name: str, shape: tuple[int, ...], rank: int) -> weights.Shard | None:
    """The part of checkpoint tensor ``name`` (full ``shape``) rank ``rank`` holds."""
    style = plan.style_of(name)
    if style is None or style in _REPLICATED or (style == "rowwise" and name.endswith(".bias")):
        return None
    dim = _STYLES[style]
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
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(plan.local_config, dtype=dtype, attn_implementation="sdpa")
    files = _checkpoint_files(directory)
    by_file: dict[pathlib.Path, list[str]] = {}
    params = dict(model.named_parameters())
    for name in params:
        if name not in files:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            raise KeyError(f"{directory}: the checkpoint has no tensor {name}")
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, "pt") as f:
            for name in names:
                tensor_slice = f.get_slice(name)
                shape = tuple(tensor_slice.get_shape())
                shard = _shard(plan, name, shape, ctx.rank)
                value = _read(tensor_slice, shape, shard, name, ctx.rank).to(dtype)
                module_name, attr = name.rsplit(".", 1)
                module = model.get_submodule(module_name)
                expected = tuple(params[name].shape)
                if name.endswith(".bias") and plan.style_of(name) == "rowwise" and ctx.rank != 0:
                    value = torch.zeros_like(value)  # added once, by rank 0, before the sum
                if shard is not None and shard.style in ("vocab", "colwise_gather_output"):
                    expected = (value.shape[0],) + expected[1:]
                if tuple(value.shape) != expected:
                    raise ValueError(f"{name}: rank {ctx.rank}'s slice is {tuple(value.shape)}, the local model "
                                     f"expects {expected}")
                param = torch.nn.Parameter(value, requires_grad=False)
                if shard is not None:
                    weights.attach_shard(param, shard)
                setattr(module, attr, param)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.config = config
    model.generation_config = _generation_config(directory, model.generation_config)
    return model.eval()


def _generation_config(directory: pathlib.Path, default):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:
        return default


def _read(tensor_slice, shape: tuple[int, ...], shard: weights.Shard | None, name: str, rank: int) -> torch.Tensor:
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

    from tilefx.compiler.report import _cpu_ranges

    placements = [None] * ctx.world_size
    dist.all_gather_object(placements, (os.uname().nodename, _cpu_ranges(placement.cpus), placement.how))
    if ctx.rank == 0 and not quiet:
        lines = [f"  rank {r}: {host} cpus {cpus} ({how})" for r, (host, cpus, how) in enumerate(placements)]
        print(f"tilefx tp={ctx.world_size}:\n" + "\n".join(lines), file=sys.stderr)
