"""The compute-once pass on captured graphs: RoPE's tables are read through tilefx.materialize, outputs are
unchanged, and Inductor then computes each table in one kernel instead of inside every layer's."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code

import tilefx.custom_ops  # noqa: F401
from helpers import PassTestBackend, count, is_op, run_on_new_cache
from tilefx.compiler.passes.compute_once import ComputeOncePass
from tilefx.models.presets import build_model


def _forward(model, ids, backend):
    """One forward of ``model`` over an empty tilefx cache (helpers.run), compiled with ``backend``."""
    return run_on_new_cache(model, ids, backend)[0]


# (family, tables): cos and sin, or DeepSeek-V2's one complex table (torch.polar)
@pytest.mark.parametrize("family,tables", [("tiny-llama", 2), ("tiny-qwen3-moe", 2), ("tiny-deepseek-v2", 1)])
@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 5)])
def test_each_table_is_read_through_one_materialize_and_outputs_are_unchanged(family, tables, batch, seq):
    model = build_model(family, seed=3)
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seq))
    torch._dynamo.reset()
    plain = PassTestBackend()
    want = _forward(model, ids, plain)
    torch._dynamo.reset()
    backend = PassTestBackend(ComputeOncePass())
    got = _forward(model, ids, backend)

    before, after, result = backend.before[0], backend.after[0], backend.results[0]
    is_materialize = is_op("materialize")
    assert count(before, is_materialize) == 0
    assert count(after, is_materialize) == tables == result.rewritten
    for node in after.nodes:
        if is_materialize(node):  # every layer reads the one copy
            assert len(node.users) >= model.config.num_hidden_layers
            assert all(not is_materialize(user) for user in node.users)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # a copy: bit for bit


def test_a_value_read_once_is_left_alone():
    """cos of a tensor read by one node, whose chain grows (broadcast into a larger tensor): nothing inserted."""

    def f(x, y):
        return (x.cos() * y).sum() + x.sin().sum()

    backend = PassTestBackend(ComputeOncePass())
    torch._dynamo.reset()
    x, y = torch.randn(8), torch.randn(4, 8)
    torch.testing.assert_close(torch.compile(f, backend=backend, fullgraph=True)(x, y), f(x, y))
    assert count(backend.after[0], is_op("materialize")) == 0
    assert backend.results[0].rewritten == 0 and len(backend.results[0].fallbacks) == 2


def test_inductor_computes_the_tables_once():
    """The point of the pass: in Inductor's code for a 2-layer Llama prefill, one kernel computes cos (and
    one sin); without the pass each layer's RoPE kernel computes them again (3 kernels here)."""
    model = build_model("tiny-llama", seed=3)

    def backend(gm, example_inputs):
        ComputeOncePass()(gm.graph)
        gm.recompile()
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    ids = torch.randint(3, 500, (1, 6))
    _, code = run_and_get_code(_forward, model, ids, backend)
    kernels = [k for source in code for k in source.split("async_compile.cpp_pybinding")[1:]]
    assert kernels, "no C++ kernels found in Inductor's output"
    assert sum("cos(" in k for k in kernels) == 1
    assert sum("sin(" in k for k in kernels) == 1
