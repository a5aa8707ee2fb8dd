"""tilefx.linear / linear_silu_mul and the packing ops: every kernel path vs fp32 matmuls of the unpacked weights; opcheck."""

from __future__ import annotations

import pytest
import torch

from tilefx.custom_ops import linear as linear_ops
from tilefx.custom_ops import weights


def _relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def _problem(rows, out_features, in_features, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, in_features, generator=g).to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None
    want = x.float() @ weight.float().T + (b.float() if bias else 0.0)
    return x, weight, b, want


SHAPES = [
    # rows (leading dims of x), out_features N, in_features K
    ((1,), 64, 64),  # decode, whole blocks
    ((1,), 33, 7),  # N not a multiple of the block, odd K
    ((1, 1), 1, 130),  # one output column
    ((2,), 200, 96),  # batch-2 decode
    ((3,), 96, 129),  # batch-3 decode, odd K
    ((4,), 160, 130),  # batch-4 decode: the most rows a block is streamed for as a GEMV
    ((5,), 96, 130),  # smallest GEMM
    ((2, 37), 70, 300),  # prefill: rows not a multiple of the tile, K spanning two panels
    ((2, 101), 70, 300),  # prefill over the AVX2 unit's packing chunks of x (96, 96, then 10 rows)
    ((1, 5), 4096, 64),  # many blocks
]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_linear_matches_matmul(kernel_path, rows, out_features, in_features, bias):
    x, weight, b, want = _problem(rows, out_features, in_features, bias, seed=out_features + in_features)
    packed = weights.pack_linear_weight(weight)
    got = linear_ops.linear(x, packed, b, out_features)
    assert got.shape == (*rows, out_features) and got.dtype == torch.bfloat16
    assert _relative_error(got, want) < 1e-2


@pytest.mark.parametrize("rows", [(2,), (3, 5)], ids=["batch2", "prefill"])
def test_strided_activations(kernel_path, rows):
    """x as a view into a wider tensor (what a slice of a fused projection's output is): rows are not adjacent."""
    wide, weight, _, _ = _problem(rows, 96, 2 * 130, False, seed=11)
    x = wide[..., 5:135]
    assert not x.is_contiguous()
    packed = weights.pack_linear_weight(weight[:, :130].contiguous())
    got = linear_ops.linear(x, packed, None, 96)
    assert got.shape == (*rows, 96)
    assert _relative_error(got, x.float() @ weight[:, :130].float().T) < 1e-2


@pytest.mark.parametrize("in_features", [64, 65])
def test_activations_at_an_odd_offset(kernel_path, in_features):
    """A contiguous x whose data starts 2 bytes into a 4-byte word (the AVX512-BF16 unit reads bf16 pairs)."""
    flat, weight, _, _ = _problem((1,), 96, 3 * in_features + 1, False, seed=in_features)
    x = flat[0, 1:].view(3, in_features)
    assert x.is_contiguous() and x.data_ptr() % 4 == 2
    weight = weight[:, :in_features].contiguous()
    got = linear_ops.linear(x, weights.pack_linear_weight(weight), None, 96)
    assert _relative_error(got, x.float() @ weight.float().T) < 1e-2


@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 8, 13, 47, 130])
def test_every_block_is_computed_once(kernel_path, blocks):
    """Threads take shrinking chunks of the column blocks: every block count comes out whole."""
    x, weight, _, want = _problem((1,), 32 * blocks - 3, 64, False, seed=blocks)
    packed = weights.pack_linear_weight(weight)
    assert _relative_error(linear_ops.linear(x, packed, None, weight.shape[0]), want) < 1e-2


def test_large_shapes_match(kernel_path):
    x, weight, _, want = _problem((1,), 2048, 8192, False, seed=3)
    packed = weights.pack_linear_weight(weight)
    assert _relative_error(linear_ops.linear(x, packed, None, 2048), want) < 1e-2
    x = torch.randn(64, 8192).to(torch.bfloat16)
    assert _relative_error(linear_ops.linear(x, packed, None, 2048), x.float() @ weight.float().T) < 1e-2


@pytest.mark.parametrize("out_features,in_features", [(64, 64), (33, 7), (1, 1)])
def test_pack_round_trip(out_features, in_features):
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    packed = weights.pack_linear_weight_reference(weight)
    assert packed.shape == (-(-out_features // 32), -(-in_features // 2), 32, 2)
    assert torch.equal(weights.unpack_linear_weight(packed, out_features, in_features), weight)
    assert torch.count_nonzero(packed) == torch.count_nonzero(weight)  # padding is zero


def test_packing_is_shared_until_the_weight_changes():
    weight = torch.randn(40, 16).to(torch.bfloat16)
    first = weights.pack_linear_weight(weight)
    assert weights.pack_linear_weight(weight) is first  # every compiled graph gets one copy
    weight.mul_(2)  # a new version of the weight is packed again
    again = weights.pack_linear_weight(weight)
    assert again is not first
    assert torch.equal(weights.unpack_linear_weight(again, 40, 16), weight)


def test_rejects_unpacked_weight():
    with pytest.raises(RuntimeError, match="packed"):
        linear_ops.linear(torch.randn(1, 8).to(torch.bfloat16), torch.randn(4, 8).to(torch.bfloat16), None, 4)


def _gate_up_problem(rows, width, in_features, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, in_features, generator=g).to(torch.bfloat16)
    gate, up = ((torch.randn(width, in_features, generator=g) * 2 / in_features**0.5).to(torch.bfloat16)
                for _ in range(2))
    xf = x.float()
    want = torch.nn.functional.silu(xf @ gate.float().T) * (xf @ up.float().T)
    return x, gate, up, want


@pytest.mark.parametrize("rows,width,in_features", [
    ((1,), 64, 64),  # decode: gate and up blocks as two streams
    ((1,), 224, 96),  # decode, 7 output blocks: each thread's range read as two halves, an odd block alone
    ((1,), 32, 7),  # one block, odd K
    ((2,), 96, 130),  # batch-2 decode
    ((3,), 32, 129),  # batch-3 decode
    ((4,), 96, 130),  # batch-4 decode
    ((5,), 64, 66),  # smallest GEMM
    ((2, 37), 160, 300),  # prefill: rows not a multiple of the tile, K spanning two panels
])
def test_linear_silu_mul_matches_reference(kernel_path, rows, width, in_features):
    x, gate, up, want = _gate_up_problem(rows, width, in_features, seed=width + in_features)
    packed = weights.pack_gate_up_weight(gate, up)
    got = linear_ops.linear_silu_mul(x, packed, width)
    assert got.shape == (*rows, width) and got.dtype == torch.bfloat16
    assert _relative_error(got, want) < 1e-2
    assert (want.abs() > 0.1).any() and (want < -0.01).any()  # SiLU's negative side is exercised


def test_gate_up_packing_interleaves_blocks():
    gate, up = torch.randn(64, 10).to(torch.bfloat16), torch.randn(64, 10).to(torch.bfloat16)
    packed = weights.pack_gate_up_weight_reference(gate, up)
    assert packed.shape == (4, 5, 32, 2)
    assert torch.equal(weights.unpack_linear_weight(packed[1:2], 32, 10), up[:32])  # gate 0, up 0, gate 1, up 1
    got_gate, got_up = weights.unpack_gate_up_weight(packed, 64, 10)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        weights.pack_gate_up_weight_reference(gate[:40], up[:40])


def test_fused_packing_is_the_packed_concatenation(kernel_path):
    x, q, b, _ = _problem((2,), 64, 48, True, seed=7)
    k, v = torch.randn(32, 48).to(torch.bfloat16), torch.randn(20, 48).to(torch.bfloat16)  # last may be ragged
    packed = weights.pack_fused_linear_weight([q, k, v])
    assert torch.equal(packed, weights.pack_linear_weight_reference(torch.cat([q, k, v])))
    got = linear_ops.linear(x, packed, None, 116)
    want = x.float() @ torch.cat([q, k, v]).float().T
    assert _relative_error(got, want) < 1e-2
    assert weights.pack_fused_linear_weight([q, k, v]) is packed  # memoized per group
    with pytest.raises(RuntimeError, match="multiples of 32"):
        weights.pack_fused_linear_weight([v, q])


def test_release_makes_each_weight_a_view_of_its_packing():
    q, k = torch.randn(64, 16).to(torch.bfloat16), torch.randn(32, 16).to(torch.bfloat16)
    gate, up = torch.randn(32, 16).to(torch.bfloat16), torch.randn(32, 16).to(torch.bfloat16)
    fused = weights.pack_fused_linear_weight([q, k])
    gate_up = weights.pack_gate_up_weight(gate, up)
    released, kept = weights.release_sources({id(q), id(k), id(gate), id(up)})
    assert (released, kept) == (sum(w.nbytes for w in (q, k, gate, up)), 0)
    for weight, packed in ((q, fused), (k, fused), (gate, gate_up), (up, gate_up)):
        assert weight.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert torch.equal(k.view(-1), fused[2:].reshape(-1))  # k is exactly its blocks
    # packing again (a graph compiled later) returns the same packed tensors
    assert weights.pack_fused_linear_weight([q, k]) is fused
    assert weights.pack_gate_up_weight(gate, up) is gate_up


def test_opcheck(kernel_path):
    x, weight, b, _ = _problem((3,), 40, 18, True, seed=5)
    torch.library.opcheck(weights.pack_linear_weight, (weight,))
    torch.library.opcheck(linear_ops.linear, (x, weights.pack_linear_weight_reference(weight), b, 40))
    torch.library.opcheck(weights.pack_fused_linear_weight, ([weight[:32], weight[32:]],))
    x, gate, up, _ = _gate_up_problem((2,), 32, 18, seed=5)
    torch.library.opcheck(weights.pack_gate_up_weight, (gate, up))
    torch.library.opcheck(linear_ops.linear_silu_mul, (x, weights.pack_gate_up_weight_reference(gate, up), 32))


@pytest.mark.parametrize("path", ["reference", "avx2", "avx512_bf16", "avx512_bf16_emulated"])
def test_kernel_path_decides_what_runs(path):
    """The native CPU kernel hands the reference path to the PyTorch ``*_portable`` op, and keeps the rest."""
    from tilefx.custom_ops import isa

    if isa.unsupported_reason(path):
        pytest.skip(f"{path}: {isa.unsupported_reason(path)}")
    x, weight, _, _ = _problem((1,), 64, 64, False, seed=1)
    with isa.forced(path), torch.profiler.profile() as prof:
        linear_ops.linear(x, weights.pack_linear_weight(weight), None, 64)
    ran_portable = any(event.key == "tilefx::linear_portable" for event in prof.key_averages())
    assert ran_portable == (path == "reference")


def test_dispatch_table_rows():
    """One native table maps path to unit per op family. On AMX CPUs (which all have AVX512-BF16) the linear
    ops of more than 4 rows take brgemm by default (tuning may choose per format, tests/custom_ops/test_brgemm.py);
    decode GEMVs, the per-head linear, the experts' GEMVs and attention run the AVX512-BF16 units, not AVX2. The table is read
    on any CPU; the amx row runs only where AMX exists."""
    from tilefx.custom_ops import isa

    if isa.native is None:
        pytest.skip(isa.NATIVE_IMPORT_ERROR)
    assert isa.kernel_units("reference") == {}
    amx = isa.kernel_units("amx")
    assert amx["linear"] == "brgemm above 4 rows, else avx512_bf16"
    assert {amx[f] for f in ("linear_float", "linear_per_head", "fused_moe")} == {"avx512_bf16"}
    avx512 = isa.kernel_units("avx512_bf16")
    assert {avx512[f] for f in ("linear", "linear_float", "linear_per_head", "fused_moe")} == {"avx512_bf16"}
    assert set(isa.kernel_units("avx2").values()) == {"avx2"}
    assert {row["attention"] for row in (amx, avx512)} == {"avx512_bf16"}
    with pytest.raises(ValueError, match="unknown kernel path"):
        isa.kernel_units("avx1024")


@pytest.mark.parametrize("rows,out_features,in_features", [((1,), 64, 2048), ((3,), 33, 70), ((2, 5), 16, 64)])
def test_linear_float_keeps_fp32(kernel_path, rows, out_features, in_features):
    """HF's fp32 routers over bf16 values: the fp32 product, not rounded to bf16."""
    x, weight, _, want = _problem(rows, out_features, in_features, False, seed=11)
    got = linear_ops.linear_float(x, weights.pack_linear_weight(weight), None, out_features)
    assert got.shape == (*rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.library.opcheck(linear_ops.linear_float, (x, weights.pack_linear_weight_reference(weight), None,
                                                    out_features))


def test_a_built_native_library_is_loaded():
    """Where the extension was built (as `make test` does), it must load: a library refused at import (say,
    built against another torch) would otherwise turn every native test into a skip."""
    import pathlib

    from tilefx.custom_ops import isa

    built = list(pathlib.Path(isa.__file__).parent.glob("_C*.so"))
    if not built:
        pytest.skip("the native library was never built here")
    assert isa.native is not None, isa.NATIVE_IMPORT_ERROR
    assert isa.version_mismatch(isa.native.torch_version, torch.__version__) is None


def test_a_library_built_for_another_torch_is_refused():
    from tilefx.custom_ops import isa

    assert isa.version_mismatch("2.13", "2.13.0+cpu") is None and isa.version_mismatch("2.13", "2.13.1") is None
    assert "built against torch 2.11 and this is torch 2.13.0+cpu: rebuild" in isa.version_mismatch("2.11", "2.13.0+cpu")
    assert "of an older tilefx" in isa.version_mismatch(None, "2.13.0")
