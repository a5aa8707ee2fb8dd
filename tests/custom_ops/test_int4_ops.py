"""int4 weights as GPTQ / AWQ checkpoints hold them: unsigned nibbles with a scale and a zero point per row and
128 inputs (asymmetric: any zero in [0, 15]), packed as they are and run on every kernel path, against the
exactly dequantized weight. (``weights="int4"``'s own symmetric RTN runs in test_quantized_ops.py.)"""

from __future__ import annotations

import pytest
import torch

from tilefx.custom_ops import linear as linear_ops
from tilefx.custom_ops import isa, tuning, weights

from quantized import experts_as_read, gemm_x, rows_as_read


def _marked(values: torch.Tensor, params: torch.Tensor) -> torch.nn.Parameter:
    """A parameter standing for nibbles ``values`` (one a byte) as the loader holds an int4 checkpoint's weight:
    untouched zeros of its shape, its nibbles two a byte and its params beside it."""
    weight = torch.nn.Parameter(weights.untouched_zeros(values.shape, torch.uint8), requires_grad=False)
    weights.attach_checkpoint_int4(weight, weights.pair_nibbles(values), params)
    return weight


def _checkpoint_int4(rows, in_features, seed, lead=()):
    """Random nibbles and params ``[..., rows, groups, 2]`` (fp16 scale, integer zero point in [0, 15]), marked as
    an int4 checkpoint's weight; and the fp32 weight they mean."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (*lead, rows, in_features), generator=g, dtype=torch.uint8)
    groups = -(-in_features // weights.INT4_GROUP)
    scales = (torch.rand(*lead, rows, groups, generator=g) * 0.02 + 0.005).half()
    zeros = torch.randint(0, 16, (*lead, rows, groups), generator=g).half()
    params = torch.stack([scales, zeros], dim=-1)
    weight = _marked(values, params)
    flat = [weights.dequantize_int4_rows(v, p, torch.float32)
            for v, p in zip(values.reshape(-1, rows, in_features), params.reshape(-1, rows, groups, 2))]
    return weight, torch.stack(flat).reshape(*lead, rows, in_features)


def _relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def test_dequantize_int4_rows_is_q_minus_z_times_s():
    values = torch.tensor([[0, 15, 8, 3] + [1] * 124 + [7, 9]], dtype=torch.uint8)  # 130 inputs: two groups
    params = torch.tensor([[[0.5, 8.0], [0.25, 3.0]]], dtype=torch.float16)
    got = weights.dequantize_int4_rows(values, params, torch.float32)
    assert got[0, :4].tolist() == [-4.0, 3.5, 0.0, -2.5] and got[0, 128:].tolist() == [1.0, 1.5]


# decode (1-4 rows: words), the smallest GEMM (5), prefill; K with a partial last group (200, 1000) and over many
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 37])
@pytest.mark.parametrize("out_features,in_features", [(70, 200), (64, 1000), (4096 + 32, 256)])
def test_int4_checkpoint_linear_on_every_path(kernel_path, int4_x, rows, out_features, in_features):
    weight, want_weight = _checkpoint_int4(out_features, in_features, seed=rows + in_features)
    packed = weights.pack_linear_weight(weight, "int4")
    scales = weights.packed_scales(packed)
    assert packed.dtype == torch.uint8 and scales.dtype == torch.float16
    x = (torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)) * 2).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = rows_as_read(x, "int4", kernel_path) @ want_weight.T + bias.float()
    got = linear_ops.linear(x, packed, bias, out_features, scales)
    assert _relative_error(got, want) < 1e-2
    # the reference reads the packing back exactly
    assert torch.equal(weights.unpack_linear_weight(weights.dequantize(packed, scales), out_features, in_features),
                       want_weight)


def test_int4_decode_holds_the_largest_products(kernel_path, int4_x):
    """Every nibble 15 against zero point 0 and every x at the row's maximum over K = 8192: each group's int32
    sums stay exact, and a zero point of 15 cancels them to 0 exactly where the nibbles equal it."""
    in_features = 8192
    values = torch.full((64, in_features), 15, dtype=torch.uint8)
    groups = in_features // weights.INT4_GROUP
    params = torch.stack([torch.full((64, groups), 0.01), torch.zeros(64, groups)], dim=-1).half()
    params[32:, :, 1] = 15  # the second block's columns: (15 - 15) * s = 0
    weight = _marked(values, params)
    packed = weights.pack_linear_weight(weight, "int4")
    for rows in (1, 2):
        x = torch.ones(rows, in_features).to(torch.bfloat16)
        got = linear_ops.linear_float(x, packed, None, 64, weights.packed_scales(packed))
        want = float(torch.tensor(0.01, dtype=torch.float16)) * 15 * in_features
        assert torch.allclose(got[:, :32], torch.full((rows, 32), want), rtol=1e-4)
        assert torch.equal(got[:, 32:], torch.zeros(rows, 32))


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_int4_checkpoint_gate_up(kernel_path, int4_x, rows):
    gate, gate_w = _checkpoint_int4(96, 384, seed=1)
    up, up_w = _checkpoint_int4(96, 384, seed=2)
    packed = weights.pack_gate_up_weight(gate, up, "int4")
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    xf = rows_as_read(x, "int4", kernel_path)  # decode on a native unit: x as the unit rounds it
    want = torch.nn.functional.silu(xf @ gate_w.T) * (xf @ up_w.T)
    got = linear_ops.linear_silu_mul(x, packed, 96, weights.packed_scales(packed))
    assert _relative_error(got, want) < 1e-2


@pytest.mark.parametrize("tokens", [1, 2, 8, 40])
def test_int4_checkpoint_experts(kernel_path, int4_x, tokens):
    """A checkpoint's experts (each expert's gate and up rows stacked, as the loader fuses them), decode and
    prefill, on the unit and (prefill) forced onto oneDNN's brgemm. 8 tokens route 3, 1, 4, 3 and 5 rows to the
    five experts: decode GEMVs of 1, 3 and 4 rows beside a GEMM in one call."""

    experts, hidden, inter = 5, 256, 96
    gate_up, gate_up_w = _checkpoint_int4(2 * inter, hidden, seed=7, lead=(experts,))
    down, down_w = _checkpoint_int4(hidden, inter, seed=8, lead=(experts,))
    w13 = weights.pack_expert_gate_up_weight(gate_up, "int4")
    w2 = weights.pack_expert_down_weight(down, "int4")
    s13, s2 = weights.packed_scales(w13), weights.packed_scales(w2)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)]).to(torch.int32)
    topk_weights = torch.rand(tokens, 2, generator=g) + 0.1
    # each expert a decode GEMV or a GEMM: x and the intermediate as that reads them
    want = experts_as_read(x, gate_up_w, down_w, topk_weights, ids, "int4", kernel_path)
    got = torch.ops.tilefx.fused_moe(x, w13, w2, topk_weights, ids, w13_scales=s13, w2_scales=s2)
    assert _relative_error(got, want.float()) < 1e-2
    if kernel_path != "reference" and tokens > 4:
        with tuning.forced_gemm("int4", "brgemm"):  # (x as it is: brgemm multiplies bf16)
            on_brgemm = torch.ops.tilefx.fused_moe(x, w13, w2, topk_weights, ids, w13_scales=s13, w2_scales=s2)
            want = experts_as_read(x, gate_up_w, down_w, topk_weights, ids, "int4", kernel_path)
        assert _relative_error(on_brgemm, want.float()) < 1e-2


@pytest.mark.parametrize("rows", [5, 70])
def test_int4_prefill_on_brgemm(kernel_path, rows):
    if kernel_path == "reference":
        pytest.skip("the reference path runs PyTorch's matmul; brgemm is a native path's choice")
    weight, want_weight = _checkpoint_int4(5 * 32 + 7, 300, seed=11)
    packed = weights.pack_linear_weight(weight, "int4")
    x = torch.randn(rows, 300, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    with tuning.forced_gemm("int4", "brgemm"):
        got = torch.ops.tilefx.linear_float(x, packed, None, 5 * 32 + 7, weights.packed_scales(packed))
    assert _relative_error(got, x.float() @ want_weight.T) < 1e-2


@pytest.mark.parametrize("format", ["bf16", "int8"])
def test_int4_checkpoint_packs_in_other_formats(kernel_path, format):
    """An int4 checkpoint's weight asked for in another format is dequantized a chunk at a time, then packed."""
    weight, want_weight = _checkpoint_int4(64, 256, seed=12)
    packed = weights.pack_linear_weight(weight, format)
    scales = weights.packed_scales(packed) if format != "bf16" else None
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert _relative_error(linear_ops.linear(x, packed, None, 64, scales), x.float() @ want_weight.T) < 1e-2


def test_int4_checkpoint_needs_its_params():
    values = torch.zeros(32, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fp16 scales and zero points"):
        weights.attach_checkpoint_int4(values, weights.pair_nibbles(values), torch.zeros(32, 2, 2))
    with pytest.raises(ValueError, match="fp16 scales and zero points"):
        weights.attach_checkpoint_int4(values, weights.pair_nibbles(values), torch.zeros(32, 1, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="nibbles must be uint8 rows, two a byte"):
        weights.attach_checkpoint_int4(values, values, torch.zeros(32, 2, 2, dtype=torch.float16))
    experts = torch.zeros(2, 32, 256, dtype=torch.uint8)
    half = weights.Int4Rows.of(torch.zeros(16, 128, dtype=torch.uint8), torch.zeros(16, 2, 2, dtype=torch.float16))
    weights.attach_int4_parts(experts, [(half, half), (half, half)])  # per expert: gate and up parts
    with pytest.raises(ValueError, match="32 rows per matrix"):  # an expert's parts short of its rows
        weights.attach_int4_parts(experts, [(half, half), (half,)])
    assert "packed from bf16 or from a quantized" in weights.can_pack("linear", [values], format="int4")


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("in_features", [200, 1024])
def test_int4_decode_reads_x_as_its_unit_rounds_it(kernel_path, int4_x, rows, in_features):
    """int4 decode (up to 4 rows; on the AVX2 unit rows 2-3 in a second pass over each block) on every unit: x
    rounded as the unit reads it (AVX512-BF16: int8 per 32 inputs; AVX2: int16 words per row, their bytes multiplied
    apart) against the nibbles, within 1e-4 of the fp32 product
    of those rows and the exactly dequantized weight (partial last groups of x and of the weight included, and a
    group of x that is all zeros)."""
    if kernel_path == "reference":
        pytest.skip("the reference multiplies x as it is")
    weight, want_weight = _checkpoint_int4(96, in_features, seed=rows * 7 + in_features)
    packed = weights.pack_linear_weight(weight, "int4")
    x = (torch.randn(rows, in_features, generator=torch.Generator().manual_seed(9)) * 3).to(torch.bfloat16)
    x[:, 32:64] = 0
    got = linear_ops.linear_float(x, packed, None, 96, weights.packed_scales(packed))
    want = rows_as_read(x, "int4", kernel_path) @ want_weight.T
    assert _relative_error(got, want) < 1e-4


# a ragged last row tile of one row (the AVX512 tile is 6 rows), K over a partial last weight group (300) and over
# several of the GEMM's K chunks (2048: eight groups of 128, 128 pairs a chunk), rows over many tiles
INT4_GEMM_SHAPES = [((7,), 300), ((2, 9), 128), ((13,), 2048), ((110,), 132)]


@pytest.mark.parametrize("rows,in_features", INT4_GEMM_SHAPES)
def test_int4_gemm_multiplies_rounded_x(kernel_path, rows, in_features):
    """An int4 GEMM (more than 4 rows) on the units' own GEMM multiplies the nibbles by x rounded to int8 per 32
    inputs on the AVX512-BF16 units (`vpdpbusd`), to int16 per row on AVX2 (`vpmaddwd`), the zero points off per 128
    inputs: within fp32 rounding of the float64 product of those rows and the exactly dequantized weight, ten times
    nearer it than the product of x as it is; linear and gate/up, an outlying input included. On oneDNN's brgemm and
    with TILEFX_INT8_ACTIVATIONS=bf16 it dequantizes the blocks and reads x as it is."""
    if kernel_path == "reference":
        pytest.skip("the reference path multiplies x as it is")
    weight, w = _checkpoint_int4(96, in_features, seed=in_features)
    up, u = _checkpoint_int4(96, in_features, seed=in_features + 1)
    x = (torch.randn(*rows, in_features, generator=torch.Generator().manual_seed(in_features)) * 3)
    x[..., 3] = 3000.0  # an outlying input: its group's other inputs round to 0
    x = x.to(torch.bfloat16)
    packed, gate_up = weights.pack_linear_weight(weight, "int4"), weights.pack_gate_up_weight(weight, up, "int4")
    with tuning.forced_gemm("int4", "unit"):
        form = gemm_x("int4", kernel_path, in_features)
        assert form == ("int16" if kernel_path == "avx2" else "int8")
        fp32 = linear_ops.linear_float(x, packed, None, 96, weights.packed_scales(packed))
        gated = linear_ops.linear_silu_mul(x, gate_up, 96, weights.packed_scales(gate_up))
    rounded, plain = rows_as_read(x, "int4", kernel_path).double(), x.double()
    assert form == "bf16" or not torch.equal(rounded, plain)
    want = rounded @ w.double().T
    if form == "bf16":  # (the dequantized blocks are rounded to bf16)
        assert _relative_error(fp32.double(), want) < 1e-2
    else:
        assert _relative_error(fp32.double(), want) < 1e-5
        assert _relative_error(fp32.double(), want) * 10 < _relative_error(fp32.double(), plain @ w.double().T)
    assert _relative_error(gated.double(), torch.nn.functional.silu(want) * (rounded @ u.double().T)) < 1e-2
    if tuning.brgemm_runs():
        with tuning.forced_gemm("int4", "brgemm"):
            assert gemm_x("int4", kernel_path, in_features) == "bf16"
            on_brgemm = linear_ops.linear_float(x, packed, None, 96, weights.packed_scales(packed))
        assert _relative_error(on_brgemm.double(), plain @ w.double().T) < 1e-2
    with tuning.forced_gemm("int4", "unit"), isa.forced_int8_activations("bf16"):
        assert gemm_x("int4", kernel_path, in_features) == "bf16"
        weight_only = linear_ops.linear_float(x, packed, None, 96, weights.packed_scales(packed))
    assert _relative_error(weight_only.double(), plain @ w.double().T) < 1e-2
