"""Sampling fields with vLLM's names: n, min_tokens, presence/frequency penalties, min_p,
logit_bias, and ``{"prompt_token_ids": [...]}`` prompts (tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sampler import Sampler
from engine.sequence import Sequence
from tests.engine.test_engine_greedy import random_prompts
from tests.engine.test_engine_requests import llm  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("engine_is_clean_after")

VOCAB = 32


def make_seq(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence("s", None, prompt, SamplingParams(**params), None, None)
    seq.token_ids.extend(output)
    return seq


def test_presence_and_frequency_penalties_follow_the_formula_over_output_tokens():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    seq = make_seq([5, 6, 5], [3, 3, 7, 3], presence_penalty=0.5, frequency_penalty=0.25)
    out = Sampler().process_logits(logits, [seq])
    expected = logits.clone()
    expected[0, 3] -= 0.25 * 3 + 0.5  # three occurrences
    expected[0, 7] -= 0.25 * 1 + 0.5
    assert torch.equal(out, expected)  # prompt tokens 5 and 6 untouched
    assert torch.equal(logits, Sampler().process_logits(logits, [make_seq([5], [3])]))  # all defaults: no change


def test_logit_bias_and_min_tokens_change_the_logits_before_sampling():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    biased = make_seq([1], [4], logit_bias={"9": 2.5, 4: -1.0})  # JSON string keys accepted
    blocked = make_seq([1], [4], min_tokens=2, stop_token_ids=[11])
    out = Sampler(eos_token_ids={2}).process_logits(logits, [biased, blocked])
    expected = logits.clone()
    expected[0, 9] += 2.5
    expected[0, 4] -= 1.0
    expected[1, 2] = expected[1, 11] = float("-inf")  # EOS and stop id blocked under min_tokens
    assert torch.equal(out, expected)
    done = make_seq([1], [4, 5], min_tokens=2, stop_token_ids=[11])  # min_tokens reached: no change
    assert torch.equal(Sampler(eos_token_ids={2}).process_logits(logits[:1], [done]), logits[:1])
    ignoring = make_seq([1], [4], min_tokens=2, ignore_eos=True)  # EOS already ignored
    assert torch.isfinite(Sampler(eos_token_ids={2}).process_logits(logits[:1], [ignoring])).all()


def test_min_p_keeps_tokens_within_a_factor_of_the_top_probability():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = Sampler._probs(row, 1.0, None, 1.0, min_p=0.5)  # threshold 0.25
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(Sampler._probs(row, 1.0, None, 1.0, min_p=0.0), row.exp())


def test_logit_bias_steers_greedy_generation(llm):
    prompt = random_prompts([6], seed=21)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={1234: 100.0}))[
        0
    ].outputs[0]
    assert out.token_ids == [1234] * 6


def test_min_tokens_blocks_stop_ids_until_reached(llm):
    prompt = random_prompts([7], seed=22)[0]
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=4))[
        0
    ].outputs[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]


def test_penalties_change_greedy_tokens_in_the_engine(llm):
    prompt = random_prompts([5], seed=23)[0]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    penalized = (
        llm.generate(
            prompt,
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert (
        len(set(penalized)) >= len(set(plain)) and penalized != plain
    )  # a random model repeats itself; the penalty breaks it


def test_n_seeded_completions_are_distinct_and_reproducible(llm):
    prompt = random_prompts([10], seed=24)[0]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7, n=2)
    first = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    assert [c.index for c in first.outputs] == [0, 1]
    a, b = (c.token_ids for c in first.outputs)
    assert a != b and [c.token_ids for c in again.outputs] == [a, b]
    # completion i samples as a single request seeded with seed + i
    single = (
        llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=8))[0]
        .outputs[0]
        .token_ids
    )
    assert single == b
    assert first.metrics.num_output_tokens == 20


def test_greedy_n_gives_equal_completions_sharing_the_prompt_blocks(llm):
    prompt = random_prompts([17], seed=25)[0]  # four full blocks of 4 tokens
    engine = llm.engine
    reference = (
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    )
    other = random_prompts([17], seed=26)[0]
    hits_before = engine.block_manager.prefix_cache_hits_tokens
    out = llm.generate({"prompt_token_ids": other}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3))[
        0
    ]
    assert len(out.outputs) == 3 and out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids
    assert engine.block_manager.prefix_cache_hits_tokens - hits_before == 2 * 16  # 2nd and 3rd hit the 1st's blocks
    assert (
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
        == reference
    )


def test_abort_of_an_n_request_frees_every_completion(llm):
    engine = llm.engine
    prompt = random_prompts([9], seed=27)[0]
    engine.add_request("many", prompt, SamplingParams(temperature=0.8, max_tokens=50, ignore_eos=True, n=3))
    for _ in range(3):
        engine.step()
    (aborted,) = engine.abort_request("many")
    assert aborted.finished and [c.finish_reason for c in aborted.outputs] == ["abort"] * 3
    assert engine.block_manager.usage == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n": 0}, "n=0"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"x": 1}}, "logit_bias key"),
        ({"logit_bias": {3: 101}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
    ],
)
def test_bad_sampling_fields_raise_a_named_error(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_engine_checks_ids_against_the_vocabulary(llm):
    engine = llm.engine
    vocab = engine.runner.spec.vocab_size
    with pytest.raises(ValueError, match="logit_bias has token ids"):
        engine.add_request(None, [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request(None, {"prompt_token_ids": "1 2"}, SamplingParams())
    with pytest.raises(ValueError, match="prompt dict"):
        engine.add_request(None, {"tokens": [1]}, SamplingParams())
