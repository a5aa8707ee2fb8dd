#!/usr/bin/env python
"""Prompt lookup decoding: what drafting from the prompt buys, HF eager against tilefx.

    python scripts/bench_assisted.py                          # SmolLM2-135M-Instruct, drafts of 3 and 10 tokens
    python scripts/bench_assisted.py --preset llama-3.2-1b --lookup 4 --new-tokens 32

``generate(prompt_lookup_num_tokens=N)`` (transformers' assisted generation, its drafts found by
matching the last tokens against the prompt) verifies up to N draft tokens in one forward and keeps
those the model would have chosen. Decode reads every weight once per forward whatever the token
count, so a request that quotes its input (editing, extraction, summaries) gets several tokens per
read. The default model is the trained SmolLM2-135M-Instruct (``bench_quality.py`` loads it), asked
to repeat a passage of CPython's Language Reference: a request whose drafts are found. A ``--preset``
has random weights: its drafts are rarely right, so its rows measure the cost, not the gain.

The second table is the cost side on tilefx: one forward of k new tokens after the prompt, in decode
steps (k = 1). Up to 4 tokens the linears run the decode GEMVs; above, the prefill GEMM.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

REQUEST = "Repeat the following text word for word, then stop.\n\n"
VERIFY_TOKENS = (1, 2, 3, 4, 5, 8, 11)


def trained_model_and_prompt(passage_chars: int):
    """SmolLM2-135M-Instruct (bf16) and a chat prompt asking it to repeat a passage."""
    import pydoc_data.topics

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import bench_quality

    model, tokenizer = bench_quality.load_reference(torch.bfloat16)
    passage = pydoc_data.topics.topics["for"][:passage_chars]
    messages = [{"role": "user", "content": REQUEST + passage}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    return model, ids, "SmolLM2-135M-Instruct, asked to repeat a passage"


def preset_model_and_prompt(preset: str, layers: int | None, prompt_len: int):
    from tilefx.models.presets import build_model

    model = build_model(preset, layers=layers)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=generator)
    return model, ids, f"preset {preset} (random weights), a random {prompt_len}-token prompt"


def forwards_counted(model) -> list[int]:
    """The token count of every forward of ``model`` from now on (a module hook: eager and compiled alike)."""
    calls: list[int] = []
    model.register_forward_pre_hook(lambda _module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    return calls


def time_generate(model, calls: list[int], ids, new_tokens: int, lookup: int, runs: int):
    """Median seconds of ``runs`` greedy generations of up to ``new_tokens``, the tokens, forwards per run
    (``calls``: ``forwards_counted``'s list for ``model``). No ``min_new_tokens``: its logits processor runs
    once per draft token checked and would charge the drafts transformers' per-call cost."""
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    seconds = []
    for run in range(runs + 1):  # the first untimed: a graph compiled at first use, the allocator's first pages
        calls.clear()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             **extra)
        if run:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out[0, ids.shape[1]:], len(calls)


def verify_costs(compiled, ids, rounds: int) -> dict[int, float]:
    """Median seconds of one forward of k random tokens after the prompt, k in VERIFY_TOKENS interleaved."""
    times: dict[int, list[float]] = {k: [] for k in VERIFY_TOKENS}
    mask = torch.ones_like(ids)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(rounds):
            for k in VERIFY_TOKENS:
                out = compiled(input_ids=ids, attention_mask=mask, logits_to_keep=1)
                new = torch.randint(3, compiled.config.vocab_size, (1, k), generator=generator)
                whole = torch.ones(1, ids.shape[1] + k, dtype=torch.long)
                start = time.perf_counter()
                compiled(input_ids=new, attention_mask=whole, logits_to_keep=k, cache=out.cache)
                times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", help="a preset of random weights instead of the trained model")
    parser.add_argument("--layers", type=int, help="cut the preset to this many layers")
    parser.add_argument("--prompt-len", type=int, default=256, help="a preset's prompt length")
    parser.add_argument("--passage-chars", type=int, default=1500, help="the trained model's passage to repeat")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--lookup", default="3,10", help="comma-separated prompt_lookup_num_tokens values")
    parser.add_argument("--modes", default="eager,tilefx", help="comma-separated: eager, tilefx")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--verify-rounds", type=int, default=8, help="rounds of the verification table (0: none)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    lookups = [int(n) for n in args.lookup.split(",") if n]
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - {"eager", "tilefx"}:
        parser.error(f"unknown modes {sorted(unknown)}: eager, tilefx")

    import tilefx

    def load():
        if args.preset:
            return preset_model_and_prompt(args.preset, args.layers, args.prompt_len)
        return trained_model_and_prompt(args.passage_chars)

    rows, costs = [], {}
    for mode in modes:
        model, ids, label = load()
        if mode == "tilefx":
            longest = max(args.new_tokens + max(lookups, default=0), max(VERIFY_TOKENS))
            model = tilefx.compile_model(model, max_seq_len=ids.shape[1] + longest, progress=False)
        calls = forwards_counted(model)
        greedy_s, greedy, forwards = time_generate(model, calls, ids, args.new_tokens, 0, args.runs)
        rows.append(dict(mode=mode, lookup=0, seconds=greedy_s, tokens=len(greedy), forwards=forwards, same=1.0))
        for lookup in lookups:
            seconds, tokens, forwards = time_generate(model, calls, ids, args.new_tokens, lookup, args.runs)
            common = min(len(tokens), len(greedy))
            same = (tokens[:common] == greedy[:common]).float().mean().item()
            rows.append(dict(mode=mode, lookup=lookup, seconds=seconds, tokens=len(tokens), forwards=forwards,
                             same=same))
        if mode == "tilefx" and args.verify_rounds:
            costs = verify_costs(model, ids, args.verify_rounds)
        del model

    print(f"\n{label}: {ids.shape[1]}-token prompt, up to {args.new_tokens} new tokens (greedy), "
          f"median of {args.runs}, {torch.get_num_threads()} threads\n")
    print("| mode | prompt_lookup_num_tokens | tokens | ms | tokens/s | vs its greedy | tokens per forward "
          "| same tokens as greedy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        greedy = next(r for r in rows if r["mode"] == row["mode"] and r["lookup"] == 0)
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["vs_greedy"] = row["tokens_per_s"] / greedy["tokens_per_s"]
        print(f"| {row['mode']} | {row['lookup'] or '-'} | {row['tokens']} | {row['seconds'] * 1e3:.0f} | "
              f"{row['tokens_per_s']:.1f} | {row['vs_greedy']:.2f}x | {row['tokens'] / row['forwards']:.2f} | "
              f"{row['same']:.0%} |")
    if costs:
        print(f"\ntilefx: one forward of k new tokens after the {ids.shape[1]}-token prompt (median of "
              f"{args.verify_rounds}, k interleaved)\n")
        print("| k | ms | decode steps |")
        print("|---:|---:|---:|")
        for k, seconds in costs.items():
            print(f"| {k} | {seconds * 1e3:.2f} | {seconds / costs[1]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "verify_seconds": costs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
