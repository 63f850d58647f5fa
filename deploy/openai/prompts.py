"""Turning an OpenAI request into engine prompts and sampling parameters (the ``Plan``).

Prompt token ids are checked by the engine's own rules (``engine.inputs``), so a bad prompt is
refused here with the engine's words before anything is sent to Triton. The model's request
limits (``engine.limits.RequestLimits`` from its ``model.json``) are checked the way the engine
checks them, the cheap ones first: the number of prompts x ``n`` and each prompt's characters
before anything is tokenized, the sampling fields' sizes before their entries are validated.
Every refusal is a 400 whose ``param`` names the field.
"""

from __future__ import annotations

import dataclasses
import json

from deploy.openai.models import ServedModel
from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from deploy.openai.tool_parsers import TOOL_PARSERS
from deploy.openai.tools import ToolPlan, template_messages, tool_plan


@dataclasses.dataclass
class Plan:
    """What to ask Triton: one engine request per prompt, ``n`` completions each."""

    model: ServedModel
    prompts: list[list[int]]
    sampling: dict  # SamplingParams fields (JSON)
    n: int
    logprobs: int | None  # top alternatives per token; None = no logprobs
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt text (and its logprobs) before each choice's text
    prompt_texts: list[str] | None = None  # with echo: each prompt as text
    structured_param: str | None = None  # the request field that set a structured-output constraint
    lora_name: str | None = None  # the LoRA adapter the request's ``model`` named (``None``: the base)
    tools: ToolPlan | None = None  # chat: the request's tool calling (deploy.openai.tools)

    @property
    def served_name(self) -> str:
        """The ``model`` the response names: the adapter, or the base."""
        return self.lora_name or self.model.name


def _prompt_error(exc) -> OpenAIError:
    """An ``engine.inputs.PromptError`` as a 400 naming the field."""
    code = exc.code if exc.code == "context_length_exceeded" else None
    return OpenAIError(400, str(exc), param=exc.field, code=code)


def _check_prompt_ids(ids: list[int], model: ServedModel, param: str) -> list[int]:
    """The engine's checks of a prompt's ids (not empty, in the vocabulary) -> 400 naming ``param``."""
    # torch-heavy: imported on use, so importing this module stays light
    from engine.inputs import PromptError, check_prompt_token_ids

    try:
        return check_prompt_token_ids(ids, model.vocab_size, field=param)
    except PromptError as exc:
        raise _prompt_error(exc) from exc


def _check_prompt_length(num_tokens: int, model: ServedModel, param: str) -> None:
    """The engine's check that a prompt leaves room to generate -> 400 ``context_length_exceeded``."""
    # torch-heavy: imported on use, so importing this module stays light
    from engine.inputs import PromptError, check_prompt_length

    try:
        check_prompt_length(num_tokens, model.max_model_len, field=param)
    except PromptError as exc:
        raise _prompt_error(exc) from exc


def request_error(exc) -> OpenAIError:
    """An ``engine.errors.InvalidRequestError`` (a limit, a sampling field) as a 400 naming its ``param``."""
    return OpenAIError(400, str(exc), param=getattr(exc, "param", None))


def _limited(check, *args) -> None:
    """Run a ``RequestLimits`` check; its ``InvalidRequestError`` becomes a 400."""
    # torch-heavy package (engine/__init__): imported on use, so importing this module stays light
    from engine.errors import InvalidRequestError

    try:
        check(*args)
    except InvalidRequestError as exc:
        raise request_error(exc) from exc


def _tokenize(text: str, model: ServedModel, param: str) -> list[int]:
    _limited(model.limits.check_prompt_text, text, param)  # its size and the blank rule, before tokenizing
    return _check_prompt_ids(model.tokenizer(text).input_ids, model, param)


def _token_prompt(ids: list[int], model: ServedModel, param: str) -> list[int]:
    _limited(model.limits.check_prompt_tokens, len(ids), model.max_model_len, param)
    return _check_prompt_ids(ids, model, param)


def completion_prompts(request: CompletionRequest, model: ServedModel) -> list[list[int]]:
    """The prompts' token ids; prompts x ``n`` is checked against the limits before any is tokenized."""
    prompt = request.prompt
    if isinstance(prompt, str):
        _limited(model.limits.check_choices, 1, request.n)
        return [_tokenize(prompt, model, "prompt")]
    if not prompt:
        raise OpenAIError(400, "prompt: empty list; give a string, a list of strings or token ids", param="prompt")
    single = all(isinstance(p, int) for p in prompt)
    _limited(model.limits.check_choices, 1 if single else len(prompt), request.n)
    if single:
        return [_token_prompt(list(prompt), model, "prompt")]
    if all(isinstance(p, str) for p in prompt):
        for i, p in enumerate(prompt):  # every size before any tokenizing
            _limited(model.limits.check_prompt_text, p, f"prompt.{i}")
        return [_tokenize(p, model, f"prompt.{i}") for i, p in enumerate(prompt)]
    return [_token_prompt(list(p), model, f"prompt.{i}") for i, p in enumerate(prompt)]


def template_dicts(messages) -> list[dict]:
    """The chat messages as the chat template takes them: plain dicts, a list of text parts joined into one string."""
    out = []
    for m in messages:
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            message["content"] = "".join(part.text for part in m.content)
        out.append(message)
    return out


def render_chat(model: ServedModel, messages: list[dict], tools: ToolPlan | None, fix: str, **kwargs):
    """``messages`` (``template_dicts``) and ``tools`` through the model's chat template, tools rendered as
    ``template_messages`` says; ``kwargs`` go to ``apply_chat_template`` (its answer is returned).

    Raises:
        OpenAIError: 400 the model has no chat template (``fix`` says what to send instead) or the
            template refuses the messages.
    """
    if model.tokenizer.chat_template is None:
        raise OpenAIError(400, f"model {model.name} has no chat template; {fix}", param="messages")
    template = model.tokenizer.chat_template
    messages, template_tools = template_messages(
        messages,
        tools,
        template if isinstance(template, str) else json.dumps(template),
        TOOL_PARSERS[model.tool_call_parser],
    )
    try:
        return model.tokenizer.apply_chat_template(messages, tools=template_tools, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template that refuses these messages (e.g. role order)
        raise OpenAIError(400, f"messages: the chat template refused them ({exc})", param="messages") from exc


def chat_prompt(request: ChatCompletionRequest, model: ServedModel, tools: ToolPlan | None = None) -> list[int]:
    messages = template_dicts(request.messages)
    for i, message in enumerate(messages):  # OpenAI's API refuses these too; the chat template would fail on them
        if message.get("content") is None and not (message.get("role") == "assistant" and message.get("tool_calls")):
            raise OpenAIError(
                400,
                f"messages.{i}.content: missing or null; a {message.get('role')} message needs content (a string "
                "or a list of text parts; an assistant message may have tool_calls instead)",
                param=f"messages.{i}.content",
            )
    _limited(model.limits.check_choices, 1, request.n)
    num_chars = sum(len(m.get("content") or "") for m in messages)
    if num_chars > model.limits.max_prompt_chars:
        raise OpenAIError(
            400,
            f"messages: {num_chars} characters of content is over the limit of {model.limits.max_prompt_chars}; "
            "shorten them",
            param="messages",
        )
    ids = render_chat(model, messages, tools, "use /v1/completions", add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict):  # BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return _check_prompt_ids(list(ids), model, "messages")


def _find_model(
    request: CompletionRequest | ChatCompletionRequest, models: dict[str, ServedModel]
) -> tuple[ServedModel, str | None]:
    """The model the request names, and the LoRA adapter when ``model`` names one (its base serves it)."""
    model = models.get(request.model)
    if model is not None:
        return model, None
    base = next((m for m in models.values() if request.model in m.adapters), None)
    if base is None:
        served = sorted([*models, *(a for m in models.values() for a in m.adapters)])
        raise OpenAIError(
            404,
            f"the model `{request.model}` does not exist; GET /v1/models lists {served}",
            param="model",
            code="model_not_found",
        )
    return base, request.model


def _max_tokens(
    request: CompletionRequest | ChatCompletionRequest, model: ServedModel, prompts: list[list[int]]
) -> int:
    """The completion budget: as asked, else the rest of the context (chat) or 16 (completions).

    Raises:
        OpenAIError: 400 the longest prompt, or it + ``max_tokens``, over the model's context.
    """
    chat = isinstance(request, ChatCompletionRequest)
    max_tokens = (request.max_completion_tokens or request.max_tokens) if chat else request.max_tokens
    param = "max_completion_tokens" if chat and request.max_completion_tokens else "max_tokens"
    longest = max(len(p) for p in prompts)
    _check_prompt_length(longest, model, "messages" if chat else "prompt")
    defaulted = max_tokens is None
    if defaulted:
        max_tokens = model.max_model_len - longest if chat else 16
    if longest + max_tokens > model.max_model_len:
        why = (
            f": the default max_tokens of /v1/completions); shorten the prompt or pass a smaller {param}"
            if defaulted
            else f"); reduce {param}"
        )
        raise OpenAIError(
            400,
            f"this model's maximum context length is {model.max_model_len} tokens; you requested "
            f"{longest + max_tokens} "
            f"({longest} in the prompt, {max_tokens} in the completion{why}",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def _logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Top alternatives per token (``None``: no logprobs)."""
    if not isinstance(request, ChatCompletionRequest):
        return request.logprobs
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


#: vLLM's extra fields that each set one ``StructuredOutputsParams`` field.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(request: CompletionRequest | ChatCompletionRequest) -> tuple[dict | None, str | None]:
    """The ``StructuredOutputsParams`` fields the request asks for, and the request field that asked.

    ``response_format`` ``json_schema`` (``strict`` or not: the schema is always enforced) and
    ``json_object``, vLLM's ``structured_outputs`` and its older ``guided_*`` fields; ``text`` asks
    for nothing.

    Raises:
        OpenAIError: 400 when two fields constrain the output, a ``json_schema`` without its
            ``schema``, or a constraint ``StructuredOutputsParams`` refuses (none or two kinds set).
    """
    # torch-heavy: imported on use, so importing this module stays light
    from engine.sampling_params import StructuredOutputsParams

    given: list[tuple[str, dict]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema.schema_ is None:
            param = "response_format.json_schema.schema"
            raise OpenAIError(400, f"{param}: missing; give the JSON schema the output must follow", param=param)
        given.append(("response_format.json_schema.schema", {"json": response_format.json_schema.schema_}))
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        given.append(("structured_outputs." + (next(iter(fields)) if len(fields) == 1 else ""), fields))
    given.extend(
        (name, {kind: getattr(request, name)})
        for name, kind in GUIDED_FIELDS.items()
        if getattr(request, name) is not None
    )
    if not given:
        return None, None
    if len(given) > 1:
        names = [name.removesuffix(".") for name, _ in given]
        raise OpenAIError(400, f"{' and '.join(names)} all constrain the output; send one of them", param=names[1])
    param, fields = given[0]
    param = param.removesuffix(".")
    try:
        StructuredOutputsParams.from_value(fields)
    except ValueError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param=param) from exc
    return fields, param


def _sampling(
    request: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    model: ServedModel,
    longest_prompt: int,
    constraint: dict | None = None,
) -> dict:
    """The ``SamplingParams`` fields (JSON) Triton gets, checked by the engine's own rules."""
    # torch-heavy: imported on use, so importing this module stays light
    from engine.sampling_params import SamplingParams

    sampling = {
        "max_tokens": max_tokens,
        "n": request.n,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "min_p": request.min_p,
        "min_tokens": request.min_tokens,
        "repetition_penalty": request.repetition_penalty,
        "ignore_eos": request.ignore_eos,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
    }
    optional = {
        "seed": request.seed,
        "stop": request.stop,
        "top_k": request.top_k,
        "logprobs": logprobs,
        "stop_token_ids": request.stop_token_ids,
        "logit_bias": request.logit_bias,
    }
    sampling.update({k: v for k, v in optional.items() if v is not None})
    try:
        _limited(model.limits.check_params, sampling)  # sizes first (a huge logit_bias is refused by its count)
    except OpenAIError as exc:
        if exc.param == "logprobs" and isinstance(request, ChatCompletionRequest):  # chat names it top_logprobs
            limit = model.limits.max_logprobs
            raise OpenAIError(
                400, f"top_logprobs={logprobs} is over the limit of {limit}", param="top_logprobs"
            ) from exc
        raise
    echo = getattr(request, "echo", False)
    if max_tokens == 0 and not echo:
        raise OpenAIError(
            400,
            "max_tokens: 0 generates nothing; set echo=true (with logprobs) to score the prompt",
            param="max_tokens",
        )
    if echo and (logprobs is not None or max_tokens == 0):  # the prompt tokens' logprobs (lm-eval's loglikelihood)
        sampling["prompt_logprobs"] = logprobs or 0
    if constraint is not None:
        if max_tokens == 0:
            raise OpenAIError(400, "max_tokens: 0 with a structured output generates nothing", param="max_tokens")
        sampling["structured_outputs"] = constraint
    try:
        params = SamplingParams(**sampling)  # the engine's own checks, before anything is sent
        params.check_for_model(model.vocab_size, model.max_model_len, longest_prompt)
    except ValueError as exc:
        error = request_error(exc)
        if error.param == "logprobs" and isinstance(request, ChatCompletionRequest):
            error.param = "top_logprobs"
        raise error from exc
    return sampling


def make_plan(request: CompletionRequest | ChatCompletionRequest, models: dict[str, ServedModel]) -> Plan:
    """Check the request against the model and build what Triton gets.

    Raises:
        OpenAIError: 404 unknown model; 400 a prompt or a parameter the engine refuses, or a
            prompt + ``max_tokens`` beyond the model's context.
    """
    model, lora_name = _find_model(request, models)
    chat = isinstance(request, ChatCompletionRequest)
    tools = tool_plan(request, model.tool_call_parser) if chat else None
    prompts = [chat_prompt(request, model, tools)] if chat else completion_prompts(request, model)
    max_tokens = _max_tokens(request, model, prompts)
    logprobs = _logprobs(request)
    constraint, structured_param = structured_outputs(request)
    if tools is not None and tools.constraint is not None:
        if constraint is not None:
            message = f"{structured_param} and tool_choice={tools.mode} both constrain the output; send one of them"
            raise OpenAIError(400, message, param=structured_param)
        constraint, structured_param = tools.constraint, tools.param
    sampling = _sampling(request, max_tokens, logprobs, model, max(len(p) for p in prompts), constraint)
    if lora_name is not None:
        sampling["lora_name"] = lora_name  # the Triton model's sampling_parameters field (deploy.llm_request)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    if request.stream_options is not None and not request.stream:
        raise OpenAIError(400, "stream_options: only allowed with stream=true", param="stream_options")
    echo = not chat and request.echo
    return Plan(
        model,
        prompts,
        sampling,
        request.n,
        logprobs,
        request.stream,
        include_usage,
        echo=echo,
        prompt_texts=_echo_texts(request, prompts, model) if echo else None,
        structured_param=structured_param,
        lora_name=lora_name,
        tools=tools,
    )


def _echo_texts(request: CompletionRequest, prompts: list[list[int]], model: ServedModel) -> list[str]:
    """Each prompt as the client sent it: its text, or its token ids decoded (as vLLM echoes them)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [model.tokenizer.decode(ids) for ids in prompts]
