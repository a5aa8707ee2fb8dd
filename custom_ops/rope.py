"""``tilefx::rope(x, cos, sin) -> Tensor``: rotary position embedding in its rotate-half form,

    out = x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin

as every HF family but DeepSeek-V2 applies it to the queries and keys of the new tokens
(compiler/passes/rope.py rewrites that region of a prefill graph into this op). Shapes:

- ``x``          ``[B, H, S, D]``, D even: queries or keys of the new tokens, any strides
- ``cos``, ``sin`` ``[B or 1, 1, S, D]``: the tables at the tokens' positions (HF's ``cos.unsqueeze(1)``)
- returns       ``[B, H, S, D]`` laid out as ``[B, S, H, D]`` (a token's heads side by side: the layout a
  projection's output has before HF's transpose), so the op writes each token's row in one pass.

Computed in fp32 and rounded to x's dtype once, as Inductor's fused kernel of the same region
does. Inductor writes ``rotate_half``'s concatenation out and reads it back, with per-element
index arithmetic for the two halves; the native kernel reads each row once and writes it once.
"""

from __future__ import annotations

import torch

from tilefx.custom_ops import isa

_SCHEMA = "(Tensor x, Tensor cos, Tensor sin) -> Tensor"


def _check_shapes(x, cos, sin) -> None:
    torch._check(x.dim() == 4 and x.shape[-1] % 2 == 0, lambda: f"x must be [B, H, S, D] with D even, got {tuple(x.shape)}")
    batch, _, seq, dim = x.shape
    for name, table in (("cos", cos), ("sin", sin)):
        torch._check(table.dim() == 4 and table.shape[0] in (1, batch) and table.shape[1] == 1
                     and table.shape[2:] == (seq, dim),
                     lambda: f"{name} must be [{batch} or 1, 1, {seq}, {dim}] for x {tuple(x.shape)}, "
                     f"got {tuple(table.shape)}")
        torch._check(table.dtype == x.dtype, lambda: f"{name} is {table.dtype}, x {x.dtype}: cast the tables to x's dtype")


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor of x's shape ``[B, H, S, D]`` laid out as ``[B, S, H, D]``."""
    batch, heads, seq, dim = x.shape
    return x.new_empty((batch, seq, heads, dim)).transpose(1, 2)


def rope_reference(x, cos, sin):
    """The specification: the rotate-half RoPE in fp32, rounded once."""
    _check_shapes(x, cos, sin)
    half = x.shape[-1] // 2
    wide = x.float()
    rotated = torch.cat((-wide[..., half:], wide[..., :half]), dim=-1)
    return _token_major(x).copy_(wide * cos.float() + rotated * sin.float())


def _rope_fake(x, cos, sin):
    _check_shapes(x, cos, sin)
    return _token_major(x)


_LIB = torch.library.Library("tilefx", "FRAGMENT")
isa.define_native_op(_LIB, "rope", _SCHEMA, rope_reference, _rope_fake)
rope = torch.ops.tilefx.rope.default
