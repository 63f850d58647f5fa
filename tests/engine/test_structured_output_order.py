"""A JSON schema's property order survives the grammar cache (engine/structured_output.py ``grammar_key``):
llguidance generates properties in schema order, so a forced tool call writes its ``name`` before its
``arguments`` and a ``response_format`` model's fields come in the order the model class declares them."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.sampling_params import StructuredOutputsParams
from engine.structured_output import GrammarCompiler, grammar_key

ARGUMENTS = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
CALL = {
    "type": "object",
    "properties": {"name": {"const": "f"}, "arguments": ARGUMENTS},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def test_grammar_key_keeps_property_order_and_sorts_the_rest():
    kind, text = grammar_key(StructuredOutputsParams(json=CALL))
    assert kind == "json" and text.index('"name"') < text.index('"arguments"') and text.index('"b"') < text.index('"a"')
    assert text.startswith('{"additionalProperties":false,"properties":')  # keywords sorted
    reordered = {k: CALL[k] for k in reversed(CALL)}  # the same schema, keywords in another order
    assert grammar_key(StructuredOutputsParams(json=reordered)) == grammar_key(StructuredOutputsParams(json=CALL))
    swapped = {**CALL, "properties": {k: CALL["properties"][k] for k in ("arguments", "name")}}
    assert grammar_key(StructuredOutputsParams(json=swapped)) != grammar_key(StructuredOutputsParams(json=CALL))
    nested = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"z": {}, "y": {}}}}}
    text = grammar_key(StructuredOutputsParams(json=nested))[1]
    assert text.index('"z"') < text.index('"y"')  # a property named "properties" is a schema, its map kept too


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    yield tokenizer, compiler
    compiler.shutdown()


@pytest.mark.parametrize(
    "text, accepted",
    [('{"name":"f","arguments":{"b":1,"a":2}}', True), ('{"arguments":{"b":1,"a":2},"name":"f"}', False)],
)
def test_the_compiled_grammar_generates_properties_in_schema_order(compiler, text, accepted):
    tokenizer, grammars = compiler
    matcher = grammars.submit(StructuredOutputsParams(json=CALL)).result(timeout=120).new_matcher()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert (matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()) == accepted
