"""Tool-call parsers (deploy/openai/tool_parsers.py) and the request side of tool calling
(deploy/openai/tools.py): whole outputs, streams cut at every size, and the 400s of bad tools.

Every streamed case is checked against the whole one: the deltas joined give the same content
and calls, each call opens with its id, type and name before any argument text.
"""

from __future__ import annotations

import argparse
import copy
import json

import pytest
from transformers import AutoTokenizer

from deploy import serve
from deploy.openai.protocol import ChatCompletionRequest, OpenAIError
from deploy.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    ToolDelta,
)
from deploy.openai.tools import template_messages, tool_plan

ARGS = '{"city": "Paris", "days": [1, 2]}'
WEATHER = f'{{"name": "get_weather", "arguments": {ARGS}}}'
NO_TAG = "No tools needed: 1 < 2 and <tool is not a tag.\n"
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}

CASES = [
    # (parser, text, content, [(name, arguments)])
    (HermesToolParser, f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", ARGS)]),
    (
        HermesToolParser,
        f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{WEATHER}</tool_call>\n",
        "Let me look.",
        [("get_weather", ARGS)] * 2,
    ),
    (  # SmolLM2's form: a list in one block; keys in any order; parameters for arguments
        HermesToolParser,
        '<tool_call>[{"name": "a", "arguments": {}}, {"parameters": {"x": "}]</tool_call>"}, "name": "b"}]</tool_call>',
        None,
        [("a", "{}"), ("b", '{"x": "}]</tool_call>"}')],
    ),
    (HermesToolParser, '<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    (HermesToolParser, NO_TAG, NO_TAG, []),
    (HermesToolParser, "Ends with a partial tag <tool_ca", "Ends with a partial tag <tool_ca", []),
    (  # not a call: the block is content, as written
        HermesToolParser,
        'Hi <tool_call>{"name": 3}</tool_call> ok',
        'Hi <tool_call>{"name": 3}</tool_call> ok',
        [],
    ),
    (HermesToolParser, "x <tool_call>{oops}</tool_call>", "x <tool_call>{oops}</tool_call>", []),
    (HermesToolParser, "<tool_call>\n", "<tool_call>\n", []),
    (  # cut off (max_tokens): the call as far as it went
        HermesToolParser,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        None,
        [("get_weather", '{"city": "Par')],
    ),
    (
        Llama3JsonToolParser,
        '{"name": "f", "parameters": {"q": "caf\\u00e9 \u00e9", "n": -12.5e3}}; {"name": "g", "parameters": {}}',
        None,
        [("f", '{"q": "caf\\u00e9 \u00e9", "n": -12.5e3}'), ("g", "{}")],
    ),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "f", "arguments": {"a": true}}', None, [("f", '{"a": true}')]),
    (Llama3JsonToolParser, '{"answer": 42}', '{"answer": 42}', []),
    (Llama3JsonToolParser, "The answer is 42.", "The answer is 42.", []),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {}} and more', " and more", [("f", "{}")]),
    (
        JsonArrayToolParser,
        '[{"name":"a","arguments":{"x":[{"y":null}]}},{"name":"b","arguments":{}}]',
        None,
        [("a", '{"x":[{"y":null}]}'), ("b", "{}")],
    ),
]


def streamed(parser, text: str, step: int) -> list[ToolDelta]:
    deltas = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)]
    return [d for d in [*deltas, parser.finish()] if d]


def calls_of(tool_calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]


@pytest.mark.parametrize("parser_type, text, content, calls", CASES)
def test_whole_output(parser_type, text, content, calls):
    got_content, got_calls = parser_type().extract(text)
    assert got_content == content and calls_of(got_calls) == calls
    for call in got_calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert len({c["id"] for c in got_calls}) == len(got_calls)
    if content is not None and not calls:
        assert content == text  # no call: the text comes back untouched


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser_type, text, content, calls", CASES)
def test_stream_deltas_join_to_the_whole_output(parser_type, text, content, calls, step):
    deltas = streamed(parser_type(), text, step)
    assert "".join(d.content for d in deltas) == (content or "")
    joined: dict[int, dict] = {}
    for delta in deltas:
        for entry in delta.tool_calls:
            call = joined.get(entry["index"])
            if call is None:  # a call opens with its id, type and name (and empty arguments)
                assert entry["type"] == "function" and entry["id"].startswith("call_") and entry["function"]["name"]
                assert entry["index"] == len(joined)
                joined[entry["index"]] = {
                    "name": entry["function"]["name"],
                    "arguments": entry["function"]["arguments"],
                }
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                call["arguments"] += entry["function"]["arguments"]
    assert [(c["name"], c["arguments"]) for c in joined.values()] == calls


def test_stream_sends_arguments_before_the_call_ends():
    parser = HermesToolParser()
    assert parser.feed("Sure.").content == "Sure."
    assert parser.feed(" <tool_") == ToolDelta()  # maybe a tag: held back
    first = parser.feed('call>{"name": "get_weather", "arguments": {"ci')
    assert first.content == ""
    assert first.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert parser.feed('ty": "Pa').tool_calls == [{"index": 0, "function": {"arguments": 'ty": "Pa'}}]
    assert parser.feed('ris"}}</tool_call>').tool_calls == [{"index": 0, "function": {"arguments": 'ris"}'}}]
    assert parser.finish() == ToolDelta() and len(parser.calls) == 1


def test_named_parser_opens_the_call_at_once():
    parser = NamedToolParser("get_weather")
    opening = parser.feed("")
    assert opening.tool_calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert parser.feed('{"city":').tool_calls == [{"index": 0, "function": {"arguments": '{"city":'}}]
    content, calls = NamedToolParser("f").extract('{"a":1}')
    assert content is None and calls_of(calls) == [("f", '{"a":1}')]


def test_formats_written_back_parse_again():
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]
    for parser_type in (HermesToolParser, Llama3JsonToolParser):
        content, parsed = parser_type().extract(parser_type.format_calls(calls))
        assert content is None
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [
            (c["name"], c["arguments"]) for c in calls
        ]


# ------------------------------------------------------------------------------------ the request side

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"tools": []}, "tools", "empty"),
        ({"tools": [TOOL, TOOL]}, "tools.1.function.name", "names must differ"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
            "tools.0.function.parameters",
            "Invalid type: strin",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
            'type "object"',
        ),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice", "not one of"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not among the tools (get_weather)",
        ),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "sunny"}]}, "messages.1.tool_call_id", "missing"),
    ],
    ids=[
        "empty",
        "duplicate",
        "invalid-schema",
        "not-an-object",
        "choice-without-tools",
        "unknown-choice",
        "unknown-function",
        "tool-message-without-id",
    ],
)
def test_bad_tools_are_refused_naming_the_field(fields, param, message):
    with pytest.raises(OpenAIError) as caught:
        tool_plan(request(**fields), "hermes")
    assert caught.value.status == 400 and caught.value.param == param and message in caught.value.message


def test_required_and_named_choices_build_their_grammar():
    other = {"type": "function", "function": {"name": "now"}}
    required = tool_plan(request(tools=[TOOL, other], tool_choice="required", parallel_tool_calls=False), "hermes")
    schema = required.constraint["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "now"]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == TOOL["function"]["parameters"]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"]["additionalProperties"] is False
    named = tool_plan(
        request(tools=[other, TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "hermes"
    )
    assert named.constraint == {"json": TOOL["function"]["parameters"]} and named.param == "tools.1.function.parameters"
    assert isinstance(named.new_parser(), NamedToolParser)
    assert tool_plan(request(tools=[TOOL]), "llama3_json").new_parser().name == "llama3_json"
    assert tool_plan(request(tools=[TOOL], tool_choice="none"), "hermes").new_parser() is None
    assert tool_plan(request(tool_choice="none"), "hermes") is None


def test_a_template_without_tools_gets_them_in_a_system_prompt(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    template = tokenizer.chat_template
    assert "tools" not in template  # SmolLM2's template ignores tools: the server writes them
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    plan = tool_plan(request(tools=[TOOL]), "hermes")
    messages, tools_kwarg = template_messages(copy.deepcopy(history), plan, template, HermesToolParser)
    assert tools_kwarg is None and messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in text and "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
    # tool_choice none: the tools stay out of the prompt
    messages, _ = template_messages(
        [dict(m) for m in MESSAGES],
        tool_plan(request(tools=[TOOL], tool_choice="none"), "hermes"),
        template,
        HermesToolParser,
    )
    assert messages == MESSAGES
    # a template that renders tools gets them as its tools keyword
    aware = "{% for t in tools %}{{ t.function.name }}{% endfor %}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
    messages, tools_kwarg = template_messages(copy.deepcopy(history), plan, aware, HermesToolParser)
    assert tools_kwarg == [TOOL] and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_lmforge_serve_offers_every_parser_to_the_frontend_it_starts():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "tool_call_parser")
    assert sorted(action.choices) == sorted(TOOL_PARSERS) and action.default is None
