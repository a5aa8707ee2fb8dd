#!/usr/bin/env python
"""Generate text from a prompt with a tilefx-compiled model, streaming tokens as they come.

    python scripts/generate.py ./ckpt --prompt "Once upon a time" --max-new-tokens 32
    python scripts/generate.py meta-llama/Llama-3.2-1B --eager    # plain HF, for comparison
    torchrun --nproc-per-node 2 scripts/generate.py ./ckpt --tp 2  # tensor parallel: one rank per NUMA node

With ``--tp`` every rank generates (the same tokens); rank 0 prints them.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import AutoTokenizer, TextStreamer

import tilefx
from tilefx.models.load import load_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="hub id or local directory")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-k 50) instead of greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eager", action="store_true", help="run plain transformers, no compilation")
    parser.add_argument("--local-files-only", action="store_true", help="never contact the hub")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (run under torchrun)")
    args = parser.parse_args(argv)
    if args.tp > 1 and args.eager:
        parser.error("--eager runs one process; drop --tp")

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=args.local_files_only)
    if args.eager:
        model = load_model(args.model, local_files_only=args.local_files_only)
    else:
        model = tilefx.compile_model(args.model, max_seq_len=args.max_seq_len, local_files_only=args.local_files_only,
                                     tp=args.tp)
    leader = args.tp == 1 or torch.distributed.get_rank() == 0
    inputs = tokenizer(args.prompt, return_tensors="pt")
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    out = model.generate(
        **inputs,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=0.8 if args.sample else None,
        top_k=50 if args.sample else None,
        streamer=TextStreamer(tokenizer, skip_prompt=False) if leader else None,
    )
    elapsed = time.perf_counter() - start
    new = out.shape[1] - inputs["input_ids"].shape[1]
    if leader:
        print(f"\n[{new} tokens in {elapsed:.2f}s, {new / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
