"""The MoE pass on captured graphs: one tilefx.fused_moe and one router op per MoE layer, outputs equal eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tilefx.custom_ops  # noqa: F401
from helpers import PassTestBackend, count, eager_logits_and_routing_ties, is_op, run
from tilefx.compiler.passes.moe import MoePass
from tilefx.models.adapters import adapter_for
from tilefx.models.kv_cache import TilefxCache
from tilefx.models.presets import build_model

FAMILIES = ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2", "tiny-deepseek-v3"]


def is_grouped_mm(n):
    return n.op == "call_function" and "grouped_mm" in str(n.target)


def is_bmm(n):
    return n.op == "call_function" and n.target in (torch.bmm, torch.ops.aten.bmm.default)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 5)])
def test_every_moe_block_becomes_router_op_and_fused_moe(family, batch, seq):
    torch._dynamo.reset()
    model = build_model(family, seed=3)
    adapter = adapter_for(model.config)
    ids = torch.randint(3, 200, (batch, seq), generator=torch.Generator().manual_seed(seq))
    dims = adapter.moe_dims(model.config)
    want, ties = eager_logits_and_routing_ties(model, ids, adapter.moe.router_class, dims["top_k"])

    blocks = adapter_for(model.config).moe_blocks(model.config)
    backend = PassTestBackend(MoePass(blocks))
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=2, max_seq_len=32)
    cache.start(batch)
    got = run(model, cache, ids, backend)

    layers = len(adapter.moe_layers(model.config))
    assert len(blocks) == layers >= 1
    before, after = backend.before[0], backend.after[0]
    assert count(before, is_grouped_mm) == 2 * layers  # HF's default experts path: two grouped matmuls
    assert count(after, is_grouped_mm) == 0
    assert count(after, is_op("fused_moe")) == layers
    router_op = adapter.routing(model.config).op
    assert count(after, is_op(router_op)) == layers
    assert count(after, lambda n: n.op == "call_function" and n.target is torch.topk) == 0
    result = backend.results[0]
    assert result.rewritten == layers and not result.fallbacks
    assert len(result.packed_exclusively) == 2 * layers  # gate_up_proj and down_proj of each block
    assert (~ties).sum() >= ties.numel() // 2, f"router ties at {ties.nonzero().tolist()}: pick another input"
    torch.testing.assert_close(got[~ties].float(), want[~ties].float(), rtol=2e-2,
                               atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("implementation", ["batched_mm"])
def test_matches_whichever_experts_implementation_hf_runs(implementation):
    torch._dynamo.reset()
    model = build_model("tiny-qwen3-moe", seed=4)
    model.set_experts_implementation(implementation)
    ids = torch.randint(3, 200, (1, 4))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    backend = PassTestBackend(MoePass(adapter_for(model.config).moe_blocks(model.config)))
    cache = TilefxCache.for_config(model.config, adapter_for(model.config), max_batch=1, max_seq_len=16)
    cache.start(1)
    got = run(model, cache, ids, backend)
    layers = model.config.num_hidden_layers
    assert count(backend.before[0], is_bmm) >= 2 * layers and count(backend.before[0], is_grouped_mm) == 0
    assert count(backend.after[0], is_op("fused_moe")) == layers
    assert count(backend.after[0], is_bmm) == 0
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_uuid_depends_on_routing():
    model = build_model("tiny-qwen3-moe")
    blocks = adapter_for(model.config).moe_blocks(model.config)
    other = {path: dataclasses.replace(b, routing=dataclasses.replace(b.routing, top_k=b.routing.top_k + 1))
             for path, b in blocks.items()}
    assert MoePass(blocks).uuid() != MoePass(other).uuid()
