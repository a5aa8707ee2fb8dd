"""The benchmark scripts run end to end on a tiny preset and report correct kernels (timings are not checked)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import runpy
import subprocess
import sys

import pytest
import torch
from helpers import run_script

from tilefx.custom_ops import isa

ROOT = pathlib.Path(__file__).resolve().parents[1]

needs_native = pytest.mark.skipif(isa.native is None or not isa.native.cpu_has("avx2"),
                                  reason="the native streaming-read probe needs the built library and AVX2")


def test_bench_kernels_reports_every_op(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    run_script("bench_kernels.py", ["--presets", "tiny-llama,tiny-qwen2", "--repeats", "2", "--contexts", "16,40",
                                    "--prefill-rows", "8", "--stream-mib", "64", "--moe-presets",
                                    "tiny-qwen3-moe,tiny-deepseek-v2", "--moe-tokens", "24,40", "--json", str(out)])
    result = json.loads(out.read_text())
    assert len(result["linear"]) >= 5 and all(r["rel_err"] < 1e-2 for r in result["linear"])
    quantized = result["quantized_linear"]  # the decode linears in int8 and fp8
    assert {r["format"] for r in quantized} == {"int8", "fp8"} and all(r["rel_err"] < 1e-2 for r in quantized)
    assert all(r["tilefx_gbps"] > 0 and r["fraction_of_stream"] > 0 for r in result["linear"])
    from tilefx.custom_ops import tuning  # decode's brgemm candidate, timed where it has a compiled kernel

    assert all((r["brgemm_gbps"] or 0) > 0 for r in result["linear"]) == tuning.brgemm_has_kernel()
    ops = ["decode_attention"] * 2 + ["extend_attention"] + ["mla_attention"] * 2
    assert [r["op"] for r in result["attention"]] == ops
    assert all(r["rel_err"] < 1e-2 for r in result["attention"])  # (decode on brgemm's too, where it is timed)
    decode = [r for r in result["attention"] if r["new_tokens"] == 1]
    assert all((r["brgemm_us"] or 0) > 0 for r in decode) == tuning.brgemm_has_kernel()
    moe = result["moe"]  # each MoE preset's routed experts at one token and at two prompts, against HF's experts
    assert [(r["preset"], r["tokens"]) for r in moe] == [(p, n) for p in ("tiny-qwen3-moe", "tiny-deepseek-v2")
                                                         for n in (1, 24, 40)]
    assert all(r["rel_err"] < 1e-2 and r["tilefx_ms"] > 0 and r["hf_ms"] > 0 for r in moe)
    assert all(r["tilefx_gbps"] > 0 and r["tilefx_gflops"] > 0 for r in moe)
    # at this thread count and at one: a line through five sizes' times (a tiny preset's GEMVs take 10-60 us, so
    # a bandwidth change mid-run can tilt the line either way: its slope is reported, not its sign asserted)
    fixed = result["gemv_fixed_cost"]
    assert fixed[-1]["threads"] == 1 and all(len(r["us"]) == 5 and min(r["us"]) > 0 for r in fixed)
    assert all(math.isfinite(r["slope_gbps"]) and math.isfinite(r["fixed_us"]) for r in fixed)
    assert all(a < b for r in fixed for a, b in zip(r["bytes"], r["bytes"][1:]))
    out = capsys.readouterr().out
    assert "slowest M=1 shape" in out and "kernels per step" in out and "fixed us a call" in out
    assert result["glue"]["kernels_per_step"] > 0 and result["glue"]["inductor_us_per_step"] > 0


@needs_native
def test_stream_probe_is_one_pass_per_call(monkeypatch):
    """Each kernel pass is paired with one probe pass (the patterns alternate), not the better of two."""
    calls = []
    monkeypatch.setattr(isa.native, "stream_read_gbps", lambda buffer, streams: calls.append(streams) or 7.0)
    probe = isa.stream_probe(4)
    assert [probe() for _ in range(4)] == [7.0] * 4 and calls == [1, 2, 1, 2]


@needs_native
def test_bench_kernels_holds_packed_copies_in_huge_pages():
    """The M=1 passes read weights as the linear pass holds them: 2 MiB-aligned (THP-advised) copies."""
    cold_copies = runpy.run_path("scripts/bench_kernels.py")["cold_copies"]
    weight = torch.randn(1024, 2048).to(torch.bfloat16)
    copies = cold_copies(weight, at_least_bytes=3 * weight.nbytes, huge_pages=True)
    assert len(copies) == 3
    assert all(torch.equal(c, weight) and c.data_ptr() % (2 << 20) == 0 for c in copies)


def test_startup_warm_process_hits_the_caches_and_agrees(tmp_path):
    """Two fresh processes share one Inductor cache directory: the second loads both graphs from tilefx's
    graph cache in it (no Dynamo, no compile-cache lookups) and generates the same first token; neither compiles
    at the first generate()."""
    out = tmp_path / "startup.json"
    run_script("startup.py", ["--preset", "tiny-llama", "--json", str(out)])
    cold, warm = json.loads(out.read_text())
    assert (cold["start"], warm["start"]) == ("cold", "warm")
    assert "aot miss 2" in cold["startup"] and "loaded" not in cold["startup"], cold["startup"]
    assert "tilefx graphs loaded 2" in warm["startup"] and "miss" not in warm["startup"], warm["startup"]
    assert warm["token"] == cold["token"]
    assert cold["recompiles"] == warm["recompiles"] == 0 and cold["graphs"] == warm["graphs"] == 2


def test_bench_tpot_holds_each_weight_format_to_its_own_floor(tmp_path):
    out = tmp_path / "tpot.json"
    run_script("bench_tpot.py", ["--preset", "tiny-llama", "--modes", "tilefx", "--weights", "bf16,int8",
                                 "--runs", "1", "--prompt-len", "8", "--new-tokens", "2", "--json", str(out),
                                 "--profile", "--options", '{"recycle_buffers": false}', "--ttft-prompts", "2"])
    result = json.loads(out.read_text())
    assert result["tilefx_options"] == {"cpp_wrapper": False, "recycle_buffers": False}
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"tilefx", "tilefx int8"}
    assert rows["tilefx int8"]["decode_gb"] < 0.75 * rows["tilefx"]["decode_gb"]  # 1-byte values, fp32 scales
    assert all(r["tpot_ms"] > 0 and r["floor_ms"] > 0 for r in rows.values())
    # a run's TTFT: the least of its prompts' (the timed request's own, then a one-token request)
    for (sample,) in (r["samples"] for r in rows.values()):
        prompts = sample["ttft_prompts_ms"]
        assert len(prompts) == 2 and all(t > 0 for t in prompts) and sample["ttft_ms"] == min(prompts), sample
    # --profile: the prefill's and the decode steps' ops, tilefx's linears one row per shape with the rate their
    # weight was read at and their GFLOP/s
    for row in rows.values():
        for phase, attention in (("prefill", "tilefx::extend_attention"), ("decode", "tilefx::decode_attention")):
            window = row["profile"][phase]
            linears = [op for op in window["ops"] if op["op"].startswith("tilefx::linear ")]
            assert linears and all(op["calls"] >= 1 and op["weight_gbps"] > 0 and op["gflops"] > 0
                                   for op in linears), window
            assert any(op["op"].startswith(attention) for op in window["ops"]), window
            assert window["ms"] > 0


@pytest.mark.parametrize("options, refusal", [(["--options", "{recycle"], "is not JSON"),
                                              (["--options", "[1]"], "must be a JSON object"),
                                              (["--options", '{"weights": "int8"}'], "weights are the bench's own"),
                                              (["--ttft-prompts", "0"], "--ttft-prompts must be at least 1"),
                                              (["--new-tokens", "1"], "--new-tokens must be at least 2")])
def test_bench_tpot_refuses_bad_options(options, refusal, capsys):
    bench = runpy.run_path(str(ROOT / "scripts" / "bench_tpot.py"))
    with pytest.raises(SystemExit) as done:
        bench["main"](["--preset", "tiny-llama", *options])
    assert done.value.code == 2 and refusal in capsys.readouterr().err


def test_bench_assisted_times_prompt_lookup_on_both_modes(tmp_path):
    out = tmp_path / "assisted.json"
    run_script("bench_assisted.py", ["--preset", "tiny-llama", "--prompt-len", "24", "--new-tokens", "6",
                                     "--lookup", "3", "--runs", "1", "--verify-rounds", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {(r["mode"], r["lookup"]): r for r in result["rows"]}
    assert set(rows) == {("eager", 0), ("eager", 3), ("tilefx", 0), ("tilefx", 3)}
    assert all(r["seconds"] > 0 and 1 <= r["forwards"] <= r["tokens"] <= 6 for r in rows.values())
    assert rows["tilefx", 0]["forwards"] == rows["tilefx", 0]["tokens"]  # greedy: one forward a token
    assert sorted(int(k) for k in result["verify_seconds"]) == [1, 2, 3, 4, 5, 8, 11]


def test_profile_counts_the_weights_each_op_reads():
    """bench_tpot --profile's weight bytes: a linear's packed weight, scales and bias; fused_moe's routed experts'
    w13 and w2 with their scales, at most every expert once."""
    bench = runpy.run_path(str(ROOT / "scripts" / "bench_tpot.py"))
    bytes_of = bench["op_weight_bytes"]
    assert bytes_of("tilefx::linear", [[1, 1, 64], [4, 32, 32, 2], [4, 32]],
                    ["c10::BFloat16", "signed char", "float"]) == 4 * 32 * 32 * 2 + 4 * 32 * 4
    moe = [[1, 64], [8, 4, 32, 32, 2], [8, 2, 32, 32, 2], [1, 2], [1, 2]]
    types = ["c10::BFloat16"] * 3 + ["float", "long int"]
    per_expert = (4 + 2) * 32 * 32 * 2 * 2
    assert bytes_of("tilefx::fused_moe", moe, types) == 2 * per_expert
    assert bytes_of("tilefx::fused_moe", moe[:3] + [[16, 2], [16, 2]], types) == 8 * per_expert  # every expert once
    assert bytes_of("tilefx::decode_attention", moe, types) == 0


def test_profile_counts_the_flops_of_each_op():
    """bench_tpot --profile's GFLOP/s: a linear's rows times its whole weight (int4: two a byte); fused_moe's routed
    rows each times one expert's w13 and w2."""
    bench = runpy.run_path(str(ROOT / "scripts" / "bench_tpot.py"))
    flops = bench["op_flops"]
    weight = [4, 32, 32, 2]  # N 128 x K 64
    assert flops("tilefx::linear", [[1, 5, 64], weight], ["c10::BFloat16"] * 2) == 2 * 5 * 128 * 64
    assert flops("tilefx::linear", [[5, 64], [4, 32, 32, 1], [4, 2]],
                 ["c10::BFloat16", "unsigned char", "float"]) == 2 * 5 * 128 * 64
    moe = [[16, 64], [8, 4, 32, 32, 2], [8, 2, 32, 32, 2], [16, 2], [16, 2]]
    types = ["c10::BFloat16"] * 3 + ["float", "long int"]
    assert flops("tilefx::fused_moe", moe, types) == 2 * 16 * 2 * (4 + 2) * 32 * 32 * 2
    assert flops("tilefx::extend_attention", moe, types) == 0 and flops("tilefx::linear", moe, []) == 0


def test_amx_checks_runs_the_steps_asked_and_refuses_unknown_ones(tmp_path):
    """scripts/amx_checks.sh, the battery an AMX lease runs: a step's log and its status line; an unknown step
    refused before any step runs; a step past the budget skipped, not started."""
    def run(*args):
        return subprocess.run(["bash", "scripts/amx_checks.sh", str(tmp_path), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})

    done = run("60", "cpu,exceptions")
    assert done.returncode == 0, done.stderr
    assert "## cpu: exit 0" in done.stdout and "## exceptions: exit 0" in done.stdout, done.stdout
    assert "cache L1 Data" in (tmp_path / "cpu.log").read_text()
    if isa.native is not None:  # a C++ exception reaches Python here (it killed the process on two AMX machines)
        assert "tilefx: its C++ exception reached Python" in (tmp_path / "exceptions.log").read_text()
    refused = run("60", "cpu,nosuch")
    assert refused.returncode == 2 and "unknown step 'nosuch'" in refused.stderr and "## cpu" not in refused.stdout
    skipped = run("10", "tpot1024")
    assert skipped.returncode == 0 and "## tpot1024: skipped" in skipped.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ldd, ldconfig and LD_PRELOAD are Linux's")
def test_amx_checks_diagnoses_a_throw_that_kills_the_process(tmp_path):
    """Where the exception check dies (as on two AMX machines), the step says what the throw ran through and runs the
    check again with the GNU unwinder preloaded. A Python that dies on the check unless something is preloaded
    stands in for such a machine."""
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\nif [[ $1 == - && -z ${{LD_PRELOAD:-}} ]]; then kill -SEGV $$; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    done = subprocess.run(["bash", "scripts/amx_checks.sh", str(tmp_path / "out"), "60", "exceptions"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": str(python)})
    log = (tmp_path / "out" / "exceptions.log").read_text()
    assert "## exceptions: exit 139" in done.stdout, done.stdout
    assert "the check exited 139" in log and f"python {sys.version.split()[0]}" in log, log
    assert "again with LD_PRELOAD=" in log and "torch: its C++ exception reached Python" in log, log
