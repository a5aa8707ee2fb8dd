#!/usr/bin/env python
"""All-reduce latency for decode-sized tensors: tilefx's shared-memory collective vs gloo, as the graphs call them.

    torchrun --nproc-per-node 2 scripts/bench_allreduce.py
    torchrun --nproc-per-node 2 scripts/bench_allreduce.py --hidden 2048,4096,7168 --tokens 1,16 --json out.json

Every rank calls ``torch.ops.tilefx.all_reduce`` on a bf16 ``[tokens, hidden]`` tensor (one decode step's
hidden state per token) over each communicator in turn; rank 0 prints the median microseconds per call over
``--iters`` calls, after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import tilefx.custom_ops  # noqa: F401  (defines the ops)
from tilefx.custom_ops import collectives


def median_us(group: str, x: torch.Tensor, iters: int, repeats: int = 5) -> float:
    for _ in range(max(10, iters // 10)):
        torch.ops.tilefx.all_reduce(x, group)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            torch.ops.tilefx.all_reduce(x, group)
        times.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", default="2048,3072,4096,5120,7168")
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives.open_group("shm", "shm")
    collectives.open_group("gloo", "gloo")
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        for hidden in map(int, args.hidden.split(",")):
            x = torch.randn(tokens, hidden).to(torch.bfloat16)
            shm = median_us("shm", x, args.iters)
            gloo = median_us("gloo", x, max(50, args.iters // 10))
            rows.append({"tokens": tokens, "hidden": hidden, "kib": x.nbytes / 1024, "shm_us": shm, "gloo_us": gloo})
    if rank == 0:
        print(f"# {world} ranks, {torch.get_num_threads()} threads each, bf16, median of 5 x {args.iters} calls")
        print("| tokens x hidden | KiB | shm us | gloo us | gloo / shm |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['tokens']} x {r['hidden']} | {r['kib']:.0f} | {r['shm_us']:.1f} | {r['gloo_us']:.1f} "
                  f"| {r['gloo_us'] / r['shm_us']:.0f}x |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world, "rows": rows}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
