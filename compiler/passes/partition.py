"""Partition pass: the collectives a tensor-parallel rank's graph needs (models/shard_loading.py loads the rank).

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

The pass runs after the MoE pass (a ``tilefx.fused_moe`` whose experts' down_proj is
split by columns is a row-parallel region; a shared expert added to it joins the same
reduction) and before the linear pass, on HF's linear and embedding calls. A weight
split by columns that something else reads is an error, not wrong output.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import LINEAR, example_value, linear_args, model_parameter, run_fake
from tilefx.custom_ops import weights

_ADDS = (operator.add, torch.add, operator.iadd)
_SCALES = (operator.mul, torch.mul, operator.truediv, torch.div)  # partial * full is partial
_VIEWS = {"view", "reshape", "contiguous", "unsqueeze", "squeeze", "flatten"}


def _shard(node) -> weights.Shard | None:
    param = model_parameter(node)
    return weights.shard_of(param) if param is not None else None


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
        self._check_row_parallel_reads(graph)
        return result

    def _check_row_parallel_reads(self, graph: torch.fx.Graph) -> None:
        """A rowwise weight read by anything but a linear or the experts' packing would compute with a slice of a
        weight as if it were whole: an error, not wrong tokens."""
        for node in graph.nodes:
            shard = _shard(node)
            if shard is None or shard.style != "rowwise":
                continue
            for user in node.users:
                packs_experts = any(u.op == "call_function" and u.target is torch.ops.tilefx.fused_moe.default
                                    for u in user.users)
                linear = user.op == "call_function" and user.target in LINEAR
                cast_for_linear = user.op == "call_method" and user.target == "float" and all(
                    u.op == "call_function" and u.target in LINEAR for u in user.users)
                if not (linear or cast_for_linear or packs_experts):
                    raise RuntimeError(
                        f"tensor parallel: {node.target} is split by input columns, but {user.format_node()} reads "
                        f"it as a whole weight; no collective covers that use (a MoE block left to HF's code? "
                        f"see tilefx.explain's moe pass)")

    def _embeddings(self, graph: torch.fx.Graph, result: PassResult) -> None:
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target is torch.nn.functional.embedding]:
            shard = _shard(node.args[1])
            if shard is None:
                continue
            ids, weight = node.args[:2]
            rows = int(example_value(weight).shape[0])
            first = shard.index * rows
            with graph.inserting_before(node):
                local = run_fake(graph.call_function(torch.sub, (ids, first)))
                above = run_fake(graph.call_function(torch.ge, (local, 0)))
                below = run_fake(graph.call_function(torch.lt, (local, rows)))
                mine = run_fake(graph.call_function(torch.logical_and, (above, below)))
                clamped = run_fake(graph.call_function(torch.clamp, (local, 0, rows - 1)))
            node.update_arg(0, clamped)
            with graph.inserting_after(node):
                keep = run_fake(graph.call_function(torch.unsqueeze, (mine, -1)))
            with graph.inserting_after(keep):
                masked = run_fake(graph.call_function(torch.mul, (node, keep)))
            with graph.inserting_after(masked):
                summed = run_fake(graph.call_function(torch.ops.tilefx.all_reduce.default, (masked, self.group)))
            node.replace_all_uses_with(summed, delete_user_cb=lambda user: user is not masked)
            result.rewritten += 1

    @staticmethod
    def _row_parallel_output(node: torch.fx.Node) -> bool:
        """A linear over a rowwise weight, or a fused_moe over experts whose down_proj is split by columns."""
        if node.op != "call_function":
            return False
        if node.target in LINEAR:
            shard = _shard(linear_args(node)[1])
        elif node.target is torch.ops.tilefx.fused_moe.default:
            packing = node.args[2]  # w2: the packing op of the experts' down_proj
            shard = _shard(packing.args[0]) if isinstance(packing, torch.fx.Node) and packing.args else None
        else:
            return False
        return shard is not None and shard.style == "rowwise"

    @staticmethod
    def _stays_partial(node: torch.fx.Node, partial: set) -> bool:
        """Sums and scalings of partial sums are partial sums: one all-reduce after them covers the region."""
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        mine = [a for a in tensors if a in partial]
        if node.op == "call_method" and node.target in _VIEWS:
            return tensors[:1] == mine
        if node.op != "call_function" or node.kwargs:
            return False
        if node.target in _ADDS:
            return len(node.args) == 2 and len(mine) == 2
        if node.target in _SCALES:  # partial * full (a gate, a routing weight): not partial * partial
            return len(mine) == 1 and (node.target in (operator.mul, torch.mul) or node.args[0] in partial)
        return False

    def _row_parallel(self, graph: torch.fx.Graph, result: PassResult) -> None:
        partial: dict[torch.fx.Node, torch.dtype] = {}  # partial sum -> the dtype the region hands on
        reduced: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if self._row_parallel_output(node):
                partial[node] = example_value(node).dtype
                self._in_fp32(graph, node)
                continue
            inputs = [a for a in node.all_input_nodes if a in partial]
            if not inputs:
                continue
            if self._stays_partial(node, partial):
                partial[node] = partial[inputs[0]]
                run_fake(node)  # its inputs may now be fp32
                continue
            for source in inputs:
                if source not in reduced:
                    reduced[source] = self._reduce(graph, source, partial[source])
                    result.rewritten += 1
                node.replace_input_with(source, reduced[source])

    def _reduce(self, graph: torch.fx.Graph, source: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
        """``all_reduce(source)``, cast back to the region's dtype where its partials were summed in fp32."""
        with graph.inserting_after(source):
            summed = run_fake(graph.call_function(torch.ops.tilefx.all_reduce.default, (source, self.group)))
        if example_value(source).dtype == dtype:
            return summed
        with graph.inserting_after(summed):
            return run_fake(graph.call_method("to", (summed, dtype)))

    @staticmethod
    def _in_fp32(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
        """A bf16 row-parallel linear without bias -> ``linear(x.float(), W.float())``: its partial sum stays fp32
        until the ranks' parts are added (the linear pass runs it as ``tilefx.linear_float`` on the packed bf16
        weight: the same products, not rounded to bf16 first). One rounding after the sum, as without tp."""
        if node.target not in LINEAR:
            return
        x, weight, bias = linear_args(node)
        value = example_value(node)
        if bias is not None or value is None or value.dtype != torch.bfloat16:
            return
        with graph.inserting_before(node):
            x32 = run_fake(graph.call_method("float", (x,)))
            w32 = run_fake(graph.call_method("float", (weight,)))
        node.args, node.kwargs = (x32, w32), {}
        run_fake(node)

    def _logits(self, graph: torch.fx.Graph, result: PassResult) -> None:
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in LINEAR]:
            shard = _shard(linear_args(node)[1])
            if shard is None or shard.style not in ("colwise_gather_output", "vocab"):  # vocab: lm_head tied
                continue
            with graph.inserting_after(node):
                gathered = run_fake(graph.call_function(torch.ops.tilefx.all_gather.default,
                                                        (node, self.group, shard.size)))
            node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
            result.rewritten += 1
