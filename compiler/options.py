"""Options that change what tilefx compiles. Passes read only the fields they need."""

from __future__ import annotations

import dataclasses
import json

import torch


WEIGHT_FORMATS = ("auto", "bf16", "int8", "fp8", "int4")


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    max_seq_len: int = 2048
    max_batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    attention: bool = True  # swap HF attention + cache update for tilefx attention ops
    mla: bool = True  # DeepSeek latent attention: weight-absorbed tilefx.mla_attention over the latent cache
    moe: bool = True  # swap each sparse MoE block's routing + experts for tilefx router ops + fused_moe
    linear: bool = True  # swap every linear for tilefx.linear over its packed weight (packed as the model loads)
    fuse_linears: bool = True  # sibling linears (q/k/v, gate/up + SiLU-and-mul) become one packed linear
    rope: bool = True  # a prompt's rotate-half RoPE on queries and keys as tilefx.rope (one read, one write a row)
    norm: bool = True  # a prompt's RMSNorms (and the residual adds before them) as tilefx ops: one pass over each row
    # A prompt's last layer after its attention (o_proj, the MLP, the norms) only for the rows whose logits are kept
    kept_rows: bool = True
    compute_once: bool = True  # RoPE's cos/sin tables computed once per forward, not inside every layer's kernels
    # Inductor freezing (weights become constants of the compiled graphs). Off: packed weights are graph
    # inputs either way, and without it both compile caches (FX graph and AOT autograd) serve a warm start.
    freezing: bool = False
    # Inductor's C++ wrapper: each compiled graph calls its kernels and tilefx's ops from C++ instead of a Python
    # function, which saves each op's Python call on every decode step (0.4-0.65 ms a token on a Zen 4 for a
    # Llama of 16 layers cut to hidden 256, where the step is all per-op cost; within the noise on Llama-3.2-1B
    # itself) at ~25-40% more compile time on a cold cache (docs/PERFORMANCE.md). Off until it is measured on a
    # many-core CPU, where the step is shorter and the saving weighs more.
    cpp_wrapper: bool = False
    # Off: the rewritten graphs run as the PyTorch ops they hold, without Inductor (Dynamo's "eager" backend
    # after tilefx's passes): the same tilefx ops and packed weights, with the glue between them run op by op.
    # A debugging switch: tokens that differ with Inductor on and agree with it off point at Inductor's compile
    # of the rewritten graph, not at the passes or the kernels. Compiles in a fraction of the time, decodes
    # slower (each glue op a call); no graph cache (there is nothing compiled to keep).
    inductor: bool = True
    fullgraph: bool = True  # a graph break is an error, not a silent slow path
    # A prompt longer than this runs as consecutive prefill calls of at most this many tokens, each continuing
    # the cache (0: in one call). Every intermediate of a prefill call grows with its tokens (the attention mask
    # with them times max_seq_len, the linears' outputs, fused_moe's routed rows: ~1 GB for a 16k-token prompt of
    # Llama-3.2-1B): chunks bound it at the cost of reading the weights once more per chunk. 4096 rather than 8192
    # halved a 16k-token prompt's peak above the idle model (Llama-3.2-1B, Qwen3-30B-A3B, DeepSeek-V2-Lite at 8k,
    # 4 layers each) at the same TTFT within 1-2% (docs/PERFORMANCE.md, thirty-fourth session).
    # The graphs are the same (the prompt length is dynamic), and so is the math (tests/test_generate.py).
    prefill_chunk: int = 4096
    # Keep freed CPU blocks of 1 MiB and more within each forward and hand them to later requests of their size
    # (custom_ops/buffers.py): each layer of a prefill allocates the same large intermediates, which glibc maps
    # afresh, and the kernel faults in and zeroes, for every layer. The kept blocks are freed as the forward ends.
    recycle_buffers: bool = True
    # Weight format of the packed linears and experts: "auto" (what the checkpoint holds: bf16, fp8 for an FP8
    # checkpoint, int4 for a GPTQ / AWQ one), "bf16", "int8" (symmetric per output channel), "fp8" (e4m3, 128 x
    # 128 block scales) or "int4" (RTN with zero points, per output channel and 128 inputs; the lm_head int8),
    # quantized as the weights load. Routers and MLA's absorbed projections stay bf16 (tilefx.explain says why).
    weights: str = "auto"
    # Keep each compiled graph with how to call it (compiler/graph_cache.py): a later process loads it and skips
    # Dynamo. Off with freezing, without fullgraph, or when Inductor's caches are disabled.
    graph_cache: bool = True
    # Time the decode walk's candidates on this machine once (custom_ops/tuning.py; cached per CPU next to the
    # graph cache) and keep the fastest. Off: the built-in defaults. Never changes what a graph computes.
    tune: bool = True
    tp_rank: int = 0
    tp_world_size: int = 1

    def __post_init__(self):
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len}: expected at least 2")
        if self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch}: expected at least 1")
        if isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk={self.prefill_chunk!r}: expected a token count (0: no chunks)")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights={self.weights!r}: expected one of {', '.join(map(repr, WEIGHT_FORMATS))}")
        if not self.inductor and (self.cpp_wrapper or self.freezing):
            chosen = " and ".join(name for name in ("cpp_wrapper", "freezing") if getattr(self, name))
            raise ValueError(f"{chosen}=True is an Inductor setting: it needs inductor=True")
        if self.dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"dtype={self.dtype}: expected torch.bfloat16, torch.float16 or torch.float32")

    # Fields only the runtime reads, between graph calls: the graphs are the same whatever they are.
    RUNTIME_ONLY = ("prefill_chunk", "recycle_buffers")

    def key(self) -> str:
        """A stable string of every field that shapes the graphs, for cache keys (uuid())."""
        return json.dumps({f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)
                           if f.name not in self.RUNTIME_ONLY}, sort_keys=True)
