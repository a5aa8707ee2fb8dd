"""Partition pass: the collectives a tensor-parallel rank's graph needs (models/tp.py builds the rank's model).

Each rank's model is the full model's local part: its parameters are the rank's
slices, marked with ``weights.Shard`` by the loader, and its module config has the
local head counts, so Dynamo already traced the rank's own shapes and views. What
the split changes, this pass adds, from the shard marks alone:

- **Row-parallel regions** (``rowwise``: o_proj, down_proj): a linear over the rank's
  input columns gives a partial sum. Partials stay partial through ``add`` of two
  partials (one region may hold several: a shared expert added to the routed ones),
  and the first other use reads one ``tilefx.all_reduce`` of them: one all-reduce per
  region, before the residual add.
- **The embedding** (``vocab``: each rank holds ``ceil(V / N)`` rows): the lookup reads
  the rank's rows at ``ids - first row`` (clamped), zeroes the rows of ids another rank
  holds, and the ranks' lookups are summed (``tilefx.all_reduce``).
- **The logits** (``colwise_gather_output``: ``lm_head`` by vocabulary rows, or tied to the split embedding):
  ``tilefx.all_gather`` puts the ranks' columns side by side and cuts the padding.

The pass runs first, on HF's linear and embedding calls, so the passes after it
(attention, linear packing, a tied embedding read packed) see ordinary local shapes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import LINEAR, example_value, linear_args, model_parameter
from tilefx.custom_ops import weights

_ADDS = (operator.add, torch.add, operator.iadd)


def _shard(node) -> weights.Shard | None:
    param = model_parameter(node)
    return weights.shard_of(param) if param is not None else None


def _fake(node: torch.fx.Node, value) -> torch.fx.Node:
    node.meta["example_value"] = value
    return node


class PartitionPass(TilefxPass):
    name = "partition"

    def __init__(self, group: str, world_size: int):
        self.group = group
        self.world_size = world_size

    def option_key(self) -> str:
        return f"{self.group}:{self.world_size}"

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        self._embeddings(graph, result)
        self._row_parallel(graph, result)
        self._logits(graph, result)
        return result

    def _embeddings(self, graph: torch.fx.Graph, result: PassResult) -> None:
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target is torch.nn.functional.embedding]:
            shard = _shard(node.args[1])
            if shard is None:
                continue
            ids, weight = node.args[:2]
            rows = int(example_value(weight).shape[0])
            first = shard.index * rows
            ids_value = example_value(ids)
            with graph.inserting_before(node):
                flags = ids_value.to(torch.bool)
                local = _fake(graph.call_function(torch.sub, (ids, first)), ids_value)
                above = _fake(graph.call_function(torch.ge, (local, 0)), flags)
                below = _fake(graph.call_function(torch.lt, (local, rows)), flags)
                mine = _fake(graph.call_function(torch.logical_and, (above, below)), flags)
                clamped = _fake(graph.call_function(torch.clamp, (local, 0, rows - 1)), ids_value)
            node.update_arg(0, clamped)
            value = example_value(node)
            with graph.inserting_after(node):
                keep = _fake(graph.call_function(torch.unsqueeze, (mine, -1)), ids_value.to(torch.bool).unsqueeze(-1))
            with graph.inserting_after(keep):
                masked = _fake(graph.call_function(torch.mul, (node, keep)), value)
            with graph.inserting_after(masked):
                summed = _fake(graph.call_function(torch.ops.tilefx.all_reduce.default, (masked, self.group)), value)
            node.replace_all_uses_with(summed, delete_user_cb=lambda user: user is not masked)
            result.rewritten += 1

    def _row_parallel(self, graph: torch.fx.Graph, result: PassResult) -> None:
        partial: set[torch.fx.Node] = set()
        reduced: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in LINEAR:
                shard = _shard(linear_args(node)[1])
                if shard is not None and shard.style == "rowwise":
                    partial.add(node)
                    continue
            inputs = [a for a in node.all_input_nodes if a in partial]
            if not inputs:
                continue
            if node.op == "call_function" and node.target in _ADDS and all(
                    a in partial for a in node.args if isinstance(a, torch.fx.Node)) and len(node.args) == 2:
                partial.add(node)  # partial + partial: still one region
                continue
            for source in inputs:
                if source not in reduced:
                    with graph.inserting_after(source):
                        reduced[source] = _fake(graph.call_function(
                            torch.ops.tilefx.all_reduce.default, (source, self.group)), example_value(source))
                    result.rewritten += 1
                node.replace_input_with(source, reduced[source])

    def _logits(self, graph: torch.fx.Graph, result: PassResult) -> None:
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in LINEAR]:
            shard = _shard(linear_args(node)[1])
            if shard is None or shard.style not in ("colwise_gather_output", "vocab"):  # vocab: lm_head tied
                continue
            value = example_value(node)
            full = value.new_empty((*value.shape[:-1], shard.size))
            with graph.inserting_after(node):
                gathered = _fake(graph.call_function(torch.ops.tilefx.all_gather.default,
                                                     (node, self.group, shard.size)), full)
            node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
            result.rewritten += 1
