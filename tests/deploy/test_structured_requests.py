"""How structured-output and scoring fields of a request become ``SamplingParams`` fields, without a server:
the OpenAI body (``deploy.openai.prompts.structured_outputs``) and Triton's ``sampling_parameters``."""

from __future__ import annotations

import json
import re

import pytest

from deploy.llm_request import parse_sampling_parameters
from deploy.openai.prompts import structured_outputs
from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from engine.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": False}}


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "llm", "messages": [{"role": "user", "content": "x"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


@pytest.mark.parametrize(
    "fields, expected, param",
    [
        ({}, None, None),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}, "response_format"),
        ({"response_format": JSON_SCHEMA}, {"json": SCHEMA}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}, "structured_outputs.choice"),
        ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}, "guided_json"),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}, "guided_regex"),
        ({"guided_choice": ["x"]}, {"choice": ["x"]}, "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}, "guided_grammar"),
    ],
)  # fmt: skip
def test_openai_fields_map_onto_structured_outputs(fields, expected, param):
    constraint, source = structured_outputs(chat(**fields))
    assert constraint == expected and source == param
    if constraint is not None:
        StructuredOutputsParams.from_value(constraint)  # what the engine builds from it


def test_two_constraints_or_a_bad_one_are_refused_naming_the_field():
    with pytest.raises(OpenAIError) as error:
        structured_outputs(chat(response_format={"type": "json_object"}, guided_regex="a"))
    assert error.value.status == 400 and error.value.param == "guided_regex"
    with pytest.raises(OpenAIError) as error:
        structured_outputs(chat(guided_choice=[]))
    assert error.value.param == "guided_choice" and "non-empty list" in error.value.message
    completion = CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "x", "guided_json": "{"}))
    with pytest.raises(OpenAIError) as error:
        structured_outputs(completion)
    assert error.value.param == "guided_json" and "not valid JSON" in error.value.message


def test_triton_sampling_parameters_take_structured_outputs_guided_decoding_and_prompt_logprobs():
    params = parse_sampling_parameters(json.dumps({"structured_outputs": {"regex": "a+"}, "max_tokens": 4}))
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    legacy = parse_sampling_parameters(json.dumps({"guided_decoding": {"json": SCHEMA}}))
    assert legacy.structured_outputs == StructuredOutputsParams(json=SCHEMA)
    scoring = parse_sampling_parameters(json.dumps({"max_tokens": 0, "prompt_logprobs": 2}))
    assert scoring.max_tokens == 0 and scoring.prompt_logprobs == 2
    for fields, message in [
        ({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}, "both structured_outputs"),
        ({"structured_outputs": {"regex": "a", "json_object": True}}, "sets regex and json_object"),
        ({"structured_outputs": {"xml": "a"}}, "unknown field(s) ['xml']"),
        ({"prompt_logprobs": 21}, "prompt_logprobs=21 is over the limit of 20"),
        ({"max_tokens": 0}, "max_tokens=0 generates nothing"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_sampling_parameters(json.dumps(fields))
