"""The norm pass on captured graphs: a prompt's RMSNorms become tilefx.add_rms_norm (after the residual add that
feeds them) or tilefx.rms_norm (a first layer's, Qwen3's per-head ones, MLA's latent ones), outputs equal eager's;
a decode step's norms and strided rows are left alone with why."""

from __future__ import annotations

import pytest
import torch

import tilefx.custom_ops  # noqa: F401
from helpers import PassTestBackend, count, decode_step, is_op, run_on_new_cache, tiny_model, without_and_with
from tilefx.compiler.passes.norm import NormPass, match


def _is_rsqrt(node) -> bool:
    return node.op == "call_function" and node.target is torch.rsqrt


def _forward(model, ids, backend):
    return run_on_new_cache(model, ids, backend)[0]


def _norms(model) -> int:
    return sum(type(module).__name__.endswith("RMSNorm") for module in model.modules())


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2",
                                    "tiny-deepseek-v3"])
@pytest.mark.parametrize("batch,seq", [(1, 7), (2, 5)])
def test_a_prompts_norms_become_the_ops_with_their_residual_adds(family, batch, seq):
    model = tiny_model(family)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seq))
    want, got, backend = without_and_with(model, ids, NormPass())

    before, after, result = backend.before[0], backend.after[0], backend.results[0]
    assert count(before, _is_rsqrt) == _norms(model)
    assert count(after, _is_rsqrt) == 0 and not any(match(node) for node in after.nodes)
    # each layer's two norms and the final one read a residual add; the first layer's input norm does not
    assert count(after, is_op("add_rms_norm")) == 2 * layers
    assert count(after, is_op("rms_norm")) == _norms(model) - 2 * layers
    assert result.rewritten == _norms(model) and not result.fallbacks
    # eager's graph and the ops round alike (the sum to bf16, the normalized row before the weight)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_a_decode_steps_norms_are_left_to_inductor():
    model, result, after = decode_step(NormPass())
    assert result.rewritten == 0 and count(after, is_op("add_rms_norm")) == 0
    # one line for the graph's regions (explain() would list two a layer otherwise)
    assert result.fallbacks == [f"{_norms(model)} norm region(s): one new token (decode): left to Inductor's "
                                "kernels, fused with their neighbours"]


def _hf_norm(x, weight):
    wide = x.to(torch.float32)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * wide.to(x.dtype)


def test_per_head_norms_are_taken_and_other_dtypes_left_alone():
    """A norm over heads of a wider projection's rows (Qwen3's q_norm after the linear pass fused q/k/v) becomes the
    op; an fp32 norm is matched and refused with why."""

    def f(rows, weight, wide_x, wide_weight):
        heads = rows[..., :64].view(1, 5, 4, 16)
        return _hf_norm(heads, weight), _hf_norm(wide_x, wide_weight)

    rows = torch.randn(1, 5, 96, dtype=torch.bfloat16)
    args = (rows, torch.ones(16, dtype=torch.bfloat16), torch.randn(1, 5, 16), torch.ones(16))
    backend = PassTestBackend(NormPass())
    torch._dynamo.reset()
    got = torch.compile(f, backend=backend, fullgraph=True)(*args)
    result = backend.results[0]
    assert result.rewritten == 1 and len(result.fallbacks) == 1 and "native kernel is bf16's" in result.fallbacks[0]
    assert count(backend.after[0], is_op("rms_norm")) == 1
    for a, b in zip(got, f(*args)):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_a_norm_of_another_form_does_not_match():
    """LayerNorm-like centring, or a mean over another dim, is another function: no match."""

    def f(x, weight):
        wide = x.to(torch.float32)
        centred = wide * torch.rsqrt((wide - wide.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + 1e-6)
        other_dim = wide * torch.rsqrt(wide.pow(2).mean(1, keepdim=True) + 1e-6)
        return weight * centred.to(x.dtype) + weight * other_dim.to(x.dtype)

    backend = PassTestBackend(NormPass())
    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(torch.randn(1, 5, 16, dtype=torch.bfloat16),
                                                      torch.ones(16, dtype=torch.bfloat16))
    assert backend.results[0].rewritten == 0 and not backend.results[0].fallbacks
