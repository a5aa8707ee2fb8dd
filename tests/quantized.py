"""Reference models for quantized weights: HF eager over the values the quantized kernels multiply by."""

from __future__ import annotations

import torch

from tilefx.custom_ops import weights


def dequantized(weight: torch.Tensor, format: str) -> torch.Tensor:
    """``weight`` as the quantized kernels see it: ``values * scales`` in fp32 (``weights.quantize_rows``)."""
    values, scales = weights.quantize_rows(weight, format)
    if format == "int8":
        return values.float() * scales[:, None]
    if format == "int4":
        return weights.dequantize_int4_rows(values, scales, torch.float32)
    n, k = weight.shape
    group = weights.FP8_GROUP
    return values.float() * scales.repeat_interleave(group, 0).repeat_interleave(group, 1)[:n, :k]


def decode_rows(x: torch.Tensor, format: str, kernel_path: str) -> torch.Tensor:
    """x as a decode GEMV (up to 2 rows) over ``format`` weights multiplies it on a native path, in fp32: int8 and
    int4 read each row rounded to int16 times its scale max|x| / 32767 (round half to even); bf16 and fp8 read x
    as it is."""
    rows = x.numel() // max(1, x.shape[-1])
    if format not in ("int8", "int4") or rows > 2 or kernel_path == "reference":
        return x.float()
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 32767
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(xf * (1 / scale)) * scale


def dequantize_like_packing(model: torch.nn.Module, format: str) -> None:
    """Replace, in place, each weight that ``compile_model(..., weights=format)`` would quantize by its
    dequantized values (rounded to its dtype): an eager model that computes what the compiled one does."""
    from tilefx.compiler import CompileOptions
    from tilefx.models.adapters import adapter_for
    from tilefx.models.packing import plan

    with torch.no_grad():
        for _, groups in plan(model, adapter_for(model.config), CompileOptions(weights=format)):
            for group in groups:
                if group.format != "bf16":
                    for param in group.params:
                        param.copy_(_dequantized_like(param, group.layout, group.format).to(param.dtype))


def _dequantized_like(param: torch.Tensor, layout: str, format: str) -> torch.Tensor:
    """2-D weights as they are; experts one by one, a fused gate_up as its gate and up halves."""
    if param.dim() == 2:
        return dequantized(param, format)
    halves = 2 if layout == "expert_gate_up" else 1
    return torch.stack([torch.cat([dequantized(h, format) for h in expert.chunk(halves)]) for expert in param])
