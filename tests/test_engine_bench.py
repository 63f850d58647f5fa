"""The engine benchmark's metric code, workload, and one tiny-model run of the harness (--smoke)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bound import ModelShape, percentile, ratio, workload_flops
from bench.engine_backends import left_pad
from bench.engine_bench import engine_targets, parse_engine_args, summarize, token_agreement

ROOT = Path(__file__).resolve().parent.parent

SMOLLM2_CONFIG = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "vocab_size": 49152, "head_dim": 64}


def test_layer_params_of_smollm2_match_its_weights():
    shape = ModelShape.from_config(SMOLLM2_CONFIG)
    # q, o: 576x576; k, v: 576x192; gate, up, down: 576x1536
    assert shape.layer_matmul_params == 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 == 3_538_944
    assert shape.lm_head_flops == 2 * 576 * 49152


def test_workload_flops_equals_token_by_token_sum():
    shape = ModelShape.from_config({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100})
    prompt_lens, system_of, shared, max_tokens = [10, 12, 9, 7], [0, 0, 1, 1], [8, 5], 4
    expected = sum(shape.body_flops(pos + 1) for s in shared for pos in range(s))
    for n, s in zip(prompt_lens, system_of):
        expected += sum(shape.body_flops(pos + 1) for pos in range(shared[s], n + max_tokens - 1))
        expected += max_tokens * shape.lm_head_flops
    assert workload_flops(shape, prompt_lens, max_tokens, shared, system_of) == expected
    # sharing the prefix saves exactly the prefix work of the requests after the first
    unshared = workload_flops(shape, prompt_lens, max_tokens, [0, 0], system_of)
    assert unshared - expected == sum(shape.body_flops(p + 1) for p in range(8)) + sum(shape.body_flops(p + 1) for p in range(5))
    with pytest.raises(ValueError, match="longer than a prompt"):
        workload_flops(shape, [4], 2, [5], [0])


def test_percentile_ratio_agreement():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([], 50) is None
    assert ratio(10.0, 4.0) == 2.5 and ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    assert token_agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 0.5
    assert parse_engine_args(["max_num_seqs=64", "dtype=float32"]) == {"max_num_seqs": 64, "dtype": "float32"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_engine_args(["max_num_seqs"])


def test_summary_ratios_and_targets():
    def ok(name, tokens, seconds, ttft, hit=None):
        return {"config": name, "status": "ok", "output_tokens": tokens, "elapsed_s": seconds, "ttft_s": ttft,
                "peak_rss_bytes": 2**20, "prefix_hit_rate": hit, "token_ids": [[1, 2]]}

    rows = summarize([ok("hf_sequential", 100, 10.0, [1.0]), ok("hf_static", 100, 4.0, [2.0]),
                      {"config": "llama_cpp", "status": "not installed", "reason": "x"},
                      ok("engine_prefix_off", 100, 1.0, [0.4], 0.0), ok("engine_prefix_on", 100, 0.5, [0.1], 0.9)], bound_tok_s=400.0)
    on = rows[-1]
    assert on.output_tok_s == 200.0 and on.speedup["hf_static"] == 8.0 and on.speedup["llama_cpp"] is None
    assert on.fraction_of_bound == 0.5 and on.same_tokens_as_hf == 1.0 and on.peak_rss_mib == 1.0
    targets = {w: v for w, v, _ in engine_targets(rows)}
    assert targets["TTFT p50 on / off"] == pytest.approx(0.25) and targets["prefix hit rate"] == 0.9


def test_left_pad_puts_prompts_at_the_right_edge():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_workload_is_deterministic_and_shares_the_system_prompt(tiny_llama_dir):
    from transformers import AutoTokenizer

    from bench.workload import WorkloadError, build_workload

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    a = build_workload(tokenizer, num_requests=8, max_tokens=4, num_systems=2)
    b = build_workload(tokenizer, num_requests=8, max_tokens=4, num_systems=2)
    assert a.prompts == b.prompts and len(set(a.questions)) == 8 and a.system_of == [0, 1] * 4
    assert all(130 <= n < min(a.prompt_lens) for n in a.shared_prefix_lens)
    with pytest.raises(WorkloadError, match="num_systems"):
        build_workload(tokenizer, num_requests=2, num_systems=3)


def test_smoke_run_of_the_harness(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "lmforge_cli", "bench", "engine", "--model", str(tiny_llama_dir), "--smoke",
           "--configs", "hf_sequential,hf_static,engine_prefix_on", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert report["workload"]["num_requests"] == 4 and report["bound"]["output_tok_s"] > 0
    for name in ("hf_sequential", "hf_static"):
        assert rows[name]["status"] == "ok", rows[name]["reason"]
        assert rows[name]["output_tok_s"] > 0 and rows[name]["ttft_p50_ms"] > 0 and rows[name]["peak_rss_mib"] > 50
    assert rows["hf_sequential"]["same_tokens_as_hf"] == 1.0
    engine = rows["engine_prefix_on"]
    assert engine["status"] == "ok", engine["reason"]
    assert engine["same_tokens_as_hf"] == 1.0  # greedy engine tokens equal HF generate's
    assert 0.5 < engine["prefix_hit_rate"] < 1.0  # the first request misses, the other three hit the system prompt
    assert engine["speedup"]["hf_static"] > 0 and engine["fraction_of_bound"] > 0
    assert rows["hf_static"]["speedup"]["hf_sequential"] > 0
    assert "hf_static" in proc.stdout and "compute bound" in proc.stdout
