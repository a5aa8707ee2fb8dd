"""Run by torchrun from tests/custom_ops/test_collectives.py: the shared-memory and gloo collectives against
the sum / concatenation of every rank's inputs, eager and inside an Inductor-compiled graph."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import tilefx.custom_ops  # noqa: F401  (defines the ops)
from tilefx.custom_ops import collectives


def inputs(shape, dtype, rank: int) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(1000 * rank + sum(shape))) * 3).to(dtype)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives.open_group("shm", "shm")
    collectives.open_group("gloo", "gloo")
    # a group whose slots (4 KiB) are smaller than most tensors below: several steps per collective
    collectives._GROUPS["shm-small"] = collectives.ShmCommunicator(dist.group.WORLD, 60.0, slot_bytes=4096)
    failures = []
    shapes = [(1, 1, 2048), (1, 1, 7168), (2, 1, 3000), (1, 37, 512), (5,), (1, 129, 1000)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in shapes:
            parts = [inputs(shape, dtype, r) for r in range(world)]
            expected = sum(p.float() for p in parts).to(dtype)
            gathered = torch.cat(parts, dim=-1)
            for name in ("shm", "gloo", "shm-small"):
                got = torch.ops.tilefx.all_reduce(parts[rank], name)
                if not torch.equal(got, expected):
                    failures.append(f"all_reduce {name} {shape} {dtype}: max error "
                                    f"{(got.float() - expected.float()).abs().max().item()}")
                size = gathered.shape[-1] - (3 if shape[-1] > 3 else 0)
                got = torch.ops.tilefx.all_gather(parts[rank], name, size)
                if not torch.equal(got, gathered[..., :size]):
                    failures.append(f"all_gather {name} {shape} {dtype}")
    # inside a compiled graph: one extern call each, no graph break (fullgraph)
    def layer(x, w):
        return torch.ops.tilefx.all_gather(torch.ops.tilefx.all_reduce(x @ w, "shm").relu() + 1, "shm", 2 * 48 - 5)

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    x, w = inputs((4, 32), torch.float32, rank), inputs((32, 48), torch.float32, 7)
    expected = torch.cat([inputs((4, 32), torch.float32, r) @ w for r in range(world)][:1], -1)
    partials = [inputs((4, 32), torch.float32, r) @ w for r in range(world)]
    reduced = (sum(partials).relu() + 1)
    expected = torch.cat([reduced] * world, dim=-1)[..., : 2 * 48 - 5]
    got = compiled(x, w)
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
        failures.append(f"compiled: max error {(got - expected).abs().max().item()}")
    segments = [path for name in ("shm", "shm-small") for path in collectives._GROUPS[name].paths]
    print(f"rank {rank} segments:", *segments, flush=True)
    print(f"rank {rank}: {len(failures)} failures", *failures, sep="\n", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
