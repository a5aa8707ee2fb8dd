"""FP8 checkpoints as they ship (DeepSeek-V3/R1, Qwen3 ``-FP8``): loaded without dequantizing.

Such a checkpoint holds its linears (and experts) as ``float8_e4m3fn`` ``weight`` with
a fp32 ``weight_scale_inv`` per 128 x 128 block (``W = q * scale_inv``) and says so in
``config.json``'s ``quantization_config``. On a machine without a GPU, transformers
dequantizes such a model to bf16 while loading it: twice the checkpoint's bytes, more
than most CPU servers hold for DeepSeek-V3. tilefx lets transformers load it its own
way (``FP8Linear`` / ``FP8Experts`` modules holding the e4m3 values and their scales,
its key renames and expert stacking included) but keeps it quantized, then gives the
model back its plain modules (``nn.Linear``, the family's experts class) whose weights
are those e4m3 tensors, each marked with its scales (``weights.attach_checkpoint_scales``).
Packing then copies them as they are (``weights="auto"`` / ``"fp8"``) or dequantizes
them a chunk at a time (``"bf16"``, ``"int8"``, and whatever a kernel cannot yet read
in fp8): no whole bf16 copy of the model ever exists.

Each tensor's format is its own, read from the files' headers before any value loads
(``weight_formats``): e4m3 with its ``weight_scale_inv`` is fp8, anything else is what
its dtype says, whatever the config's ``modules_to_not_convert`` lists. transformers is
told to leave exactly the unquantized ones alone (``modules_to_not_convert``); left to
itself it would load an unlisted bf16 linear into an e4m3 one and make up its scales.
An e4m3 tensor without its scales is refused by name: nothing could read its values.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import sys
from unittest import mock

import torch

from tilefx.custom_ops import weights
from tilefx.models import int4

SUPPORTED = ("bf16 / fp16 / fp32 weights, or FP8 as DeepSeek-V3 and Qwen3-FP8 ship it (quant_method 'fp8', "
             "fmt 'e4m3', weight_block_size [128, 128], activation_scheme 'dynamic', float scales)")


SCALES = "_scale_inv"  # the hub's name for tensor X's block scales: X_scale_inv
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")  # a per-expert tensor; group 1: the experts module it stacks into


class UnsupportedCheckpointError(ValueError):
    """The checkpoint is quantized in a way tilefx cannot run."""


def checkpoint_format(config) -> str:
    """``"fp8"`` for an FP8 checkpoint tilefx loads natively, ``"int4"`` for a GPTQ / AWQ one it runs
    (models/int4.py), ``"bf16"`` for an unquantized one; raises ``UnsupportedCheckpointError`` for any other
    ``quantization_config``, naming what."""
    fields = _quantization_fields(config)
    if fields is None:
        return "bf16"
    method = str(_normal(fields.get("quant_method", "?")))  # transformers' config objects hold an enum
    if method.lower() in int4.METHODS:
        try:
            int4.scheme_of(fields)
        except int4.UnsupportedInt4Error as error:
            raise UnsupportedCheckpointError(str(error)) from None
        return "int4"
    wanted = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
              "activation_scheme": "dynamic", "scale_fmt": "float", "expert_dtype": "fp8"}
    problems = [f"{key}={fields[key]!r}" for key, value in wanted.items()
                if key in fields and fields[key] is not None and _normal(fields[key]) != value]
    if method != "fp8" or problems:
        what = f"quant_method={method!r}" + "".join(f", {p}" for p in problems if not p.startswith("quant_method"))
        raise UnsupportedCheckpointError(
            f"this checkpoint is quantized ({what}), which tilefx cannot load; it runs {SUPPORTED}, and "
            f"{int4.SUPPORTED}. Load it with transformers, or convert it to bf16 first."
        )
    return "fp8"


def int4_scheme(config) -> int4.Int4Scheme:
    """The GPTQ / AWQ scheme of a checkpoint ``checkpoint_format`` says is int4."""
    return int4.scheme_of(_quantization_fields(config))


def _quantization_fields(config) -> dict | None:
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


def _normal(value):
    value = getattr(value, "value", value)  # enums
    return list(value) if isinstance(value, tuple) else value


def weight_formats(files: dict[str, pathlib.Path]) -> dict[str, str]:
    """Each weight of a checkpoint (a tensor of two or more dims; models/shard_loading.checkpoint_files' ``{name:
    file}``) -> its format, read from the files' headers alone: ``"fp8"`` for e4m3 values with their
    ``<name>_scale_inv`` block scales, else its own dtype (``"bf16"``, ``"f32"``): a bf16 weight of an FP8
    checkpoint is bf16.

    Refuses what no loader could read right, naming the tensor: e4m3 values without their scales (``ValueError``),
    scales beside values that are not e4m3, another fp8 dtype, and one layer's per-expert tensors in two formats
    (both loaders stack them into one fused tensor of one dtype)."""
    from safetensors import safe_open

    stored: dict[str, tuple[str, int]] = {}  # name -> (safetensors dtype, dims)
    by_file: dict[pathlib.Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(path, "pt") as f:
            for name in names:
                tensor = f.get_slice(name)
                stored[name] = (tensor.get_dtype(), len(tensor.get_shape()))
    formats: dict[str, str] = {}
    for name, (dtype, dims) in stored.items():
        if name.endswith(SCALES):
            continue
        scaled = f"{name}{SCALES}" in stored
        if dtype == "F8_E4M3" and not scaled:
            raise ValueError(
                f"{name} is float8_e4m3fn but the checkpoint has no {name}{SCALES}: e4m3 values mean nothing "
                f"without their 128 x 128 block scales (transformers would make them up and warn MISSING). The "
                f"checkpoint is incomplete: download it again, or store that tensor with its scales or in bf16.")
        if dtype.startswith("F8") and dtype != "F8_E4M3":
            raise UnsupportedCheckpointError(f"{name} is {dtype}; tilefx runs {SUPPORTED}")
        if scaled and dtype != "F8_E4M3":
            raise UnsupportedCheckpointError(
                f"{name} is {dtype} and has block scales ({name}{SCALES}), which tilefx reads only beside e4m3 "
                f"values; it runs {SUPPORTED}")
        if dtype == "F8_E4M3":
            formats[name] = "fp8"
        elif dims >= 2:
            formats[name] = dtype.lower()
    experts: dict[str, dict[str, str]] = {}  # experts module -> {format: a tensor stored in it}
    for name, format in formats.items():
        if match := _PER_EXPERT.match(name):
            experts.setdefault(match.group(1), {}).setdefault(format, name)
    for module, held in experts.items():
        if len(held) > 1:
            raise UnsupportedCheckpointError(
                f"{module}: the experts' tensors are stored in different formats "
                f"({', '.join(f'{name} is {format}' for format, name in sorted(held.items()))}); a layer's experts "
                f"are stacked into one tensor of one format. Store them all in fp8 (with scales) or all in bf16.")
    return formats


def modules_to_not_convert(formats: dict[str, str], config, lm_head: str) -> list[str]:
    """What transformers must leave unquantized as it loads an FP8 checkpoint (its ``modules_to_not_convert``), from
    ``weight_formats`` rather than the config: every module whose weight is stored otherwise than in fp8 (a layer's
    experts: the experts module), ``lm_head`` unless stored in fp8 (a tied one has no tensor of its own), and of the
    config's own list the patterns that match no fp8 weight's module."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    kept = {_module_of(name) for name, format in formats.items() if format != "fp8"}
    if formats.get(f"{lm_head}.weight") != "fp8":
        kept.add(lm_head)
    quantized = {_module_of(name) for name, format in formats.items() if format == "fp8"}
    listed = (_quantization_fields(config) or {}).get("modules_to_not_convert") or ()
    kept.update(pattern for pattern in listed if all(should_convert_module(m, [pattern]) for m in quantized))
    return sorted(kept)


def _module_of(name: str) -> str:
    match = _PER_EXPERT.match(name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


@contextlib.contextmanager
def loading_quantized(unquantized: list[str]):
    """While transformers loads an FP8 checkpoint: keep it quantized although no GPU is present (transformers
    would otherwise switch its FP8 quantizer to dequantizing everything to bf16), and leave the modules
    ``unquantized`` names (``modules_to_not_convert``) as they are."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    def validate_environment(self, *args, **kwargs):
        self.quantization_config.dequantize = False
        self.quantization_config.modules_to_not_convert = list(unquantized)

    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", validate_environment):
        yield


def refuse_made_up_scales(missing_keys, source) -> None:
    """transformers gives an FP8 module whose scales the checkpoint lacks made-up ones (it warns MISSING); refuse
    them. ``missing_keys``: its loading info's, in the model's names."""
    made_up = sorted(key for key in missing_keys if key.endswith(SCALES))
    if made_up:
        raise ValueError(
            f"{source}: no block scales for {', '.join(made_up[:4])}{' ...' if len(made_up) > 4 else ''} "
            f"(transformers loaded e4m3 values for them without scales); the checkpoint is incomplete or names its "
            f"scales otherwise than <tensor>{SCALES}")


def adopt_fp8_modules(model: torch.nn.Module, experts_class: str | None) -> int:
    """Swap transformers' ``FP8Linear`` / ``FP8Experts`` back to ``nn.Linear`` / the family's ``experts_class``,
    holding the same e4m3 tensors marked with their scales. Returns how many modules it swapped."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    swapped = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, FP8Linear):
            if module.weight.dtype != torch.float8_e4m3fn or getattr(module, "activation_scale", None) is not None:
                raise UnsupportedCheckpointError(f"{name}: an FP8 linear with {module.weight.dtype} weights or static "
                                                 f"activation scales; tilefx runs {SUPPORTED}")
            with torch.device("meta"):
                plain = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight = _fp8_parameter(module.weight, module.weight_scale_inv, name)
            if module.bias is not None:
                plain.bias = module.bias
        elif isinstance(module, FP8Experts):
            if experts_class is None or not getattr(module, "has_gate", True):
                raise UnsupportedCheckpointError(f"{name}: FP8 experts of a kind tilefx does not run")
            namespace = sys.modules[type(model).__module__]
            with torch.device("meta"):
                plain = getattr(namespace, experts_class)(module.config)
            plain.gate_up_proj = _fp8_parameter(module.gate_up_proj, module.gate_up_proj_scale_inv, name)
            plain.down_proj = _fp8_parameter(module.down_proj, module.down_proj_scale_inv, name)
        else:
            continue
        model.set_submodule(name, plain)
        swapped += 1
    if swapped and getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None  # what remains are plain modules: nothing of transformers' FP8 runtime is used
    return swapped


def _fp8_parameter(values: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.nn.Parameter:
    if scale_inv.dim() == 0:
        raise UnsupportedCheckpointError(f"{name}: per-tensor FP8 scales; tilefx runs {SUPPORTED}")
    weight = torch.nn.Parameter(values.data, requires_grad=False)
    weights.attach_checkpoint_scales(weight, scale_inv.data)
    return weight
