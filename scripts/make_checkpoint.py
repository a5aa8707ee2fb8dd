#!/usr/bin/env python
"""Write a preset as an ordinary HF model directory: config.json, safetensors, a working tokenizer.

    python scripts/make_checkpoint.py --preset llama-3.2-1b --layers 2 ./ckpt
    python scripts/make_checkpoint.py --preset qwen3-30b-a3b --layers 4 --weights fp8 ./ckpt-fp8
    python -c "import tilefx; tilefx.compile_model('./ckpt')"

The weights are random (no hub access here); the tokenizer is a byte-level BPE
trained locally on a small built-in text, saved with its special tokens.
``--weights fp8`` writes the hub's FP8 layout (DeepSeek-V3, Qwen3-FP8): every decoder
linear and expert as float8_e4m3fn with a float32 ``weight_scale_inv`` per 128 x 128
block, and ``quantization_config`` in config.json. ``--weights gptq`` / ``gptq-asym`` / ``awq`` write the
same linears in that 4-bit layout (models/int4.py), groups of 128 inputs;
``--repeat-layer`` builds one layer and writes it ``--layers`` times, for checkpoints too large
to build in memory:

    python scripts/make_checkpoint.py --preset qwen3-30b-a3b --layers 48 --weights gptq --repeat-layer ./q30b
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from tilefx.models.checkpoint import CHECKPOINT_FORMATS, INT4_QUANTIZATION_CONFIGS, write_checkpoint, \
    write_repeated_int4_checkpoint
from tilefx.models.presets import PRESETS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="keep only this many layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", default="bf16", choices=CHECKPOINT_FORMATS, help="the checkpoint's format")
    parser.add_argument("--repeat-layer", action="store_true",
                        help="4-bit layouts only: build one layer and write it --layers times (checkpoints too large "
                             "to build in memory, such as qwen3-30b-a3b at 48 layers)")
    parser.add_argument("out", type=pathlib.Path, help="output directory (must be empty or absent)")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty; choose a new directory")
    if args.repeat_layer:
        if args.weights not in INT4_QUANTIZATION_CONFIGS or not args.layers:
            parser.error("--repeat-layer writes a 4-bit layout (--weights gptq, gptq-asym or awq) with --layers")
        write_repeated_int4_checkpoint(args.preset, args.out, layers=args.layers, layout=args.weights, seed=args.seed)
    else:
        write_checkpoint(args.preset, args.out, layers=args.layers, seed=args.seed, weights=args.weights)
    print(f"wrote {args.preset} ({args.weights}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
