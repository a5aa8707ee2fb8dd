"""One tensor-parallel rank, run by torchrun from tests/test_tp.py:

    torchrun --nproc-per-node 2 tests/tp_worker.py OUT_DIR CKPT [CKPT ...]

For each checkpoint: compile_model(CKPT, tp=world size), greedy generate() for a batch-1 prompt and a padded
batch of 2, and write what the test checks to OUT_DIR/<ckpt name>.rank<R>.json.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist

import tilefx
from tilefx.custom_ops import weights


def resident_weight_bytes(model) -> int:
    """Bytes of every distinct storage the model's parameters and packed weights live in."""
    storages = {}
    tensors = [*model.parameters(), *(p.data for p in weights.registered()),
               *(p.scales for p in weights.registered() if p.scales is not None)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main() -> None:
    out, checkpoints = pathlib.Path(sys.argv[1]), sys.argv[2:]
    world = int(__import__("os").environ["WORLD_SIZE"])
    for checkpoint in checkpoints:
        model = tilefx.compile_model(checkpoint, tp=world, max_seq_len=64, max_batch=2, progress=False)
        rank = dist.get_rank()
        prompt = torch.tensor([[5, 17, 33, 101, 7, 250, 64, 3, 99, 12, 41, 8, 77]])
        batch_ids = torch.tensor([[0, 0, 0, 9, 23, 51, 6], [4, 18, 200, 31, 90, 11, 2]])
        batch_mask = (torch.arange(7) >= torch.tensor([[3], [0]])).long()
        with torch.inference_mode():
            one = model.generate(prompt, max_new_tokens=8, do_sample=False)
            two = model.generate(batch_ids, attention_mask=batch_mask, max_new_tokens=8, do_sample=False)
        explain = tilefx.explain(model)
        result = {
            "rank": rank,
            "one": one.tolist(),
            "two": two.tolist(),
            "batch_mask": batch_mask.tolist(),
            "weight_bytes": resident_weight_bytes(model),
            "recompiles": model.tilefx.report.recompiles,
            "graph_ops": [dict(g.tilefx_ops) for g in model.tilefx.report.graphs],
            "explain": explain,
        }
        (out / f"{pathlib.Path(checkpoint).name}.rank{rank}.json").write_text(json.dumps(result))
        del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
