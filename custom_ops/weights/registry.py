"""The descriptor of a packed weight, the registry that finds the packing of a source, and the release policy.

``pack()`` makes a packing (or returns the one that exists for the same sources),
``release()`` hands the sources' memory back: each source parameter becomes a view of its
part of the packed tensor, so memory holds the weight once (its values are then in packed
order: only tilefx graphs, which read it packed, may use it). A ``PackedWeight`` holds
what a packing is: layout, format, scales, the tensor-parallel shard, its sources.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from tilefx.custom_ops.weights import fill, formats, layouts, memory

# -- the descriptor and the registry ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shard:
    """The part of a weight a tensor-parallel rank holds: ``index`` of ``count`` equal slices along ``dim`` of a
    weight ``size`` long there (models/tp.py). ``style``: the HF plan's name for the split (``colwise``: output
    rows, ``rowwise``: input columns, the partial sums added across ranks; ``vocab`` / ``colwise_gather_output``:
    vocabulary rows of the embedding / ``lm_head``, the last rank's padded with zeros)."""

    dim: int
    index: int
    count: int
    style: str = "colwise"
    size: int = 0


# parameter -> the Shard it holds (by the parameter object's identity, not an attribute on the tensor)
_shards = WeakTensorKeyDictionary()


def attach_shard(weight: torch.Tensor, shard: Shard) -> None:
    """Mark ``weight`` as the part ``shard`` of a full weight; packings of it carry the mark (``PackedWeight.shard``)
    and the partition pass reads it."""
    _shards[weight] = shard


def shard_of(weight: torch.Tensor) -> Shard | None:
    return _shards.get(weight)


@dataclasses.dataclass(eq=False)
class PackedWeight:
    """One packed tensor the kernels read, and what it was made from."""

    layout: str
    data: torch.Tensor
    source_shapes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...] = ()  # the source parameters' names where the loader knows them
    args: tuple = ()  # layout arguments (mla_*: heads, nope_dim)
    format: str = "bf16"
    scales: torch.Tensor | None = None  # int8 / fp8: per channel or per block
    shard: Shard | None = None  # None: the whole weight
    released: bool = False  # the sources are views of ``data`` (their own memory handed back)
    _sources: tuple = ()  # weakrefs to the source tensors

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def members(self, first: int, last: int) -> torch.Tensor:
        """Sources ``first..last``'s own packing (``linear`` layout): the contiguous blocks they fill."""
        if self.layout != "linear":
            raise ValueError(f"{self.describe()}: only the linear layout has per-source slices")
        begin, end = layouts.member_blocks(self.source_shapes, first, last)
        return self.data[begin:end]

    def describe(self) -> str:
        names = ", ".join(self.names) or f"{len(self.source_shapes)} weight(s)"
        return f"{self.layout} {self.format} [{names}]"


def _key(weight: torch.Tensor) -> tuple:
    return (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(),
            weight._version)


# key of one source tensor -> the packings that hold it, each with the source's index among its sources
_registry: dict[tuple, list[tuple[PackedWeight, int]]] = {}
# a packed tensor's storage -> its PackedWeight (each packing has storage of its own; weak: the registry
# above decides how long a packing lives)
_by_storage: weakref.WeakValueDictionary[int, PackedWeight] = weakref.WeakValueDictionary()


def _current(key: tuple, packed: PackedWeight, index: int) -> bool:
    """The source is alive and unchanged: an address can be reused by a new tensor, and weights edited in place."""
    source = packed._sources[index]()
    return source is not None and _key(source) == key


_dropping = False  # _drop_stale is running
_drop_again = False  # a source died while it ran


def _drop_stale() -> None:
    """Forget the packings of sources gone or changed; a packing no graph holds is freed with its entry."""
    global _dropping, _drop_again
    if _dropping:  # a source died during the pass (its weakref's callback): one more pass when this one ends
        _drop_again = True
        return
    _dropping = True
    try:
        while True:
            _drop_again = False
            for key in list(_registry):
                hits = _registry.get(key)
                if hits is None:
                    continue
                kept = [hit for hit in hits if _current(key, *hit)]
                if kept:
                    _registry[key] = kept
                else:
                    del _registry[key]
            if not _drop_again:
                return
    finally:
        _dropping = False


def _source_gone(_ref: weakref.ref) -> None:
    """A source's weakref callback: a deleted model's packings go with it, not at the next packing (until then
    the registry held every packed weight of it: a second model compiled after it peaked at twice the memory)."""
    _drop_stale()


def packings_of(weight: torch.Tensor) -> list[tuple[PackedWeight, int]]:
    """The PackedWeights that hold ``weight``, each with ``weight``'s index among its sources."""
    key = _key(weight)
    return [hit for hit in _registry.get(key, ()) if _current(key, *hit)]


def packing_of(weight: torch.Tensor) -> PackedWeight | None:
    """The one PackedWeight that holds ``weight`` (None if none or several do)."""
    hits = packings_of(weight)
    return hits[0][0] if len(hits) == 1 else None


def is_released(weight: torch.Tensor) -> bool:
    """``weight``'s data is a view of a packed tensor: only packing ops may read it."""
    return any(packed.released for packed, _ in packings_of(weight))


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed tensor that holds ``weight`` (alone or with its siblings), if exactly one does."""
    packed = packing_of(weight)
    return None if packed is None else packed.data


def _serve(layout: str, weights, args: tuple, format: str) -> torch.Tensor | None:
    """The existing packed tensor for this request, or None where the weights are to be packed (again)."""
    for packed, first in packings_of(weights[0]):
        indices = [next((i for p, i in packings_of(w) if p is packed), None) for w in weights]
        if None in indices or indices != list(range(first, first + len(weights))) or packed.format != format:
            continue
        if packed.layout == layout and packed.args == tuple(args) and len(weights) == len(packed.source_shapes):
            return packed.data
        if layout == "linear" == packed.layout:
            return packed.members(indices[0], indices[-1])  # some siblings of a fused packing, in order
    held = sorted({p.describe() for w in weights for p, _ in packings_of(w) if p.released})
    if held:  # their own data is gone: there is nothing to pack from
        raise ValueError(
            f"weights of shapes {[tuple(w.shape) for w in weights]} were packed as {'; '.join(held)} and released, "
            f"and cannot also be packed as {layout} {format}{list(args) if args else ''}: a graph must read a packed "
            f"weight the way it was packed (custom_ops/weights/registry.py). Compile with fuse_linears=False if sibling "
            f"fusion differs."
        )
    return None


def pack(layout: str, weights, args: tuple = (), names: tuple[str, ...] = (), format: str = "bf16") -> torch.Tensor:
    """``weights`` packed in ``layout`` and ``format``: the existing packed tensor where one holds them, else
    packed now, once (into transparent huge pages: streamed every token), and registered. A quantized
    packing's scales: ``scales_of`` (or the graph op ``tilefx.packed_scales``)."""
    weights = list(weights)
    existing = _serve(layout, weights, tuple(args), format)
    if existing is not None:
        return existing
    layouts.check_sources(layout, weights)
    if format != "bf16":
        why = formats.can_pack(layout, weights, format=format)
        torch._check(why is None, lambda: f"pack ({layout}, {format}): {why}")
    shape = formats.stored_shape(layouts.layout_shape(layout, weights, args), format)
    scales = torch.zeros(formats.scales_shape(shape, format), dtype=formats.SCALE_DTYPES[format]) \
        if format != "bf16" else None
    data = fill.fill(layout, weights, tuple(args), memory.huge_page_empty(shape, formats.FORMATS[format]),
                     scales=scales)
    packed = PackedWeight(layout, data, tuple(tuple(w.shape) for w in weights), tuple(names), tuple(args),
                          format=format, scales=scales, shard=shard_of(weights[0]),
                          _sources=tuple(weakref.ref(w, _source_gone) for w in weights))
    _drop_stale()
    for index, weight in enumerate(weights):
        _registry.setdefault(_key(weight), []).append((packed, index))
    _by_storage[data.untyped_storage().data_ptr()] = packed
    return data


def _holder(data: torch.Tensor) -> PackedWeight | None:
    """The current PackedWeight whose packed tensor ``data`` is (or is a slice of)."""
    packed = _by_storage.get(data.untyped_storage().data_ptr())
    return packed if packed is not None and packed in registered() else None


def scales_of(data: torch.Tensor) -> torch.Tensor:
    """The scales of a quantized packed tensor ``pack`` returned (or of the slice it returned for some
    siblings of a fused packing): ``[..., blocks, 32]`` (int8) or ``[..., blocks, K/128]`` (fp8)."""
    packed = _holder(data)
    if packed is None or packed.scales is None:
        raise ValueError(f"no quantized packing holds this tensor ({data.dtype} {tuple(data.shape)})")
    if data.shape == packed.data.shape:
        return packed.scales
    block_elems = packed.data[0].numel()
    first = (data.storage_offset() - packed.data.storage_offset()) // block_elems
    return packed.scales[first : first + data.shape[0]]


def _packing_with_data(data: torch.Tensor) -> PackedWeight:
    packed = _holder(data)
    if packed is None or packed.data is not data:
        raise ValueError("not a packed tensor made by tilefx.custom_ops.weights.pack")
    return packed


def release(packed_data: torch.Tensor) -> int:
    """The release policy: the sources of ``packed_data`` give their memory back.

    bf16: each source's data becomes a view of its own range of the packed tensor (same
    shape, values in packed order), so memory holds the weight once. Quantized: the packed
    tensor holds other values than the source, so each source's data becomes
    ``untouched_zeros`` of its shape (bf16 for an fp8 checkpoint's; shape and strides kept
    for the graphs that trace it; only packing ops may read it). Either way packing the same sources again returns the same
    packed tensor. Pages of a source mapped from a file (safetensors loaded lazily) are
    dropped from this process too. A source packed in two ways stays.
    Returns the bytes released.
    """
    packed = _packing_with_data(packed_data)
    if packed.released:
        return 0
    sources = [ref() for ref in packed._sources]
    if any(s is None for s in sources):
        raise ValueError(f"release: a source of {packed.describe()} is gone")
    if any(len(packings_of(s)) > 1 for s in sources):
        raise ValueError(f"release: a source of {packed.describe()} is packed in another way too")
    flat, offset, released, mapped = packed.data.view(-1), 0, 0, memory.file_mappings()
    for index, source in enumerate(sources):
        del _registry[_key(source)]
        old = source.data
        if formats.checkpoint_format(source) == "int4":  # its rows, beside its untouched data (a deferred read: none)
            released += sum(part.held_bytes for part in formats.int4_parts(source))
        elif old.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            released += old.numel() * old.element_size()
            memory.drop_file_pages(old, mapped)
        if packed.format == "bf16":
            source.data = flat[offset : offset + source.numel()].view(source.shape)
        else:  # an fp8 checkpoint's source: the bf16 it stands for in the graphs that trace it
            dtype = torch.bfloat16 if old.dtype in formats.QUANTIZED_DTYPES else old.dtype
            source.data = memory.untouched_zeros(old.shape, dtype)
        formats.forget_checkpoint_scales(source)
        offset += source.numel()
        _registry[_key(source)] = [(packed, index)]
    packed.released = True
    return released


def release_sources(ids: set[int]) -> tuple[int, int]:
    """Release every packing not yet released whose sources' ``id``s are all in ``ids`` (read only packed)
    and packed in one way only. Returns (bytes released, sources in ``ids`` kept unpacked)."""
    released = kept = 0
    for packed in registered():
        sources = [ref() for ref in packed._sources]
        if packed.released or not any(id(s) in ids for s in sources):
            continue
        if all(id(s) in ids and len(packings_of(s)) == 1 for s in sources):
            released += release(packed.data)
        else:
            kept += sum(id(s) in ids for s in sources)
    return released, kept


def registered() -> list[PackedWeight]:
    """Every current packed weight (for reports)."""
    _drop_stale()
    return list({id(p): p for hits in list(_registry.values()) for p, _ in hits}.values())
