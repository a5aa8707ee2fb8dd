#!/usr/bin/env python
"""Peak memory of ``compile_model`` and a first ``generate()``, against the checkpoint's bytes.

    python scripts/make_checkpoint.py --preset llama-3.2-1b ./ckpt
    python scripts/peak_rss.py ./ckpt            # one JSON line: peak RSS, checkpoint bytes, ratios

``--hf``: the same figures for transformers' own ``from_pretrained`` of the checkpoint
(bf16; an FP8 checkpoint is dequantized on a machine without a GPU) and one generate(),
to set tilefx's memory beside it.

Run it in a fresh process per measurement: the peak (the kernel's ``VmHWM``) only grows.
``import_rss`` is the process's RSS after importing torch, transformers and tilefx;
``baseline`` its RSS after it also compiled a tiny model of the same kind (``--stack``),
which brings in what every compile costs once whatever the model (Dynamo, Inductor,
their caches and code: a few hundred MB); ``over_checkpoint`` is ``(peak - baseline -
kv_cache) / checkpoint``: what holding this model cost, per checkpoint byte.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import sys
import time


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak() -> int:
    """This process's peak RSS: the kernel's high-water mark of its own memory (``VmHWM``). Not ``ru_maxrss``:
    a process started by a large one (pytest) inherits its parent's RSS there through fork and exec."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def checkpoint_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=pathlib.Path, help="a checkpoint directory (config.json + safetensors)")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--options", default="{}", help="compile_model options as JSON, e.g. '{\"fuse_linears\": false}'")
    parser.add_argument("--hf", action="store_true", help="measure transformers' own load instead of tilefx")
    parser.add_argument("--stack", default="tiny-llama",
                        help="a preset compiled before the baseline is taken ('none': baseline right after imports)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TILEFX_QUIET", "1")

    import torch

    import tilefx

    import_rss = _rss()
    if args.stack != "none":
        from tilefx.models.presets import build_model

        tiny = tilefx.compile_model(build_model(args.stack), max_seq_len=16)
        with torch.no_grad():
            tiny.generate(torch.ones(1, 2, dtype=torch.long), max_new_tokens=2, do_sample=False)
        del tiny
    baseline = _rss()
    start = time.perf_counter()
    if args.hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.bfloat16).eval()
    else:
        model = tilefx.compile_model(str(args.model), max_seq_len=args.max_seq_len, **json.loads(args.options))
    compiled_at = time.perf_counter()
    peak_compile = _peak()
    ids = torch.randint(3, min(model.config.vocab_size, 1000), (1, 16))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    peak = _peak()
    ckpt, cache = checkpoint_bytes(args.model), 0 if args.hf else model.tilefx.cache.nbytes
    print(json.dumps({
        "model": str(args.model),
        "loader": "transformers" if args.hf else "tilefx",
        "checkpoint_bytes": ckpt,
        "kv_cache_bytes": cache,
        "import_rss": import_rss,
        "baseline_rss": baseline,
        "peak_rss_compile": peak_compile,
        "peak_rss": peak,
        "rss_after": _rss(),
        "peak_over_checkpoint": round(peak / ckpt, 3),
        "over_checkpoint": round((peak - baseline - cache) / ckpt, 3),
        "compile_seconds": round(compiled_at - start, 1),
        # what this compile timed or read from the tuning cache, and where its time went
        **({} if args.hf else {"explain": [line for line in tilefx.explain(model).splitlines()
                                           if line.startswith(("decode walk", "prefill", "startup", "graph cache"))]}),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
