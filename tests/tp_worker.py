"""One tensor-parallel rank, run by torchrun from tests/test_tp.py:

    torchrun --nproc-per-node 2 tests/tp_worker.py OUT_DIR [--batch2 NAME,...] [--no-inductor NAME,...] CKPT ...

For each checkpoint: compile_model(CKPT, tp=world size), greedy generate() for a batch-1 prompt and, for the
checkpoints named by --batch2 (all without it), a padded batch of 2, a beam search of 2 beams (compiled for
max_batch 2: twice the graphs) and prompt lookup decoding (drafts checked several tokens a forward, rejected ones
cropped), and write what the test checks to OUT_DIR/<ckpt name>.rank<R>.json. The checkpoints named by
--no-inductor compile with inductor=False (the same passes and kernels, the glue run op by op).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import pathlib
import time

import torch
import torch._inductor.config
import torch.distributed as dist

import tilefx
from tilefx.custom_ops import weights

from helpers import adapter_lookups, graph_calls  # (tests/ is this script's directory: first on sys.path)


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of ``[address, address + nbytes)`` in memory (mincore): a released quantized source's untouched
    zeros are address space only."""
    page = 4096
    start = address & ~(page - 1)
    length = address + nbytes - start
    pages = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if ctypes.CDLL(None).mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        return nbytes
    flags = bytes(pages)
    return min(nbytes, (len(flags) - flags.count(0)) * page)


def resident_weight_bytes(model) -> int:
    """Resident bytes of every distinct storage the model's parameters and packed weights live in."""
    storages = {}
    mine = {id(p) for p in model.parameters()}  # (models compiled before in this process stay registered)
    packings = [p for p in weights.registered() if any(id(source()) in mine for source in p._sources)]
    tensors = [*model.parameters(), *(p.data for p in packings), *(p.scales for p in packings if p.scales is not None)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(resident_bytes(address, nbytes) for address, nbytes in storages.items())


def _names(text: str) -> set[str]:
    return set(text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--batch2", type=_names, default=None, help="the checkpoints that also run batch 2 (all)")
    parser.add_argument("--no-inductor", type=_names, default=set(), help="the checkpoints compiled inductor=False")
    parser.add_argument("checkpoints", nargs="+")
    args = parser.parse_args()
    out = args.out
    world = int(os.environ["WORLD_SIZE"])
    for checkpoint in args.checkpoints:
        start = time.perf_counter()
        name = pathlib.Path(checkpoint).name
        rows = 2 if args.batch2 is None or name in args.batch2 else 1
        with adapter_lookups() as lookups:
            model = tilefx.compile_model(checkpoint, tp=world, max_seq_len=64, max_batch=rows, progress=False,
                                         inductor=name not in args.no_inductor)
        rank = dist.get_rank()
        prompt = torch.tensor([[5, 17, 33, 101, 7, 250, 64, 3, 99, 12, 41, 8, 77]])
        batch_ids = torch.tensor([[0, 0, 0, 9, 23, 51, 6], [4, 18, 200, 31, 90, 11, 2]])
        batch_mask = (torch.arange(7) >= torch.tensor([[3], [0]])).long()
        with torch.inference_mode():
            one = model.generate(prompt, max_new_tokens=8, do_sample=False)
            two = model.generate(batch_ids, attention_mask=batch_mask, max_new_tokens=8, do_sample=False) \
                if rows == 2 else None
            # two beams: the batch-2 graphs, each rank reordering its own slice of the cache
            beams = model.generate(prompt, max_new_tokens=6, do_sample=False, num_beams=2, num_return_sequences=2,
                                   length_penalty=0.0, output_scores=True, return_dict_in_generate=True) \
                if rows == 2 else None
            recompiles = model.tilefx.report.recompiles  # (before the all-rows graph prompt lookup compiles)
            lookup, forwards = None, []
            if rows == 2:  # prompt lookup: a prompt that repeats itself, so drafts are found
                with graph_calls(model.tilefx) as forwards:
                    lookup = model.generate(prompt.repeat(1, 2), max_new_tokens=12, do_sample=False,
                                            prompt_lookup_num_tokens=3, output_logits=True,
                                            return_dict_in_generate=True)
        explain = tilefx.explain(model)
        result = {
            "rank": rank,
            "one": one.tolist(),
            "two": two.tolist() if two is not None else None,
            "batch_mask": batch_mask.tolist(),
            "beams": beams.sequences.tolist() if beams is not None else None,
            "beam_scores": beams.sequences_scores.tolist() if beams is not None else None,
            "lookup": lookup.sequences.tolist() if lookup is not None else None,
            "lookup_logits": [step.float().tolist() for step in lookup.logits] if lookup is not None else None,
            "lookup_forwards": forwards,
            "weight_bytes": resident_weight_bytes(model),
            "recompiles": recompiles,
            "recompiles_after_lookup": model.tilefx.report.recompiles,
            "adapter_lookups": len(lookups),
            "graph_ops": [dict(g.tilefx_ops) for g in model.tilefx.report.graphs],
            "explain": explain,
            "cpus": len(os.sched_getaffinity(0)),
            "compile_threads": torch._inductor.config.compile_threads,
            "seconds": time.perf_counter() - start,  # compile and generate: what each checkpoint costs the suite
        }
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
        del model
    dist.destroy_process_group()


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # an abort prints every thread's Python stack to the test's stderr
    main()
