"""The OpenAI API's protocol as lmforge serves it: the request bodies and the error shape.

Request bodies are pydantic models checked strictly, like OpenAI's own API: a field of the wrong
type, an out-of-range value or an unknown field is an error naming the field. vLLM's extra
sampling fields (``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``) are accepted, and so are its structured-output fields (``structured_outputs``,
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``) beside OpenAI's
``response_format``. Errors are ``OpenAIError`` with OpenAI's body
``{"error": {"message", "type", "param", "code"}}``. ``deploy.openai.app`` serves them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

#: Seconds a client should wait before retrying a 503 (a model or the server recovering).
RETRY_AFTER_S = 5


# --------------------------------------------------------------------------------------------
# Request bodies (strict: wrong types and unknown fields are errors)
# --------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema is enforced whether ``strict`` is true or not."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StructuredOutputsFields(_Strict):
    """vLLM's ``structured_outputs`` extra field (``engine.sampling_params.StructuredOutputsParams``)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)  # its upper bound is the model's RequestLimits (deploy.openai.prompts)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # the engine's own fields, with vLLM's names
    top_k: int | None = Field(None, ge=1)
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # structured output: OpenAI's field, then vLLM's (at most one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a prompt is text, a list of texts, token ids or lists of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt only (with echo)
    logprobs: int | None = Field(None, ge=0)  # at most the model's limits.max_logprobs
    echo: bool = False  # the prompt before the completion; with logprobs, the prompt tokens' logprobs too


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # the SDK's parse() adds parsed_arguments
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(BaseModel):
    """An earlier assistant message's tool call, sent back with the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A chat message; fields beyond ``role`` and ``content`` go to the chat template as given."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None  # the schema is enforced when the grammar forces a call, strict or not


class ChatCompletionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class _ToolFields(_Strict):
    """The tool fields of a chat request (checked in ``deploy.openai.tools``)."""

    tools: list[ChatCompletionTool] | None = None
    # none, auto, required (checked with the tools) or a function: a dict is read as the function form only
    tool_choice: (
        Annotated[
            Annotated[str, Tag("str")] | Annotated[NamedToolChoice, Tag("NamedToolChoice")],
            Discriminator(lambda v: "str" if isinstance(v, str) else "NamedToolChoice"),
        ]
        | None
    ) = None
    parallel_tool_calls: bool = True


class ChatCompletionRequest(_SamplingFields, _ToolFields):
    """``POST /v1/chat/completions``; ``tools`` and ``tool_choice`` are checked in ``deploy.openai.tools``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``: ``input`` is a text, a list of texts, token ids or lists of them."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # only the model's own width: it has no shorter embeddings
    user: str | None = None


class TokenizeCompletionRequest(_Strict):
    """``POST /tokenize`` of a prompt (vLLM's body); ``model`` may be left out when one LLM is served."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ToolFields):
    """``POST /tokenize`` of chat messages through the model's chat template (vLLM's body), with the
    ``tools`` rendered as ``/v1/chat/completions`` renders them."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's body)."""

    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status (a 503 also with ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_elsewhere = False  # a model instance refused it for a dead stub: another instance may take it

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unavailable(message: str) -> OpenAIError:
    """A 503 ``server_error`` (with ``Retry-After``): the model or the server is recovering; retry."""
    return OpenAIError(503, message, type_="server_error", code="model_unavailable")


#: What a JSON value that is not an object is, by the Python type it parses into (for error messages).
_JSON_KINDS = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def validation_error(exc: ValidationError) -> OpenAIError:
    """The first pydantic error as a 400 naming the field."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON ({first['msg']})", code="invalid_json")
    if not first["loc"]:  # the body itself: valid JSON, but an array, a string, a number or null
        kind = _JSON_KINDS.get(type(first.get("input")), "not an object")
        return OpenAIError(400, f"the request body must be a JSON object, not {kind}", code="invalid_value")
    loc = [str(part) for part in first["loc"] if not isinstance(part, str) or not _is_type_tag(part)]
    if len(loc) > 1 and loc[0] == "response_format":  # drop the union's tag (the ``type`` it matched)
        del loc[1]
    param = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        return OpenAIError(400, f"unrecognized request argument supplied: {param}", param=param, code="unknown_field")
    if first["type"] == "missing":
        return OpenAIError(400, f"{param}: missing required field", param=param, code="missing_field")
    value = first.get("input")
    if isinstance(value, float) and not math.isfinite(value):  # a bound check would read "<= 2 (got nan)"
        return OpenAIError(400, f"{param}: must be a finite number (got {value})", param=param, code="invalid_value")
    shown = repr(value)[:80]
    return OpenAIError(400, f"{param}: {first['msg']} (got {shown})", param=param, code="invalid_value")


def _is_type_tag(part: str) -> bool:
    """Union members in pydantic locations (``str``, ``list[int]``...), not field names."""
    return (
        part in ("str", "int", "float", "bool")
        or part.startswith(("list[", "dict["))
        or part in ("ContentPart", "NamedToolChoice")
    )


class LoadLoRAAdapterRequest(_Strict):
    """``POST /v1/load_lora_adapter`` (vLLM's body); ``base_model_name`` picks the base when several are served."""

    lora_name: str
    lora_path: str
    base_model_name: str | None = None
    load_inplace: bool = False  # replace an adapter of that name (vLLM's field)


class UnloadLoRAAdapterRequest(_Strict):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    lora_name: str
    lora_int_id: int | None = None
