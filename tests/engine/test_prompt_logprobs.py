"""Prompt logprobs equal Hugging Face's float32 log-softmax of the same prompt, prefix cache or not.

Oracle: ``log_softmax(model(prompt).logits)`` of ``transformers`` in float32; entry ``i`` of the
engine's ``prompt_logprobs`` scores prompt token ``i`` from the logits at position ``i - 1``
(``None`` for the first token, as vLLM).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_engine_greedy import random_prompts

CONFIG = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_model_len=256, dtype="float32")
TOP_K = 3


def hf_prompt_logprobs(model, prompt: list[int], k: int) -> list[dict[int, float] | None]:
    """Per prompt token: {token: logprob, top-k alternatives...}; ``None`` first."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()  # [T, vocab]
    logprobs = torch.log_softmax(logits, dim=-1)
    entries: list[dict[int, float] | None] = [None]
    for i, token in enumerate(prompt[1:]):
        entry = {token: float(logprobs[i, token])}
        values, ids = torch.topk(logprobs[i], k)
        entry.update(zip(ids.tolist(), values.tolist()))
        entries.append(entry)
    return entries


def assert_same(engine_entries, reference, atol: float = 1e-4) -> None:
    assert len(engine_entries) == len(reference)
    assert engine_entries[0] is None
    for got, want in zip(engine_entries[1:], reference[1:]):
        assert list(got) == list(want)  # same prompt token first, then the same top-k ids in order
        assert all(abs(got[t] - want[t]) <= atol for t in want), (got, want)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([1, 2, 5, 9, 23, 70], seed=3) + random_prompts([6, 13], seed=4, shared_prefix=17)


def test_prompt_logprobs_equal_hf_float32(tiny_llama_dir, hf_model, prompts):
    llm = LLM(str(tiny_llama_dir), **CONFIG)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP_K))
    for prompt, out in zip(prompts, outs):
        assert_same(out.prompt_logprobs, hf_prompt_logprobs(hf_model, prompt, TOP_K))
        assert len(out.outputs[0].token_ids) == 2
    plain = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_with_a_prefix_cache_hit_recompute_the_prompt(tiny_llama_dir, hf_model, prompts):
    """A warm prefix cache holds K/V but no logits: the scoring request computes its prompt in full."""
    llm = LLM(str(tiny_llama_dir), **CONFIG)
    prompt = prompts[5]  # 70 tokens: 17 full blocks
    warm = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].metrics.num_cached_tokens == 68
    scored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert scored.metrics.num_cached_tokens == 0
    assert_same(scored.prompt_logprobs, hf_prompt_logprobs(hf_model, prompt, 0))
    assert scored.outputs[0].token_ids == warm.outputs[0].token_ids
    # the cache still serves the requests after it
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].metrics.num_cached_tokens == 68


def test_scoring_only_requests_with_max_tokens_0(tiny_llama_dir, hf_model, prompts):
    """``max_tokens=0`` + ``prompt_logprobs``: lm-eval's loglikelihood requests; chunked prefill and a batch."""
    llm = LLM(str(tiny_llama_dir), **{**CONFIG, "max_num_batched_tokens": 16})
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=TOP_K))
    for prompt, out in zip(prompts, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
        assert_same(out.prompt_logprobs, hf_prompt_logprobs(hf_model, prompt, TOP_K))
    with pytest.raises(ValueError, match="max_tokens=0 generates nothing; it must be >= 1, or set prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs=-1; it must be an integer >= 0, or None"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs=21 is over the limit of 20"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=0, prompt_logprobs=21))
    llm.engine.check_invariants()
    assert not llm.engine.has_unfinished_requests()


def test_n_completions_score_the_prompt_once_and_share_it(tiny_llama_dir, hf_model, prompts):
    llm = LLM(str(tiny_llama_dir), **CONFIG)
    out = llm.generate([prompts[4]], SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=3, prompt_logprobs=1))[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 3 for c in out.outputs)
    assert_same(out.prompt_logprobs, hf_prompt_logprobs(hf_model, prompts[4], 1))


@pytest.mark.integration
def test_real_smollm2_prompt_logprobs_equal_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    llm = LLM(str(smollm2_dir), max_model_len=512, num_kv_blocks=128, block_size=16, dtype="float32")
    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
    prompt = llm.tokenizer(text).input_ids
    reference = hf_prompt_logprobs(hf, prompt, 5)
    cold = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=5))[0]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))  # fills the prefix cache
    warm = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=5))[0]
    assert_same(cold.prompt_logprobs, reference, atol=1e-3)
    assert_same(warm.prompt_logprobs, reference, atol=1e-3)
