"""Requests through the engine: stops, sampling, logprobs, abort, bad input, detokenization, stats."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.checkpoint.store import hf_greedy_tokens
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import stop_prefix_length
from tests.engine.test_engine_greedy import hf_greedy, random_prompts

CONFIG = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_model_len=128, dtype="float32")

pytestmark = pytest.mark.usefixtures("engine_is_clean_after")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **CONFIG)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


def run_to_end(engine: LLMEngine, max_steps: int = 500) -> dict:
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("engine did not finish")


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompts([9], seed=11)[0]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_token = full.token_ids[4]
    first = full.token_ids.index(stop_token)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first + 1]


def test_stop_string_truncates_text(llm):
    prompt = "The weather today is"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop, "zzzz-never"]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]


def test_streamed_text_never_shows_what_a_stop_string_cuts(llm):
    """Every step's text is a prefix of the finished text: the start of a stop string that spans
    tokens is held back until the next token shows whether it completes (the stop is cut with it)."""
    prompt = "The weather today is"

    def stream(request_id: str, **params) -> list:
        engine, seen = llm.engine, []
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=24, **params))
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            seen += [out.outputs[0] for out in engine.step() if out.request_id == request_id]
        return seen

    steps = stream("no-stop")
    text, ends = steps[-1].text, [len(step.text) for step in steps]  # where each token's text ends

    def spans_tokens(stop: str) -> bool:  # its first occurrence begins in one token's text and ends in another's
        start = text.index(stop)
        return any(start < end < start + len(stop) for end in ends)

    candidates = [text[end - 1 : end + 2] for end in ends[1:] if end < len(text) - 2]
    stop = next(c for c in candidates if spans_tokens(c))
    seen = stream("stop", stop=[stop, stop[0] + "never-this"])
    final = seen[-1]
    assert final.finish_reason == "stop" and final.text == text[: text.index(stop)]
    assert all(final.text.startswith(step.text) for step in seen), [step.text for step in seen]


def test_stop_prefix_length_is_the_longest_end_that_begins_a_stop():
    assert stop_prefix_length("1, 2, 3,", [", 7"]) == 1
    assert stop_prefix_length("1, 2, 3, ", [", 7", "3, 9"]) == 3
    assert stop_prefix_length("abc", ["x", "bcd"]) == 2
    assert stop_prefix_length("abc", ["abc"]) == 0  # a whole stop string is the stop itself, not a prefix
    assert stop_prefix_length("", [", 7"]) == 0


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    prompts = random_prompts([4, 12], seed=12)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    top_k = llm.generate(prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=8, seed=1))
    top_p = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=8, seed=2))
    assert [o.outputs[0].token_ids for o in top_k] == greedy
    assert [o.outputs[0].token_ids for o in top_p] == greedy


def test_seeded_sampling_is_reproducible_alone_or_in_batch(llm):
    prompts = random_prompts([5, 9, 14], seed=13)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=1234)
    alone = llm.generate([prompts[1]], params)[0].outputs[0].token_ids
    batch = llm.generate(
        prompts,
        [SamplingParams(temperature=1.0, max_tokens=10), params, SamplingParams(temperature=0.7, max_tokens=10)],
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate([prompts[1]], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=99))
    assert other_seed[0].outputs[0].token_ids != alone


def test_repetition_penalty_equals_hf(llm, tiny_llama_dir, hf_model):
    prompt = random_prompts([7], seed=14)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5))[0].outputs[0]
    assert out.token_ids == hf_greedy_tokens(hf_model, [prompt], 10, repetition_penalty=1.5)[0]


def test_logprobs_match_hf_scores(llm, hf_model):
    prompt = random_prompts([6], seed=15)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    ids = torch.tensor([prompt])
    ref = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=2,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert len(out.logprobs) == 5
    for token, entry, scores in zip(out.token_ids, out.logprobs, ref.scores):
        expected = torch.log_softmax(scores[0].float(), dim=-1)
        assert len(entry) == 3 and token in entry
        assert math.isclose(entry[token], float(expected[token]), abs_tol=1e-4)
        assert entry[token] == max(entry.values())


def test_bad_requests_fail_alone_while_others_finish(llm, tiny_llama_dir):
    engine = llm.engine
    prompts = random_prompts([6, 10], seed=16)
    reference = hf_greedy(tiny_llama_dir, prompts, 8)
    good = [
        engine.add_request(f"good-{i}", p, SamplingParams(temperature=0, max_tokens=8)) for i, p in enumerate(prompts)
    ]
    engine.step()
    too_long = list(range(5, 5 + CONFIG["max_model_len"] + 1))
    bad = [
        (lambda: engine.add_request("b1", "", None), "prompt"),
        (lambda: engine.add_request("b2", [], None), "prompt"),
        (lambda: engine.add_request("b3", too_long, None), "max_model_len"),
        (lambda: engine.add_request("b4", [5], SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda: engine.add_request("b5", [5], SamplingParams(temperature=-0.5)), "temperature"),
        (lambda: engine.add_request("b6", [5], SamplingParams(top_p=0.0)), "top_p"),
        (lambda: engine.add_request("b7", [5], SamplingParams(top_p=1.5)), "top_p"),
        (lambda: engine.add_request("b8", [5], SamplingParams(stop=5)), "stop"),
        (lambda: engine.add_request("good-0", [5], None), "request_id"),
    ]
    for call, field in bad:
        with pytest.raises(ValueError, match=field):
            call()
    finals = run_to_end(engine)
    assert [finals[g].outputs[0].token_ids for g in good] == reference
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_model_len=4096, max_num_batched_tokens=1024, enable_chunked_prefill=False)


def test_abort_midway_frees_blocks_and_after_finish_is_noop(llm, tiny_llama_dir):
    engine = llm.engine
    prompts = random_prompts([20, 8], seed=17)
    reference = hf_greedy(tiny_llama_dir, prompts[1:], 6)
    engine.add_request("victim", prompts[0], SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("keeper", prompts[1], SamplingParams(temperature=0, max_tokens=6))
    for _ in range(3):
        engine.step()
    used_before = engine.block_manager.num_used_blocks
    victim_blocks = len(engine.requests["victim"].block_table)
    (aborted,) = engine.abort_request("victim")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == used_before - victim_blocks
    engine.check_invariants()
    finals = run_to_end(engine)
    assert finals["keeper"].outputs[0].token_ids == reference[0]
    assert engine.abort_request(["keeper", "victim", "unknown"]) == []


def test_exact_block_multiple_prompt_fully_cached(llm, tiny_llama_dir):
    prompt = random_prompts([16], seed=18)[0]  # 4 full blocks of 4
    reference = hf_greedy(tiny_llama_dir, [prompt], 6)[0]
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0]
    second = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 12  # 3 of 4 blocks: the last prompt token is always recomputed
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == reference


def test_prefix_ending_mid_block_is_copied_from_a_running_request(llm, tiny_llama_dir):
    shared = random_prompts([10], seed=21)[0]  # 2 full blocks of 4, then 2 tokens of a third
    prompts = [shared + tail for tail in random_prompts([3, 5, 4], seed=22)]
    reference = hf_greedy(tiny_llama_dir, prompts, 6)
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    copies = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        copies.extend(out.kv_copies)
        return out

    engine.scheduler.schedule = recording
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    finally:
        engine.scheduler.schedule = schedule
    # the first computes the prefix; the others hit its 2 blocks and copy the 2 tokens past them
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 10, 10]
    assert [n for _, _, n in copies] == [2, 2]
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_forced_hash_collision_keeps_outputs_correct(llm, tiny_llama_dir):
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    engine.block_manager.hash_fn = lambda parent, tokens: 7  # every block collides
    try:
        prompts = random_prompts([13, 13], seed=19)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama_dir, prompts, 6)
        assert all(o.metrics.num_cached_tokens == 0 for o in outs)
    finally:
        engine.block_manager.reset_prefix_cache()
        engine.block_manager.hash_fn = type(engine.block_manager)(1, 1).hash_fn


def test_chat_template_and_stats(llm):
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=4), chat=True)[0]
    expected = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=True
    )
    assert out.prompt_token_ids == list(expected)
    assert out.metrics.ttft_s is not None and out.metrics.ttft_s >= 0
    assert out.metrics.tpot_s is not None and out.metrics.tpot_s >= 0
    stats = llm.engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert stats.num_generation_tokens_total >= 4 and stats.num_requests_finished_total >= 1


def test_incremental_detokenization_never_splits_characters(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = "Grüße aus Köln 🌍🚀 — 世界你好, naïve café ✓"
    prompt = tok("Say:").input_ids
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_token(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    assert any(d == "" for d in deltas)  # some tokens were held back (partial UTF-8)


@pytest.mark.parametrize("clean_up", [True, False])
def test_detokenizer_window_decode_equals_tokenizer_decode(tiny_llama_dir, clean_up):
    """The fast path (the Rust tokenizer called directly) gives tokenizer.decode's text, clean-up included."""
    import random

    from transformers import AutoTokenizer

    from engine.detokenizer import _window_decoder

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.clean_up_tokenization_spaces = clean_up
    decode = _window_decoder(tok)
    rng = random.Random(0)
    ids = tok("Hello , world ! It 's a test . Isn 't it ? n't 'm 've 're", add_special_tokens=False).input_ids
    windows = [ids] + [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(200)]
    for window in windows:
        assert decode(window) == tok.decode(window, skip_special_tokens=True)


def test_unsupported_architecture_is_named_with_the_supported_ones(gpt2_like_dir):
    from engine.checkpoint.store import CheckpointError

    with pytest.raises(CheckpointError, match="gpt2.*llama"):
        LLM(str(gpt2_like_dir), **CONFIG)


def test_cli_generate_uses_the_engine(tiny_llama_dir, capsys):
    from lmforge_cli import main

    prompt = "Once upon a time"
    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", prompt, "--max-tokens", "5"]) == 0
    engine_text = capsys.readouterr().out.rstrip("\n")
    assert (
        main(["generate", "--model", str(tiny_llama_dir), "--prompt", prompt, "--max-tokens", "5", "--backend", "hf"])
        == 0
    )
    hf_text = capsys.readouterr().out.rstrip("\n")
    assert engine_text == hf_text
    assert (
        main(["generate", "--model", str(tiny_llama_dir), "--prompt", prompt, "--top-p", "1.5"]) == 2
    )  # a usage error, as docs/cli.md documents
    assert "top_p" in capsys.readouterr().err


def test_auto_dtype_is_bf16_where_the_cpu_has_it(tiny_llama_dir, tmp_path):
    from engine.config import CPU_BF16_FLAGS, cpu_flags
    from engine.platform import cpu_vendor

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile\n")
    assert {"amx_bf16", "avx512f"} <= cpu_flags(str(info))
    assert cpu_vendor(str(info)) == "AuthenticAMD" and cpu_vendor(str(tmp_path / "missing")) == ""
    assert cpu_flags(str(tmp_path / "missing")) == set()
    config = {k: v for k, v in CONFIG.items() if k != "dtype"}
    llm = LLM(str(tiny_llama_dir), **config)
    expected = "bfloat16" if cpu_flags() & set(CPU_BF16_FLAGS) else "float32"
    assert llm.engine.config.dtype == expected
    assert llm.engine.runner.kv_cache.dtype == getattr(torch, expected)
    assert LLM(str(tiny_llama_dir), **CONFIG).engine.runner.kv_cache.dtype == torch.float32
