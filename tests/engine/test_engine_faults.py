"""The engine survives any single request: model-dependent validation at add time, a fault inside a
step failing only that step's requests, and a dead engine that says so."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from engine.async_engine import EngineDeadError
from engine.llm_engine import MAX_CONSECUTIVE_FAILED_STEPS
from tests.engine.test_engine_greedy import hf_greedy, random_prompts
from tests.engine.test_engine_requests import run_to_end

CONFIG = dict(
    block_size=4, num_kv_blocks=128, max_num_batched_tokens=64, max_model_len=64, max_num_seqs=2, dtype="float32"
)
VOCAB = 49152  # make_tiny_llama: the SmolLM2 vocabulary

pytestmark = pytest.mark.usefixtures("engine_is_clean_after")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **CONFIG)


BAD_PARAMS = [
    (dict(logprobs=VOCAB + 1), "logprobs"),
    (dict(logprobs=100000), "logprobs"),
    (dict(stop_token_ids=[5, VOCAB]), "stop_token_ids"),
    (dict(stop_token_ids=[10**12]), "stop_token_ids"),
    (dict(max_tokens=64), "max_tokens"),  # prompt + max_tokens > max_model_len=64
    (dict(max_tokens=10**9), "max_tokens"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-1), "seed"),
    (dict(temperature=1e-40), "temperature"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=float("nan")), "top_p"),
]


@pytest.mark.parametrize("fields, field", BAD_PARAMS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_PARAMS)])
def test_out_of_range_parameter_is_refused_at_add_naming_the_field(llm, fields, field):
    engine = llm.engine
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", [5, 6, 7], SamplingParams(**{"max_tokens": 4, **fields}))
    assert "bad" not in engine.requests and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"max_tokens": "4"}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": True}, "logprobs"),
        ({"max_tokenz": 4}, "unknown"),
    ],
)
def test_wrong_json_types_name_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(fields)


def test_bad_prompts_fail_alone_and_good_requests_match_hf(llm, tiny_llama_dir):
    engine = llm.engine
    prompts = random_prompts([6, 9], seed=31)
    reference = hf_greedy(tiny_llama_dir, prompts, 8)
    for i, p in enumerate(prompts):
        engine.add_request(f"good-{i}", p, SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    for prompt, field in [
        ("bad \ud800 surrogate", "Unicode"),
        ([5, VOCAB], "vocabulary"),
        ([-1], "vocabulary"),
        (list(range(5, 69)), "max_model_len"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine.add_request("bad", prompt, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="logprobs"):  # the offline API validates every request before running any
        llm.generate(
            [prompts[0], prompts[1]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logprobs=VOCAB + 1)]
        )
    finals = run_to_end(engine)
    assert [finals[f"good-{i}"].outputs[0].token_ids for i in range(2)] == reference


def test_fault_in_model_fails_only_that_steps_requests(llm, tiny_llama_dir, monkeypatch):
    engine = llm.engine
    prompts = random_prompts([5, 7, 11, 6], seed=32)
    reference = hf_greedy(tiny_llama_dir, prompts[2:], 6)
    original = engine.runner.execute
    calls = {"n": 0}

    def execute_failing_once(out, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode step of the two running requests
            raise RuntimeError("injected fault")
        return original(out, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute_failing_once)
    for i, p in enumerate(prompts[:3]):  # max_num_seqs=2: the third waits, outside the failing step
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6))
    finals = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert {finals["r0"].outputs[0].finish_reason, finals["r1"].outputs[0].finish_reason} == {"error"}
    assert "RuntimeError: injected fault" in finals["r0"].outputs[0].error
    assert len(finals["r0"].outputs[0].token_ids) == 1  # the token sampled before the fault is kept
    engine.check_invariants()
    engine.add_request("r3", prompts[3], SamplingParams(temperature=0, max_tokens=6))
    finals.update(run_to_end(engine))
    assert finals["r2"].outputs[0].token_ids == reference[0] and finals["r2"].outputs[0].finish_reason == "length"
    assert finals["r3"].outputs[0].token_ids == reference[1] and finals["r3"].outputs[0].error is None
    assert engine.num_failed_steps_total >= 1 and engine.num_consecutive_failed_steps == 0


def test_fault_in_sampler_and_in_one_detokenizer(llm, tiny_llama_dir, monkeypatch):
    engine = llm.engine
    prompts = random_prompts([5, 8], seed=33)
    reference = hf_greedy(tiny_llama_dir, prompts, 5)
    sampler = engine.sampler
    state = {"failed": False}

    def sample_failing_once(logits, seqs, **kwargs):
        if not state["failed"]:
            state["failed"] = True
            raise IndexError("injected sampler fault")
        return sampler(logits, seqs, **kwargs)

    monkeypatch.setattr(engine, "sampler", sample_failing_once)
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "error" and "IndexError: injected sampler fault" in out.error
    # a detokenizer fault fails its request only; the other request of the same steps finishes
    engine.add_request("detok-bad", prompts[0], SamplingParams(temperature=0, max_tokens=5))
    engine.add_request("detok-good", prompts[1], SamplingParams(temperature=0, max_tokens=5))

    def broken(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    monkeypatch.setattr(engine.requests["detok-bad"].detokenizer, "add_token", broken)
    finals = run_to_end(engine)
    assert (
        finals["detok-bad"].outputs[0].finish_reason == "error"
        and "UnicodeDecodeError" in finals["detok-bad"].outputs[0].error
    )
    assert finals["detok-good"].outputs[0].token_ids == reference[1]


def test_every_step_failing_kills_the_engine_and_async_reports_it(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), **CONFIG)
    prompts = random_prompts([5, 6], seed=34)
    reference = hf_greedy(tiny_llama_dir, prompts[1:], 4)

    async def collect(engine, prompt, request_id):
        return [out async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4), request_id)]

    async def main():
        with AsyncLLMEngine(config) as engine:
            real = engine.engine.runner.execute
            engine.engine.runner.execute = _raise
            once = await collect(engine, prompts[0], "fails")  # one failed step: that request only
            assert once[-1].outputs[0].finish_reason == "error" and not engine.is_dead
            engine.engine.runner.execute = real
            good = await collect(engine, prompts[1], "serves")
            engine.check_invariants()
            engine.engine.runner.execute = _raise
            results = await asyncio.gather(
                *(collect(engine, prompts[0], f"doomed-{i}") for i in range(2 * MAX_CONSECUTIVE_FAILED_STEPS)),
                return_exceptions=True,
            )  # 2 per step
            for _ in range(100):
                if engine.is_dead:
                    break
                await asyncio.sleep(0.05)
            return once, good, results, engine.is_dead, engine.dead_reason, engine

    once, good, results, dead, reason, engine = asyncio.run(main())
    assert good[-1].outputs[0].token_ids == reference[0] and good[-1].outputs[0].finish_reason == "length"
    assert dead and "steps failed in a row" in reason and "injected fault" in reason
    assert all(
        isinstance(r, list) and r[-1].outputs[0].finish_reason == "error" or isinstance(r, EngineDeadError)
        for r in results
    )
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, prompts[1], "after"))


def _raise(out, **kwargs):
    raise RuntimeError("injected fault")
