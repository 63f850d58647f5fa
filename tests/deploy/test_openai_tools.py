"""Tool calling through the real server: the official ``openai`` client against the OpenAI frontend
in front of the real tritonserver.

The session's Triton server (tests/conftest.py) serves the tiny random Llama as ``llm`` (SmolLM2's
tokenizer and chat template, which ignores tools: the frontend writes them into a system prompt).
Its near-uniform logits make every valid call the grammar's doing (``tool_choice`` ``required``
or named); ``auto`` is driven by a ``guided_regex`` that makes the model write a call in the
parser's format, so the parser, not a grammar, finds it. Plain answers are compared with the
in-process engine's greedy text for the same prompt. The real SmolLM2-135M-Instruct, loaded for the
last test, shows the forced call's function and arguments follow the question.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from typing import Annotated, Literal

import openai
import pytest
import requests
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from deploy.export import export
from deploy.openai.protocol import ChatCompletionRequest
from deploy.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser
from deploy.openai.tools import template_messages, tool_plan
from engine import LLM, SamplingParams
from tests.deploy.test_deploy_openai import API_KEY, PROMPT, client, frontend, tokenizer  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Annotated[str, Field(max_length=8)]
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The time in a time zone."""

    zone: Literal["UTC", "CET"]


WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather")
TIME = openai.pydantic_function_tool(GetTime, name="get_time")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def post(frontend, body: dict) -> requests.Response:
    return requests.post(
        f"{frontend}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    )


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None, parser=HermesToolParser) -> list[int]:
    """The prompt the frontend renders for ``messages`` and ``tools`` (tool_choice auto)."""
    plan = (
        tool_plan(
            ChatCompletionRequest.model_validate({"model": "llm", "messages": messages, "tools": tools}), parser.name
        )
        if tools
        else None
    )
    rendered, _ = template_messages(copy.deepcopy(messages), plan, tokenizer.chat_template, parser)
    return list(tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True))


def streamed_calls(chunks) -> tuple[str, list[dict], list[str]]:
    """(content, calls, finish reasons) of a streamed choice 0, checking each call opens before its arguments."""
    content, calls, reasons = "", [], []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for entry in choice.delta.tool_calls or []:
                if entry.index == len(calls):
                    assert entry.id.startswith("call_") and entry.type == "function" and entry.function.name
                    calls.append({"id": entry.id, "name": entry.function.name, "arguments": ""})
                else:
                    assert entry.id is None and entry.function.name is None
                calls[entry.index]["arguments"] += entry.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


def test_named_call_round_trip_then_the_model_answers(client, engine_text, tokenizer):
    first = client.chat.completions.create(
        model="llm", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=FORCE_WEATHER, max_tokens=60, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    arguments = GetWeather.model_validate_json(call.function.arguments)  # valid against the tool's schema
    # the call and its result go back; the model answers in words (tool_choice auto: the parser finds no call)
    history = [
        *MESSAGES,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": f"{arguments.city}: sunny, 21 {arguments.unit}"},
    ]
    answer = client.chat.completions.create(
        model="llm",
        messages=history,
        tools=[WEATHER, TIME],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ids = prompt_ids(tokenizer, history, [WEATHER, TIME])
    expected, _ = engine_text({"prompt_token_ids": ids}, temperature=0, max_tokens=12, ignore_eos=True)
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == expected and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "length"
    text = tokenizer.decode(ids)
    assert '"name": "get_weather"' in text and f"<|im_start|>tool\n{arguments.city}: sunny" in text
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": ' in text  # the earlier call, written back


def test_required_calls_parse_with_the_sdk_sampled_and_in_parallel(client):
    cases = [  # parallel calls of the short tool only: a random model stops a list at each item's end by chance
        {"tools": [WEATHER, TIME], "temperature": 0, "parallel_tool_calls": False},
        {"tools": [TIME], "temperature": 1.0, "seed": 3, "n": 3},
    ]
    for params in cases:
        out = client.chat.completions.parse(
            model="llm", messages=MESSAGES, tool_choice="required", max_tokens=180, **params
        )
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            calls = choice.message.tool_calls
            assert calls and len({c.id for c in calls}) == len(calls)
            if not params.get("parallel_tool_calls", True):
                assert len(calls) == 1
            for call in calls:
                model = {"get_weather": GetWeather, "get_time": GetTime}[call.function.name]
                assert isinstance(call.function.parsed_arguments, model)
                assert model.model_validate_json(call.function.arguments) == call.function.parsed_arguments


def test_streamed_tool_calls_reassemble_into_the_same_calls(client):
    for tool_choice in (FORCE_WEATHER, "required"):
        request = {
            "model": "llm",
            "messages": MESSAGES,
            "tools": [WEATHER, TIME],
            "tool_choice": tool_choice,
            "parallel_tool_calls": False,  # greedy, the random model would extend the list to max_tokens
            "max_tokens": 120,
            "temperature": 0,
        }
        whole = client.chat.completions.create(**request).choices[0]
        chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
        content, calls, reasons = streamed_calls(chunks)
        assert content == "" and reasons == ["tool_calls"] == [whole.finish_reason]
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls
        ]
        assert chunks[-1].usage.completion_tokens > 0
    # the SDK's stream helper puts them together too
    with client.chat.completions.stream(**{**request, "tool_choice": FORCE_WEATHER}) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)


CALL_REGEX = (
    r'Let me check\.\n<tool_call>\{"name": "get_weather", '
    r'"arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}</tool_call>'
)


def test_auto_finds_a_call_in_free_text_whole_and_streamed(client):
    request = {
        "model": "llm",
        "messages": MESSAGES,
        "tools": [WEATHER],
        "max_tokens": 60,
        "temperature": 0,
        "extra_body": {"guided_regex": CALL_REGEX},  # the model writes a call in the hermes format
    }
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and GetWeather.model_validate_json(call.function.arguments).city in (
        "Paris",
        "Rome",
    )
    content, calls, reasons = streamed_calls(client.chat.completions.create(**request, stream=True))
    assert content == "Let me check." and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    # tool_choice none: the tools stay out of the prompt and the text is not parsed
    none = client.chat.completions.create(**request, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content.endswith("</tool_call>")
    bare = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=1)
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens


def test_llama3_json_parser_flag(server, served_repo, start_frontend, tokenizer):
    flags = ("--models", "llm", "--tool-call-parser", "llama3_json")
    with start_frontend(served_repo, server, *flags) as url:
        llama_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        regex = r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}'
        out = llama_client.chat.completions.create(
            model="llm",
            messages=MESSAGES,
            tools=[TIME],
            max_tokens=40,
            temperature=0,
            extra_body={"guided_regex": regex},
        )
        [call] = out.choices[0].message.tool_calls
        assert out.choices[0].message.content is None and out.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_time" and GetTime.model_validate_json(call.function.arguments).zone in (
            "UTC",
            "CET",
        )
        # the tools reach the model in the llama3_json format's prompt
        assert out.usage.prompt_tokens == len(prompt_ids(tokenizer, MESSAGES, [TIME], Llama3JsonToolParser))


BAD_PARAMS = {"type": "object", "properties": {"city": {"type": "strin"}}}
TOOL_MESSAGE = {"role": "tool", "content": "sunny"}
BAD_TOOLS = [
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_PARAMS}}]},
        "tools.0.function.parameters",
        "Invalid type: strin",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
        "not among the tools",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "not one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function", "missing"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "both constrain",
    ),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "function"),
    ({"tools": []}, "tools", "empty"),
    ({"messages": [*MESSAGES, TOOL_MESSAGE]}, "messages.1.tool_call_id", "missing"),
]


@pytest.mark.parametrize(
    "fields, param, message",
    BAD_TOOLS,
    ids=["invalid-schema", "unknown-function", "choice-without-tools", "unknown-choice", "choice-without-function",
         "with-response-format", "bad-function-name", "not-a-function", "empty-tools", "tool-message-without-id"],
)  # fmt: skip
def test_bad_tools_get_a_400_naming_the_field_and_the_server_keeps_serving(frontend, client, fields, param, message):
    response = post(frontend, {"model": "llm", "messages": MESSAGES, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error", error
    with pytest.raises(openai.BadRequestError):  # the SDK raises it as OpenAI's own 400
        client.chat.completions.create(**{"model": "llm", "messages": MESSAGES, "max_tokens": 4, **fields})
    good = client.chat.completions.create(
        model="llm", messages=MESSAGES, tools=[WEATHER], tool_choice=FORCE_WEATHER, max_tokens=60, temperature=0
    )
    assert GetWeather.model_validate_json(good.choices[0].message.tool_calls[0].function.arguments)
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


SMOLLM2_ENGINE = {"max_model_len": 1024, "num_threads": 1}


@pytest.fixture(scope="module")
def smollm2_client(server, served_repo, smollm2_dir, start_frontend):
    """The real SmolLM2-135M-Instruct loaded into the session's Triton as ``smollm2_tools``, behind its own frontend."""
    export(smollm2_dir, served_repo, name="smollm2_tools", engine=SMOLLM2_ENGINE)
    loaded = requests.post(f"{server.http_url}/v2/repository/models/smollm2_tools/load", json={}, timeout=600)
    assert loaded.status_code == 200, loaded.text
    try:
        # a shared machine can starve the model's heartbeats past the 1 s default while its first grammar builds
        flags = ("--models", "smollm2_tools", "--stall-timeout-s", "30")
        with start_frontend(served_repo, server, *flags) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        # unloaded and removed from the repository: later tests list every model and check server readiness
        requests.post(f"{server.http_url}/v2/repository/models/smollm2_tools/unload", json={}, timeout=120)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
            e["name"] == "smollm2_tools" and e.get("state") in ("READY", "UNLOADING") for e in server.repository_index()
        ):
            time.sleep(0.5)
        shutil.rmtree(served_repo / "smollm2_tools", ignore_errors=True)


def test_real_smollm2_calls_the_right_function_and_answers_with_its_result(smollm2_client, smollm2_dir):
    """Forced (``required``, parallel calls allowed) the model picks the function and its arguments from the
    question; the result goes back and its answer is the in-process engine's greedy text for that prompt."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    expected = {"What is the weather in Paris?": ("get_weather", {"city": "Paris", "unit": "celsius"}),
                "What time is it in UTC?": ("get_time", {"zone": "UTC"})}  # fmt: skip
    answers = {}
    for question, (name, arguments) in expected.items():
        messages = [{"role": "user", "content": question}]
        request = {"model": "smollm2_tools", "messages": messages, "tools": [WEATHER, TIME], "max_tokens": 100}
        whole = answers[question] = smollm2_client.chat.completions.create(
            **request, tool_choice="required", temperature=0
        )
        [call] = whole.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (name, arguments)
        chunks = smollm2_client.chat.completions.create(**request, tool_choice="required", temperature=0, stream=True)
        content, calls, reasons = streamed_calls(chunks)
        assert [(c["name"], c["arguments"]) for c in calls] == [(name, call.function.arguments)]
        assert content == "" and reasons == ["tool_calls"]
    question = "What is the weather in Paris?"
    weather = answers[question].choices[0].message
    history = [
        {"role": "user", "content": question},
        weather.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": weather.tool_calls[0].id, "content": "Paris: sunny, 21 celsius"},
    ]
    answer = smollm2_client.chat.completions.create(
        model="smollm2_tools", messages=history, tools=[WEATHER, TIME], max_tokens=40, temperature=0
    )
    ids = prompt_ids(tokenizer, history, [WEATHER, TIME])
    reference = LLM(str(smollm2_dir), **SMOLLM2_ENGINE).generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=40)
    )[0]
    assert answer.usage.prompt_tokens == len(ids)
    assert (
        answer.choices[0].message.content == reference.outputs[0].text and answer.choices[0].message.tool_calls is None
    )
