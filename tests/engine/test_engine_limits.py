"""One set of per-request limits (``engine.limits.RequestLimits``) on the Python API and the Triton request
parser: each refusal is an ``InvalidRequestError`` naming the field, and the size checks run before the
prompt is tokenized."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from deploy.llm_request import parse_request
from engine import LLM, EngineConfig, SamplingParams
from engine.errors import InvalidRequestError, UsageError
from engine.limits import RequestLimits

CONFIG = dict(block_size=4, num_kv_blocks=64, max_model_len=64, dtype="float32", num_threads=1)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **CONFIG, limits={"max_n": 4, "max_stop": 2, "max_logit_bias": 3})


def refused(call, param: str, match: str | None = None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=match) as info:
        call()
    assert info.value.param == param, (info.value.param, str(info.value))
    return info.value


def test_limits_refuse_before_tokenizing_and_name_the_field(llm, monkeypatch):
    engine = llm.engine
    assert engine.config.limits.max_n == 4 and engine.config.limits.max_choices == 128  # dict -> RequestLimits

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a request the limits refuse")

    monkeypatch.setattr(engine, "tokenizer", no_tokenizing)
    huge = "word " * 200_000
    refused(lambda: engine.add_request(None, huge, SamplingParams(n=5)), "n", "n=5 is over the limit of 4")
    refused(lambda: engine.validate_request(huge, SamplingParams(stop=["a", "b", "c"])), "stop", "at most 2")
    refused(lambda: engine.validate_request(huge, SamplingParams(stop=["x" * 300])), "stop", "300 characters")
    bias = {i: 1.0 for i in range(4)}
    refused(lambda: engine.validate_request(huge, SamplingParams(logit_bias=bias)), "logit_bias", "4 entries")
    refused(lambda: engine.validate_request(huge, SamplingParams(logprobs=21)), "logprobs", "limit of 20")
    refused(lambda: engine.validate_request("x" * 1_000_001, None), "prompt", "1000001 characters")
    refused(lambda: engine.validate_request("  \n ", None), "prompt", "empty prompt")
    refused(lambda: engine.validate_request(list(range(64)), None), "prompt", "64 tokens; at most 63")
    assert not engine.has_unfinished_requests() and not engine.groups


def test_python_api_refuses_n_over_the_limit_and_the_model_checks_name_the_field(llm):
    refused(lambda: llm.generate(["Hello"], SamplingParams(n=5)), "n")
    vocab = llm.engine.runner.spec.vocab_size
    refused(lambda: llm.generate(["Hello"], SamplingParams(stop_token_ids=[vocab])), "stop_token_ids", "vocabulary")
    refused(lambda: llm.generate(["Hello"], SamplingParams(logit_bias={vocab + 5: 1})), "logit_bias", "vocabulary")
    refused(lambda: llm.generate(["Hello"], SamplingParams(max_tokens=64)), "max_tokens", "max_model_len")
    [out] = llm.generate(["Hello"], SamplingParams(n=4, temperature=0, max_tokens=2))
    assert len(out.outputs) == 4


@pytest.mark.parametrize(
    "values, param",
    [
        ({"logit_bias": {"²": 5}}, "logit_bias"),  # a Unicode digit is no token id
        ({"logit_bias": {"-3": 5}}, "logit_bias"),
        ({"logit_bias": {"7": 101}}, "logit_bias"),
        ({"logit_bias": {"7": math.nan}}, "logit_bias"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"max_token": 3}, "max_token"),
    ],
)
def test_sampling_params_errors_name_their_field(values, param):
    refused(lambda: SamplingParams.from_dict(values), param)


def test_limits_config_is_checked():
    assert EngineConfig(limits={"max_n": 2}).limits == RequestLimits(max_n=2)
    with pytest.raises(UsageError, match="unknown field"):
        EngineConfig(limits={"max_nn": 2})
    with pytest.raises(UsageError, match="max_stop=0"):
        RequestLimits(max_stop=0)
    refused(lambda: RequestLimits().check_choices(2, 65), "prompt", "130 completions")
    refused(lambda: RequestLimits().check_choices(1, 129), "n")


def test_triton_parser_refuses_by_size_before_validating_entries():
    def parse(params: dict, limits=None, **inputs):
        return parse_request(
            np.array([b"Hello"], dtype=object),
            sampling_parameters=np.array([json.dumps(params).encode()], dtype=object),
            limits=limits,
            **inputs,
        )

    with pytest.raises(InvalidRequestError, match="n=10000 is over the limit of 128"):
        parse({"n": 10000})
    # 5000 entries, each invalid: refused by the count, not by the first bad entry
    with pytest.raises(InvalidRequestError, match="logit_bias has 5000 entries"):
        parse({"logit_bias": {f"x{i}": 500 for i in range(5000)}})
    with pytest.raises(InvalidRequestError, match="stop has 17 strings"):
        parse({"stop": ["a"] * 17})
    with pytest.raises(InvalidRequestError, match="n=3 is over the limit of 2"):
        parse({"n": 3}, RequestLimits(max_n=2))
    with pytest.raises(InvalidRequestError, match="prompt_token_ids has 600 tokens"):
        parse_request(None, prompt_token_ids=np.arange(600), max_model_len=512)
    assert parse({"n": 128}, stream=np.array([True])).sampling_params.n == 128


def test_triton_parser_refuses_n_over_1_without_stream():
    params = np.array([b'{"n": 2}'], dtype=object)
    with pytest.raises(InvalidRequestError, match="n=2 with stream=false") as info:
        parse_request(np.array([b"Hello"], dtype=object), sampling_parameters=params)
    assert info.value.param == "n"
    assert parse_request(np.array([b"Hello"], dtype=object), np.array([True]), params).sampling_params.n == 2
