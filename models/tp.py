"""Tensor parallelism, before anything loads: the process group, and how the model splits across it.

``compile_model(source, tp=N)`` under torchrun (SPMD: every rank runs the same script):

1. ``join`` joins the process group torchrun set up (or initialises one from torchrun's
   environment) and checks its size is N; ``plan_for`` checks, from the config alone,
   that the heads, KV heads and MLP width split N ways (KV heads fewer than N are
   replicated: N a multiple of them) and returns the rank's local config: the same
   model with ``heads / N``, ``kv_heads / N`` (at least 1) and ``intermediate / N``.
   Nothing is loaded before these checks pass.
   Which parameter splits along which dim is the family adapter's ``tp_plan``: the HF
   plan (``base_model_tp_plan``; ``colwise`` rows, ``rowwise`` columns), the family's
   extras, and tilefx's vocabulary split of the embedding and ``lm_head``;
   ``Plan.shard_of`` gives the part of a tensor a rank holds.
2. ``bind`` gives each rank its cores and memory (models/placement.py).
3. models/shard_loading.py builds the local model on the meta device and reads only
   the rank's slice of each tensor from the safetensors files, each sharded parameter
   marked with its ``weights.Shard``; the partition pass (compiler/passes/partition.py)
   reads those marks to insert the collectives.

models/load.py runs these steps for ``compile_model(source, tp=N)``.

Because the model is built from the local config, Dynamo traces each rank's own
graph (local head counts and shapes come from the module code itself); the partition
pass adds only what the split changes: the sums after row-parallel layers, the
masked embedding lookup and the logits' gather.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os

from tilefx.custom_ops import weights
from tilefx.models import fp8
from tilefx.models.adapters import FamilyAdapter

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
    kv_linears: tuple[str, ...] = ()  # the attention linears whose rows are KV heads (the adapter's)

    @classmethod
    def whole(cls, config) -> "Plan":
        """No split: every parameter whole (the shard loader reading a whole 4-bit checkpoint, models/int4.py)."""
        return cls(tp=1, styles={}, local_config=config, kv_replicas=1)

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

    def shard_of(self, name: str, shape: tuple[int, ...], rank: int) -> weights.Shard | None:
        """The part of checkpoint tensor ``name`` (full ``shape``) rank ``rank`` holds; None: all of it."""
        style = self.style_of(name)
        if style is None or style in _REPLICATED or (style == "rowwise" and name.endswith(".bias")):
            return None
        dim = max(0, len(shape) + _STYLES[style])  # a colwise bias: its only dim
        kv = tuple(f"{linear}.{kind}" for linear in self.kv_linears for kind in ("weight", "bias"))
        if kv and name.endswith(kv) and self.kv_replicas > 1:
            # fewer KV heads than ranks: each group of kv_replicas ranks holds one whole KV head
            return weights.Shard(dim, rank // self.kv_replicas, self.tp // self.kv_replicas, style, shape[dim])
        return weights.Shard(dim, rank, self.tp, style, shape[dim])

    def local_shard_of(self, name: str, local_shape: tuple[int, ...], rank: int) -> weights.Shard | None:
        """The ``Shard`` of parameter ``name`` that rank ``rank`` holds as ``local_shape`` (a fused experts
        parameter stacked from per-expert slices); None: not split."""
        style = self.style_of(name)
        if style is None:
            return None
        dim = len(local_shape) + _STYLES[style]
        return weights.Shard(dim, rank, self.tp, style, local_shape[dim] * self.tp)


def plan_for(config, adapter: FamilyAdapter, tp: int) -> Plan:
    """Check that ``config`` splits ``tp`` ways (from the config alone: before loading) and say how. ``adapter``:
    the family's (models/adapters.py), which names what splits how."""
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
    styles = adapter.tp_plan(config)
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
    return Plan(tp=tp, styles=styles, local_config=local, kv_replicas=max(1, tp // kv_heads),
                kv_linears=adapter.kv_linears)


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
