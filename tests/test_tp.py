"""Tensor parallelism end to end: 2 ranks on this machine (torchrun, one core each), against HF eager on one.

One torchrun run compiles, with tp=2 (tests/tp_worker.py), two dense models: Llama-3.2-1B's architecture cut
to one layer (GQA, KV heads split; its tied 0.5 GB embedding split by vocabulary rows) and a tiny Qwen2 with
one KV head (replicated on both ranks; qkv bias); three tiny MoE models: Qwen3-MoE (Qwen3's attention, q/k
norms), Qwen2-MoE (a sigmoid-gated shared expert, reduced with the routed experts), Mixtral (its checkpoint's
block_sparse_moe names); two tiny DeepSeek models (MLA: heads split, the latent cache whole on every rank;
shared experts; V3's dense first layer); Qwen3-30B-A3B's architecture cut to one layer in the hub's FP8
layout, and a tiny GPTQ MoE. Greedy tokens must agree with HF eager's on the full model (close-logprobs rule)
and be the same on both ranks; each rank holds half the weights. (Each model costs the suite about 20 s of
cold compiles on two cores, so one model stands for each plan: plain Qwen3 is Qwen3-MoE's attention, a bf16
Qwen3-30B-A3B layer splits its experts as the FP8 one does; and a padded batch of 2, which doubles the graphs,
runs on DeepSeek-V3 only, whose layers are a dense MLP, routed and shared experts and MLA: the other plans' splits
are per row too, and their batches of 2 run on one process in tests/test_generate*.py. DeepSeek-V3 also runs a
beam search on those graphs and prompt lookup decoding, whose draft check compiles one more graph.)
Inductor compiles the ranks' graphs of Llama and the two DeepSeeks (the embedding's and logits' glue, a
collective after each row-parallel region and the experts' among Inductor's kernels; the DeepSeeks share most of
theirs); the other plans run their rewritten graphs with inductor=False (``NO_INDUCTOR``): the same partition,
passes and kernels, the glue op by op, at a fifth to a third of the compile.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import assert_draws_from_reference_logits, assert_greedy_matches, reference_sequence_logprobs
from tilefx.models.checkpoint import write_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILIES = ("tiny-qwen2-mqa", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-deepseek-v2",
            "tiny-deepseek-v3")
UNCOMPILED = "tiny-llama"  # written for the refusals only: Llama-3.2-1B's layer below is the dense GQA plan


def torchrun(*args: str, nproc: int = 2, timeout: float = 600, env: dict | None = None):
    """``torchrun --nproc-per-node nproc ARGS`` (standalone rendezvous on a free port)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    full_env = {**os.environ, "TILEFX_QUIET": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)


# real architectures cut to one layer: Llama-3.2-1B (0.77 GB, its tied 0.5 GB embedding split by vocabulary rows)
LARGE = ("llama-3.2-1b",)
# Qwen3-30B-A3B in the hub's FP8 layout (1.3 GB: 128 experts, each split by its intermediate columns): each rank
# reads its e4m3 slices and their scale blocks
FP8 = "qwen3-30b-a3b-fp8"
INT4 = "tiny-qwen3-moe-w256-gptq"  # a GPTQ checkpoint: each rank repacks its rows, or its whole groups of inputs
# The checkpoint that also generates a padded batch of 2 (compiled for max_batch 2, twice the graphs to compile):
# MLA, a dense first layer, routed and shared experts; the others a batch of 1.
BATCH2 = ("tiny-deepseek-v3",)
# The plans whose graphs run without Inductor: what is under test is the partition pass, the loader's slices and the
# collectives, which inductor=False runs the same; Inductor is ~2/3 of a cold compile.
NO_INDUCTOR = ("tiny-qwen2-mqa", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", FP8, INT4)
GLOO = "tiny-deepseek-v2"  # run again over gloo, from the graphs its first run saved (so compiled by Inductor)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    written = {name: write_checkpoint(name, root / name) for name in (*FAMILIES, UNCOMPILED)}
    written.update({name: write_checkpoint(name, root / name, layers=1) for name in LARGE})
    written[FP8] = write_checkpoint("qwen3-30b-a3b", root / FP8, layers=1, weights="fp8")
    written[INT4] = write_checkpoint("tiny-qwen3-moe-w256", root / INT4, seed=3, weights="gptq")
    yield written
    shutil.rmtree(root)  # 2.7 GB: gone before the next module writes its own


@pytest.fixture(scope="module")
def tp2(checkpoints, tmp_path_factory):
    """Each checkpoint compiled with tp=2 and generated from on both ranks: {name: [rank 0 result, rank 1 result]}."""
    out = tmp_path_factory.mktemp("tp-out")
    names = [name for name in checkpoints if name != UNCOMPILED]
    done = torchrun("tests/tp_worker.py", str(out), "--batch2", ",".join(BATCH2),
                    "--no-inductor", ",".join(NO_INDUCTOR), *(str(checkpoints[n]) for n in names))
    assert done.returncode == 0, done.stderr[-12000:]
    return {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)] for name in names}


@pytest.mark.parametrize("family", [*LARGE, *FAMILIES])
def test_tp2_greedy_tokens_match_hf_eager(family, checkpoints, tp2):
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.bfloat16).eval()
    rank0, rank1 = tp2[family]
    assert rank0["one"] == rank1["one"] and rank0["two"] == rank1["two"], "the ranks generated different tokens"
    with torch.no_grad():
        one = torch.tensor(rank0["one"])
        assert_greedy_matches(reference, one[:, :13], torch.ones(1, 13, dtype=torch.long), one)
        if family in BATCH2:
            two, mask = torch.tensor(rank0["two"]), torch.tensor(rank0["batch_mask"])
            assert_greedy_matches(reference, two[:, :7], mask, two)
            # beam search: both ranks reorder their caches alike, and each beam's score is its tokens' log-probs
            assert rank0["beams"] == rank1["beams"], "the ranks kept different beams"
            scores = reference_sequence_logprobs(reference, torch.tensor(rank0["beams"]), 13)
            torch.testing.assert_close(torch.tensor(rank0["beam_scores"]), scores, rtol=0, atol=0.1)
            # prompt lookup: both ranks accept and crop alike, and every token is still the reference's greedy one
            # (each step's logits, not only its token: after a rejected draft a crop that forgot nothing moves every
            # later step's, mostly by less than the greedy rule sees on this tiny model)
            assert rank0["lookup"] == rank1["lookup"], "the ranks accepted different drafts"
            lookup = SimpleNamespace(sequences=torch.tensor(rank0["lookup"]),
                                     logits=tuple(torch.tensor(step) for step in rank0["lookup_logits"]))
            prompt = lookup.sequences[:, :26]
            assert_draws_from_reference_logits(reference, prompt, torch.ones_like(prompt), lookup, 1, routing_flips=1)
            assert max(rank0["lookup_forwards"][1:]) > 1  # drafts were checked several tokens a forward
            # at first use, the one graph that checks drafts (a prompt's, keeping all rows), on both ranks
            assert [r["recompiles_after_lookup"] for r in (rank0, rank1)] == [1, 1]
        else:
            assert rank0["two"] is None
    assert rank0["recompiles"] == 0 and rank1["recompiles"] == 0
    # each rank compiled in a pool of its own CPUs' size (one CPU each here: in its own process), not the host's
    assert [r["compile_threads"] for r in (rank0, rank1)] == [min(32, r["cpus"]) for r in (rank0, rank1)]


@pytest.mark.parametrize("family", [*LARGE, *FAMILIES])
def test_tp2_graphs_reduce_once_per_row_parallel_region(family, checkpoints, tp2):
    """Per graph: one all-reduce after each o_proj and MLP (down_proj, or the experts with the shared expert
    added: 2 per layer), one for the embedding lookup, one gather of the logits."""
    layers = json.loads((pathlib.Path(checkpoints[family]) / "config.json").read_text())["num_hidden_layers"]
    for rank in tp2[family]:
        for ops in rank["graph_ops"]:
            assert ops.get("tilefx.all_reduce") == 2 * layers + 1, ops
            assert ops.get("tilefx.all_gather") == 1, ops


def test_tp2_over_gloo_generates_the_same_tokens(checkpoints, tp2, tmp_path):
    """The collectives ranks on several hosts use (TILEFX_TP_COMM=gloo forces them here): the same tokens as
    shared memory (both sum in fp32, every rank gets the same bits). The graphs are the same too: each rank loads
    the ones its first run saved to tilefx's graph cache and runs them without Dynamo."""
    assert GLOO not in NO_INDUCTOR
    done = torchrun("tests/tp_worker.py", str(tmp_path), "--batch2", ",".join(BATCH2),
                    str(checkpoints[GLOO]), env={"TILEFX_TP_COMM": "gloo"})
    assert done.returncode == 0, done.stderr[-12000:]
    for rank in (0, 1):
        over_gloo = json.loads((tmp_path / f"{GLOO}.rank{rank}.json").read_text())
        assert "collectives gloo" in over_gloo["explain"]
        assert "tilefx graphs loaded" in over_gloo["explain"], over_gloo["explain"]
        assert over_gloo["one"] == tp2[GLOO][rank]["one"]
        assert over_gloo["two"] == tp2[GLOO][rank]["two"]


def test_tp2_fp8_checkpoint(checkpoints, tp2):
    """An FP8 checkpoint splits as it ships: every rank's linears and experts stay fp8 (the checkpoint's bytes and
    scale blocks), and the tokens agree with transformers' own (dequantizing) load of the same files."""
    rank0, rank1 = tp2[FP8]
    assert rank0["one"] == rank1["one"] and rank0["two"] == rank1["two"]
    assert "weight formats: fp8 4" in rank0["explain"], rank0["explain"]
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[FP8], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        one = torch.tensor(rank0["one"])
        assert_greedy_matches(reference, one[:, :13], torch.ones(1, 13, dtype=torch.long), one)


def test_tp2_int4_checkpoint(checkpoints, tp2):
    """A GPTQ checkpoint splits as it ships: each rank's linears and experts int4 (rows, or whole 128-input groups
    of the row-parallel ones), tokens like HF eager over the exactly dequantized weights."""
    from test_int4_checkpoint import _dequantized_reference

    rank0, rank1 = tp2[INT4]
    assert rank0["one"] == rank1["one"] and rank0["two"] == rank1["two"]
    assert "weight formats: int4" in rank0["explain"], rank0["explain"]
    reference = _dequantized_reference(pathlib.Path(checkpoints[INT4]), "gptq")
    with torch.no_grad():
        one = torch.tensor(rank0["one"])
        assert_greedy_matches(reference, one[:, :13], torch.ones(1, 13, dtype=torch.long), one)


@pytest.mark.parametrize("name", [*LARGE, FP8])
def test_tp2_each_rank_holds_about_half_the_weights(name, checkpoints, tp2):
    """Every weight but the norms (and the MoE router) is split, so each rank's packed and unpacked weights
    together are half the checkpoint's: no rank ever held the whole of any of them."""
    from safetensors import safe_open

    full = 0
    for path in pathlib.Path(checkpoints[name]).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                tensor_slice = f.get_slice(key)
                full += math.prod(tensor_slice.get_shape()) * (4 if key.endswith("scale_inv") else
                                                                 1 if "F8" in tensor_slice.get_dtype() else 2)
    for rank in tp2[name]:
        share = rank["weight_bytes"] / full
        assert 0.49 <= share <= 0.51, (rank["rank"], share)
    assert tp2[name][0]["one"] == tp2[name][1]["one"]


def test_tp2_resolves_the_adapter_once_per_compile(tp2):
    """Joining, planning, shard loading, packing, the runtime and the KV cache share one adapter_for lookup."""
    assert {rank["adapter_lookups"] for ranks in tp2.values() for rank in ranks} == {1}


def test_tp_refuses_without_a_process_group(checkpoints):
    import tilefx
    from tilefx.models.tp import TensorParallelError

    env = {name: os.environ.pop(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           if name in os.environ}
    try:
        with pytest.raises(TensorParallelError, match="no process group.*torchrun"):
            tilefx.compile_model(checkpoints["tiny-llama"], tp=2)
    finally:
        os.environ.update(env)


def test_tp_refusals_before_loading():
    from transformers import AutoConfig

    from tilefx.models.adapters import adapter_for
    from tilefx.models.presets import get_preset
    from tilefx.models.tp import TensorParallelError, plan_for

    def split(config, tp: int):
        return plan_for(config, adapter_for(config), tp)

    llama = get_preset("tiny-llama").build_config()
    with pytest.raises(TensorParallelError, match="num_attention_heads 4.*not divisible by 3"):
        split(llama, 3)
    odd = AutoConfig.for_model("llama", **{**get_preset("tiny-llama").config, "intermediate_size": 129})
    with pytest.raises(TensorParallelError, match="intermediate_size 129"):
        split(odd, 2)
    with pytest.raises(TensorParallelError, match="num_key_value_heads 2 is neither"):
        split(AutoConfig.for_model("llama", **{**get_preset("tiny-llama").config, "num_attention_heads": 8,
                                               "num_key_value_heads": 2}), 3)
    with pytest.raises(TensorParallelError, match="moe_intermediate_size 64 gives each rank 16 columns"):
        split(get_preset("tiny-qwen3-moe").build_config(), 4)
    from tilefx.models.checkpoint import FP8_QUANTIZATION_CONFIG

    fp8 = AutoConfig.for_model("llama", **{**get_preset("tiny-llama").config,
                                           "quantization_config": dict(FP8_QUANTIZATION_CONFIG)})
    with pytest.raises(TensorParallelError, match="scale blocks would straddle ranks.*q_proj rows 32"):
        split(fp8, 2)
    mla = split(get_preset("tiny-deepseek-v3").build_config(), 2)  # heads split, the latent whole
    assert mla.style_of("model.layers.0.self_attn.kv_b_proj.weight") == "colwise"
    # whole on every rank: no entry (transformers < 5.25) or HF's mla_kv_a_proj (5.25), which tilefx replicates
    assert mla.shard_of("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (48, 64), 0) is None
    assert mla.local_config.num_attention_heads == 2 and mla.local_config.kv_lora_rank == 32
    local = split(get_preset("tiny-qwen2-mqa").build_config(), 2)
    assert (local.local_config.num_attention_heads, local.local_config.num_key_value_heads, local.kv_replicas,
            local.local_config.intermediate_size) == (2, 1, 2, 64)


def test_tp_world_size_mismatch(checkpoints, tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(f"import tilefx\ntilefx.compile_model({str(checkpoints['tiny-llama'])!r}, tp=3)\n")
    done = torchrun(str(script), timeout=300)
    assert done.returncode != 0
    assert "tp=3 but the process group has 2 ranks" in done.stderr


def shm_files_named_in(output: str) -> set[str]:
    """The shared-memory group files (``/dev/shm/tilefx-<run>-<rank>``) a rank's output names: each test checks
    its own group's files are gone, not all of /dev/shm (another worker's ranks may hold one for a moment); found
    anywhere in the output, as torchrun interleaves the ranks' lines."""
    return set(re.findall(r"/dev/shm/tilefx-[0-9a-f]+-[0-9]+", output))


def launch_ranks(script: pathlib.Path, nproc: int = 2, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """The ranks of ``script`` started as plain processes (no torchrun: its agent would stop the survivors of a
    dead rank itself, and the point is that tilefx does)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
            "OMP_NUM_THREADS": "1", "TILEFX_QUIET": "1"}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(nproc)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def test_a_killed_rank_stops_the_other_in_bounded_time(tmp_path):
    """Rank 1 dies (SIGKILL) between collectives; rank 0, waiting in the next one, exits with an error naming
    rank 1 within a few seconds, and none of the group's shared-memory segments is left (its own: other tests may
    open groups meanwhile)."""
    script = tmp_path / "die.py"
    script.write_text(
        "import os, signal, time, torch, torch.distributed as dist\n"
        "import tilefx.custom_ops\n"
        "from tilefx.custom_ops import collectives\n"
        "dist.init_process_group('gloo')\n"
        "collectives.open_group('g', 'shm', timeout_s=120)\n"
        "print('SEGMENTS', *collectives._GROUPS['g'].paths, flush=True)\n"
        "x = torch.ones(8)\n"
        "for _ in range(3): torch.ops.tilefx.all_reduce(x, 'g')\n"
        "if dist.get_rank() == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
        "start = time.perf_counter()\n"
        "try:\n"
        "    torch.ops.tilefx.all_reduce(x, 'g')\n"
        "except RuntimeError as error:\n"
        "    print(f'ERROR after {time.perf_counter() - start:.2f}s: {error}', flush=True)\n"
        "    os._exit(3)\n"
    )
    rank0, rank1 = launch_ranks(script)
    assert rank1.returncode == -signal.SIGKILL
    assert rank0.returncode == 3, rank0.stdout + rank0.stderr[-3000:]
    assert "rank 1" in rank0.stdout and "exited while rank 0 waited" in rank0.stdout, rank0.stdout
    waited = float(rank0.stdout.split("ERROR after ")[1].split("s:")[0])
    assert waited < 5.0, waited
    segments = shm_files_named_in(rank0.stdout)
    assert len(segments) == 2, rank0.stdout
    assert not any(os.path.exists(s) for s in segments)


def test_a_hung_rank_times_out(tmp_path):
    """Rank 1 stops calling collectives (sleeps); rank 0 gives up after TILEFX_TP_TIMEOUT naming rank 1."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, time, torch, torch.distributed as dist\n"
        "import tilefx.custom_ops\n"
        "from tilefx.custom_ops import collectives\n"
        "dist.init_process_group('gloo')\n"
        "collectives.open_group('g', 'shm', timeout_s=1.5)\n"
        "x = torch.ones(8)\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(6); os._exit(0)\n"
        "try:\n"
        "    torch.ops.tilefx.all_reduce(x, 'g')\n"
        "except RuntimeError as error:\n"
        "    print('ERROR', error, flush=True); os._exit(3)\n"
    )
    start = time.perf_counter()
    rank0, _ = launch_ranks(script)
    assert rank0.returncode == 3, rank0.stdout + rank0.stderr[-3000:]
    assert "did not reach collective step 0 within 1.5 s" in rank0.stdout and "rank 1" in rank0.stdout, rank0.stdout
    assert time.perf_counter() - start < 60
