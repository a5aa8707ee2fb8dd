"""Kept-rows pass: compute the last layer's row-wise tail only for the rows whose logits are kept.

A prompt's forward keeps the logits of its last token (``generate()`` passes ``logits_to_keep=1``), and HF
slices the final hidden states just before ``lm_head``:

    n = final_norm(h) ; logits = lm_head(n[:, -1:, :])

Every op between the last attention and that slice is row-wise (a token's output row depends on that token's
input rows only): o_proj, the residual adds and norms, the MLP. So ``n[:, -1:]`` needs only the last rows of
each, and the last layer's o_proj and MLP need not run for the other tokens (the layer's K/V, which later
tokens read, come from its input norm and q/k/v projection, before the attention, and stay whole). This pass
moves the slice up through those ops, as far as each value is read by nothing else: the attention's output
is sliced before o_proj, and the row-wise ops run on the kept rows. On Llama-3.2-1B that is the o_proj and MLP
of one layer in 16 for a 1024-token prompt.

Row-wise here: ``tilefx.linear`` / ``linear_silu_mul`` / ``linear_float`` (their x), ``tilefx.add_rms_norm`` /
``rms_norm`` (their rows; both outputs of the former), and an elementwise ``+`` of two values of one shape.
Values the walk meets that anything else reads (the residual stream, the attention's output, an MoE block's
output) are sliced where they are. The slice must be along the tokens (dim 1 of [B, S, D] values) and keep
fewer rows than all; every value on the way must be [B, S, ...] with the slice's B and S.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx

from tilefx.compiler.passes.base import PassResult, TilefxPass
from tilefx.compiler.passes.graph_utils import ADD, calls, example_value, run_fake
from tilefx.custom_ops import linear, norm

_ROW_OPS = {  # op -> the positions of its row inputs
    linear.linear: (0,),
    linear.linear_silu_mul: (0,),
    linear.linear_float: (0,),
    norm.rms_norm: (0,),
    norm.add_rms_norm: (0, 1),
}


def _row_slice(node: torch.fx.Node) -> slice | None:
    """The slice of ``node = x[:, rows, :]`` (a getitem slicing dim 1 only, keeping fewer rows than all), else None."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[1], tuple):
        return None
    index = node.args[1]
    if len(index) < 2 or not all(isinstance(i, slice) and i == slice(None) for i in index[:1] + index[2:]):
        return None
    rows = index[1]
    if not isinstance(rows, slice) or rows.step not in (None, 1) or (rows.start in (None, 0) and rows.stop is None):
        return None
    if not all(isinstance(end, (int, type(None))) for end in (rows.start, rows.stop)):
        return None
    return rows


def _row_inputs(node: torch.fx.Node) -> tuple[int, ...] | None:
    """The positions of ``node``'s row inputs where it is row-wise, else None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target in _ROW_OPS:
        return _ROW_OPS[node.target]
    if node.target in ADD and len(node.args) == 2:
        values = [example_value(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
        if all(v is not None for v in values) and values[0].shape == values[1].shape:
            return (0, 1)
    return None


def _kept_rows(value: torch.Tensor, rows: slice) -> torch.Tensor:
    """A new tensor like ``value[:, rows]`` (contiguous, as the row-wise ops write their outputs), in value's fake mode."""
    mode = getattr(value, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return value[:, rows].contiguous()


def _several_outputs(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), (tuple, list))


def _outputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The values ``node`` gives: its getitem readers for an op with several outputs, else itself."""
    return list(node.users) if _several_outputs(node) else [node]


def _producer(value: torch.fx.Node) -> torch.fx.Node:
    """The op that computes ``value``: the op itself, or the op with several outputs ``value`` takes one of."""
    if calls(value, (operator.getitem,)) and isinstance(value.args[0], torch.fx.Node) and _several_outputs(value.args[0]):
        return value.args[0]
    return value


class KeptRowsPass(TilefxPass):
    name = "kept_rows"

    def __call__(self, graph: torch.fx.Graph) -> PassResult:
        result = PassResult(self.name)
        for keep in [n for n in graph.nodes if _row_slice(n) is not None]:
            why = self._rewrite(graph, keep)
            if why is None:
                result.rewritten += 1
            elif why:
                result.skip(keep.name, why)
        return result

    def _rewrite(self, graph: torch.fx.Graph, keep: torch.fx.Node) -> str | None:
        rows = _row_slice(keep)
        source = keep.args[0]
        shape = example_value(source).shape if example_value(source) is not None else None
        if shape is None or len(shape) != 3:
            return ""  # not a slice of [B, S, D] hidden states: not this pass's
        if isinstance(shape[1], int) and len(range(shape[1])[rows]) == shape[1]:
            return ""  # keeps every row (a decode step's one token): nothing to save
        order = {n: i for i, n in enumerate(graph.nodes)}

        def fits(value: torch.fx.Node) -> bool:
            v = example_value(value)
            return v is not None and v.dim() == 3 and v.shape[:2] == shape[:2]

        # Which ops only the kept rows of are read: those up the row inputs from the slice's source whose every
        # output is read by the slice or by ops already taken (users come later in the graph: decided first).
        candidates, stack = set(), [_producer(source)]
        while stack:
            op = stack.pop()
            if op in candidates or _row_inputs(op) is None:
                continue
            candidates.add(op)
            stack.extend(_producer(op.args[p]) for p in _row_inputs(op) if isinstance(op.args[p], torch.fx.Node))
        ops: set[torch.fx.Node] = set()
        for op in sorted(candidates, key=order.__getitem__, reverse=True):
            outputs = _outputs(op)
            if all(fits(v) for v in outputs) and all(user is keep or user in ops for v in outputs for user in v.users):
                ops.add(op)
        if _producer(source) not in ops:
            return "the kept rows' source is not a row-wise op read by the slice alone"

        # Rewrite: each op of the set again on its inputs' kept rows, in graph order; inputs outside the set are
        # sliced where they are.
        sliced: dict[torch.fx.Node, torch.fx.Node] = {}

        def kept(value: torch.fx.Node) -> torch.fx.Node:
            if value not in sliced:
                with graph.inserting_after(value):
                    sliced[value] = run_fake(graph.call_function(
                        operator.getitem, (value, (slice(None), rows, slice(None)))))
            return sliced[value]

        for op in sorted(ops, key=order.__getitem__):
            args = list(op.args)
            for position in _row_inputs(op):
                arg = args[position]
                args[position] = sliced[arg] if _producer(arg) in ops else kept(arg)
            with graph.inserting_before(keep):
                new = graph.call_function(op.target, tuple(args))
            # the op's value on its kept rows: the packed weights' nodes carry no example values to run it on
            value = op.meta["example_value"]
            new.meta["example_value"] = (type(value)(_kept_rows(v, rows) for v in value)
                                         if isinstance(value, (tuple, list)) else _kept_rows(value, rows))
            if op in _outputs(op):  # one output
                sliced[op] = new
            else:
                for value in _outputs(op):
                    with graph.inserting_before(keep):
                        part = graph.call_function(operator.getitem, (new, value.args[1]))
                    part.meta["example_value"] = new.meta["example_value"][value.args[1]]
                    sliced[value] = part
        keep.replace_all_uses_with(sliced[source])
        graph.erase_node(keep)
        for op in sorted(ops, key=order.__getitem__, reverse=True):
            for value in reversed(_outputs(op)):
                if value is not op and not value.users:
                    graph.erase_node(value)
            if not op.users:
                graph.erase_node(op)
        for value in list(sliced.values()):  # a sliced output nothing reads (an add_rms_norm's unread sum)
            if not value.users and value.op == "call_function" and value.target is operator.getitem:
                graph.erase_node(value)
        return None
