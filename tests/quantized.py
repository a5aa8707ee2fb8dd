"""Reference models for quantized weights: HF eager over the values the quantized kernels multiply by (and, for int4
decode, the inputs as its GEMVs round them)."""

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


def rows_as_read(x: torch.Tensor, format: str, kernel_path: str) -> torch.Tensor:
    """x as a native path's linear over ``format`` weights multiplies it, in fp32. A decode GEMV (up to 4 rows,
    csrc/kernels.h kGemvRows): int8 and int4 read each row rounded to int16 times
    its scale max|x| / 32767 (round half to even), int4 with int8 activations (``int4_reads_int8``) each 32 inputs
    rounded to int8 times their max|x| / 127. An int8 or int4 GEMM (more than 4 rows) reads x as ``gemm_x`` says:
    each 32 inputs rounded to int8 likewise, or each row to int16. Otherwise x as it is."""
    rows = x.numel() // max(1, x.shape[-1])
    gemm_x_form = gemm_x(format, kernel_path, x.shape[-1]) if format in ("int8", "int4") and rows > 4 else None
    if gemm_x_form == "int8":
        return rounded_to_groups(x.float(), 32, 127)
    if gemm_x_form == "int16":
        return rounded_to_groups(x.float(), x.shape[-1], 32767)
    if format not in ("int8", "int4") or rows > 4 or kernel_path == "reference":
        return x.float()
    if format == "int4" and int4_reads_int8(kernel_path):
        return rounded_to_groups(x.float(), 32, 127)
    return rounded_to_groups(x.float(), x.shape[-1], 32767)


def gemm_x(format: str, kernel_path: str, in_features: int) -> str:
    """How a linear or expert of more than 4 rows over ``format`` weights on ``kernel_path`` reads x
    (``tuning.gemm_x``): "int8" per 32 inputs (where K padded to even is a multiple of 4, else as "bf16"), "int16"
    per row, or "bf16" as it is."""
    from tilefx.custom_ops import tuning

    form = tuning.gemm_x(format, kernel_path)
    return "bf16" if form == "int8" and (in_features + in_features % 2) % 4 else form


def experts_as_read(x, gate_up_w, down_w, topk_weights, ids, format: str, kernel_path: str) -> torch.Tensor:
    """fused_moe over quantized experts (fp32 dequantized weights ``[E, 2I, H]``, ``[E, H, I]``) as its units
    compute it, expert by expert: each expert's rows of x and of the intermediate read as a linear of that many rows
    reads them (``rows_as_read``; the AVX512-BF16 units round the intermediate to bf16 first), each pair's result
    rounded to bf16, the weighted sum in fp32."""
    out = torch.zeros(x.shape[0], down_w.shape[1])
    pairs_bf16 = kernel_path not in ("avx2", "reference")
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        gate, up = (rows_as_read(x[token], format, kernel_path) @ gate_up_w[expert].float().T).chunk(2, dim=-1)
        hidden = torch.nn.functional.silu(gate) * up
        if pairs_bf16:
            hidden = hidden.to(torch.bfloat16)
        result = (rows_as_read(hidden, format, kernel_path) @ down_w[expert].float().T).to(torch.bfloat16)
        out.index_add_(0, token, topk_weights[token, slot].float()[:, None] * result.float())
    return out


class _RoundedInt4Inputs(torch.overrides.TorchFunctionMode):
    """``F.linear`` over one of ``storages``' weights (the int4 ones) reads its input rounded, in fp32: ``form``
    "int8" (per 32 inputs) or "int16" (per row) on every row, or with None as the current path does (``rows_as_read``:
    decode's form up to 4 rows, the GEMM's above)."""

    def __init__(self, storages: set[int], form: str | None):
        super().__init__()
        self.storages, self.form = storages, form

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and args[1].untyped_storage().data_ptr() in self.storages:
            from tilefx.custom_ops import isa

            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if self.form is None:
                rounded = rows_as_read(x, "int4", isa.current())
            else:
                rounded = (rounded_to_groups(x.float(), 32, 127) if self.form == "int8" else
                           rounded_to_groups(x.float(), x.shape[-1], 32767))
            out = torch.nn.functional.linear(rounded, weight.float(), None if bias is None else bias.float())
            return out.to(x.dtype)
        return func(*args, **kwargs)


def rounds_int4_inputs(model: torch.nn.Module, form: str | None = None) -> torch.nn.Module:
    """``model`` (eager, its int4 weights already dequantized) made to read each int4 weight's input rounded: as the
    current kernel path's decode GEMVs and GEMMs do (``form`` None), or on every row as ``form`` ("int8": per 32
    inputs; "int16": per row) says. The oracle of a model whose int4 kernels round x. The weights are those
    ``weights="int4"`` packs as int4 (a 4-bit checkpoint's too)."""
    from tilefx.compiler import CompileOptions
    from tilefx.models.adapters import adapter_for
    from tilefx.models.packing import plan

    storages = {param.untyped_storage().data_ptr()
                for _, groups in plan(model, adapter_for(model.config), CompileOptions(weights="int4"))
                for group in groups if group.format == "int4" for param in group.params}
    assert storages, "no int4 weights"
    forward = model.forward

    def rounded_forward(*args, **kwargs):
        with _RoundedInt4Inputs(storages, form):
            return forward(*args, **kwargs)

    model.forward = rounded_forward
    return model


def int4_reads_int8(kernel_path: str) -> bool:
    """Whether int4 decode on ``kernel_path`` reads x as int8 per 32 inputs (a native path, where
    ``TILEFX_INT4_ACTIVATIONS=int8`` or ``isa.forced_int4_activations("int8")`` asks for it)."""
    from tilefx.custom_ops import isa

    return kernel_path != "reference" and isa.int4_activations() == "int8"


def rounded_to_groups(x: torch.Tensor, group: int, levels: int) -> torch.Tensor:
    """fp32 ``x`` with each ``group`` inputs of a row rounded (half to even) to ``levels`` steps of their max|x| (the
    last group may be shorter)."""
    k = x.shape[-1]
    padded = torch.nn.functional.pad(x.reshape(-1, k), (0, -k % group)).view(-1, (k + group - 1) // group, group)
    scale = padded.abs().amax(-1, keepdim=True) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    rounded = torch.round(padded * (1 / scale)) * scale
    return rounded.flatten(1)[:, :k].reshape(x.shape)


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
