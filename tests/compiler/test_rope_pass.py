"""The RoPE pass on captured graphs: a prompt's rotate-half RoPE becomes tilefx.rope (queries and keys of every
layer), outputs equal eager's; decode steps, DeepSeek-V2's complex form and other dtypes are left alone with why."""

from __future__ import annotations

import operator

import pytest
import torch

import tilefx.custom_ops  # noqa: F401
from helpers import PassTestBackend, count, decode_step, is_op, run_on_new_cache, tiny_model, without_and_with
from tilefx.compiler.passes.rope import RopePass, match


def _is_cat(node) -> bool:
    return node.op == "call_function" and node.target is torch.cat


def _is_neg(node) -> bool:
    return node.op == "call_function" and node.target is operator.neg


def _forward(model, ids, backend):
    return run_on_new_cache(model, ids, backend)[0]


# families whose attention applies HF's rotate_half to q and k
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3-moe", "tiny-mixtral"])
@pytest.mark.parametrize("batch,seq", [(1, 7), (2, 5)])
def test_a_prompts_rope_becomes_one_op_for_q_and_one_for_k(family, batch, seq):
    model = tiny_model(family)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seq))
    want, got, backend = without_and_with(model, ids, RopePass())

    before, after, result = backend.before[0], backend.after[0], backend.results[0]
    assert count(before, is_op("rope")) == 0 and count(before, _is_cat) >= 2 * layers
    assert count(after, is_op("rope")) == 2 * layers == result.rewritten and not result.fallbacks
    assert count(after, _is_neg) == count(before, _is_neg) - 2 * layers  # rotate_half's negations are gone
    assert count(after, _is_cat) == count(before, _is_cat) - 2 * layers
    assert not any(match(node) for node in after.nodes)
    # eager's graph rounds x * cos and rotate_half(x) * sin to bf16 before adding them; the op rounds once
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_a_decode_steps_rope_is_left_to_inductor():
    model, result, after = decode_step(RopePass())
    assert result.rewritten == 0 and count(after, is_op("rope")) == 0
    # one line for the graph's regions (explain() would list two a layer otherwise)
    assert result.fallbacks == [f"{2 * model.config.num_hidden_layers} rope region(s): one new token (decode): "
                                "left to Inductor's kernel, fused with its neighbours"]


@pytest.mark.parametrize("family", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_deepseeks_forms_do_not_match(family):
    """V2 rotates by complex numbers (torch.polar), V3 (rope_interleave) the pairs (x[0::2], x[1::2]): other
    regions, left to Inductor."""
    model = tiny_model(family)
    torch._dynamo.reset()
    backend = PassTestBackend(RopePass())
    _forward(model, torch.randint(3, 500, (1, 6)), backend)
    assert backend.results[0].rewritten == 0 and not backend.results[0].fallbacks


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype,why", [(torch.float32, "native kernel is bf16's"), (torch.bfloat16, None)])
def test_each_term_order_matches_and_other_dtypes_are_refused(dtype, why):
    """HF's form with its terms and factors swapped still matches; fp32 is left alone and says why."""

    def f(q, cos, sin):
        return (_rotate_half(q) * sin) + (cos * q)

    q = torch.randn(1, 4, 6, 16, dtype=dtype)
    angles = torch.rand(1, 1, 6, 8)
    cos, sin = (torch.cat((t, t), -1).to(dtype) for t in (angles.cos(), angles.sin()))
    backend = PassTestBackend(RopePass())
    torch._dynamo.reset()
    got = torch.compile(f, backend=backend, fullgraph=True)(q, cos, sin)
    result = backend.results[0]
    if why is None:
        assert result.rewritten == 1 and count(backend.after[0], is_op("rope")) == 1
    else:
        assert result.rewritten == 0 and len(result.fallbacks) == 1 and why in result.fallbacks[0]
    torch.testing.assert_close(got.float(), f(q, cos, sin).float(), rtol=1e-2, atol=1e-2)


def test_a_rotation_that_is_not_rotate_half_does_not_match():
    """cat((x_hi, -x_lo)) (the other sign) and a cut off the middle are other functions: no match."""

    def f(q, cos, sin):
        other_sign = torch.cat((q[..., 8:], -q[..., :8]), dim=-1)
        off_middle = torch.cat((-q[..., 6:], q[..., :6]), dim=-1)
        return (q * cos + other_sign * sin) + (q * cos + off_middle * sin)

    q = torch.randn(1, 4, 6, 16, dtype=torch.bfloat16)
    cos = sin = torch.randn(1, 1, 6, 16, dtype=torch.bfloat16)
    backend = PassTestBackend(RopePass())
    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(q, cos, sin)
    assert backend.results[0].rewritten == 0 and not backend.results[0].fallbacks
