"""tilefx::rope: the op on every kernel path against the reference and against HF's own
``apply_rotary_pos_emb`` in fp32, its layout, its refusals, opcheck."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import tilefx.custom_ops  # noqa: F401
from tilefx.custom_ops.rope import rope_reference


def _inputs(batch, heads, seq, dim, table_batch=1, projected=True, seed=0):
    """x as the attention sees it: a [B, H, S, D] view of a projection's output [B, S, H * D] (or contiguous
    [B, H, S, D]), and bf16 tables [table_batch, 1, S, D] of RoPE's form (the two halves repeat)."""
    g = torch.Generator().manual_seed(seed)
    if projected:
        x = torch.randn(batch, seq, heads * dim + 8, generator=g).to(torch.bfloat16)[..., 8:]  # a slice, as q of qkv
        x = x.view(batch, seq, heads, dim).transpose(1, 2)
    else:
        x = torch.randn(batch, heads, seq, dim, generator=g).to(torch.bfloat16)
    angles = torch.rand(table_batch, seq, dim // 2, generator=g) * 6.3
    angles = torch.cat((angles, angles), dim=-1)[:, None]
    return x, angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


# head dims: Llama's and Qwen's (64, 128), DeepSeek's rope part (64), and halves that are not a multiple of 8 / 16
@pytest.mark.parametrize("batch,heads,seq,dim,table_batch,projected", [
    (1, 32, 37, 64, 1, True),
    (2, 8, 5, 128, 2, True),
    (2, 4, 3, 128, 1, False),
    (1, 3, 7, 34, 1, True),    # half 17: one vector and a masked / scalar tail
    (3, 2, 2, 8, 3, False),    # half 4: tail only
])
def test_rope_matches_the_reference_on_every_path(kernel_path, batch, heads, seq, dim, table_batch, projected):
    x, cos, sin = _inputs(batch, heads, seq, dim, table_batch, projected, seed=dim + seq)
    got = torch.ops.tilefx.rope(x, cos, sin)
    want = rope_reference(x, cos, sin)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert got.stride() == want.stride() == (seq * heads * dim, dim, heads * dim, 1)  # [B, S, H, D]-major
    assert got.abs().max() > 0.1  # never compare zeros
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    # within one bf16 rounding of HF's formula in fp32
    hf, _ = apply_rotary_pos_emb(x.float(), x.float(), cos.float().squeeze(1), sin.float().squeeze(1))
    torch.testing.assert_close(got.float(), hf, rtol=1e-2, atol=1e-2)


def test_rope_layout_is_the_fake_impls():
    x, cos, sin = _inputs(2, 4, 5, 64)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.tilefx.rope(mode.from_tensor(x), mode.from_tensor(cos), mode.from_tensor(sin))
    assert torch.ops.tilefx.rope(x, cos, sin).stride() == fake.stride() == (5 * 4 * 64, 64, 4 * 64, 1)


@pytest.mark.parametrize("bad,message", [
    ("odd_width", "D even"),
    ("table_heads", "must be"),
    ("table_dtype", "cast the tables"),
])
def test_rope_refuses_what_it_cannot_take(bad, message):
    x, cos, sin = _inputs(1, 2, 3, 16)
    if bad == "odd_width":
        x, cos, sin = x[..., :15], cos[..., :15], sin[..., :15]
    elif bad == "table_heads":
        cos = cos.expand(1, 2, 3, 16)
    else:
        sin = sin.float()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tilefx.rope(x, cos, sin)


def test_rope_takes_other_dtypes_on_the_reference():
    x, cos, sin = (t.float() for t in _inputs(1, 2, 3, 16))
    torch.testing.assert_close(torch.ops.tilefx.rope(x, cos, sin), rope_reference(x, cos, sin))


def test_rope_opcheck():
    x, cos, sin = _inputs(2, 4, 5, 64, table_batch=2)
    torch.library.opcheck(torch.ops.tilefx.rope.default, (x, cos, sin))
