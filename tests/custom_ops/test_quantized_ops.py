"""Quantized weights (int8, fp8, int4): packing and scales, and every linear kernel path against a reference that
dequantizes the weight then multiplies in fp32."""

from __future__ import annotations

import pytest
import torch

from tilefx.custom_ops import isa
from tilefx.custom_ops import linear as linear_ops
from tilefx.custom_ops import weights

from quantized import dequantized, experts_as_read, gemm_x, rows_as_read, rounded_to_groups

FORMATS = ["int8", "fp8", "int4"]


def _skip_unless_fits(format, in_features):
    if format == "int4" and in_features % 4:
        pytest.skip("int4 reads inputs in fours (can_pack refuses other K)")


def _relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def _weight(out_features, in_features, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(torch.bfloat16)


SHAPES = [
    # rows (leading dims of x), out_features N, in_features K
    ((1,), 64, 64),  # decode, whole blocks
    ((1,), 33, 7),  # N not a multiple of the block, odd K
    ((1,), 96, 300),  # K over two fp8 scale groups, not a multiple of 128
    ((1,), 64, 130),  # odd K pair count (65): a group's last pair row without its odd partner
    ((2,), 200, 96),  # batch-2 decode
    ((3,), 96, 129),  # batch-3 decode (in registers, as 1-2 rows), odd K just past a scale group
    ((4,), 64, 300),  # batch-4 decode
    ((5,), 96, 129),  # smallest GEMM
    ((2, 37), 70, 300),  # prefill
    ((1,), 4096 + 32, 256),  # many blocks, odd block count (two streams + one left)
    ((1,), 160, 1000),  # N spanning two 128-row scale groups, K over 8
]


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_quantized_linear_matches_dequantized_matmul(kernel_path, format, rows, out_features, in_features, bias):
    _skip_unless_fits(format, in_features)
    weight = _weight(out_features, in_features, seed=out_features + in_features)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*rows, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None
    packed = weights.pack_linear_weight(weight, format)
    scales = weights.packed_scales(packed)
    want = rows_as_read(x, format, kernel_path) @ dequantized(weight, format).T + (b.float() if bias else 0.0)
    got = linear_ops.linear(x, packed, b, out_features, scales)
    assert got.shape == (*rows, out_features) and got.dtype == torch.bfloat16
    assert _relative_error(got, want) < 1e-2
    fp32 = linear_ops.linear_float(x, packed, b, out_features, scales)
    assert fp32.dtype == torch.float32 and _relative_error(fp32, want) < 1e-2


# odd K (a last K pair row alone), odd block counts (two streams + one), 2-4 rows
INT8_DECODE_SHAPES = [((1,), 64, 64), ((1,), 33, 7), ((1,), 96, 300), ((2,), 200, 96), ((1,), 4096 + 32, 256),
                      ((1,), 160, 1000), ((2,), 64, 5), ((3,), 96, 129), ((4,), 64, 130)]


@pytest.mark.parametrize("rows,out_features,in_features", INT8_DECODE_SHAPES)
def test_int8_decode_reads_x_as_words(kernel_path, rows, out_features, in_features):
    """int8 decode (up to 4 rows) on every unit: x as int16 words per row against the int8
    weight, within 1e-2 of the fp32 product of those rows and the dequantized weight; plain, linear_float and
    gate/up."""
    if kernel_path == "reference":
        pytest.skip("the reference multiplies x as it is")
    weight = _weight(out_features, in_features, seed=out_features * 3 + in_features)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(*rows, in_features, generator=g) * 3).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16)
    packed = weights.pack_linear_weight(weight, "int8")
    scales = weights.packed_scales(packed)
    xq = rows_as_read(x, "int8", kernel_path)
    want = xq @ dequantized(weight, "int8").T + b.float()
    got = linear_ops.linear(x, packed, b, out_features, scales)
    fp32 = linear_ops.linear_float(x, packed, b, out_features, scales)
    assert _relative_error(got, want) < 1e-2 and _relative_error(fp32, want) < 1e-2
    if out_features % 32 == 0:  # the gate/up packing's blocks
        up = _weight(out_features, in_features, seed=out_features * 5 + in_features)
        gate_up = weights.pack_gate_up_weight(weight, up, "int8")
        want_gated = torch.nn.functional.silu(xq @ dequantized(weight, "int8").T) * (xq @ dequantized(up, "int8").T)
        gated = linear_ops.linear_silu_mul(x, gate_up, out_features, weights.packed_scales(gate_up))
        assert _relative_error(gated, want_gated) < 1e-2


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_int8_decode_holds_the_largest_products(kernel_path, rows):
    """Every weight at +-127 and every x at the row's maximum, over K = 8192: the int16 words' int32 sums (2 * 127 *
    32767 per K pair; on two streams both halves of K into the same sums; 3-4 rows in chunks; 7 rows: the AVX2
    unit's GEMM) must reach fp32 before int32 overflows."""
    in_features = 8192
    weight = torch.full((64, in_features), 0.5).to(torch.bfloat16)
    weight[1::2] = -0.5
    x = torch.ones(rows, in_features).to(torch.bfloat16)
    packed = weights.pack_linear_weight(weight, "int8")
    got = linear_ops.linear(x, packed, None, 64, weights.packed_scales(packed))
    want = x.float() @ dequantized(weight, "int8").T
    assert want.abs().min() > 4000
    assert _relative_error(got, want) < 1e-2


# rows, K: the smallest GEMM, K padded to 8 (a partial group of x), a last group of 4 inputs, K past one chunk of 128
# pairs, a prompt over several row tiles and 8 chunks, K not a multiple of 4 over two of the AVX2 GEMM's row chunks
INT8_GEMM_SHAPES = [((5,), 7), ((7,), 100), ((2, 9), 300), ((13,), 2048), ((110,), 130)]


@pytest.mark.parametrize("rows,in_features", INT8_GEMM_SHAPES)
def test_int8_gemm_multiplies_rounded_x(kernel_path, rows, in_features):
    """An int8 GEMM on the units' own GEMM multiplies integers: x rounded to int8 per 32 inputs on the AVX512-BF16
    units (`vpdpbusd`; K a multiple of 4), to int16 per row on AVX2 (`vpmaddwd`). Within fp32 rounding of the float64
    product of those rows and the dequantized weight, ten times nearer it than the product of x as it is; linear,
    linear_float and gate/up. On oneDNN's brgemm, and with TILEFX_INT8_ACTIVATIONS=bf16, the same call reads x as it
    is."""
    from tilefx.custom_ops import tuning

    if kernel_path == "reference":
        pytest.skip("the reference path multiplies x as it is")
    g = torch.Generator().manual_seed(in_features)
    x = (torch.randn(*rows, in_features, generator=g) * 3).to(torch.bfloat16)
    # an outlying input, as trained models' hidden states have: its group's other inputs round to 0, and the
    # products of the +128 the AVX512 unit adds to each weight byte are ~1e5 times the outputs (none of its own: its
    # weights are 0), so those must come off exactly (K of one group: left out, every output would be 0)
    weight, up = _weight(96, in_features, seed=in_features), _weight(96, in_features, seed=in_features + 1)
    if in_features > 32:
        x[..., 3] = 3000.0
        weight[:, 3] = up[:, 3] = 0
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    packed, gate_up = weights.pack_linear_weight(weight, "int8"), weights.pack_gate_up_weight(weight, up, "int8")
    w, u = dequantized(weight, "int8").double(), dequantized(up, "int8").double()
    with tuning.forced_gemm("int8", "unit"):
        form = gemm_x("int8", kernel_path, in_features)
        assert form == ("int16" if kernel_path == "avx2" else "int8" if (in_features + in_features % 2) % 4 == 0
                        else "bf16")
        fp32 = linear_ops.linear_float(x, packed, b, 96, weights.packed_scales(packed))
        got = linear_ops.linear(x, packed, b, 96, weights.packed_scales(packed))
        gated = linear_ops.linear_silu_mul(x, gate_up, 96, weights.packed_scales(gate_up))
    rounded, plain = rows_as_read(x, "int8", kernel_path).double(), x.double()  # rounded in fp32, as the units do
    assert form == "bf16" or not torch.equal(rounded, plain)

    def error(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    want = rounded @ w.T + b.double()
    assert error(fp32, want) < 1e-5
    if form != "bf16":
        assert error(fp32, want) * 10 < error(fp32, plain @ w.T + b.double())
    assert error(got, want) < 1e-2
    assert error(gated, torch.nn.functional.silu(rounded @ w.T) * (rounded @ u.T)) < 1e-2
    if tuning.brgemm_runs():
        with tuning.forced_gemm("int8", "brgemm"):
            assert gemm_x("int8", kernel_path, in_features) == "bf16"
            on_brgemm = linear_ops.linear_float(x, packed, b, 96, weights.packed_scales(packed))
        assert error(on_brgemm, plain @ w.T + b.double()) < 1e-5
    # TILEFX_INT8_ACTIVATIONS=bf16: the unit's GEMM over dequantized blocks, x as it is
    with tuning.forced_gemm("int8", "unit"), isa.forced_int8_activations("bf16"):
        assert gemm_x("int8", kernel_path, in_features) == "bf16"
        weight_only = linear_ops.linear_float(x, packed, b, 96, weights.packed_scales(packed))
    assert error(weight_only, plain @ w.T + b.double()) < 1e-5


def test_int8_activations_are_checked_and_default_to_int8(monkeypatch):
    if isa.native is None:
        pytest.skip("native library not built")
    assert isa.int8_activations() == "int8"
    with pytest.raises(RuntimeError, match="int8 and int4 GEMMs read x as int8 or bf16"):
        isa.native.set_int8_activations("int4")
    with pytest.raises(ValueError, match="int8 and int4 GEMMs read x as one of"):
        with isa.forced_int8_activations("fp32"):
            pass
    monkeypatch.setenv("TILEFX_INT8_ACTIVATIONS", "BF16")
    assert isa._int8_from_environment() == "bf16"
    monkeypatch.setenv("TILEFX_INT8_ACTIVATIONS", "int16")
    with pytest.raises(RuntimeError, match="TILEFX_INT8_ACTIVATIONS=int16"):
        isa._int8_from_environment()


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("rows", [(1,), (2,), (4,), (3, 5)], ids=["decode", "batch2", "batch4", "prefill"])
def test_quantized_linear_silu_mul(kernel_path, format, rows):
    gate, up = _weight(96, 200, seed=3), _weight(96, 200, seed=4)
    x = torch.randn(*rows, 200, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    packed = weights.pack_gate_up_weight(gate, up, format)
    xf = rows_as_read(x, format, kernel_path)
    want = torch.nn.functional.silu(xf @ dequantized(gate, format).T) * (xf @ dequantized(up, format).T)
    got = linear_ops.linear_silu_mul(x, packed, 96, weights.packed_scales(packed))
    assert _relative_error(got, want) < 1e-2


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("rows", [(2,), (3,), (3, 5)], ids=["batch2", "batch3", "prefill"])
def test_quantized_strided_activations(kernel_path, format, rows):
    _skip_unless_fits(format, 130)
    wide = torch.randn(*rows, 2 * 130, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x = wide[..., 5:135]
    weight = _weight(96, 130, seed=6)
    packed = weights.pack_linear_weight(weight, format)
    got = linear_ops.linear(x, packed, None, 96, weights.packed_scales(packed))
    assert _relative_error(got, x.float() @ dequantized(weight, format).T) < 1e-2


def _every_finite_e4m3() -> torch.Tensor:
    """[256, 128]: row r holds one e4m3 code in every column, each 128-row scale group holding 448 (so both
    group scales are exactly 1); the 254 finite codes, and 448 again where a NaN code would be."""
    codes = torch.arange(256, dtype=torch.int32)
    codes[0x7F] = codes[0xFF] = 0x7E
    values = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    return values[:, None].expand(256, 128).to(torch.bfloat16), values


@pytest.mark.parametrize("rows", [1, 2, 4, 5], ids=["gemv", "two-row gemv", "four-row gemv", "gemm"])
def test_every_e4m3_code_decodes_exactly(kernel_path, rows):
    """Subnormals, both zeros, the largest normal: each finite code's value comes out exact (x one-hot)."""
    weight, values = _every_finite_e4m3()
    packed = weights.pack_linear_weight(weight, "fp8")
    scales = weights.packed_scales(packed)
    assert torch.equal(scales, torch.ones_like(scales))
    codes = weights.unpack_linear_weight(packed, 256, 128).view(torch.uint8)[:, 0]
    assert torch.equal(codes, values.to(torch.float8_e4m3fn).view(torch.uint8))  # every code stored as is, -0 too
    x = torch.zeros(rows, 128, dtype=torch.bfloat16)
    x[:, 0] = 1.0
    got = linear_ops.linear_float(x, packed, None, 256, scales)
    assert torch.equal(got, values.expand(rows, 256))


def test_fp8_gemm_panel_takes_each_group_scale(kernel_path):
    """The GEMM's dequantized fp8 panel: every value times its 128-input group's scale, rounded to bf16 once.
    One-hot rows of x read the panel back out (K = 300: two whole groups and a partial one; N = 201)."""
    weight = (torch.randn(201, 300, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    packed = weights.pack_linear_weight(weight, "fp8")
    scales = weights.packed_scales(packed)
    assert scales.unique().numel() == 6  # two 128-row blocks x three groups, each its own scale
    x = torch.eye(300, dtype=torch.bfloat16)
    got = linear_ops.linear(x, packed, None, 201, scales)
    assert torch.equal(got, linear_ops.linear_reference(x, packed, None, 201, scales))


def test_quantize_rows():
    weight = _weight(200, 300, seed=7)
    values, scales = weights.quantize_rows(weight, "int8")
    assert values.dtype == torch.int8 and scales.shape == (200,) and int(values.abs().max()) == 127
    assert torch.allclose(values.float() * scales[:, None], weight.float(), atol=float(scales.max()) / 2 + 1e-6)
    values, scales = weights.quantize_rows(weight, "fp8")
    assert values.dtype == torch.float8_e4m3fn and values.shape == (200, 300) and scales.shape == (2, 3)
    assert float(values.float().abs().amax()) == weights.FP8_MAX  # each block's largest value maps to 448
    assert not values.float().isnan().any()
    values, params = weights.quantize_rows(weight, "int4")  # per row and 128 inputs: scale, zero point
    assert values.dtype == torch.uint8 and values.shape == (200, 300) and params.shape == (200, 3, 2)
    assert params.dtype == torch.float16 and int(values.max()) <= 15
    assert bool((values.amin(dim=1) == 0).all()) and bool((values.amax(dim=1) == 15).all())  # min and max map to 0, 15
    scale, zero = params[..., 0].float().repeat_interleave(128, 1)[:, :300], params[..., 1].float().repeat_interleave(128, 1)[:, :300]
    assert torch.allclose((values.float() - zero) * scale, weight.float(), atol=float(scale.max()) / 2 + 1e-6)
    zero = torch.zeros(40, 50, dtype=torch.bfloat16)
    for format in FORMATS:
        _, scales = weights.quantize_rows(zero, format)
        scales = scales[..., 0] if format == "int4" else scales
        assert torch.equal(scales, torch.ones_like(scales))  # no division by zero


@pytest.mark.skipif(isa.native is None, reason="native library not built")
@pytest.mark.parametrize("format", FORMATS)
def test_native_quantizing_equals_torchs(format, monkeypatch):
    """quantize_rows in one native pass (csrc/memory.cpp) against its torch ops, bit for bit: rows of magnitudes
    2^-20 to 2^20 (every format's scales over a wide range), a zero row, ties (int8: x.5 times the scale), ragged
    blocks and groups (n and K not multiples of 128, K odd), rows read through a stride (a column slice)."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(267, 301, generator=g) * torch.logspace(-20, 20, 267, base=2)[:, None]
    wide[5] = 0
    wide[9, 1:5] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # int8's scale 1: 0.5, 1.5 and -2.5 are ties
    weight = wide.to(torch.bfloat16)[:, 1:300]
    native = weights.quantize_rows(weight, format)
    monkeypatch.setattr(isa, "native", None)
    ops = weights.quantize_rows(weight, format)
    as_bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    assert torch.equal(as_bits(native[0]), as_bits(ops[0].contiguous())) and torch.equal(native[1], ops[1])
    if format == "int8":
        assert native[0][9, :4].tolist() == [127, 0, 2, -2] and float(native[1][5]) == 1.0


@pytest.mark.parametrize("format", FORMATS)
def test_quantized_packing_layout_and_scales(format):
    """Values in the bf16 layout's element order; scales in packed-block order (each sibling's own)."""
    q, k = _weight(160, 72, seed=8), _weight(40, 72, seed=9)
    fused = weights.pack("linear", [q, k], format=format)
    assert fused.dtype == weights.FORMATS[format] and weights.logical_shape(fused) == weights.packed_shape(200, 72)
    scales = weights.scales_of(fused)
    assert tuple(scales.shape) == weights.scales_shape(tuple(fused.shape), format)
    for source, first, blocks in ((q, 0, 5), (k, 5, 2)):
        values, row_scales = weights.quantize_rows(source, format)
        part = fused[first : first + blocks]
        if format == "int4":  # nibbles in the int4 order, params per block [groups, 2, 32]
            unpacked = weights.unpack_linear_weight(weights.layouts.int4_values(part), source.shape[0], 72)
            assert torch.equal(unpacked, values)
            params = scales[first : first + blocks].permute(0, 3, 1, 2).reshape(-1, 1, 2)
            assert torch.equal(params[: source.shape[0]], row_scales)
            continue
        unpacked = weights.unpack_linear_weight(part, source.shape[0], 72)
        assert torch.equal(unpacked.view(torch.uint8), values.view(torch.uint8))
        if format == "int8":
            assert torch.equal(scales[first : first + blocks].flatten()[: source.shape[0]], row_scales)
        else:
            assert torch.equal(scales[first : first + blocks], row_scales.repeat_interleave(4, 0)[:blocks])
    k_alone = weights.pack_linear_weight(k, format)  # a sibling read alone: its slice, with its scales
    assert k_alone.data_ptr() == fused[5].data_ptr()
    assert torch.equal(weights.packed_scales(k_alone), scales[5:7])


def test_quantized_release_keeps_shape_and_serves_the_packing():
    weight = torch.nn.Parameter(_weight(64, 96, seed=10), requires_grad=False)
    packed = weights.pack("linear", [weight], format="int8")
    assert weights.release(packed) == 64 * 96 * 2
    assert weight.shape == (64, 96) and weight.dtype == torch.bfloat16 and weight.stride() == (96, 1)
    assert not weight.data.any()  # untouched zeros: no memory of its own
    assert weights.is_released(weight)
    assert weights.pack_linear_weight(weight, "int8") is packed
    with pytest.raises(ValueError, match="cannot also be packed as linear bf16"):
        weights.pack_linear_weight(weight)


def test_can_pack_says_which_layouts_take_quantized_formats():
    gate_up, down = _bf16_experts()
    assert weights.can_pack("experts", [gate_up, down], format="int8") is None
    kv_b = _weight(64, 32, seed=2)
    assert "bf16 only" in weights.can_pack("mla", [kv_b], format="int8")  # MLA's per-head halves
    assert weights.can_pack("linear", [_weight(32, 64, seed=1)], format="fp8") is None
    assert "in fours" in weights.can_pack("linear", [_weight(32, 66, seed=1)], format="int4")
    with pytest.raises(ValueError, match="unknown weight format"):
        weights.can_pack("linear", [_weight(32, 64, seed=1)], format="int3")


def _bf16_experts():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(4, 64, 48, generator=g).to(torch.bfloat16),
            torch.randn(4, 48, 32, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("format", FORMATS)
def test_quantized_packed_embedding(format):
    weight = _weight(100, 72, seed=11)
    packed = weights.pack_linear_weight(weight, format)
    for ids in (torch.tensor([[0, 5, 99], [31, 32, 64]]), torch.tensor(37)):
        got = linear_ops.packed_embedding(ids, packed, 72, weights.packed_scales(packed))
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, dequantized(weight, format).to(torch.bfloat16)[ids])


@pytest.mark.parametrize("format", FORMATS)
def test_opcheck_quantized(kernel_path, format):
    weight, gate, up = _weight(40, 72, seed=12), _weight(32, 72, seed=13), _weight(32, 72, seed=14)
    x = torch.randn(3, 72, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    packed = weights.pack_linear_weight(weight, format)
    scales = weights.packed_scales(packed)
    torch.library.opcheck(weights.pack_linear_weight, (weight, format))
    # packed_scales looks a registered packing up (opcheck's copies are none): check its fake's shape instead;
    # like the packing ops it runs once when a graph compiles, never inside one.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = weights.packed_scales(mode.from_tensor(packed))
    assert fake.shape == scales.shape and fake.dtype == scales.dtype == weights.SCALE_DTYPES[format]
    # test_schema compares the inputs before and after with arithmetic torch lacks for float8 on the CPU.
    checks = dict(test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
                  if format == "fp8" else torch.library._OPCHECK_DEFAULT_UTILS)
    torch.library.opcheck(linear_ops.linear, (x, packed, None, 40, scales), **checks)
    torch.library.opcheck(linear_ops.linear_float, (x[:1], packed, None, 40, scales), **checks)
    gate_up = weights.pack_gate_up_weight(gate, up, format)
    torch.library.opcheck(linear_ops.linear_silu_mul, (x, gate_up, 32, weights.packed_scales(gate_up)), **checks)
    torch.library.opcheck(linear_ops.packed_embedding, (torch.tensor([1, 39]), packed, 72, scales), **checks)


def test_quantized_weight_needs_its_scales(kernel_path):
    weight = _weight(40, 72, seed=15)
    packed = weights.pack_linear_weight(weight, "int8")
    x = torch.randn(1, 72).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="scales"):
        linear_ops.linear(x, packed, None, 40)
    with pytest.raises(RuntimeError, match="scales"):
        linear_ops.linear(x, packed, None, 40, torch.ones(3, 7))


# -- fp8 checkpoint weights (models/fp8.py): values and block scales as the hub ships them ----------------------


def _checkpoint_weight(out_features, in_features, seed):
    """An fp8 checkpoint's weight: e4m3 values marked with their 128 x 128 ``weight_scale_inv``."""
    values, scale_inv = weights.quantize_rows(_weight(out_features, in_features, seed).float() * 3, "fp8")
    weight = torch.nn.Parameter(values.contiguous(), requires_grad=False)
    weights.attach_checkpoint_scales(weight, scale_inv * 0.5)  # scales of their own, not quantize_rows' choice
    return weight


@pytest.mark.parametrize("format", ["fp8", "bf16", "int8"])
def test_checkpoint_fp8_packs_in_each_format(kernel_path, format):
    """fp8: the checkpoint's bytes and scales as they are; bf16 / int8: dequantized (then quantized) by chunks."""
    q, k, v = (_checkpoint_weight(n, 300, seed=n) for n in (160, 64, 33))  # N across a 128-row scale block
    want = torch.cat([weights.dequantize_blocks(w, weights.checkpoint_scales(w), torch.float32) for w in (q, k, v)])
    packed = weights.pack_fused_linear_weight([q, k, v], format)
    assert packed.dtype == weights.FORMATS[format]
    scales = weights.packed_scales(packed) if format != "bf16" else None
    if format == "fp8":
        unpacked = weights.unpack_linear_weight(weights.dequantize(packed, scales), 257, 300)
        assert torch.equal(unpacked, want)  # exact: the same e4m3 values times the same scales
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = linear_ops.linear(x, packed, None, 257, scales)
    assert _relative_error(got, x.float() @ want.T) < 1e-2


def test_checkpoint_fp8_gate_up_and_experts():
    gate, up = _checkpoint_weight(96, 200, seed=1), _checkpoint_weight(96, 200, seed=2)
    packed = weights.pack_gate_up_weight(gate, up, "fp8")
    deq = weights.unpack_gate_up_weight(weights.dequantize(packed, weights.packed_scales(packed)), 96, 200)
    for got, source in zip(deq, (gate, up)):
        assert torch.equal(got, weights.dequantize_blocks(source, weights.checkpoint_scales(source), torch.float32))
    # Experts as transformers stacks them: gate_up [E, 2I, H] whose scales hold gate's blocks, then up's
    # (I = 32: one 128-row block each), dequantized to bf16 as they pack.
    halves = [[_checkpoint_weight(32, 64, seed=10 * e + h) for h in (0, 1)] for e in range(3)]
    gate_up = torch.stack([torch.cat([g.data, u.data]) for g, u in halves])
    scales = torch.stack([torch.cat([weights.checkpoint_scales(g), weights.checkpoint_scales(u)]) for g, u in halves])
    expected = torch.stack([torch.cat([weights.dequantize_blocks(w, weights.checkpoint_scales(w)) for w in pair])
                            for pair in halves])
    experts = torch.nn.Parameter(gate_up, requires_grad=False)
    weights.attach_checkpoint_scales(experts, scales)
    assert weights.can_pack("experts", [experts, torch.zeros(3, 64, 32, dtype=torch.bfloat16)]) is None
    packed = weights.pack_expert_gate_up_weight(experts)
    assert torch.equal(weights.unpack_expert_gate_up_weight(packed, 64), expected)
    # read unpacked (nothing packs it): dequantized in place, the same values
    experts_again = torch.nn.Parameter(gate_up.clone(), requires_grad=False)
    weights.attach_checkpoint_scales(experts_again, scales)
    weights.dequantize_checkpoint_weight(experts_again)
    assert experts_again.dtype == torch.bfloat16 and torch.equal(experts_again.data, expected)
    assert weights.checkpoint_scales(experts_again) is None


def test_checkpoint_fp8_release_and_checks():
    weight = _checkpoint_weight(64, 64, seed=3)
    packed = weights.pack_linear_weight(weight, "fp8")
    weights.release(packed)
    assert weight.dtype == torch.bfloat16 and weight.shape == (64, 64)  # what the graphs trace: bf16
    assert weights.checkpoint_scales(weight) is None
    assert weights.pack_linear_weight(weight, "fp8") is packed
    with pytest.raises(ValueError, match="128 x 128 blocks"):
        weights.attach_checkpoint_scales(torch.zeros(64, 300, dtype=torch.float8_e4m3fn), torch.ones(1, 2))
    with pytest.raises(ValueError, match="float8_e4m3fn with float32"):
        weights.attach_checkpoint_scales(torch.zeros(64, 64), torch.ones(1, 1))
    unmarked = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    assert "packed from bf16 or from a quantized checkpoint" in weights.can_pack("linear", [unmarked])
    nan = _checkpoint_weight(64, 64, seed=4)
    nan.data.view(torch.uint8)[1, 2] = 0x7F
    with pytest.raises(ValueError, match="NaN e4m3 codes"):
        weights.pack_linear_weight(nan, "bf16")


# -- quantized experts: fused_moe over int8 / fp8 expert packings ------------------------------------------------


def _experts(experts, hidden_size, inter, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * inter, hidden_size, generator=g) / hidden_size**0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden_size, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    return gate_up, down


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("tokens,hidden_size,inter", [(1, 64, 32), (2, 200, 64), (5, 130, 160), (40, 96, 96)])
def test_quantized_fused_moe_matches_dequantized_experts(kernel_path, format, tokens, hidden_size, inter):
    """Decode (1-2 tokens: GEMVs over 1-byte experts), prefill (GEMMs over dequantized panels); odd H, H not
    a multiple of 128, I spanning two 128-row scale blocks."""
    _skip_unless_fits(format, hidden_size)

    experts = 6
    gate_up, down = _experts(experts, hidden_size, inter, seed=tokens + hidden_size)
    w13 = weights.pack_expert_gate_up_weight(gate_up, format)
    w2 = weights.pack_expert_down_weight(down, format)
    s13, s2 = weights.packed_scales(w13), weights.packed_scales(w2)
    assert w13.dtype == w2.dtype == weights.FORMATS[format]
    # the halves of gate_up are quantized as the separate gate and up weights they are
    want_gate_up = torch.stack([torch.cat([dequantized(h, format) for h in e.chunk(2)]) for e in gate_up])
    want_down = torch.stack([dequantized(e, format) for e in down])
    assert torch.equal(weights.unpack_expert_gate_up_weight(weights.dequantize(w13, s13), hidden_size), want_gate_up)
    assert torch.equal(weights.unpack_expert_down_weight(weights.dequantize(w2, s2), hidden_size, inter), want_down)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(tokens)]).to(torch.int32)
    topk_weights = torch.rand(tokens, 3, generator=g) + 0.1
    # each expert's rows as its GEMV or GEMM reads them (int8, int4 decode: words; the AVX512 units' int8 GEMM:
    # int8 groups)
    want = experts_as_read(x, want_gate_up, want_down, topk_weights, ids, format, kernel_path)
    got = torch.ops.tilefx.fused_moe(x, w13, w2, topk_weights, ids, w13_scales=s13, w2_scales=s2)
    assert _relative_error(got, want.float()) < 1e-2


@pytest.mark.parametrize("format", ["int8", "fp8"])
@pytest.mark.parametrize("rows", [3, 4])
def test_quantized_experts_of_three_and_four_rows(kernel_path, format, rows):
    """One expert gets 3 or 4 rows and the others 1 or 2 in one call: every unit decodes int8 and fp8 up to 4 rows
    in registers (int8 against x as words, made for those experts' rows too)."""
    from tilefx.custom_ops.moe import experts_reference

    experts, hidden_size, inter = 4, 200, 96
    gate_up, down = _experts(experts, hidden_size, inter, seed=rows)
    w13 = weights.pack_expert_gate_up_weight(gate_up, format)
    w2 = weights.pack_expert_down_weight(down, format)
    s13, s2 = weights.packed_scales(w13), weights.packed_scales(w2)
    want_gate_up = torch.stack([torch.cat([dequantized(h, format) for h in e.chunk(2)]) for e in gate_up])
    want_down = torch.stack([dequantized(e, format) for e in down])
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1 + t % 3] for t in range(rows)], dtype=torch.int32)  # expert 0: every row
    topk_weights = torch.rand(rows, 2, generator=g) + 0.1
    want = experts_reference(x, want_gate_up.to(torch.bfloat16), want_down.to(torch.bfloat16), topk_weights, ids)
    got = torch.ops.tilefx.fused_moe(x, w13, w2, topk_weights, ids, w13_scales=s13, w2_scales=s2)
    assert _relative_error(got, want.float()) < 1e-2


def test_quantized_fused_moe_checks_its_scales(kernel_path):
    gate_up, down = _experts(4, 64, 32, seed=1)
    w13, w2 = weights.pack_expert_gate_up_weight(gate_up, "int8"), weights.pack_expert_down_weight(down, "int8")
    x, ids, topk_weights = torch.ones(2, 64, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.tilefx.fused_moe(x, w13, w2, topk_weights, ids)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.tilefx.fused_moe(x, w13, w2, topk_weights, ids, w13_scales=weights.packed_scales(w13),
                                   w2_scales=weights.packed_scales(w2)[:, :1].contiguous())


@pytest.mark.parametrize("format", FORMATS)
def test_opcheck_quantized_fused_moe(kernel_path, format):
    gate_up, down = _experts(8, 64, 32, seed=2)
    w13, w2 = weights.pack_expert_gate_up_weight(gate_up, format), weights.pack_expert_down_weight(down, format)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    topk_weights, ids = torch.ops.tilefx.topk_softmax(torch.randn(3, 8), 2, True)
    skip = ("test_schema",) if format == "fp8" else ()  # float8 comparisons torch lacks on CPU (see above)
    tests = [t for t in ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
             if t not in skip]
    torch.library.opcheck(torch.ops.tilefx.fused_moe.default, (x, w13, w2, topk_weights, ids),
                          {"w13_scales": weights.packed_scales(w13), "w2_scales": weights.packed_scales(w2)},
                          test_utils=tests)
