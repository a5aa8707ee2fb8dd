"""Memory of packed weights and their sources: transparent huge pages for what decode streams, memory that
costs nothing until written for released sources, and the pages of safetensors mappings dropped as their
bytes are packed (a lazily loaded checkpoint is never resident twice)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import threading

import torch

from tilefx.custom_ops import isa

HUGE_PAGE_MIN_BYTES = 2 << 20  # below this a 2 MiB page would waste more than it saves


def huge_page_empty(shape, dtype) -> torch.Tensor:
    """An uninitialized tensor in transparent huge pages where it pays (large, native library built).

    Decode streams packed weights and the KV cache every token; with 4 KiB pages their
    page walks cost measurably (csrc/memory.cpp, docs/PERFORMANCE.md). Small tensors use the
    ordinary allocator.
    """
    if isa.native is None or math.prod(shape) * dtype.itemsize < HUGE_PAGE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return isa.native.huge_page_empty(list(shape), dtype)


def untouched_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape`` with contiguous strides in memory never touched: an anonymous private mapping, whose
    pages cost nothing until written (reads see the kernel's zero page). What a released quantized source
    holds: graphs trace its shape and strides (HF's grouped_mm checks them), only packing ops use its data."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


# -- file-backed sources -----------------------------------------------------------------------------------

_MADV_DONTNEED = 4
_libc = None


def file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process mapped from safetensors files (a lazy load keeps weights there)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip().endswith(".safetensors"):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def drop_unused_file_pages(live) -> int:
    """Drop from this process every page of its safetensors mappings that no tensor in ``live`` reads.

    Loading can read a checkpoint tensor without keeping it: transformers stacks per-expert
    weights into fused 3-D experts, and the per-expert bytes it read stay resident in the
    file's mapping (counted as this process's memory) while the mapping lives for the
    weights still read from it (norms, embeddings). Pages outside ``live`` serve no tensor,
    so dropping them changes nothing a tensor sees. Returns the bytes of the ranges advised.
    """
    keep = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in live if t.numel()]
    return _drop_mapped_pages(keep)


def _drop_mapped_pages(keep) -> int:
    """``drop_file_mapping_pages`` (csrc/memory.cpp): every safetensors mapping's pages but ``keep``'s, the maps
    read and advised with the GIL held, so that no mapping is unmapped, and its addresses given to other memory,
    between the two (MADV_DONTNEED would zero that memory). Without the native library: 0, nothing dropped."""
    if isa.native is None:
        return 0
    return isa.native.drop_file_mapping_pages(".safetensors", keep)


@contextlib.contextmanager
def checkpoint_pages_bounded(every_seconds: float = 0.2):
    """While the block runs (a lazy load), drop this process's pages of safetensors mappings every
    ``every_seconds``: what loading reads and converts (per-expert tensors stacked into fused experts)
    then never sits in memory twice, mapped and converted. The pages stay in the page cache and a
    later read maps them again; the checkpoint's bytes are never written, so a read sees the file.
    Each sweep holds the GIL (``_drop_mapped_pages``): the loading thread closes files and allocates
    memory meanwhile, and a sweep that let it run between reading the maps and advising them could
    zero memory that took a closed file's addresses."""
    stop = threading.Event()

    def drop() -> None:
        while not stop.wait(every_seconds):
            _drop_mapped_pages([])

    thread = threading.Thread(target=drop, name="tilefx-page-dropper", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _madvise_dontneed(address: int, length: int) -> None:
    global _libc
    _libc = _libc or ctypes.CDLL(None, use_errno=True)
    _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_DONTNEED)


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses from ``tensor``'s first byte to past its last (its strides' span, gaps included)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + span * tensor.element_size()


def in_file_mapping(tensor: torch.Tensor, mapped: list[tuple[int, int]]) -> bool:
    """Whether ``tensor``'s bytes lie in one of the ``mapped`` file ranges (``file_mappings``): pages of the page
    cache, not memory of this process's own."""
    if not tensor.numel():
        return False
    start, end = _extent(tensor)
    return any(lo <= start and end <= hi for lo, hi in mapped)


def drop_file_pages(tensor: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """Drop the pages of ``tensor``'s bytes from this process where they lie in one of the ``mapped`` file ranges:
    they stay in the page cache, but no longer count as this process's memory (a later read maps them again)."""
    if not in_file_mapping(tensor, mapped):
        return  # anonymous memory: freed when its last reference goes
    start, end = _extent(tensor)
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
    if last > first:
        _madvise_dontneed(first, last - first)
