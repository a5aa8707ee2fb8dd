"""graph_utils.run_fake: a node's example value from running it on its inputs' fake values."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from tilefx.compiler.passes.graph_utils import run_fake


def _placeholder(graph: torch.fx.Graph, name: str, value) -> torch.fx.Node:
    node = graph.placeholder(name)
    node.meta["example_value"] = value
    return node


def test_run_fake_derives_shapes_and_dtypes_of_functions_and_methods():
    mode = FakeTensorMode()
    with mode:
        x, y = torch.empty(3, 8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.float32)
    graph = torch.fx.Graph()
    a, b = _placeholder(graph, "a", x), _placeholder(graph, "b", y)
    total = run_fake(graph.call_function(torch.add, (a, b)))  # bf16 + fp32 promotes
    half = run_fake(graph.call_method("to", (total, torch.float16)))
    rows = run_fake(graph.call_method("view", (half, 24)))
    kept = run_fake(graph.call_function(torch.clamp, (rows,), {"min": 0}))
    assert (total.meta["example_value"].dtype, tuple(total.meta["example_value"].shape)) == (torch.float32, (3, 8))
    assert half.meta["example_value"].dtype == torch.float16
    assert tuple(rows.meta["example_value"].shape) == (24,) and kept.meta["example_value"].dtype == torch.float16
    assert all(n.meta["example_value"].fake_mode is mode for n in (total, half, rows, kept))


def test_run_fake_joins_an_input_of_another_fake_mode():
    mode, other = FakeTensorMode(), FakeTensorMode()
    with mode:
        x = torch.empty(2, 4)
    with other:
        w = torch.empty(5, 4)
    graph = torch.fx.Graph()
    out = run_fake(graph.call_function(torch.nn.functional.linear,
                                       (_placeholder(graph, "x", x), _placeholder(graph, "w", w))))
    assert tuple(out.meta["example_value"].shape) == (2, 5) and out.meta["example_value"].fake_mode is mode


def test_run_fake_needs_a_fake_input():
    graph = torch.fx.Graph()
    node = graph.call_function(torch.add, (_placeholder(graph, "a", torch.ones(2)), 1))
    with pytest.raises(ValueError, match="no fake tensor"):
        run_fake(node)
