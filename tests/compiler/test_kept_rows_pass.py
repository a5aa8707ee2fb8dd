"""The kept-rows pass on captured graphs: a prompt keeping its last row's logits runs the last layer's o_proj, MLP
and norms on that row only (the layer's K/V still from every token), outputs equal; a graph keeping every row,
and values something else reads, are left whole."""

from __future__ import annotations

import operator

import pytest
import torch

import tilefx.custom_ops  # noqa: F401
from helpers import PassTestBackend, is_op, run_on_new_cache, tiny_model
from tilefx.compiler.passes.kept_rows import KeptRowsPass
from tilefx.compiler.passes.linear import LinearPass
from tilefx.compiler.passes.norm import NormPass


def _rows_in(graph, op) -> list[int]:
    """The row count (dim 1) of x at each call of ``op``, in graph order."""
    return [node.args[0].meta["example_value"].shape[1] for node in graph.nodes if is_op(op)(node)]


def _forward(model, ids, backend, logits_to_keep):
    return run_on_new_cache(model, ids, backend, logits_to_keep=logits_to_keep)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("tiny-llama")


@pytest.mark.parametrize("batch,seq,keep", [(1, 7, 1), (2, 5, 1), (1, 6, 2)])
def test_the_last_layers_tail_runs_on_the_kept_rows(llama, batch, seq, keep):
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seq))
    torch._dynamo.reset()
    want, want_cache = _forward(llama, ids, PassTestBackend(LinearPass(), NormPass()), keep)
    torch._dynamo.reset()
    backend = PassTestBackend(LinearPass(), NormPass(), KeptRowsPass())
    got, got_cache = _forward(llama, ids, backend, keep)

    after, result = backend.after[0], backend.results[-1]
    assert result.rewritten == 1 and not result.fallbacks
    layers = llama.config.num_hidden_layers
    # per layer: q/k/v, o_proj, down (linear) and gate/up (linear_silu_mul); then lm_head. The last layer's o_proj,
    # MLP and norms after its attention see the kept rows; its q/k/v projection every token.
    assert _rows_in(after, "linear") == [seq, seq, seq] * (layers - 1) + [seq, keep, keep, keep]
    assert _rows_in(after, "linear_silu_mul") == [seq] * (layers - 1) + [keep]
    assert _rows_in(after, "add_rms_norm")[-2:] == [keep, keep]
    assert not any(node.target is operator.getitem and node.args[0].op == "call_function"
                   and is_op("add_rms_norm")(node.args[0]) and not node.users for node in after.nodes)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same ops on the same rows: bit for bit
    for a, b in zip(got_cache.layers, want_cache.layers):  # every token's K/V, the last layer's included
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)


def test_a_graph_keeping_every_row_is_left_whole(llama):
    torch._dynamo.reset()
    backend = PassTestBackend(LinearPass(), NormPass(), KeptRowsPass())
    _forward(llama, torch.randint(3, 500, (1, 5)), backend, 0)
    assert backend.results[-1].rewritten == 0
    assert set(_rows_in(backend.after[0], "linear")) == {5}


def test_a_value_read_elsewhere_stays_whole():
    """x feeds the kept slice through a linear and is also returned: the linear runs on the kept rows, x stays."""
    lin = torch.nn.Linear(32, 64, bias=False).to(torch.bfloat16)

    def f(x):
        h = lin(x)
        return h[:, -1:, :], x * 2

    backend = PassTestBackend(LinearPass(), KeptRowsPass())
    torch._dynamo.reset()
    x = torch.randn(1, 6, 32, dtype=torch.bfloat16)
    got = torch.compile(f, backend=backend, fullgraph=True)(x)
    assert backend.results[-1].rewritten == 1 and _rows_in(backend.after[0], "linear") == [1]
    want = f(x)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[1], want[1])
