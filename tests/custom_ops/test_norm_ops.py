"""tilefx::rms_norm and tilefx::add_rms_norm: every kernel path against the reference and against HF's own
LlamaRMSNorm (after HF's residual add), strided rows, the refusals, opcheck."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import tilefx.custom_ops  # noqa: F401
from tilefx.custom_ops.norm import add_rms_norm_reference, rms_norm_reference


def _hf_norm(weight, eps):
    module = LlamaRMSNorm(weight.shape[0], eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def _inputs(shape, sliced, seed):
    """x and residual of ``shape`` (bf16, std ~3 as hidden states grow), as slices of wider rows where ``sliced``
    (the native kernel's strided rows), and a weight around 1."""
    g = torch.Generator().manual_seed(seed)
    dim = shape[-1]
    if sliced:
        x = (torch.randn(*shape[:-1], dim + 24, generator=g) * 3).to(torch.bfloat16)[..., 24:]
    else:
        x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    residual = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(dim, generator=g)).to(torch.bfloat16)
    return x, residual, weight


# hidden sizes: Llama-1B's 2048, tiny presets' 64, a width that is not a multiple of 8 or 16 (tails); a decode row
@pytest.mark.parametrize("shape,sliced", [((1, 37, 2048), True), ((2, 5, 64), False), ((1, 3, 72), True),
                                          ((3, 1, 20), False), ((1, 1, 2048), True)])
def test_norm_ops_match_the_reference_and_hf_on_every_path(kernel_path, shape, sliced):
    x, residual, weight = _inputs(shape, sliced, seed=shape[-1] + shape[1])
    eps = 1e-5
    total, normed = torch.ops.tilefx.add_rms_norm(x, residual, weight, eps)
    want_total, want_normed = add_rms_norm_reference(x, residual, weight, eps)
    hf = _hf_norm(weight, eps)
    with torch.no_grad():
        hf_total = x + residual
        hf_normed = hf(hf_total)
    torch.testing.assert_close(total, hf_total, rtol=0, atol=0)  # one bf16 add: bit for bit
    assert normed.abs().max() > 0.1  # never compare zeros
    for got, want in ((normed, want_normed), (normed, hf_normed)):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    alone = torch.ops.tilefx.rms_norm(x, weight, eps)
    with torch.no_grad():
        torch.testing.assert_close(alone.float(), hf(x).float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(alone.float(), rms_norm_reference(x, weight, eps).float(), rtol=1e-2, atol=1e-2)
    assert normed.is_contiguous() and total.is_contiguous() and alone.is_contiguous()


def test_rows_at_two_strides_on_every_path(kernel_path):
    """Qwen3's q_norm: a per-head view of a fused projection's rows ([B, S, H, D] of [B, S, H * D + more])."""
    rows = (torch.randn(2, 5, 4 * 16 + 40) * 3).to(torch.bfloat16)
    x = rows[..., :64].view(2, 5, 4, 16)
    weight = (1 + 0.3 * torch.randn(16)).to(torch.bfloat16)
    got = torch.ops.tilefx.rms_norm(x, weight, 1e-6)
    assert got.is_contiguous() and got.abs().max() > 0.1
    torch.testing.assert_close(got.float(), rms_norm_reference(x, weight, 1e-6).float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), _hf_norm(weight, 1e-6)(x).detach().float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bad,message", [("weight", "does not match"), ("residual", "is not x's")])
def test_norm_ops_refuse_what_they_cannot_take(bad, message):
    x, residual, weight = _inputs((1, 3, 16), False, seed=0)
    if bad == "weight":
        weight = weight[:8]
    else:
        residual = residual[:, :2]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tilefx.add_rms_norm(x, residual, weight, 1e-6)


def test_norm_ops_opcheck():
    x, residual, weight = _inputs((2, 5, 64), True, seed=1)
    torch.library.opcheck(torch.ops.tilefx.rms_norm.default, (x, weight, 1e-6))
    torch.library.opcheck(torch.ops.tilefx.add_rms_norm.default, (x, residual, weight, 1e-6))
