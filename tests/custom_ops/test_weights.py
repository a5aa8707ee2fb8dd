"""The packed-weight home: layouts round-trip, one packing per group of sources, release, can_pack."""

from __future__ import annotations

import mmap
import pathlib
import time

import numpy as np
import psutil
import pytest
import torch

from tilefx.custom_ops import linear as linear_ops
from tilefx.custom_ops import isa, weights


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_fused_siblings_round_trip_and_each_reads_its_own_slice():
    q, k, v = _bf16(64, 40, seed=1), _bf16(32, 40, seed=2), _bf16(20, 40, seed=3)  # the last may be ragged
    fused = weights.pack("linear", [q, k, v], names=("q", "k", "v"))
    assert torch.equal(weights.unpack_linear_weight(fused, 116, 40), torch.cat([q, k, v]))
    packing = weights.packing_of(q)
    assert packing.layout == "linear" and packing.names == ("q", "k", "v") and packing.shard is None
    # a graph that uses k alone, or k and v together, reads their slices of the same memory
    assert torch.equal(weights.unpack_linear_weight(weights.pack_linear_weight(k), 32, 40), k)
    kv = weights.pack_fused_linear_weight([k, v])
    assert kv.data_ptr() == weights.pack_linear_weight(k).data_ptr() and kv.untyped_storage() is not None
    assert torch.equal(weights.unpack_linear_weight(kv, 52, 40), torch.cat([k, v]))
    assert weights.pack_fused_linear_weight([q, k, v]) is fused


@pytest.mark.skipif(isa.native is None, reason="native library not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "bytes"])
@pytest.mark.parametrize("n, k", [(64, 40), (45, 33), (7, 1), (96, 130)])
def test_native_block_writer_equals_the_layout(n, k, dtype):
    """csrc pack_vnni_blocks against the layout's definition, for bf16 values and for bytes (a quantized weight's
    values): ragged rows and an odd last pair zero padded, rows read through a stride (a column slice), blocks
    written through a stride (gate/up interleave)."""
    wide = _bf16(n, k + 6, seed=n + k)
    if dtype == torch.uint8:
        wide = torch.randint(1, 0xAB, wide.shape, generator=torch.Generator().manual_seed(n + k)).to(torch.uint8)
    weight = wide[:, 3 : 3 + k]
    want = weights.layouts.linear_order(weight)
    blocks, pairs = want.shape[:2]
    unwritten = float("nan") if dtype == torch.bfloat16 else 0xAB  # neither a value nor padding
    out = torch.full((blocks, 2, pairs, 32, 2), unwritten, dtype=dtype).transpose(0, 1)[0]
    isa.native.pack_vnni_blocks(out, weight)
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match="does not fit"):
        isa.native.pack_vnni_blocks(out[:, : pairs - 1], weight)


@pytest.mark.skipif(isa.native is None, reason="native library not built")
@pytest.mark.parametrize("two_a_byte", [False, True], ids=["one-a-byte", "two-a-byte"])
@pytest.mark.parametrize("n, k", [(64, 256), (45, 34), (7, 2), (96, 130), (33, 6)])
def test_native_int4_block_writer_equals_the_layout(n, k, two_a_byte):
    """csrc pack_int4_blocks against layouts.int4_interleave's definition, from nibbles one a byte (the quantizer's)
    and two a byte (a GPTQ / AWQ checkpoint's): ragged rows and K (inputs past K and padding rows are zero nibbles),
    values read through a stride, blocks written through a stride (gate/up interleave)."""
    g = torch.Generator().manual_seed(n + k)
    ones = torch.randint(1, 16, (n, k), generator=g).to(torch.uint8)  # never 0: padding shows up
    # (int4 packings need K % 4 == 0, formats.can_pack; past K the writer gives zeros, as this padding does)
    padded = torch.nn.functional.pad(ones, (0, -k % 4))
    want = weights.layouts.int4_interleave(weights.layouts.linear_order(padded))
    source = weights.formats.pair_nibbles(ones) if two_a_byte else ones
    wide = torch.zeros(n, source.shape[1] + 5, dtype=torch.uint8)
    wide[:, 2 : 2 + source.shape[1]] = source
    values = wide[:, 2 : 2 + source.shape[1]]
    blocks, pairs = want.shape[:2]
    out = torch.full((blocks, 2, pairs, 16, 2), 0xAB, dtype=torch.uint8).transpose(0, 1)[0]  # neither
    isa.native.pack_int4_blocks(out, values, two_a_byte)
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match="do not fit"):
        isa.native.pack_int4_blocks(out[:, : pairs - 2], values, two_a_byte)


@pytest.mark.skipif(isa.native is None, reason="native library not built")
@pytest.mark.parametrize("n, k", [(64, 256), (45, 136), (7, 8), (33, 24)])
def test_native_int4_block_writer_reads_checkpoint_words_in_place(n, k):
    """csrc pack_int4_blocks from nibbles two a byte as 32-bit words [n, k / 8, 4] read through the strides of a
    GPTQ qweight [K / 8, N] (models/int4.py reads it in place): the same blocks as from the rows, ragged rows
    (the last block's padding high rows zero), a row slice (a chunk) as well, zeros past K."""
    g = torch.Generator().manual_seed(n * k)
    ones = torch.randint(1, 16, (n, k), generator=g).to(torch.uint8)
    paired = weights.formats.pair_nibbles(ones)  # [n, k / 2]
    qweight = paired.view(torch.int32).T.contiguous()  # [K / 8, N], as a GPTQ checkpoint stores it
    words = qweight.view(torch.uint8).as_strided((n, k // 8, 4), (4, 4 * n, 1))
    want = weights.layouts.int4_interleave(weights.layouts.linear_order(ones))
    out = torch.full(want.shape, 0xAB, dtype=torch.uint8)
    isa.native.pack_int4_blocks(out, words, True)
    assert torch.equal(out, want)
    if n > 32:  # the rows after the first block, as fill's chunks read them
        tail = weights.layouts.int4_interleave(weights.layouts.linear_order(ones[32:]))
        out = torch.full(tail.shape, 0xAB, dtype=torch.uint8)
        isa.native.pack_int4_blocks(out, words[32:], True)
        assert torch.equal(out, tail)
    wider = torch.full((want.shape[0], want.shape[1] + 4, *want.shape[2:]), 0xAB, dtype=torch.uint8)
    isa.native.pack_int4_blocks(wider, words, True)  # a packing with more inputs than K: zeros past it
    assert torch.equal(wider[:, : want.shape[1]], want) and not wider[:, want.shape[1] :].any()
    with pytest.raises(RuntimeError, match="values must be"):
        isa.native.pack_int4_blocks(out, words, False)  # words hold nibbles two a byte


def test_gate_up_round_trip():
    gate, up = _bf16(64, 30, seed=4), _bf16(64, 30, seed=5)
    packed = weights.pack_gate_up_weight(gate, up)
    got_gate, got_up = weights.unpack_gate_up_weight(packed, 64, 30)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)
    assert torch.equal(packed, weights.pack_gate_up_weight_reference(gate, up))


@pytest.mark.parametrize("hidden", [48, 33])
def test_experts_round_trip(hidden):
    gate_up, down = _bf16(3, 128, hidden, seed=6), _bf16(3, hidden, 64, seed=7)
    assert weights.can_pack("experts", [gate_up, down]) is None
    w13, w2 = weights.pack_expert_gate_up_weight(gate_up), weights.pack_expert_down_weight(down)
    assert torch.equal(weights.unpack_expert_gate_up_weight(w13, hidden), gate_up)
    assert torch.equal(weights.unpack_expert_down_weight(w2, hidden, 64), down)
    assert torch.equal(w13, weights.pack_expert_gate_up_weight_reference(gate_up))


def test_mla_halves_are_two_packings_of_one_weight():
    heads, nope, value, rank = 2, 32, 32, 64
    kv_b = _bf16(heads * (nope + value), rank, seed=8)
    key_half = weights.pack_mla_absorbed_weight(kv_b, heads, nope, False)
    value_half = weights.pack_mla_absorbed_weight(kv_b, heads, nope, True)
    per_head = kv_b.view(heads, nope + value, rank)
    assert torch.equal(weights.unpack_expert_down_weight(key_half, rank, nope), per_head[:, :nope].transpose(1, 2))
    assert torch.equal(weights.unpack_expert_down_weight(value_half, value, rank), per_head[:, nope:])
    assert len(weights.packings_of(kv_b)) == 2
    with pytest.raises(ValueError, match="packed in another way"):
        weights.release(key_half)  # its data cannot be both packings


def test_release_makes_sources_views_and_serves_later_requests():
    q, k = _bf16(64, 16, seed=9), _bf16(32, 16, seed=10)
    want = torch.cat([q, k]).clone()
    fused = weights.pack("linear", [q, k])
    assert weights.release(fused) == want.nbytes
    assert weights.is_released(q) and weights.is_released(k)
    assert q.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert weights.pack_fused_linear_weight([q, k]) is fused  # a graph compiled later gets the same tensor
    assert torch.equal(weights.unpack_linear_weight(fused, 96, 16), want)
    x = _bf16(3, 16, seed=11)
    got = linear_ops.linear_reference(x, weights.pack_linear_weight(k), None, 32)  # k's own slice
    torch.testing.assert_close(got.float(), (x.float() @ want[64:].float().T).to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="released"):
        weights.pack_gate_up_weight(q[:32], k)  # q's own data is gone: nothing to pack from
    with pytest.raises(ValueError, match="released"):
        weights.pack("gate_up", [k, k])


def test_released_embedding_reads_the_packed_rows():
    table = _bf16(100, 37, seed=12)
    want = table.clone()
    packed = weights.pack_linear_weight(table)
    weights.release(packed)
    ids = torch.tensor([[0, 31, 32, 99], [5, 5, 64, 1]])
    assert torch.equal(linear_ops.packed_embedding(ids, packed, 37), want[ids])


def test_can_pack_says_why_not():
    assert "float32" in weights.can_pack("linear", [torch.randn(32, 8)])
    assert "activations" in weights.can_pack("linear", [_bf16(32, 8)], torch.float32)
    assert "multiples of 32" in weights.can_pack("linear", [_bf16(20, 8), _bf16(32, 8)])
    assert weights.can_pack("linear", [_bf16(32, 8), _bf16(20, 8)]) is None
    assert "gate/up" in weights.can_pack("gate_up", [_bf16(32, 8), _bf16(64, 8)])
    assert "multiple of 32" in weights.can_pack("experts", [_bf16(2, 40, 8), _bf16(2, 8, 20)])


def test_file_backed_source_pages_are_dropped_and_still_readable(tmp_path):
    """A lazily loaded weight lives in the safetensors file's mapping: releasing it drops those pages from this
    process (madvise), and anything that reads the mapping again gets the file's bytes back."""
    path = tmp_path / "w.safetensors"
    values = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    values.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r"))
    assert any(lo <= mapped.data_ptr() < hi for lo, hi in weights.memory.file_mappings())
    weights.memory.drop_file_pages(mapped, weights.memory.file_mappings())
    assert torch.equal(mapped, torch.from_numpy(values))
    anonymous = torch.from_numpy(values.copy())
    weights.memory.drop_file_pages(anonymous, weights.memory.file_mappings())  # not file-backed: left alone (dropping would zero it)
    assert torch.equal(anonymous, torch.from_numpy(values))


def test_opcheck_packed_embedding():
    packed = weights.pack_linear_weight_reference(_bf16(64, 10, seed=13))
    torch.library.opcheck(linear_ops.packed_embedding, (torch.tensor([[1, 40]]), packed, 10))


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(maxsplit=1)[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(isa.native is None, reason="the sweep is native (without it nothing is dropped)")
def test_pages_no_live_tensor_reads_are_dropped(tmp_path):
    """Loading may read checkpoint bytes it does not keep (per-expert weights fused into 3-D experts): those
    pages leave the process; the pages of tensors still in use stay readable and correct."""
    path = tmp_path / "w.safetensors"
    values = np.random.default_rng(1).standard_normal(4 << 20).astype(np.float32)  # 16 MiB
    values.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r"))
    live, dead = mapped[: 1 << 20], mapped[1 << 20 :]
    assert float(dead.sum()) != 0.0 and float(live.sum()) != 0.0  # both resident now
    before = _mapped_rss(path)
    weights.drop_unused_file_pages([live])
    assert _mapped_rss(path) <= before - dead.nbytes + 8192
    assert torch.equal(live, torch.from_numpy(values[: 1 << 20]))
    assert torch.equal(dead, torch.from_numpy(values[1 << 20 :]))  # read again from the file


@pytest.mark.skipif(isa.native is None, reason="the sweep is native (without it nothing is dropped)")
def test_the_page_dropper_never_zeroes_memory_that_took_a_closed_files_addresses(tmp_path):
    """A stress test of the loader's background page dropper against the loading thread: map a file, read it, unmap
    it, then take an anonymous buffer of its size (the kernel tends to give it the file's addresses) and write it.
    A sweep that let this thread run between reading the maps and advising them zeroed such buffers (the sweep in
    Python did, a few times a second here; a 30B GPTQ load aborted with free(): invalid pointer, the mark of the
    allocator's header zeroed). The native sweep holds the GIL throughout, so every buffer keeps what was written."""
    path = tmp_path / "w.safetensors"
    size = 1 << 20
    np.ones(size, dtype=np.uint8).tofile(path)
    corrupted, rounds, started = 0, 0, time.perf_counter()
    with weights.checkpoint_pages_bounded(every_seconds=0.0):
        while time.perf_counter() - started < 2.0:
            mapped = np.memmap(path, dtype=np.uint8, mode="r")
            int(mapped[::4096].sum())
            del mapped  # unmapped: its addresses are free
            buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            written = np.frombuffer(buffer, dtype=np.uint8)
            written[:] = 7
            corrupted += int(not (written == 7).all())
            del written
            buffer.close()
            rounds += 1
    assert rounds > 5 and corrupted == 0  # (the native sweep holds the GIL in a tight loop: few rounds)


@pytest.mark.skipif(isa.native is None, reason="the huge-page allocator is native")
def test_a_huge_page_tensor_ends_in_ordinary_pages():
    """Packed weights sit in 2 MiB pages, but a tensor that ends inside its last one does not make the rest of it
    resident: 32 tensors of 2 MiB + 64 KiB, written, cost about their bytes, not 4 MiB each."""
    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off here: no page is larger than 4 KiB")
    process = psutil.Process()
    nbytes = (2 << 20) + (64 << 10)
    before = process.memory_info().rss
    tensors = [weights.huge_page_empty((nbytes,), torch.uint8).fill_(1) for _ in range(32)]
    grown = process.memory_info().rss - before
    assert grown < 1.3 * 32 * nbytes, f"{grown >> 20} MiB resident for {32 * nbytes >> 20} MiB of tensors"
    assert all(int(t.sum()) == nbytes for t in tensors)
