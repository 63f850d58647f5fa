"""Tool calling on ``/v1/chat/completions``: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked and turned into a ``ToolPlan``.

``tool_choice``:

- ``none``: no tool is called; the tools are left out of the prompt (as vLLM's
  ``--exclude-tools-when-tool-choice-none``), so the model answers in words.
- ``auto`` (the default with tools): the model decides; its text is read by the server's
  ``--tool-call-parser`` (``deploy.openai.tool_parsers``).
- ``required`` and ``{"type": "function", "function": {"name": ...}}``: enforced by a grammar
  (a ``structured_outputs`` JSON schema built from the tools' ``parameters``, as vLLM does), so
  even a small model always writes a valid call: a JSON list of ``{"name", "arguments"}`` objects
  (one at most without ``parallel_tool_calls``), or the named function's arguments.

The tools reach the model through its chat template (``apply_chat_template(..., tools=...)``). A
template that ignores tools (SmolLM2's) gets them in a system prompt written in the parser's
format, and earlier assistant ``tool_calls`` written back in that format. Every refusal is a 400
naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json

from deploy.openai.protocol import ChatCompletionRequest, OpenAIError, TokenizeChatRequest
from deploy.openai.tool_parsers import (
    TOOL_PARSERS,
    JsonArrayToolParser,
    NamedToolParser,
    ToolParser,
)


@dataclasses.dataclass
class ToolPlan:
    """What a chat request's tools ask: how the output is read, and the grammar that forces a call."""

    mode: str  # none | auto | required | named
    parser: type[ToolParser]  # the server's --tool-call-parser (its prompt format)
    tools: list[dict]  # the tools as the chat template gets them
    function_name: str | None = None  # the named tool_choice
    constraint: dict | None = None  # structured_outputs fields of required / named
    param: str | None = None  # the request field the constraint stands for (named in grammar errors)

    def new_parser(self) -> ToolParser | None:
        """A fresh parser for one choice (``None``: the output is plain content)."""
        if self.mode == "named":
            return NamedToolParser(self.function_name)
        if self.mode == "required":
            return JsonArrayToolParser()
        if self.mode == "auto":
            return self.parser()
        return None


def _object_schema(parameters: dict | None) -> dict:
    """A function's ``parameters`` as the schema of its arguments (an object; none: no arguments)."""
    if parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return parameters if "type" in parameters else {**parameters, "type": "object"}


@functools.lru_cache(maxsize=256)
def _schema_error(schema_json: str) -> str:
    """llguidance's complaint about a JSON schema ("" when it can enforce it); the engine compiles the
    same schema for required / named tool_choice."""
    # optional dependency: imported on the path that needs it
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults={"whitespace_flexible": False})
    except ValueError as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar)


def _check_tools(request: ChatCompletionRequest | TokenizeChatRequest) -> list[dict]:
    if not request.tools:
        raise OpenAIError(400, "tools: empty list; give at least one function or leave tools out", param="tools")
    seen: dict[str, int] = {}
    tools = []
    for i, tool in enumerate(request.tools):
        function = tool.function
        if function.name in seen:
            param = f"tools.{i}.function.name"
            raise OpenAIError(
                400, f"{param}: `{function.name}` is also tools.{seen[function.name]}; names must differ", param=param
            )
        seen[function.name] = i
        if function.parameters is not None:
            param = f"tools.{i}.function.parameters"
            kind = function.parameters.get("type", "object")
            if kind != "object":
                raise OpenAIError(
                    400,
                    f'{param}: the schema\'s type is {kind!r}; a function takes an object (type "object")',
                    param=param,
                )
            error = _schema_error(json.dumps(function.parameters, sort_keys=True))
            if error:
                raise OpenAIError(
                    400, f"{param}: not a JSON schema the server can enforce ({error}); fix it", param=param
                )
        tools.append({"type": "function", "function": function.model_dump(exclude_none=True)})
    return tools


def _required_schema(tools: list[dict], parallel: bool) -> dict:
    """The schema of ``required``: a list of calls, each the name of a tool and arguments valid for it."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": _object_schema(tool["function"].get("parameters")),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_plan(request: ChatCompletionRequest | TokenizeChatRequest, parser_name: str) -> ToolPlan | None:
    """The request's tool calling (``None``: it has neither tools nor a ``tool_choice``).

    Raises:
        OpenAIError: 400 an empty or duplicate tool, ``parameters`` that are not an object schema the
            grammar can enforce, a ``tool_choice`` that is unknown, names no given tool or comes without
            tools, or a ``role: "tool"`` message without ``tool_call_id``.
    """
    for i, message in enumerate(request.messages):
        if message.role == "tool" and not message.tool_call_id:
            param = f"messages.{i}.tool_call_id"
            raise OpenAIError(400, f"{param}: missing; a tool message answers the call of that id", param=param)
    choice = request.tool_choice
    if request.tools is None:
        if choice is None or choice == "none":
            return None
        raise OpenAIError(400, "tool_choice: needs tools; give the functions the model may call", param="tool_choice")
    tools = _check_tools(request)
    parser = TOOL_PARSERS[parser_name]
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise OpenAIError(
                400,
                f"tool_choice: {choice!r} is not one of none, auto, required, "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if choice == "required":
            constraint = {"json": _required_schema(tools, request.parallel_tool_calls)}
            return ToolPlan("required", parser, tools, constraint=constraint, param="tools")
        return ToolPlan(choice, parser, tools)
    name = choice.function.name
    index = next((i for i, tool in enumerate(tools) if tool["function"]["name"] == name), None)
    if index is None:
        names = ", ".join(tool["function"]["name"] for tool in tools)
        param = "tool_choice.function.name"
        raise OpenAIError(400, f"{param}: `{name}` is not among the tools ({names})", param=param)
    constraint = {"json": _object_schema(tools[index]["function"].get("parameters"))}
    return ToolPlan("named", parser, tools, name, constraint, f"tools.{index}.function.parameters")


def template_messages(
    messages: list[dict], tools: ToolPlan | None, template: str, parser: type[ToolParser]
) -> tuple[list[dict], list[dict] | None]:
    """The messages as the chat template gets them, and its ``tools`` keyword (``None``: none).

    Earlier calls' ``arguments`` (JSON text in OpenAI's messages) become objects, as templates
    expect. A template that does not render tools gets them as a system prompt (``parser.prompt``)
    and earlier calls as assistant text (``parser.format_calls``).
    """
    for message in messages:
        for call in message.get("tool_calls") or []:
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except (TypeError, ValueError):
                pass  # not JSON text: the template gets it as it is
    if "tool_calls" not in template:
        for message in messages:
            calls = message.pop("tool_calls", None)
            if calls:
                written = parser.format_calls(
                    [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
                )
                message["content"] = ((message.get("content") or "") + "\n" + written).lstrip("\n")
    show = tools is not None and tools.mode != "none"
    if show and "tools" in template:
        return messages, tools.tools
    if show:
        prompt = parser.prompt(tools.tools)
        if messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, None
