"""Tensor parallel shard loading: a rank's model, read from the safetensors files as its slices only.

``load_shard`` builds the rank's model from the plan's local config (models/tp.py) on the meta
device and reads, for every parameter, only the rank's slice (``get_slice``): the plan's style
decides the dim. The fused 3-D experts transformers builds are stacked from the checkpoint's
per-expert tensors (the adapter's ``expert_keys``), tensors transformers renames on load are
looked up under the checkpoint's names (the adapter's ``checkpoint_renames``), and an FP8
checkpoint's tensors come with the rows / columns of their scale blocks: each tensor in the
format the files hold it in (``fp8.weight_formats``: e4m3 with its scales, or its own dtype;
e4m3 without scales is refused before anything is read). Each sharded parameter
is marked with its ``weights.Shard``: the partition pass (compiler/passes/partition.py) reads
those marks to insert the collectives.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import pathlib

import torch
from tqdm.auto import tqdm

from tilefx.custom_ops import weights
from tilefx.models import fp8, int4
from tilefx.models.adapters import FamilyAdapter
from tilefx.models.tp import Plan, TPContext


def checkpoint_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            files.update({name: path for name in f.keys()})
    if not files:
        raise FileNotFoundError(f"{directory} holds no safetensors files")
    return files


def resolve_directory(name: str, *, revision=None, local_files_only=False) -> pathlib.Path:
    """A local directory as it is; a hub id through the HF cache (downloading its config and safetensors if
    allowed)."""
    if pathlib.Path(name).is_dir():
        return pathlib.Path(name)
    from huggingface_hub import snapshot_download

    return pathlib.Path(snapshot_download(name, revision=revision, local_files_only=local_files_only,
                                          allow_patterns=["*.json", "*.safetensors"]))


def load_shard(directory: pathlib.Path, config, adapter: FamilyAdapter, plan: Plan, ctx: TPContext | None,
               dtype: torch.dtype, scheme: int4.Int4Scheme | None = None, *, progress: bool = False):
    """The rank's model: built from ``plan.local_config`` on the meta device, every parameter read from the
    checkpoint as the rank's slice only (``get_slice``), marked with its ``weights.Shard``; ``model.config`` is the
    full model's config again afterwards. ``adapter``: the family's (its names for the checkpoint's tensors).
    ``ctx`` None: the whole model (``Plan.whole``). ``scheme``: a GPTQ / AWQ checkpoint's (models/int4.py): its
    quantized linears become int4 checkpoint weights, read when packing reads them. ``progress``: a bar over the
    parameters read."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    ctx = ctx or TPContext(rank=0, world_size=1, local_rank=0, local_world_size=1, same_host=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(plan.local_config, dtype=dtype, attn_implementation="sdpa")
    files = checkpoint_files(directory)
    quantized = int4.quantized_modules(files) if scheme is not None else set()
    for module in sorted(quantized):
        int4.check_tensors(module, files)
    # each weight's own format; refuses e4m3 without its scales; a 4-bit linear's tensors are its weight's
    formats = fp8.weight_formats({n: p for n, p in files.items() if n.rsplit(".", 1)[0] not in quantized})
    formats.update({f"{module}.weight": "int4" for module in quantized})
    for module in quantized:  # the model's name for a 4-bit weight: the file of its qweight
        files.setdefault(f"{module}.weight", files[f"{module}.qweight"])
    aliases: dict[str, str] = {}  # model name -> checkpoint name, where they differ
    by_file: dict[pathlib.Path, list[str]] = {}
    params = dict(model.named_parameters())
    for name in params:  # checkpoint names transformers renames on load (its conversion mapping): the model's
        for renamed in adapter.checkpoint_names(name)[1:]:
            if name not in files and renamed in files:
                files[name] = files[renamed]
                aliases[name] = renamed
    experts = {}
    for name in params:
        if name not in files:
            if name == f"{adapter.lm_head}.weight" and config.tie_word_embeddings:
                continue
            sources = _expert_sources(adapter, name, files, params[name].shape[0])
            if sources is None:
                raise KeyError(f"{directory}: the checkpoint has no tensor {name}")
            experts[name] = sources
            continue
        by_file.setdefault(files[name], []).append(name)
    reader = _DeferredFiles()  # 4-bit parts are read when packing reads them
    # the bar counts weights, not tensors: a layer's experts are most of its bytes, and most of the time
    size = {name: params[name].numel() for name in [*experts, *(n for names in by_file.values() for n in names)]}
    with tqdm(total=sum(size.values()), desc="tilefx: loading weights", unit="weight", unit_scale=True,
              disable=not progress, leave=False) as bar:
        for name, sources in _counted(experts.items(), bar, lambda item: size[item[0]]):
            _set(model, name, *_read_experts(name, sources, files, formats, plan, ctx, dtype, tuple(params[name].shape),
                                             scheme, reader))
        for path, names in by_file.items():
            with _open_files() as opened:  # one file's tensors (and scales, which the hub may keep in another file)
                for name in _counted(names, bar, size.__getitem__):
                    key = aliases.get(name, name)
                    if formats.get(key) == "int4":
                        _set(model, name, *_read_int4(opened, reader, files, key, scheme, plan, ctx,
                                                      tuple(params[name].shape)))
                        continue
                    tensor_slice = opened(path).get_slice(key)
                    shape = tuple(tensor_slice.get_shape())
                    shard = plan.shard_of(name, shape, ctx.rank)
                    value = _read(tensor_slice, shape, shard, name)
                    scales = _read_scales(opened, files, key, shard) if formats.get(key) == "fp8" else None
                    if scales is None:
                        value = value.to(dtype)
                    expected = tuple(params[name].shape)
                    if name.endswith(".bias") and plan.style_of(name) == "rowwise" and ctx.rank != 0:
                        value = torch.zeros_like(value)  # added once, by rank 0, before the sum
                    if shard is not None and shard.style in ("vocab", "colwise_gather_output"):
                        expected = (value.shape[0],) + expected[1:]
                    if tuple(value.shape) != expected:
                        raise ValueError(f"{name}: rank {ctx.rank}'s slice is {tuple(value.shape)}, the local model "
                                         f"expects {expected}")
                    _set(model, name, value, shard, scales)
    # Persistent buffers the checkpoint holds (DeepSeek-V3's e_score_correction_bias): whole on every rank,
    # in the buffer's own dtype. (The others were computed when the model was built.)
    buffers = [name for name, _ in model.named_buffers() if name in model.state_dict() and name in files]
    with _open_files() as opened:
        for name in buffers:
            module_name, attr = name.rsplit(".", 1)
            module = model.get_submodule(module_name)
            module._buffers[attr] = opened(files[name]).get_tensor(name).to(module._buffers[attr].dtype)
    if config.tie_word_embeddings:
        model.get_submodule(adapter.lm_head).weight = model.get_submodule(adapter.embedding).weight
    model.config = config
    model.generation_config = _generation_config(directory, model.generation_config)
    return model.eval()


def _counted(items, bar, size):
    """``items``, each counted on ``bar`` (as ``size(item)``) once the loop's body is done with it."""
    for item in items:
        yield item
        bar.update(size(item))


def _set(model, name: str, value: torch.Tensor, shard: weights.Shard | None = None, scales=None,
         int4_parts=None) -> None:
    """Parameter ``name`` of ``model`` becomes ``value`` (marked with ``shard``, and with its FP8 block ``scales``
    where it holds an FP8 checkpoint's e4m3 values: packing reads it as models/fp8.py's loads; with ``int4_parts``,
    an int4 checkpoint's: ``value`` untouched zeros, its rows read by packing)."""
    module_name, attr = name.rsplit(".", 1)
    param = torch.nn.Parameter(value, requires_grad=False)
    if shard is not None:
        weights.attach_shard(param, shard)
    if int4_parts is not None:
        weights.attach_int4_parts(param, int4_parts)
    elif scales is not None:
        weights.attach_checkpoint_scales(param, scales)
    setattr(model.get_submodule(module_name), attr, param)


def _int4_part(reader, files: dict, key: str, scheme, shard: weights.Shard | None, shape) -> weights.Int4Rows:
    """4-bit linear ``key``'s (``X.weight``, logical ``shape`` ``[N, K]``) rows as tilefx's int4 (models/int4.py),
    the shard's rows (colwise) or whole groups of its inputs (rowwise): read when packing reads them (``reader``:
    ``_DeferredFiles``), so that loading touches none of its bytes, and packing reads each part's once."""
    module = key.removesuffix(".weight")
    rows = _int4_split(shape, key, shard)[0]

    def read():
        def tensor(name):
            return reader(files[name]).get_tensor(name)

        nibbles, params = int4.read_int4(tensor, files, module, scheme)
        if shard is None:
            return nibbles, params
        nibbles, params = _int4_shard(nibbles, params, key, shard)
        # the rank's slices own their bytes, so that the whole tensors go; GPTQ's words stay the file's, read in place
        return (nibbles if nibbles.dim() == 3 else nibbles.clone()), params.clone()

    return weights.Int4Rows(rows, read)


def _int4_split(shape, key: str, shard: weights.Shard | None) -> tuple[int, int]:
    """The shard's ``[rows, inputs]`` of a 4-bit linear of ``shape``; refused where the split cuts a group of
    inputs or does not divide the dim."""
    n, k = shape
    if shard is None:
        return n, k
    size = (n, k)[shard.dim]
    if size % shard.count:
        raise ValueError(f"{key}: dim {shard.dim} ({size}) does not split {shard.count} ways")
    part = size // shard.count
    if shard.dim == 1 and part % weights.INT4_GROUP:
        raise ValueError(f"{key}: tensor parallel splits its {k} inputs (dim 1) {shard.count} ways, {part} each, "
                         f"which cuts its 4-bit groups of {weights.INT4_GROUP}; use a tp that splits them whole")
    return (part, k) if shard.dim == 0 else (n, part)


class _DeferredFiles:
    """The checkpoint's files, opened when packing reads a deferred 4-bit part (``_int4_part``), a few at a time:
    packing goes layer by layer, and a layer's parts lie in one file or two."""

    def __init__(self, keep: int = 4):
        self._open: collections.OrderedDict = collections.OrderedDict()
        self._keep = keep

    def __call__(self, path):
        from safetensors import safe_open

        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        if len(self._open) >= self._keep:
            self._open.popitem(last=False)[1].__exit__(None, None, None)  # (tensors read from it stay valid)
        self._open[path] = safe_open(path, "pt").__enter__()
        return self._open[path]


def _int4_shard(nibbles: torch.Tensor, params: torch.Tensor, key: str, shard: weights.Shard):
    """The rank's slices (views) of a whole linear's nibbles (two a byte or words, ``formats.int4_rows``) and
    params."""
    per_byte = 2 if nibbles.dim() == 2 else 8  # inputs per element of dim 1
    n, k = nibbles.shape[0], per_byte * nibbles.shape[1]
    rows, inputs = _int4_split((n, k), key, shard)
    part = rows if shard.dim == 0 else inputs
    begin = shard.index * part
    if shard.dim == 0:
        return nibbles[begin : begin + part], params[begin : begin + part]
    groups = slice(begin // weights.INT4_GROUP, (begin + part) // weights.INT4_GROUP)
    return nibbles[:, begin // per_byte : (begin + part) // per_byte], params[:, groups]


def _read_int4(opened, reader, files: dict, key: str, scheme, plan: Plan, ctx: TPContext, expected):
    """``_set``'s arguments for a 4-bit linear's weight: untouched zeros of its local shape, its Shard, no scales,
    and its rows (read by packing)."""
    shape = int4.logical_shape(opened, files, key.removesuffix(".weight"), scheme)
    shard = plan.shard_of(key, shape, ctx.rank)
    local = _int4_split(shape, key, shard)
    if local != tuple(expected):
        raise ValueError(f"{key}: rank {ctx.rank}'s slice is {local}, the local model expects {tuple(expected)}")
    part = _int4_part(reader, files, key, scheme, shard, shape)
    return weights.untouched_zeros(local, torch.uint8), shard, None, [(part,)]


@contextlib.contextmanager
def _open_files():
    """``opened(path)``: the safetensors file at ``path``, opened once for the block, all closed at its end."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        yield functools.cache(lambda path: stack.enter_context(safe_open(path, "pt")))


def _read_scales(opened, files: dict, key: str, shard: weights.Shard | None):
    """The rank's ``weight_scale_inv`` blocks of FP8 checkpoint tensor ``key`` (one ``weight_formats`` says is fp8):
    the blocks of its rows / columns (plan_for checked each rank holds whole blocks). ``opened``: ``_open_files``'s."""
    scale_key = f"{key}{fp8.SCALES}"
    return _scale_blocks(opened(files[scale_key]).get_slice(scale_key), shard)


def _scale_blocks(scales, shard: weights.Shard | None) -> torch.Tensor:
    shape = tuple(scales.get_shape())
    if shard is None:
        return scales[:].float()
    group = weights.FP8_GROUP
    size = shard.size
    per_rank = size // shard.count
    begin, end = shard.index * per_rank // group, -(-(shard.index + 1) * per_rank // group)
    index = tuple(slice(None) if d != shard.dim else slice(begin, end) for d in range(len(shape)))
    return scales[index].float().clone()


def _expert_sources(adapter: FamilyAdapter, name: str, files: dict, num_experts: int):
    """``(kind, per-expert checkpoint names)`` that hold fused expert parameter ``name``
    (``...experts.gate_up_proj``: gate and up; ``...experts.down_proj``: down), or None. The per-expert names are
    the adapter's ``expert_keys`` under the experts module's name, or the checkpoint's name for it."""
    prefix, attr = name.rsplit(".", 1)
    if adapter.moe is None or attr not in ("gate_up_proj", "down_proj"):
        return None
    gate, up, down = adapter.moe.expert_keys
    templates = (gate, up) if attr == "gate_up_proj" else (down,)
    for module in adapter.checkpoint_names(prefix):
        names = [[f"{module}.{t.format(e=e)}" for t in templates] for e in range(num_experts)]
        if all(n in files for row in names for n in row):  # (a 4-bit expert's X.weight: its X.qweight's file)
            return attr, names
    return None


def _read_experts(name: str, sources, files: dict, formats: dict, plan: Plan, ctx: TPContext, dtype, expected,
                  scheme=None, reader=None):
    """Fused experts parameter ``name`` of the rank's model, stacked from the per-expert tensors' slices: each
    expert's gate and up rows (``packed_colwise``), or its down columns (``rowwise``). Returns it, its Shard and
    its FP8 checkpoint scales (None where the experts are stored unquantized: ``weight_formats`` checked that a
    layer's experts share one format); 4-bit experts: ``_read_int4_experts``'."""
    attr, names = sources
    if formats.get(names[0][0]) == "int4":
        return _read_int4_experts(name, names, files, scheme, plan, ctx, expected, reader)
    quantized = formats.get(names[0][0]) == "fp8"
    out = torch.empty(expected, dtype=torch.float8_e4m3fn if quantized else dtype)
    scales = None
    with _open_files() as opened:
        for e, row in enumerate(names):
            parts, part_scales = [], []
            for key in row:
                tensor_slice = opened(files[key]).get_slice(key)
                shape = tuple(tensor_slice.get_shape())
                shard = plan.shard_of(name, shape, ctx.rank)  # each expert's 2-D part, split as the fused one
                value = _read(tensor_slice, shape, shard, key)
                parts.append(value if quantized else value.to(dtype))
                if quantized:  # the fused gate_up's scales: gate's blocks, then up's (as transformers stacks them)
                    part_scales.append(_read_scales(opened, files, key, shard))
            out[e] = torch.cat(parts, dim=0)
            if quantized:
                expert_scales = torch.cat(part_scales, dim=0)
                if scales is None:
                    scales = torch.empty((len(names), *expert_scales.shape), dtype=torch.float32)
                scales[e] = expert_scales
    return out, plan.local_shard_of(name, expected, ctx.rank), scales


def _read_int4_experts(name: str, names, files: dict, scheme, plan: Plan, ctx: TPContext, expected, reader):
    """``_read_experts`` for 4-bit experts: each expert's parts (gate, then up), read by packing."""
    parts = []
    with _open_files() as opened:
        for e, row in enumerate(names):
            expert = []
            for key in row:
                shape = int4.logical_shape(opened, files, key.removesuffix(".weight"), scheme)
                expert.append(_int4_part(reader, files, key, scheme, plan.shard_of(name, shape, ctx.rank), shape))
            rows = sum(part.rows for part in expert)
            if rows != expected[1]:
                raise ValueError(f"{name}: expert {e}'s parts hold {rows} rows, the local model expects {expected[1]}")
            parts.append(tuple(expert))
    return weights.untouched_zeros(expected, torch.uint8), plan.local_shard_of(name, expected, ctx.rank), None, parts


def _generation_config(directory: pathlib.Path, default):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:
        return default


def _read(tensor_slice, shape: tuple[int, ...], shard: weights.Shard | None, name: str) -> torch.Tensor:
    """The shard's part of a checkpoint tensor; the vocabulary split pads the last rank's rows with zeros."""
    if shard is None:
        return tensor_slice[:]
    size = shape[shard.dim]
    per_rank = -(-size // shard.count)
    begin, end = shard.index * per_rank, min(size, (shard.index + 1) * per_rank)
    if shard.style not in ("vocab", "colwise_gather_output") and size % shard.count:
        raise ValueError(f"{name}: dim {shard.dim} ({size}) does not split {shard.count} ways")
    index = tuple(slice(None) if d != shard.dim else slice(begin, end) for d in range(len(shape)))
    value = tensor_slice[index]
    if value.untyped_storage().nbytes() > value.nbytes:  # a view into the file's whole tensor: own the rows
        value = value.clone()
    if end - begin < per_rank:  # vocabulary rows past the end
        pad = list(value.shape)
        pad[shard.dim] = per_rank - (end - begin)
        value = torch.cat([value, value.new_zeros(pad)], dim=shard.dim)
    return value

