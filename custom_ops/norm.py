"""``tilefx::rms_norm(x, weight, eps) -> Tensor`` and ``tilefx::add_rms_norm(x, residual, weight, eps) -> (sum,
normed)``: HF's RMSNorm of the hidden states, alone (a model's first layer) or after the residual add that feeds it
(every later one), as the norm pass (compiler/passes/norm.py) rewrites a prompt's graph:

    sum = x + residual                                            # rounded to x's dtype, as HF's add
    normed = weight * (sum.float() * rsqrt(mean(sum.float()^2, -1) + eps)).to(x.dtype)

Shapes: ``x``, ``residual`` ``[..., D]``, ``weight`` ``[D]``; outputs of x's shape, contiguous. The math is HF's,
roundings included. Inductor's kernel of the same region reads the residual stream's parts again (it keeps sums
of several layers' outputs in fp32 rather than storing each in bf16) and passes over its fp32 sum twice; the native
kernel reads each row's two inputs once and writes its two outputs once.
"""

from __future__ import annotations

import torch

from tilefx.custom_ops import isa

_NORM_SCHEMA = "(Tensor x, Tensor weight, float eps) -> Tensor"
_ADD_NORM_SCHEMA = "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)"


def _check_shapes(x, weight, residual=None) -> None:
    torch._check(x.dim() >= 1 and weight.shape == x.shape[-1:],
                 lambda: f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}'s last dim")
    if residual is not None:
        torch._check(residual.shape == x.shape and residual.dtype == x.dtype,
                     lambda: f"residual {tuple(residual.shape)} {residual.dtype} is not x's {tuple(x.shape)} {x.dtype}")


def _normalized(x, weight, eps):
    wide = x.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_reference(x, weight, eps):
    """The specification: HF's RMSNorm."""
    _check_shapes(x, weight)
    return _normalized(x, weight, eps).contiguous()


def add_rms_norm_reference(x, residual, weight, eps):
    """The specification: HF's residual add, then its RMSNorm of the sum."""
    _check_shapes(x, weight, residual)
    total = (x + residual).contiguous()
    return total, _normalized(total, weight, eps).contiguous()


def _rms_norm_fake(x, weight, eps):
    _check_shapes(x, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format, dtype=torch.promote_types(x.dtype, weight.dtype))


def _add_rms_norm_fake(x, residual, weight, eps):
    _check_shapes(x, weight, residual)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format,
                             dtype=torch.promote_types(x.dtype, weight.dtype)))


_LIB = torch.library.Library("tilefx", "FRAGMENT")
isa.define_native_op(_LIB, "rms_norm", _NORM_SCHEMA, rms_norm_reference, _rms_norm_fake)
isa.define_native_op(_LIB, "add_rms_norm", _ADD_NORM_SCHEMA, add_rms_norm_reference, _add_rms_norm_fake)
rms_norm = torch.ops.tilefx.rms_norm.default
add_rms_norm = torch.ops.tilefx.add_rms_norm.default
