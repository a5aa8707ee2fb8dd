"""tilefx.linear and pack_linear_weight: every kernel path vs an fp32 matmul of the unpacked weight; opcheck."""

from __future__ import annotations

import pytest
import torch

from tilefx.custom_ops import linear as linear_ops


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
    ((3,), 96, 129),  # smallest GEMM, odd K
    ((2, 37), 70, 300),  # prefill: rows not a multiple of the tile, K spanning two panels
    ((1, 5), 4096, 64),  # many blocks
]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_linear_matches_matmul(kernel_path, rows, out_features, in_features, bias):
    x, weight, b, want = _problem(rows, out_features, in_features, bias, seed=out_features + in_features)
    packed = linear_ops.pack_linear_weight(weight)
    got = linear_ops.linear(x, packed, b, out_features)
    assert got.shape == (*rows, out_features) and got.dtype == torch.bfloat16
    assert _relative_error(got, want) < 1e-2


def test_large_shapes_match(kernel_path):
    x, weight, _, want = _problem((1,), 2048, 8192, False, seed=3)
    packed = linear_ops.pack_linear_weight(weight)
    assert _relative_error(linear_ops.linear(x, packed, None, 2048), want) < 1e-2
    x = torch.randn(64, 8192).to(torch.bfloat16)
    assert _relative_error(linear_ops.linear(x, packed, None, 2048), x.float() @ weight.float().T) < 1e-2


@pytest.mark.parametrize("out_features,in_features", [(64, 64), (33, 7), (1, 1)])
def test_pack_round_trip(out_features, in_features):
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    packed = linear_ops.pack_linear_weight_reference(weight)
    assert packed.shape == (-(-out_features // 32), -(-in_features // 2), 32, 2)
    assert torch.equal(linear_ops.unpack_linear_weight(packed, out_features, in_features), weight)
    assert torch.count_nonzero(packed) == torch.count_nonzero(weight)  # padding is zero


def test_packing_is_shared_until_the_weight_changes():
    weight = torch.randn(40, 16).to(torch.bfloat16)
    first = linear_ops.pack_linear_weight(weight)
    assert linear_ops.pack_linear_weight(weight) is first  # every compiled graph gets one copy
    weight.mul_(2)  # a new version of the weight is packed again
    again = linear_ops.pack_linear_weight(weight)
    assert again is not first
    assert torch.equal(linear_ops.unpack_linear_weight(again, 40, 16), weight)


def test_rejects_unpacked_weight():
    with pytest.raises(RuntimeError, match="packed"):
        linear_ops.linear(torch.randn(1, 8).to(torch.bfloat16), torch.randn(4, 8).to(torch.bfloat16), None, 4)


def test_opcheck(kernel_path):
    x, weight, b, _ = _problem((3,), 40, 18, True, seed=5)
    torch.library.opcheck(linear_ops.pack_linear_weight, (weight,))
    torch.library.opcheck(linear_ops.linear, (x, linear_ops.pack_linear_weight_reference(weight), b, 40))


@pytest.mark.parametrize("path", ["reference", "avx2"])
def test_kernel_path_decides_what_runs(path):
    """The native CPU kernel hands the reference path to the PyTorch ``*_portable`` op, and keeps the rest."""
    from tilefx.custom_ops import isa

    if isa.unsupported_reason(path):
        pytest.skip(f"{path}: {isa.unsupported_reason(path)}")
    x, weight, _, _ = _problem((1,), 64, 64, False, seed=1)
    with isa.forced(path), torch.profiler.profile() as prof:
        linear_ops.linear(x, linear_ops.pack_linear_weight(weight), None, 64)
    ran_portable = any(event.key == "tilefx::linear_portable" for event in prof.key_averages())
    assert ran_portable == (path == "reference")
