"""MoE pass: each HF sparse MoE block's routing and experts -> ``tilefx.<router op>`` + ``tilefx.fused_moe``.

Regions are found by the module that traced them (Dynamo's ``nn_module_stack``),
not by the shape of the code inside, so the pass works whichever experts
implementation HF ran (``grouped_mm``, ``batched_mm``, ...) and whatever each
family's router looks like:

- experts region: every node traced inside the block's experts module (the family
  adapter names it, as it names the router and the block). Its inputs are the
  hidden states ``x [T, H]``, the routing weights and expert ids ``[T, k]`` and the
  fused 3-D parameters ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; its one
  output (``[T, H]``) becomes ``tilefx.fused_moe`` over the packed experts.
- routing: the nodes between the router's logits (the linear traced inside
  router module) and the experts' weights/ids inputs, wherever they were traced
  (the router module or the block). They become the router op the family's
  ``Routing`` names (computing exactly what HF computes), then casts to the dtypes HF
  handed the experts.

Preconditions (else the block is left alone and the reason recorded): experts
``weights.can_pack`` accepts (packed once: the packing ops become graph inputs),
exactly one experts output, a router linear and both routing inputs
found. Shared experts are ordinary MLPs: the linear pass fuses their gate/up.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import (
    LINEAR,
    ancestors,
    descendants,
    example_value,
    inside,
    model_parameter,
    module_path,
    packing_node,
    region_inputs,
)
from tilefx.custom_ops import weights as packed_weights



class MoePass(TilefxPass):
    name = "moe"

    def __init__(self, blocks: dict):
        """``blocks``: module path of each sparse MoE block (``model.layers.3.mlp``) -> its ``MoeBlock``
        (models/adapters.py: the experts' and router's module paths and the routing rule)."""
        self.blocks = dict(blocks)

    def option_key(self) -> str:
        return ";".join(f"{path}={routing!r}" for path, routing in sorted(self.blocks.items()))

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        by_module: dict[str, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            path = module_path(node) if node.op in ("call_function", "call_method", "call_module") else None
            if path is not None:  # (parameters' placeholders carry their module too: they are inputs)
                by_module.setdefault(path, []).append(node)
        for block, spec in self.blocks.items():
            routing = spec.routing
            experts = [n for path, nodes in by_module.items() if inside(path, spec.experts) for n in nodes]
            router = [n for path, nodes in by_module.items() if inside(path, spec.router) for n in nodes]
            if not experts:
                continue  # this graph does not run the block (or it was rewritten already)
            why = self._rewrite(graph, block, routing, experts, router, result)
            if why is None:
                result.rewritten += 1
            else:
                result.skip(block, why)
        return result

    def _rewrite(self, graph, block, routing, experts, router, result: PassResult) -> str | None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        experts.sort(key=order.__getitem__)
        inside = set(experts)
        outputs = [n for n in experts if any(user not in inside for user in n.users)]
        # Shape values (a SymInt Dynamo computed here and later layers reuse) stay, with what they read.
        shapes = [n for n in outputs if example_value(n) is None]
        keep = ancestors(shapes, stop=None) & inside
        outputs = [n for n in outputs if n not in shapes]
        if len(outputs) != 1:
            return f"experts region has {len(outputs)} tensor outputs, expected 1"
        output = outputs[0]
        inputs = region_inputs(experts)
        params = [n for n in inputs if (v := example_value(n)) is not None and v.dim() == 3]
        # gate_up_proj [E, 2I, H] and down_proj [E, H, I], told apart by shape (node names follow HF's
        # local variables when Dynamo freezes parameters)
        pairs = [(a, b) for a in params for b in params
                 if tuple(example_value(a).shape) == (example_value(b).shape[0], 2 * example_value(b).shape[2],
                                                      example_value(b).shape[1])]
        gate_up, down = pairs[0] if len(pairs) == 1 else (None, None)
        if gate_up is None or model_parameter(gate_up) is None or model_parameter(down) is None:
            return "expert parameters gate_up_proj [E, 2I, H] / down_proj [E, H, I] not found among the experts' inputs"
        w13, w2 = example_value(gate_up), example_value(down)
        num_experts, hidden, inter = w2.shape
        why = packed_weights.can_pack("experts", [w13, w2])
        if why is not None:
            return why
        out_val = example_value(output)
        tokens = out_val.shape[0] if out_val is not None and out_val.dim() == 2 else None
        rows = [n for n in inputs if n not in params and (v := example_value(n)) is not None and v.dim() == 2]
        x = next((n for n in rows if example_value(n).is_floating_point() and example_value(n).shape[-1] == hidden), None)
        ids = next((n for n in rows if not example_value(n).is_floating_point()), None)
        weights = next((n for n in rows if n is not x and example_value(n).is_floating_point()
                        and example_value(n).shape == example_value(ids).shape), None) if ids is not None else None
        if x is None or ids is None or weights is None or tokens is None:
            return "experts inputs x [T, H], weights and ids [T, k] not found"
        if example_value(ids).shape[-1] != routing.top_k:
            return f"experts get {example_value(ids).shape[-1]} ids per token, routing says top_k={routing.top_k}"
        logits = next((n for n in router if n.op == "call_function" and n.target in LINEAR), None)
        if logits is None:
            return "router linear (the logits) not found in the router module"
        if not ({ids, weights} <= descendants(logits)):
            return "the experts' weights/ids do not come from the router logits"
        after_logits = descendants(logits)
        routing_nodes = ancestors([ids, weights], stop=logits) & after_logits
        # In-place updates of routing tensors (DeepSeek's group mask: zeros_like(...).scatter_(...))
        # have no users: they and what feeds them are routing too.
        mutations = [n for n in after_logits if not n.users and n.op in ("call_function", "call_method")
                     and set(n.all_input_nodes) & routing_nodes]
        routing_nodes |= ancestors(mutations, stop=logits) & after_logits
        bias = None
        if routing.correction_bias:
            bias = next((n for n in region_inputs(sorted(routing_nodes, key=order.__getitem__))
                         if n.op in ("get_attr", "placeholder") and (v := example_value(n)) is not None
                         and tuple(v.shape) == (num_experts,)), None)  # e_score_correction_bias [E]
            if bias is None:
                return "routing needs e_score_correction_bias [E], not found among the routing inputs"

        # Routing: the family's router op, right after the logits.
        if bias is not None and bias.op == "get_attr" and order[bias] > order[logits]:
            logits.append(bias)
        anchor = bias if bias is not None and order.get(bias, -1) > order[logits] else logits
        with graph.inserting_before(anchor.next):  # in creation order, right after the anchor
            if routing.op == "topk_softmax":
                route = graph.call_function(torch.ops.tilefx.topk_softmax.default,
                                            (logits, routing.top_k, routing.renormalize))
            else:
                route = graph.call_function(torch.ops.tilefx.grouped_topk.default, (
                    logits, bias, routing.top_k, routing.num_expert_group, routing.topk_group, routing.scoring_func,
                    routing.renormalize, routing.routed_scaling_factor))
            routed_weights = graph.call_function(operator.getitem, (route, 0))
            routed_ids = graph.call_function(operator.getitem, (route, 1))
            new_weights = graph.call_method("to", (routed_weights, example_value(weights).dtype))
        routed_weights.meta["example_value"] = example_value(weights).float()
        new_weights.meta["example_value"] = example_value(weights)
        routed_ids.meta["example_value"] = example_value(ids).int()

        # Experts: one fused_moe over the packed experts, where the region's output was.
        for param in (gate_up, down):
            if param.op == "get_attr" and order[param] > order[output]:
                output.prepend(param)
        with graph.inserting_before(output):
            w13_packed, w13_scales = packing_node(graph, packed_weights.pack_expert_gate_up_weight, (gate_up,),
                                                  gate_up)
            w2_packed, w2_scales = packing_node(graph, packed_weights.pack_expert_down_weight, (down,), down)
            scales = {name: nodes[0] for name, nodes in (("w13_scales", w13_scales), ("w2_scales", w2_scales)) if nodes}
            fused = graph.call_function(torch.ops.tilefx.fused_moe.default,
                                        (x, w13_packed, w2_packed, new_weights, routed_ids), scales)
        fused.meta.update(output.meta)
        output.replace_all_uses_with(fused)
        for param, packed in ((gate_up, w13_packed), (down, w2_packed)):
            only_packed = set(param.users) <= set(experts) | {packed}
            (result.packed_exclusively if only_packed else result.packed_shared).add(id(model_parameter(param)))
        for node in reversed(experts):
            if node not in keep:
                graph.erase_node(node)
        for node in sorted(routing_nodes, key=order.__getitem__, reverse=True):  # HF's routing, now unused
            if not node.users:
                graph.erase_node(node)
        return None
