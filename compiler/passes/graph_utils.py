"""Graph helpers the passes share: the op targets they match, example values and parameters of nodes,
bounded searches up and down a graph, and replace-and-erase. A pass imports these, never another
pass's privates."""

from __future__ import annotations

import collections
import operator
import re

import torch
import torch.fx

LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
ADD = (operator.add, torch.add)
MUL = (operator.mul, torch.mul)
_ROOT = re.compile(r"^L\['[^']*'\]\.?(?:__self__\.)?")  # L['self']. or L['forward'].__self__. (a bound forward)


def example_value(node) -> torch.Tensor | None:
    """The example tensor Dynamo recorded for a graph node (None for non-tensors and constants)."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def model_parameter(node) -> torch.nn.Parameter | None:
    """The model parameter a node stands for: a graph attribute (freezing at trace time) or a Dynamo input."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "get_attr":
        value = getattr(node.graph.owning_module, node.target, None)
    elif node.op == "placeholder" and node.meta.get("grapharg") is not None:
        value = node.meta["grapharg"].example
    else:
        return None
    return value if isinstance(value, torch.nn.Parameter) else None


def is_parameter(node) -> bool:
    return model_parameter(node) is not None


def run_fake(node: torch.fx.Node) -> torch.fx.Node:
    """Records a node's example value by running its op (call_function) or method (call_method) on its inputs'
    example values, so a pass that adds or rewires a node never writes a shape or dtype by hand. Returns the node.

    It runs under the fake mode of the node's first non-parameter tensor input; an input of another mode (Dynamo's
    parameter inputs can carry their own) joins it as an empty tensor with the same metadata."""
    inputs = [a for a in node.all_input_nodes if example_value(a) is not None]
    ordered = [a for a in inputs if not is_parameter(a)] + [a for a in inputs if is_parameter(a)]
    modes = [getattr(example_value(a), "fake_mode", None) for a in ordered]
    mode = next((m for m in modes if m is not None), None)
    if mode is None:
        raise ValueError(f"{node.format_node()}: no fake tensor among its inputs to run it on")

    def value(arg):
        value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else arg
        if isinstance(value, torch.Tensor) and getattr(value, "fake_mode", None) is not mode:
            value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
        return value

    with mode:
        args = torch.fx.node.map_aggregate(node.args, value)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
        if node.op == "call_method":
            result = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            result = node.target(*args, **kwargs)
    node.meta["example_value"] = result
    return node


def linear_args(node: torch.fx.Node):
    """(x, weight, bias) of a linear call, positional or keyword."""
    args = list(node.args) + [None] * 2
    return node.kwargs.get("input", args[0]), node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])


def replace(graph, old: torch.fx.Node, new: torch.fx.Node) -> None:
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    graph.erase_node(old)


_VIEW_METHODS = {"reshape", "view", "expand", "contiguous", "unsqueeze"}


def view_source(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """Follow view-like ops back to their base; return the base and the view nodes passed."""
    chain = []
    while True:
        if node.op == "call_method" and node.target in _VIEW_METHODS:
            chain.append(node)
            node = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem and example_value(node.args[0]) is not None:
            chain.append(node)
            node = node.args[0]
        else:
            return node, chain


def cache_writes(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Map each buffer written by ``index_copy_`` along dim 2 to its writer nodes."""
    writes: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_method" and node.target == "index_copy_" and node.args[1] == 2:
            base, _ = view_source(node.args[0])
            writes.setdefault(base, []).append(node)
    return writes


def computed_from_cache(node: torch.fx.Node, writes, limit: int = 64) -> bool:
    """Whether ``node`` is computed (within ``limit`` nodes back) from a buffer the cache writes go to."""
    seen, frontier = set(), collections.deque([node])
    while frontier and len(seen) < limit:
        current = frontier.popleft()
        if current in writes:
            return True
        if current not in seen:
            seen.add(current)
            frontier.extend(current.all_input_nodes)
    return False


def calls(node, targets) -> bool:
    """Whether ``node`` is a call of one of ``targets`` with positional arguments only."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets and not node.kwargs


def only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one node reading ``node``, or None where none or several do."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def erase_unused(graph: torch.fx.Graph, nodes) -> None:
    for node in nodes:
        if node.op != "placeholder" and not node.users:
            graph.erase_node(node)


def first_user(node: torch.fx.Node, predicate, limit: int = 64) -> torch.fx.Node | None:
    """The first node (breadth-first, within ``limit`` nodes) downstream of ``node`` that satisfies ``predicate``."""
    seen, frontier = set(), collections.deque(node.users)
    while frontier and len(seen) < limit:
        current = frontier.popleft()
        if predicate(current):
            return current
        if current not in seen:
            seen.add(current)
            frontier.extend(current.users)
    return None


def erase_region(graph: torch.fx.Graph, roots: list[torch.fx.Node], keep: set) -> None:
    """Erase ``roots`` and every node that only fed them (or only wrote into what fed them).

    HF builds the expanded key with ``new_empty`` + in-place ``copy_`` into slices of it:
    a node whose other users all write into it dies with those writes.
    """
    dead = set(roots)
    frontier = list(roots)
    while frontier:
        node = frontier.pop()
        for source in node.all_input_nodes:
            if source in dead or source in keep or source.op in ("placeholder", "get_attr"):
                continue
            writes = writes_into(source)
            if set(source.users) - writes <= dead:
                dead |= {source} | writes
                frontier += [source, *writes]
    for node in reversed(list(graph.nodes)):  # users come after their inputs
        if node in dead:
            graph.erase_node(node)


def writes_into(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The ``copy_`` nodes writing into ``node`` or into slices of it, with those slices."""
    found = set()
    for user in node.users:
        if user.op == "call_method" and user.target == "copy_" and user.args[0] is node:
            found.add(user)
        elif user.op == "call_function" and user.target is operator.getitem and user.args[0] is node:
            inner = writes_into(user)
            if inner and set(user.users) <= inner:
                found |= inner | {user}
    return found


def module_path(node: torch.fx.Node) -> str | None:
    """The innermost module a node was traced in, as ``model.layers.0.mlp.experts``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return _ROOT.sub("", path)


def inside(path: str | None, module: str) -> bool:
    return path is not None and (path == module or path.startswith(module + "."))


def region_inputs(region: list[torch.fx.Node]) -> list[torch.fx.Node]:
    inside, seen, found = set(region), set(), []
    for node in region:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in seen:
                seen.add(arg)
                found.append(arg)
    return found


def ancestors(nodes, stop: torch.fx.Node) -> set[torch.fx.Node]:
    """Nodes that ``nodes`` depend on, down to (and without) ``stop``."""
    found, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        if node is stop or node in found:
            continue
        found.add(node)
        todo.extend(node.all_input_nodes)
    return found


def descendants(node: torch.fx.Node) -> set[torch.fx.Node]:
    found, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user not in found:
                found.add(user)
                todo.append(user)
    return found


def packing_node(graph: torch.fx.Graph, op, args: tuple, weight_node: torch.fx.Node) -> tuple[torch.fx.Node, tuple]:
    """The packing op's node, in the format the loader packed ``weight_node``'s parameter (bf16 where it did not),
    and ``(scales node,)`` for a quantized format (else ``()``): what the linear and MoE ops' scales take."""
    from tilefx.custom_ops import weights

    hits = weights.packings_of(model_parameter(weight_node))
    format = hits[0][0].format if hits else "bf16"
    if format == "bf16":
        return graph.call_function(op, args), ()
    packed = graph.call_function(op, (*args, format))
    return packed, (graph.call_function(weights.packed_scales, (packed,)),)
