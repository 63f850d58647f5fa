"""Structured output and echo + prompt logprobs through the real server: the official ``openai`` client
(``chat.completions.parse`` / ``stream`` with a pydantic model, ``extra_body`` for vLLM's fields) and
raw HTTP against the OpenAI frontend, and Triton's own ``sampling_parameters``.

The session's Triton server (tests/conftest.py) serves the tiny random Llama as ``llm``: its
near-uniform logits make any output that parses the grammar mask's doing. Prompt logprobs are
compared with the in-process engine of the same checkpoint and configuration.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import jsonschema
import pytest
import requests
from pydantic import BaseModel, Field

from engine import LLM, SamplingParams
from tests.conftest import ENGINE_CONFIG
from tests.deploy.test_deploy_openai import API_KEY, PROMPT, client, frontend, tokenizer  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"


class Person(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=99)]
    mood: Literal["happy", "sad"]


@pytest.fixture(scope="module")
def local_llm(tiny_llama_dir):
    """The in-process engine with the served model's checkpoint and configuration."""
    return LLM(str(tiny_llama_dir), **ENGINE_CONFIG)


def post(frontend, route: str, body: dict) -> requests.Response:
    return requests.post(f"{frontend}{route}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_sdk_parse_returns_the_pydantic_object_greedy_sampled_and_streamed(client):
    messages = [{"role": "user", "content": "Invent a person."}]
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 5, "n": 2}):
        parsed = client.chat.completions.parse(
            model="llm", messages=messages, response_format=Person, max_tokens=80, **params
        )
        for choice in parsed.choices:
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
            assert Person.model_validate_json(choice.message.content) == choice.message.parsed
    with client.chat.completions.stream(
        model="llm", messages=messages, response_format=Person, max_tokens=80, temperature=0.7, seed=9
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1 and isinstance(final.choices[0].message.parsed, Person)
    assert "".join(deltas) == final.choices[0].message.content


def test_json_object_regex_choice_and_vllm_fields(client, tokenizer):
    brackets = {str(tokenizer.convert_tokens_to_ids(b)): 100 for b in "{}"}
    obj = client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        logit_bias=brackets,  # among the tokens the mask allows, "{" then "}"
        max_tokens=20,
        temperature=0,
    )
    assert json.loads(obj.choices[0].message.content) == {} and obj.choices[0].finish_reason == "stop"
    text = client.chat.completions.create(
        model="llm", messages=[{"role": "user", "content": "hi"}], response_format={"type": "text"}, max_tokens=3
    )
    assert text.usage.completion_tokens == 3  # "text" constrains nothing
    regex = client.completions.create(
        model="llm", prompt="Call", n=2, max_tokens=30, temperature=1.0, seed=1, extra_body={"guided_regex": PHONE}
    )
    assert all(re.fullmatch(PHONE, c.text) for c in regex.choices)
    choice = client.completions.create(
        model="llm", prompt="Mood:", max_tokens=8, temperature=0, extra_body={"guided_choice": ["happy", "sad"]}
    )
    assert choice.choices[0].text in ("happy", "sad")
    schema = {**Person.model_json_schema(), "additionalProperties": False}
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
        out = client.completions.create(model="llm", prompt="Who?", max_tokens=80, temperature=0, extra_body=extra)
        jsonschema.validate(json.loads(out.choices[0].text), schema)


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}
CHAT = {"model": "llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
BAD_STRUCTURED = [
    (
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": BAD_SCHEMA}}},
        "response_format.json_schema.schema",
        "Invalid type: strin",
    ),
    (
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": True}}},
        "response_format.json_schema.schema",
        "missing",
    ),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format", "xml"),
    ({**CHAT, "guided_regex": "a[^\\x00-\\U0010FFFF]b"}, "guided_regex", "structured_outputs.regex"),
    ({**CHAT, "guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({**CHAT, "structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "grammar"),
    ({**CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "set exactly one"),
    ({**CHAT, "response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "send one"),
    ({**CHAT, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "unrecognized"),
]


@pytest.mark.parametrize(
    "body, param, message",
    BAD_STRUCTURED,
    ids=["invalid-schema", "no-schema", "unknown-format", "regex-matches-nothing", "bad-regex", "bad-grammar",
         "two-kinds", "two-fields", "unknown-vllm-field"],
)  # fmt: skip
def test_bad_constraints_get_a_400_naming_the_field(frontend, client, body, param, message):
    response = post(frontend, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def test_echo_logprobs_max_tokens_0_scores_the_prompt_as_the_engine(frontend, client, local_llm, tokenizer):
    """lm-evaluation-harness' loglikelihood request: token ids, echo, logprobs=1, max_tokens=0."""
    ids = tokenizer("The capital of France is Paris").input_ids
    reference = local_llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs
    scored = client.completions.create(model="llm", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([entry[t] for entry, t in zip(reference[1:], ids[1:])], abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
    # text prompt, one generated token, n=2, streamed: every choice starts with the prompt and its logprobs
    whole = client.completions.create(
        model="llm", prompt=PROMPT, echo=True, logprobs=2, max_tokens=1, n=2, temperature=0
    )
    chunks = list(
        client.completions.create(
            model="llm", prompt=PROMPT, echo=True, logprobs=2, max_tokens=1, n=2, temperature=0, stream=True
        )
    )
    prompt_len = len(tokenizer(PROMPT).input_ids)
    for choice in whole.choices:
        assert choice.text.startswith(PROMPT) and len(choice.logprobs.tokens) == prompt_len + 1
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[-1] is not None
    streamed = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed.setdefault(c.index, []).append(c)
    assert sorted(streamed) == [0, 1]
    for index, parts in streamed.items():
        assert "".join(p.text for p in parts) == whole.choices[index].text
        tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
        assert tokens == whole.choices[index].logprobs.tokens
    # the warm prefix cache does not change the scores
    again = client.completions.create(model="llm", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "llm", "prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"model": "llm", "prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
        ({"model": "llm", "prompt": PROMPT, "max_tokens": -1, "echo": True}, "max_tokens"),
        ({"model": "llm", "prompt": PROMPT, "echo": True, "max_tokens": 0, "guided_regex": "a"}, "max_tokens"),
    ],
    ids=["max-tokens-0-without-echo", "logprobs-over-20", "negative-max-tokens", "max-tokens-0-constrained"],
)
def test_bad_scoring_requests_get_a_400_naming_the_field(frontend, body, param):
    response = post(frontend, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_triton_sampling_parameters_take_structured_outputs_and_prompt_logprobs(server):
    def generate(params: dict) -> requests.Response:
        body = {"text_input": "Mood:", "sampling_parameters": json.dumps(params)}
        return requests.post(f"{server.http_url}/v2/models/llm/generate", json=body, timeout=120)

    for key in ("structured_outputs", "guided_decoding"):
        out = generate({"max_tokens": 8, "temperature": 0, key: {"choice": ["happy", "sad"]}})
        assert out.status_code == 200 and out.json()["text_output"] in ("Mood:happy", "Mood:sad"), out.text
    bad = generate({"max_tokens": 8, "structured_outputs": {"json": BAD_SCHEMA}})
    assert bad.status_code == 400 and "structured_outputs.json: Invalid type: strin" in bad.json()["error"]
    both = generate({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}})
    assert both.status_code == 400 and "both structured_outputs and guided_decoding" in both.json()["error"]
    scored = generate({"max_tokens": 0, "prompt_logprobs": 0})
    assert scored.status_code == 200 and scored.json()["finish_reason"] == "length"
    entries = json.loads(scored.json()["prompt_logprobs"])
    assert entries[0] is None and len(entries) == scored.json()["num_input_tokens"]
