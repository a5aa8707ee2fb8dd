#!/usr/bin/env python
"""Startup as a user sees it: a fresh process, wall clock from `import tilefx` to the first token.

    python scripts/startup.py --path ./ckpt                      # cold, then warm, max_batch 1
    python scripts/startup.py --preset llama-3.2-1b --max-batch 1,4 --json startup.json

Each run is its own process with TORCHINDUCTOR_CACHE_DIR pointing at one directory per
max_batch: the first run ("cold") starts it empty, the second ("warm") reuses what the
first wrote: Inductor's kernels and tilefx's graph cache (compiler/graph_cache.py). The first generate() runs under torch.inference_mode, as many user
scripts call it, on a 16-token prompt. Prints the table of issue 17 and what
`tilefx.explain` says about where the time went and whether the caches hit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
start = time.perf_counter()
import torch
import tilefx
path, max_batch = sys.argv[1], int(sys.argv[2])
imported = time.perf_counter()
model = tilefx.compile_model(path, max_batch=max_batch, max_seq_len=256, progress=False)
compiled = time.perf_counter()
ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    out = model.generate(ids, max_new_tokens=1, do_sample=False)
done = time.perf_counter()
report = model.tilefx.report
explain = tilefx.explain(model).splitlines()
print(json.dumps({
    "import_s": imported - start, "compile_model_s": compiled - imported, "first_generate_s": done - compiled,
    "first_token_s": done - start, "token": int(out[0, -1]), "graphs": len(report.graphs),
    "recompiles": report.recompiles, "startup": next(line for line in explain if line.startswith("startup")),
}))
"""


def run(path: str, max_batch: int, cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TILEFX_QUIET="1")
    env.pop("TILEFX_GRAPH_CACHE_DIR", None)  # tilefx's graph cache lives in (and starts empty with) Inductor's
    result = subprocess.run([sys.executable, "-c", CHILD, path, str(max_batch)], env=env, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(f"startup run failed (max_batch {max_batch}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="llama-3.2-1b", help="preset written to a temporary checkpoint first")
    source.add_argument("--path", help="a local HF model directory")
    parser.add_argument("--layers", type=int, help="cut the preset to this many layers")
    parser.add_argument("--max-batch", default="1", help="comma-separated max_batch values")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tilefx-startup-") as scratch:
        path = args.path
        if path is None:
            from tilefx.models.checkpoint import write_checkpoint

            path = str(write_checkpoint(args.preset, os.path.join(scratch, "checkpoint"), layers=args.layers))
        rows = []
        for max_batch in (int(b) for b in args.max_batch.split(",")):
            cache_dir = tempfile.mkdtemp(prefix=f"inductor-b{max_batch}-", dir=scratch)
            for start in ("cold", "warm"):
                row = dict(start=start, max_batch=max_batch, **run(path, max_batch, cache_dir))
                rows.append(row)
                print(f"# {start}, max_batch {max_batch}: {row['startup']}", flush=True)

    label = args.path or f"preset {args.preset}" + (f", {args.layers} layers" if args.layers else "")
    print(f"\n{label}: fresh process per row, TORCHINDUCTOR_CACHE_DIR per max_batch\n")
    print("| start | max_batch | import s | compile_model s | first generate() s | first token s | graphs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['start']} | {r['max_batch']} | {r['import_s']:.1f} | {r['compile_model_s']:.1f} | "
              f"{r['first_generate_s']:.1f} | {r['first_token_s']:.1f} | {r['graphs']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
