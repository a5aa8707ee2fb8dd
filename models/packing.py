"""Packing a loaded model's weights, layer by layer, each source released as its packed copy exists.

What is packed how comes from the family adapter (``sibling_linears``,
``gated_linears``, the MoE experts and router classes, the decoder layers' path)
and the compile options, and
every decision about formats and block sizes from ``weights.can_pack``:

- sibling linears of one module that read one input (q/k/v; DeepSeek's q_a / kv_a)
  -> one ``linear`` packing, the siblings' blocks one after another;
- a gated MLP's gate and up -> one ``gate_up`` packing (SiLU-and-mul epilogue);
- MoE experts -> ``expert_gate_up`` and ``expert_down``;
- every other linear and each router weight -> its own ``linear`` packing
  (a tied ``lm_head`` included: the linear pass then reads the input embedding
  from the same packed tensor);
- in the format ``options.weights`` asks for (quantized as they pack, chunk by chunk:
  ``weights.quantize_rows``) where ``weights.can_pack`` accepts it; ``auto``: what the
  checkpoint holds (an FP8 checkpoint's e4m3 values and scales are copied as they are,
  models/fp8.py; other formats dequantize them a chunk at a time); routers stay bf16
  and so, for now, does MLA's absorbed ``kv_b_proj`` (an FP8 checkpoint's is
  dequantized in place: nothing packs it at load);
- left unpacked: embeddings (read a few rows a token), norms, biases, and, with the
  MLA pass on, DeepSeek's ``kv_b_proj`` (the pass absorbs it per head, two packings
  of one weight; it is small).

``release`` hands each source's memory back as soon as its packed copy exists, so
the peak is the checkpoint plus one group's packed copy. The linear, MoE and MLA
passes find these packings (``weights.packings_of``) and read them as they are.
"""

from __future__ import annotations

import dataclasses
import re
import time

import torch
from tqdm.auto import tqdm

from tilefx.compiler.report import PackSummary
from tilefx.custom_ops import weights
from tilefx.models.adapters import FamilyAdapter



@dataclasses.dataclass
class PackGroup:
    layout: str
    names: tuple[str, ...]  # the parameters' names in the model
    params: tuple[torch.nn.Parameter, ...]
    format: str = "bf16"
    kept_bf16: str | None = None  # why the group stays bf16 where another format was asked for
    stored: str | None = None  # with weights="auto": the format the checkpoint holds the group in


# weights="int4": the lm_head (and the input embedding tied to it) in this format, chosen on the quality table
# (docs/PERFORMANCE.md, scripts/bench_quality.py): the logits are where 4 bits cost the most for the least bytes.
INT4_LM_HEAD = "int8"

# Weights that stay bf16 whatever format is asked for, and why (tilefx.explain lists them).
_ROUTER_BF16 = "router weights (which experts run turns on small logit differences)"


_DEQUANTIZED = ("quantized checkpoint weights read unpacked (MLA's absorbed kv_b_proj; any linear with linear=False): "
                "dequantized to bf16 at load")


def _own_format(params) -> str:
    """What the checkpoint holds: fp8 / int4 where every source arrived so (models/fp8.py, models/int4.py), else
    bf16."""
    held = {weights.checkpoint_format(p) for p in params}
    return held.pop() if len(held) == 1 else "bf16"


def _formatted(group: PackGroup, format: str) -> PackGroup:
    """``group`` in ``format`` (``auto``: the checkpoint's) where its layout takes it, else bf16 and why."""
    if format == "auto":
        format = group.stored = _own_format(group.params)
    if format != "bf16":
        why = weights.can_pack(group.layout, group.params, format=format)
        if why is None:
            group.format = format
        else:
            group.kept_bf16 = why
    return group


def _linear_children(module: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: child for name, child in module.named_children() if isinstance(child, torch.nn.Linear)}


def _bias_state(linears) -> set[bool]:
    return {linear.bias is not None for linear in linears}


def plan(model: torch.nn.Module, adapter: FamilyAdapter, options) -> list[tuple[str, list[PackGroup]]]:
    """``[(module path, groups)]`` in module order: what ``pack_model`` packs, per top-level part (one entry per
    decoder layer, then the rest). ``adapter``: the model's family's (models/adapters.py)."""
    layers = re.compile(rf"^{re.escape(adapter.layers)}\.\d+")
    gated = options.fuse_linears and getattr(model.config, "hidden_act", "silu") == "silu"
    format = options.weights  # auto: each group's own (_formatted)
    taken: set[int] = set()
    parts: dict[str, list[PackGroup]] = {}

    for name, module in model.named_modules():
        layer = layers.match(name)
        part = layer.group(0) if layer else "model"
        cls = type(module).__name__
        if adapter.moe is not None and options.moe and cls == adapter.moe.experts_class:
            experts_pair = (module.gate_up_proj, module.down_proj)
            if weights.can_pack("experts", experts_pair) is None:
                for layout, param in zip(("expert_gate_up", "expert_down"), experts_pair):
                    taken.add(id(param))
                    parts.setdefault(part, []).append(_formatted(
                        PackGroup(layout, (f"{name}.{layout[7:]}_proj",), (param,)), format))
            continue
        if not options.linear:
            continue
        if adapter.moe is not None and cls == adapter.moe.router_class and isinstance(
                getattr(module, "weight", None), torch.nn.Parameter) and module.weight.dim() == 2:
            asked = _own_format([module.weight]) if format == "auto" else format
            _add_single(parts, taken, part, f"{name}.weight", module.weight, "bf16",
                        kept_bf16=_ROUTER_BF16 if asked != "bf16" else None)
            continue
        linears = _linear_children(module)
        if options.fuse_linears:
            for siblings in adapter.sibling_linears:
                group = [linears.get(s) for s in siblings]
                if None in group or len(_bias_state(group)) != 1:
                    continue
                order = sorted(range(len(group)), key=lambda i: not weights.layouts.is_block_aligned(group[i].out_features))
                params = [group[i].weight for i in order]
                if weights.can_pack("linear", params) is None and not any(id(p) in taken for p in params):
                    taken.update(id(p) for p in params)
                    parts.setdefault(part, []).append(_formatted(
                        PackGroup("linear", tuple(f"{name}.{siblings[i]}.weight" for i in order), tuple(params)), format))
                break
        gate, up = (linears.get(n) for n in adapter.gated_linears)
        if gated and gate is not None and up is not None and gate.bias is None and up.bias is None:
            params = [gate.weight, up.weight]
            if weights.can_pack("gate_up", params) is None and not any(id(p) in taken for p in params):
                taken.update(id(p) for p in params)
                parts.setdefault(part, []).append(_formatted(
                    PackGroup("gate_up", tuple(f"{name}.{n}.weight" for n in adapter.gated_linears), tuple(params)),
                    format))
        for child, linear in linears.items():
            if adapter.mla and options.mla and child == adapter.mla_absorbed:  # the MLA pass packs it per head
                continue
            path = f"{name}.{child}" if name else child
            _add_single(parts, taken, part, f"{path}.weight", linear.weight,
                        INT4_LM_HEAD if format == "int4" and path == adapter.lm_head else format)
    rest = parts.pop("model", [])  # the root's linears (lm_head) come first in module order
    return [*parts.items(), *([("model", rest)] if rest else [])]


def _add_single(parts, taken: set[int], part: str, name: str, param, format: str,
                kept_bf16: str | None = None) -> None:
    if id(param) not in taken and param.dim() == 2 and weights.can_pack("linear", [param]) is None:
        taken.add(id(param))
        group = PackGroup("linear", (name,), (param,), kept_bf16=kept_bf16)
        parts.setdefault(part, []).append(_formatted(group, format))


def narrow_exact_routers(model: torch.nn.Module, adapter: FamilyAdapter) -> int:
    """Router weights held in fp32 whose values bf16 holds exactly go back to bf16; returns how many.

    transformers 5.24 keeps DeepSeek's router weights in fp32 (``_keep_in_fp32_modules_strict``)
    although the hub ships them in bf16, so after a load they are fp32 copies of bf16 values.
    As bf16 they take half the bytes and are packed as every router is; the products do not
    change (the router casts its weight to fp32 before the linear: the linear pass's
    ``linear_float``). A router that really holds fp32 values stays as it is, unpacked.
    """
    moe = adapter.moe
    narrowed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if moe is None or type(module).__name__ != moe.router_class or not isinstance(weight, torch.nn.Parameter):
            continue
        if weight.dtype == torch.float32 and weight.dim() == 2:
            as_bf16 = weight.detach().to(torch.bfloat16)
            if torch.equal(as_bf16.float(), weight.detach()):
                weight.data = as_bf16
                narrowed += 1
    return narrowed


def pack_model(model: torch.nn.Module, adapter: FamilyAdapter, options, *, progress: bool = True) -> PackSummary:
    """Pack every weight ``plan`` names, one part (decoder layer) at a time, releasing each source at once."""
    summary = PackSummary()
    start = time.perf_counter()
    narrow_exact_routers(model, adapter)
    parts = plan(model, adapter, options)
    quantized_checkpoint = any(group.stored in ("fp8", "int4") for _, groups in parts for group in groups)
    with torch.no_grad():
        for _, groups in tqdm(parts, desc="tilefx: packing weights", unit="layer", disable=not progress,
                              leave=False):
            for group in groups:
                try:
                    packed = weights.pack(group.layout, list(group.params), names=group.names, format=group.format)
                except ValueError as error:
                    raise ValueError(f"packing {', '.join(group.names)}: {error}") from error
                summary.add(group.format, weights.packing_of(group.params[0]).nbytes)  # values and scales
                if group.kept_bf16:
                    summary.kept_bf16[group.kept_bf16] = summary.kept_bf16.get(group.kept_bf16, 0) + 1
                if quantized_checkpoint and group.stored == "bf16":  # a bf16 tensor of a quantized checkpoint is bf16
                    summary.stored_bf16.extend(group.names)
                summary.released_bytes += weights.release(packed)
        # A quantized checkpoint's weights no packing took (MLA's kv_b_proj, absorbed per head when the graph
        # compiles; every linear with linear=False) run as bf16 in the graphs.
        for name, param in model.named_parameters():
            if weights.is_checkpoint_quantized(param):
                try:
                    weights.dequantize_checkpoint_weight(param)
                except ValueError as error:
                    raise ValueError(f"dequantizing {name}: {error}") from error
                summary.kept_bf16[_DEQUANTIZED] = summary.kept_bf16.get(_DEQUANTIZED, 0) + 1
        # What loading read but no weight keeps (per-expert tensors transformers fused) leaves the process.
        weights.drop_unused_file_pages([*model.parameters(), *model.buffers()])
    summary.seconds = time.perf_counter() - start
    return summary
