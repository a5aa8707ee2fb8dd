"""The partition pass on captured graphs of a rank's model (models/shard_loading.load_shard).

A one-rank group (every weight "split" one way, the collectives the identity a group
of one computes) runs the rewritten graph in this process: outputs equal eager on the
full model. A rank of two is checked for its structure: local shapes only, one
all-reduce per row-parallel region plus one for the embedding, one logits gather.
Tokens across two real ranks: tests/test_tp.py.
"""

from __future__ import annotations

import pytest
import torch

import tilefx.custom_ops  # noqa: F401
from helpers import PassTestBackend, count, is_op, run
from tilefx.compiler.passes.attention import AttentionPass
from tilefx.compiler.passes.linear import LinearPass
from tilefx.compiler.passes.moe import MoePass
from tilefx.compiler.passes.partition import PartitionPass
from tilefx.custom_ops import collectives, weights
from tilefx.models.adapters import adapter_for
from tilefx.models.checkpoint import write_checkpoint
from tilefx.models.kv_cache import TilefxCache
from tilefx.models.load import load_config
from tilefx.models.shard_loading import load_shard
from tilefx.models.tp import TPContext, plan_for


class OneProcess:
    """Collectives in one process: the sum of one part is the part; the gather repeats this rank's part ``parts``
    times (a group of one for parts=1; shapes only for more)."""

    kind = "one process"

    def __init__(self, parts: int):
        self.parts = parts

    def all_reduce(self, x):
        return x.clone()

    def all_gather(self, x):
        return torch.cat([x] * self.parts, dim=-1)


@pytest.fixture
def one_rank_group():
    collectives._GROUPS[collectives.TP_GROUP] = OneProcess(1)
    yield
    collectives._GROUPS.pop(collectives.TP_GROUP, None)


def is_linear(n):
    return n.op == "call_function" and n.target is torch._C._nn.linear


def rank_model(directory, rank: int, world: int):
    config, _ = load_config(directory)
    adapter = adapter_for(config)
    plan = plan_for(config, adapter, world)
    ctx = TPContext(rank=rank, world_size=world, local_rank=rank, local_world_size=world, same_host=True)
    return load_shard(directory, config, adapter, plan, ctx, torch.bfloat16), plan


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2-mqa", "tiny-qwen3", "tiny-qwen2-moe", "tiny-mixtral"])
def test_one_rank_graph_matches_eager(family, tmp_path, one_rank_group):
    """Passes in the pass manager's order; the MoE models' experts (fused_moe) and Qwen2-MoE's gated shared expert
    are one region, reduced once."""
    torch._dynamo.reset()
    directory = write_checkpoint(family, tmp_path / family, seed=3)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    model, plan = rank_model(directory, 0, 1)
    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits
    backend = PassTestBackend(AttentionPass(), MoePass(adapter_for(plan.local_config).moe_blocks(plan.local_config)),
                              PartitionPass(collectives.TP_GROUP, 1), LinearPass(fuse=True))
    cache = TilefxCache.for_config(plan.local_config, adapter_for(plan.local_config), max_batch=2, max_seq_len=32)
    cache.start(2)
    got = run(model, cache, ids, backend)
    layers = model.config.num_hidden_layers
    before, after = backend.before[0], backend.after[0]
    assert count(before, is_op("all_reduce")) == 0
    assert count(after, is_op("all_reduce")) == 2 * layers + 1  # o_proj, down_proj per layer; the embedding
    assert count(after, is_op("all_gather")) == 1
    assert backend.results[2].rewritten == 2 * layers + 2 and not backend.results[2].fallbacks
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_rank_of_two_holds_local_shapes_and_reduces_each_region(tmp_path, one_rank_group):
    """Rank 1 of 2 (tiny-llama: 4 heads, 2 KV heads, MLP 128, vocabulary 512): every split weight is its half,
    marked with its Shard; the graph reduces after o_proj and down_proj and after the embedding, gathers the
    logits to the full vocabulary, and the embedding looks up ids shifted by rank 1's first row."""
    torch._dynamo.reset()
    directory = write_checkpoint("tiny-llama", tmp_path / "llama", seed=3)
    model, plan = rank_model(directory, 1, 2)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (256, 64)
    for name, param in model.named_parameters():
        if "norm" not in name:
            shard = weights.shard_of(param)
            assert shard is not None and shard.index == 1 and shard.count == 2, name
    ids = torch.tensor([[3, 300, 511]])
    collectives._GROUPS[collectives.TP_GROUP] = OneProcess(2)
    backend = PassTestBackend(PartitionPass(collectives.TP_GROUP, 2), AttentionPass(), LinearPass(fuse=True))
    cache = TilefxCache.for_config(plan.local_config, adapter_for(plan.local_config), max_batch=1, max_seq_len=16)
    cache.start(1)
    logits = run(model, cache, ids, backend)
    after = backend.after[0]
    assert logits.shape[-1] == 512
    assert count(after, is_op("all_reduce")) == 5 and count(after, is_op("all_gather")) == 1
    subs = [n for n in after.nodes if n.op == "call_function" and n.target is torch.sub]
    assert [n.args[1] for n in subs] == [256]
    gather = next(n for n in after.nodes if n.op == "call_function" and n.target is torch.ops.tilefx.all_gather.default)
    assert gather.args[2] == 512


def test_experts_left_to_hf_code_are_an_error(tmp_path, one_rank_group):
    """Without the MoE pass, HF's experts code reads the experts' down_proj (split by columns) as a whole weight:
    the pass refuses the graph rather than let it compute with a slice."""
    torch._dynamo.reset()
    directory = write_checkpoint("tiny-qwen3-moe", tmp_path / "moe", seed=3)
    model, plan = rank_model(directory, 0, 1)
    backend = PassTestBackend(AttentionPass(), PartitionPass(collectives.TP_GROUP, 1))
    cache = TilefxCache.for_config(plan.local_config, adapter_for(plan.local_config), max_batch=1, max_seq_len=16)
    cache.start(1)
    with pytest.raises(Exception, match="split by input columns.*no collective covers that use"):
        run(model, cache, torch.tensor([[3, 4, 5]]), backend)
