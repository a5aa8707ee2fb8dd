"""The benchmark scripts run end to end on a tiny preset and report correct kernels (timings are not checked)."""

from __future__ import annotations

import json

from helpers import run_script


def test_bench_kernels_reports_every_op(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    run_script("bench_kernels.py", ["--presets", "tiny-llama,tiny-qwen2", "--repeats", "2", "--contexts", "16,40",
                                    "--prefill-rows", "8", "--stream-mib", "64", "--json", str(out)])
    result = json.loads(out.read_text())
    assert len(result["linear"]) >= 5 and all(r["rel_err"] < 1e-2 for r in result["linear"])
    assert all(r["tilefx_gbps"] > 0 and r["fraction_of_stream"] > 0 for r in result["linear"])
    assert [r["op"] for r in result["attention"]] == ["decode_attention"] * 2 + ["extend_attention"]
    assert all(r["rel_err"] < 1e-2 for r in result["attention"])
    out = capsys.readouterr().out
    assert "slowest M=1 shape" in out and "kernels per step" in out
    assert result["glue"]["kernels_per_step"] > 0 and result["glue"]["inductor_us_per_step"] > 0
