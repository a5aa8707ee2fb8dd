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
"""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import torch

from tilefx.custom_ops import weights

SUPPORTED = ("bf16 / fp16 / fp32 weights, or FP8 as DeepSeek-V3 and Qwen3-FP8 ship it (quant_method 'fp8', "
             "fmt 'e4m3', weight_block_size [128, 128], activation_scheme 'dynamic', float scales)")


class UnsupportedCheckpointError(ValueError):
    """The checkpoint is quantized in a way tilefx cannot run."""


def checkpoint_format(config) -> str:
    """``"fp8"`` for an FP8 checkpoint tilefx loads natively, ``"bf16"`` for an unquantized one; raises
    ``UnsupportedCheckpointError`` for any other ``quantization_config``."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return "bf16"
    fields = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = str(_normal(fields.get("quant_method", "?")))  # transformers' config objects hold an enum
    wanted = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
              "activation_scheme": "dynamic", "scale_fmt": "float", "expert_dtype": "fp8"}
    problems = [f"{key}={fields[key]!r}" for key, value in wanted.items()
                if key in fields and fields[key] is not None and _normal(fields[key]) != value]
    if method != "fp8" or problems:
        what = f"quant_method={method!r}" + "".join(f", {p}" for p in problems if not p.startswith("quant_method"))
        raise UnsupportedCheckpointError(
            f"this checkpoint is quantized ({what}), which tilefx cannot load; it runs {SUPPORTED}. "
            f"Load it with transformers, or convert it to bf16 first."
        )
    return "fp8"


def _normal(value):
    value = getattr(value, "value", value)  # enums
    return list(value) if isinstance(value, tuple) else value


@contextlib.contextmanager
def loading_quantized():
    """While transformers loads an FP8 checkpoint: keep it quantized although no GPU is present (transformers
    would otherwise switch its FP8 quantizer to dequantizing everything to bf16)."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    def validate_environment(self, *args, **kwargs):
        self.quantization_config.dequantize = False

    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", validate_environment):
        yield


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
