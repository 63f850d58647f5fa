"""The engine benchmark's metric code, workload, and one tiny-model run of the harness (--smoke)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.engine_bench
from bench.bound import ratio, workload_flops
from bench.engine_backends import BACKENDS, left_pad
from bench.engine_bench import find_int8, parse_configs, parse_engine_args
from bench.engine_bench_report import (
    engine_targets,
    median_results,
    round_order,
    round_targets,
    summarize,
    summarize_single,
    token_agreement,
)
from bench.harness import percentiles
from engine.checkpoint.model_spec import ModelSpec
from engine.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]

SMOLLM2_CONFIG = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "head_dim": 64,
}


def test_layer_params_of_smollm2_match_its_weights():
    shape = ModelSpec.from_config(SMOLLM2_CONFIG)
    # q, o: 576x576; k, v: 576x192; gate, up, down: 576x1536
    assert shape.layer_matmul_params == 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 == 3_538_944
    assert shape.lm_head_flops == 2 * 576 * 49152


def test_workload_flops_equals_token_by_token_sum():
    shape = ModelSpec.from_config(
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 100,
        }
    )
    prompt_lens, system_of, shared, max_tokens = [10, 12, 9, 7], [0, 0, 1, 1], [8, 5], 4
    expected = sum(shape.body_flops(pos + 1) for s in shared for pos in range(s))
    for n, s in zip(prompt_lens, system_of):
        expected += sum(shape.body_flops(pos + 1) for pos in range(shared[s], n + max_tokens - 1))
        expected += max_tokens * shape.lm_head_flops
    assert workload_flops(shape, prompt_lens, max_tokens, shared, system_of) == expected
    # sharing the prefix saves exactly the prefix work of the requests after the first
    unshared = workload_flops(shape, prompt_lens, max_tokens, [0, 0], system_of)
    assert unshared - expected == sum(shape.body_flops(p + 1) for p in range(8)) + sum(
        shape.body_flops(p + 1) for p in range(5)
    )
    with pytest.raises(ValueError, match="longer than a prompt"):
        workload_flops(shape, [4], 2, [5], [0])


def test_percentile_ratio_agreement():
    assert percentiles([3.0, 1.0, 2.0, 4.0], (50,)) == {"p50": 2.5}
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0], (99,))["p99"] == pytest.approx(4.96)
    assert percentiles([], (50, 99.9)) == {"p50": None, "p99_9": None}
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentiles([1.0], (101,))
    assert ratio(10.0, 4.0) == 2.5 and ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    assert token_agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 0.5
    assert parse_engine_args(["max_num_seqs=64", "dtype=float32"]) == {"max_num_seqs": 64, "dtype": "float32"}
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_engine_args(["max_num_seqs"])
    with pytest.raises(UsageError, match="'bogus' is not an EngineConfig field; use one of .*max_num_seqs"):
        parse_engine_args(["bogus=3"])


def test_summary_ratios_bound_per_dtype_and_targets():
    def ok(name, tokens, seconds, ttft, hit=None, single=None):
        return {
            "config": name,
            "status": "ok",
            "output_tokens": tokens,
            "elapsed_s": seconds,
            "ttft_s": ttft,
            "startup_s": 2.0,
            "peak_rss_bytes": 2**20,
            "prefix_hit_rate": hit,
            "token_ids": [[1, 2]],
            "single": single,
        }

    def one(seconds, ttft, tokens=(5, 6, 7, 8, 9)):
        return {"elapsed_s": seconds, "ttft_s": ttft, "token_ids": list(tokens)}

    results = [
        ok("hf_sequential", 100, 10.0, [1.0], single=one(1.0, 0.2)),
        ok("hf_static", 100, 4.0, [2.0]),
        {
            "config": "llama_cpp_server_f32",
            "status": "not installed",
            "reason": "llama-server not installed: run `make peers`",
        },
        ok("llama_cpp_server_q8_0", 100, 2.0, [0.5]),
        ok("vllm_fp32", 100, 1.0, [0.2, 0.4], single=one(0.5, 0.1)),
        ok("vllm_bf16", 100, 0.5, [0.1], single=one(0.25, 0.05)),
        ok("engine_prefix_off", 100, 1.0, [0.4], 0.0),
        ok("engine_fp32", 100, 0.5, [0.1, 0.3], 0.9, single=one(0.25, 0.05)),
        ok("engine_bf16", 100, 0.25, [0.05], 0.9, single=one(0.5, 0.1, (5, 6, 7, 8, 0))),
        ok("engine_int8", 100, 0.2, [0.05], 0.9),
    ]
    bound = {"fp32": 400.0, "bf16": 800.0, "int8": 1000.0}
    rows = {r.config: r for r in summarize(results, bound)}
    fp32, bf16, int8 = rows["engine_fp32"], rows["engine_bf16"], rows["engine_int8"]
    assert fp32.output_tok_s == 200.0 and fp32.speedup["hf_static"] == 8.0 and fp32.speedup["vllm_fp32"] == 2.0
    assert fp32.speedup["llama_cpp_best"] == 4.0  # the Q8_0 row, the only llama.cpp row that ran
    # each row against the bound of the dtype it runs
    assert fp32.fraction_of_bound == 0.5 and bf16.fraction_of_bound == 0.5 and int8.fraction_of_bound == 0.5
    assert rows["llama_cpp_server_q8_0"].dtype == "int8" and rows["llama_cpp_server_q8_0"].fraction_of_bound == 0.05
    assert fp32.same_tokens_as_hf == 1.0 and fp32.peak_rss_mib == 1.0 and fp32.startup_s == 2.0
    assert rows["llama_cpp_server_f32"].status == "not installed" and rows["llama_cpp_server_f32"].output_tok_s is None

    singles = {s.config: s for s in summarize_single(results)}
    assert set(singles) == {
        "hf_sequential_single",
        "vllm_fp32_single",
        "vllm_bf16_single",
        "engine_fp32_single",
        "engine_bf16_single",
    }
    e = singles["engine_fp32_single"]
    assert e.output_tok_s == 20.0 and e.ttft_ms == pytest.approx(50.0) and e.decode_tok_s == pytest.approx(4 / 0.2)
    assert e.speedup_vllm == 2.0 and e.same_tokens_as_hf is True
    assert (
        singles["engine_bf16_single"].speedup_vllm == 0.5 and singles["engine_bf16_single"].same_tokens_as_hf is False
    )

    targets = {w: (v, t) for w, v, t in engine_targets(list(rows.values()), list(singles.values()))}
    assert targets["engine_fp32 / vllm_fp32 output tok/s"] == (2.0, ">= 1.0")
    assert targets["engine_bf16 / vllm_bf16 output tok/s"] == (2.0, ">= 1.2")
    assert targets["engine_int8 / vllm_bf16 output tok/s"] == (2.5, ">= 1.5")
    assert targets["engine_int8 (fastest engine row) / best llama.cpp GGUF"] == (10.0, ">= 3")
    assert targets["engine_fp32 / vllm_fp32 TTFT p99"][0] == pytest.approx(0.298 / 0.398)
    assert targets["engine_bf16_single / vllm_bf16_single tok/s"] == (0.5, ">= 1.0")
    assert targets["engine_fp32 / engine_prefix_off TTFT p50"][0] == pytest.approx(0.5)
    assert targets["engine_fp32 start-up s"] == (2.0, "<= 10")


def test_rounds_alternate_the_order_and_report_medians():
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"] and round_order(["a", "b", "c"], 1) == ["c", "b", "a"]

    def run(config, seconds):
        if seconds is None:
            return {"config": config, "status": "failed", "reason": "timed out"}
        return {"config": config, "status": "ok", "output_tokens": 100, "elapsed_s": seconds}

    rounds = [
        [run("engine_int8", 0.5), run("vllm_bf16", 1.0)],
        [run("engine_int8", None), run("vllm_bf16", 2.0)],
        [run("engine_int8", 0.25), run("vllm_bf16", 0.5)],
    ]
    # per configuration its median round by tok/s; a failed round ranks lowest
    assert [r["elapsed_s"] for r in median_results(rounds)] == [0.5, 1.0]
    per_round = [
        [("engine_int8 / vllm_bf16 output tok/s", 2.0, ">= 1.5"), ("x", 1.0, ">= 1")],
        [("engine_int8 / vllm_bf16 output tok/s", None, ">= 1.5")],
        [("engine_int8 / vllm_bf16 output tok/s", 1.0, ">= 1.5"), ("x", 3.0, ">= 1")],
    ]
    # the median of the ratios measured within each round, over the rounds that measured it
    assert round_targets(per_round) == [("engine_int8 / vllm_bf16 output tok/s", 1.5, ">= 1.5"), ("x", 2.0, ">= 1")]


def test_configuration_names():
    assert parse_configs(" engine_fp32,vllm_bf16 ,engine_fp32,") == ["engine_fp32", "vllm_bf16"]
    names = set(parse_configs(",".join(BACKENDS)))
    assert {
        "engine_fp32",
        "engine_bf16",
        "engine_bf16_kv8",
        "engine_int8",
        "engine_prefix_off",
        "vllm_fp32",
        "vllm_bf16",
        "llama_cpp_server_f32",
        "llama_cpp_server_q8_0",
        "hf_sequential",
        "hf_static",
    } <= names
    assert {BACKENDS[c].dtype for c in ("engine_bf16", "engine_bf16_kv8", "vllm_bf16")} == {"bf16"}
    assert BACKENDS["llama_cpp_server_q8_0"].gguf_type == "q8_0" and BACKENDS["vllm_fp32"].interpreter == "vllm"
    with pytest.raises(ValueError, match="unknown engine_prefix_on; choose from"):
        parse_configs("engine_prefix_on")
    with pytest.raises(ValueError, match="empty"):
        parse_configs(" , ")


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
    long = build_workload(tokenizer, num_requests=4, max_tokens=4, user_tokens=870)  # ~1,024-token prompts
    assert all(1000 <= n <= 1150 for n in long.prompt_lens), long.prompt_lens
    assert len(set(map(tuple, long.prompts))) == 4 and long.shared_prefix_lens[0] >= 130


def test_single_prompts_share_no_prefix_block(tiny_llama_dir):
    from transformers import AutoTokenizer

    from bench.workload import WorkloadError, single_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = single_prompts(tokenizer, 160, 3)
    assert len(prompts) == 3 and all(len(p) == 160 for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 3  # each repeat prefills from a cold prefix cache
    assert single_prompts(tokenizer, 160, 1) == prompts[:1]
    assert len(single_prompts(tokenizer, 2_000, 50)) < 50  # as many as the corpus holds
    with pytest.raises(WorkloadError, match="count=0"):
        single_prompts(tokenizer, 160, 0)


def test_user_turns_stay_distinct_past_the_corpus_and_serving_runs_never_repeat_a_prompt(tiny_llama_dir):
    """The served load sends each prompt once: a repeat would be answered from the prefix cache."""
    from transformers import AutoTokenizer

    from bench.serving_profile import prompts_needed
    from bench.workload import load_questions, user_turns

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    count = len(load_questions()) + 50
    turns = user_turns(tokenizer, count)
    assert len(set(turns)) == count
    assert prompts_needed([4, 16, 64], 3) == 4 * 4 + 16 * 4 + 64 * 4  # a warm-up request per stream, then 3


def test_smoke_run_of_the_harness(tiny_llama_dir, tmp_path, lmforge):
    out = tmp_path / "bench.json"
    configs = "hf_sequential,hf_static,engine_fp32"
    smoke = ("--model", tiny_llama_dir, "--smoke", "--configs", configs, "--rounds", 2)
    proc = lmforge("bench", "engine", *smoke, "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert report["workload"]["num_requests"] == 4 and report["bound"]["output_tok_s"]["fp32"] > 0
    for name in ("hf_sequential", "hf_static"):
        assert rows[name]["status"] == "ok", rows[name]["reason"]
        assert rows[name]["output_tok_s"] > 0 and rows[name]["ttft_p50_ms"] > 0 and rows[name]["peak_rss_mib"] > 50
    assert rows["hf_sequential"]["same_tokens_as_hf"] == 1.0
    engine = rows["engine_fp32"]
    assert engine["status"] == "ok", engine["reason"]
    assert engine["same_tokens_as_hf"] == 1.0  # greedy engine tokens equal HF generate's
    assert 0.5 < engine["prefix_hit_rate"] < 1.0  # the first request misses, the other three hit the system prompt
    assert engine["speedup"]["hf_static"] > 0 and engine["fraction_of_bound"] > 0
    assert rows["hf_static"]["speedup"]["hf_sequential"] > 0
    assert engine["startup_s"] > 0 and engine["dtype"] == "fp32"
    singles = {r["config"]: r for r in report["single_rows"]}
    assert set(singles) == {"hf_sequential_single", "engine_fp32_single"}
    assert singles["engine_fp32_single"]["same_tokens_as_hf"] is True
    assert report["single"]["repeats"] == 3  # --single-repeats' default: three prompts alone, the median one shown
    assert set(report["bound"]["output_tok_s"]) == {"fp32", "bf16", "int8"}
    assert "hf_static" in proc.stdout and "compute bound" in proc.stdout and "one request alone" in proc.stdout
    # two rounds, the second in the reverse order, each configuration's tok/s in each
    assert len(report["rounds"]) == 2 and all(set(r["output_tok_s"]) == set(rows) for r in report["rounds"])
    assert "round 2/2 hf_sequential" in proc.stdout and "per round" in proc.stdout
    assert proc.stdout.index("round 2/2 engine_fp32") < proc.stdout.index("round 2/2 hf_sequential")


def test_spec_bench_compares_tokens_repeat_by_repeat_and_filters_the_corpus(tmp_path):
    """``same_tokens`` pairs each repeat with off's same repeat (same prefix-cache state); the ngram corpus
    leaves out records whose user turn is a benchmark prompt."""
    from types import SimpleNamespace

    from bench.spec_bench import measure, ngram_corpus

    class FakeLLM:
        """Greedy tokens per repeat (cold, then warm); stats that never move."""

        def __init__(self, runs):
            self.runs = iter(runs)
            stats = SimpleNamespace(
                spec_decode_num_drafts_total=0,
                spec_decode_num_draft_tokens_total=0,
                spec_decode_num_accepted_tokens_total=0,
            )
            self.engine = SimpleNamespace(get_stats=lambda: stats)

        def generate(self, batch, params):
            tokens = next(self.runs)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=t)]) for t in tokens]

    cold, warm = [[1, 2], [3, 4]], [[1, 2], [3, 5]]  # a near tie flips once the prefix cache is warm
    engines = {"off": FakeLLM([cold, warm]), "ngram": FakeLLM([cold, warm])}
    rows = measure(engines, [[0, 0]], None, 2, dict(dtype="bfloat16", prompts="chat", concurrency=2))
    assert [r.same_tokens for r in rows] == [1.0, 1.0]

    corpus = tmp_path / "teacher_generated.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]}) + "\n"
            for q in ("held out", "train one", "train two")
        )
    )
    args = SimpleNamespace(spec_ngram_corpus="auto")
    path, note = ngram_corpus(args, tmp_path / "final", {"held out"}, tmp_path)
    assert len(path.read_text().splitlines()) == 2 and "1 with a benchmark prompt left out" in note
    args.spec_ngram_corpus = "none"
    assert ngram_corpus(args, tmp_path / "final", set(), tmp_path)[0] is None


def test_the_default_int8_row_quantizes_the_lm_head_too_as_the_peers_8_bit_rows_do(monkeypatch, tmp_path):
    calls = []

    def quantize(model_dir, out, *, method, **config):
        calls.append((model_dir, out, method, config))
        return out

    monkeypatch.setattr(bench.engine_bench, "quantize", quantize)
    path, note = find_int8(None, tmp_path / "model", tmp_path / "work")
    assert calls == [
        (tmp_path / "model", tmp_path / "work" / "int8-w8a8", "w8a8", {"skip_modules": (), "outlier_channels": 32})
    ]
    assert path == str(tmp_path / "work" / "int8-w8a8") and "LM head INT8" in note
    assert find_int8("given-dir", tmp_path, tmp_path) == ("given-dir", "given: given-dir") and len(calls) == 1
