"""Turn the LLM model's Triton input tensors into an engine request (no Triton import).

The tensors are those of Triton's vLLM backend, so its clients work unchanged:

* ``text_input`` (STRING): the prompt, non-empty; or
* ``prompt_token_ids`` (INT64 [-1]): the prompt already tokenized (exactly one of the two);
* ``stream`` (BOOL, default false): one response per engine step instead of one at the end;
* ``sampling_parameters`` (STRING, default ``{}``): a JSON object of ``SamplingParams`` fields,
  e.g. ``{"temperature": 0, "max_tokens": 32}``; a constraint as
  ``{"structured_outputs": {"json": {...schema...}}}`` (or ``regex``, ``choice``, ``grammar``,
  ``json_object``), also under older vLLM's name ``guided_decoding``; ``{"prompt_logprobs": k}``;
  ``{"lora_name": "NAME"}`` runs the request with that LoRA adapter (as Triton's vLLM backend; the
  model serves the adapters of ``deploy.lora_adapters``);
* ``exclude_input_in_output`` (BOOL, default false): for non-streaming requests, leave the
  prompt out of ``text_output`` (streamed responses never repeat it).

Every problem raises ``ValueError`` naming the field and the fix; the model sends it back as the
error of that one request. The engine's ``RequestLimits`` (``EngineConfig.limits``) are checked
here first, before anything is tokenized: the prompt's size, and ``n``, stop strings, stop token
ids and ``logit_bias`` by their sizes in the JSON before ``SamplingParams`` validates their entries.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from deploy.lora_adapters import check_adapter_name
from engine.errors import InvalidRequestError
from engine.limits import RequestLimits


@dataclasses.dataclass(frozen=True)
class LLMRequest:
    """A parsed request: what to generate and how to answer."""

    prompt: str | dict  # text, or {"prompt_token_ids": [...]}
    sampling_params: Any  # engine.SamplingParams
    stream: bool
    exclude_input_in_output: bool
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base)

    @property
    def prompt_text(self) -> str:
        """The prompt as text ("" for a tokenized prompt: it is never echoed)."""
        return self.prompt if isinstance(self.prompt, str) else ""


def _first(values: Any, field: str) -> Any:
    """The single element of a ``[1]`` (or ``[1, 1]``) input tensor as a Python value."""
    flat = list(getattr(values, "flat", values))
    if len(flat) != 1:
        raise ValueError(f"{field}: expected one element, got {len(flat)}; send shape [1]")
    value = flat[0]
    return value.item() if hasattr(value, "item") else value


def decode_text(value: Any, field: str) -> str:
    """A STRING tensor element (bytes from Triton) as ``str``."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{field}: not valid UTF-8 ({exc}); send UTF-8 text") from exc
    if isinstance(value, str):
        return value
    raise ValueError(f"{field}: expected a string, got {type(value).__name__}")


def parse_sampling_parameters(text: str | None, limits: RequestLimits | None = None):
    """JSON object -> ``engine.SamplingParams`` (``parse_lora_parameters`` also takes ``lora_name``).

    Raises:
        ValueError: not JSON, not an object, an unknown field (lists the known ones), a size over
            ``limits`` (default ``RequestLimits()``), or a value ``SamplingParams`` rejects (its message
            names the field).
    """
    # torch-heavy: imported on use, so importing this module stays light
    from engine import SamplingParams

    fields = _json_object(text)
    if fields is None:
        return SamplingParams()
    return _sampling_params(fields, limits)


def parse_lora_parameters(text: str | None, limits: RequestLimits | None = None):
    """``sampling_parameters`` JSON -> ``(SamplingParams, lora_name or None)``.

    Raises:
        ValueError: as ``parse_sampling_parameters``; a ``lora_name`` that is not an adapter name (names it).
    """
    # torch-heavy: imported on use, so importing this module stays light
    from engine import SamplingParams

    fields = _json_object(text)
    if fields is None:
        return SamplingParams(), None
    lora_name = fields.pop("lora_name", None)
    if lora_name is not None:
        check_adapter_name(lora_name, "sampling_parameters.lora_name")
    return _sampling_params(fields, limits), lora_name


def _json_object(text: str | None) -> dict | None:
    """The ``sampling_parameters`` JSON object, ``None`` when empty (ValueError naming the problem)."""
    if text is None or not text.strip():
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"sampling_parameters: malformed JSON ({exc.msg} at position {exc.pos}); send a JSON object such "
            'as {"max_tokens": 32}'
        ) from exc
    except RecursionError as exc:
        raise ValueError(
            'sampling_parameters: JSON nested too deeply; send a flat JSON object such as {"max_tokens": 32}'
        ) from exc
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise ValueError(
            f'sampling_parameters: unreadable JSON ({exc}); send a JSON object such as {{"max_tokens": 32}}'
        ) from exc
    if not isinstance(fields, dict):
        raise ValueError(f"sampling_parameters: expected a JSON object, got {type(fields).__name__}")
    return fields


def _sampling_params(fields: dict, limits: RequestLimits | None):
    # torch-heavy: imported on use, so importing this module stays light
    from engine import SamplingParams

    if "guided_decoding" in fields:  # older vLLM's name of structured_outputs (Triton's vLLM backend clients)
        if "structured_outputs" in fields:
            raise InvalidRequestError(
                "sampling_parameters: both structured_outputs and guided_decoding given; send one",
                param="structured_outputs",
            )
        fields["structured_outputs"] = fields.pop("guided_decoding")
    known = {f.name for f in dataclasses.fields(SamplingParams)} if dataclasses.is_dataclass(SamplingParams) else None
    if known is not None:
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"sampling_parameters: unknown field(s) {unknown}; known fields: {sorted(known)}")
    (limits or RequestLimits()).check_params(fields)
    try:
        return SamplingParams(**fields)
    except TypeError as exc:  # unknown keyword when SamplingParams is not a dataclass
        raise ValueError(f"sampling_parameters: {exc}") from exc


def parse_request(
    text_input: Any,
    stream: Any = None,
    sampling_parameters: Any = None,
    exclude_input_in_output: Any = None,
    prompt_token_ids: Any = None,
    limits: RequestLimits | None = None,
    max_model_len: int | None = None,
) -> LLMRequest:
    """Build an ``LLMRequest`` from the input tensors' values (``None`` = input absent).

    Args:
        limits: the engine's ``RequestLimits`` (default ``RequestLimits()``).
        max_model_len: the engine's, to refuse a tokenized prompt by its length before reading it.

    Raises:
        ValueError: neither or both of ``text_input`` and ``prompt_token_ids``, an empty or too
            long prompt, a limit exceeded, a bad ``sampling_parameters``, or ``n`` > 1 without ``stream``
            (refused before anything runs: Triton's ``generate`` would turn the ``n`` responses into an error).
    """
    limits = limits or RequestLimits()
    if text_input is None and prompt_token_ids is None:
        raise ValueError("text_input: missing; send the prompt as text_input (or its tokens as prompt_token_ids)")
    if text_input is not None and prompt_token_ids is not None:
        raise ValueError("text_input and prompt_token_ids both given; send one of them")
    if text_input is not None:
        prompt: str | dict = decode_text(_first(text_input, "text_input"), "text_input")
        limits.check_prompt_text(prompt, "text_input")
    else:
        flat = getattr(prompt_token_ids, "flat", prompt_token_ids)
        num_ids = getattr(prompt_token_ids, "size", None)
        num_ids = len(flat) if num_ids is None else int(num_ids)
        if not num_ids:
            raise ValueError("prompt_token_ids: empty; send at least one token id")
        limits.check_prompt_tokens(num_ids, max_model_len or limits.max_prompt_chars + 1, "prompt_token_ids")
        prompt = {"prompt_token_ids": [int(t) for t in flat]}
    params_text = (
        None
        if sampling_parameters is None
        else decode_text(_first(sampling_parameters, "sampling_parameters"), "sampling_parameters")
    )
    sampling_params, lora_name = parse_lora_parameters(params_text, limits)
    streaming = False if stream is None else bool(_first(stream, "stream"))
    if sampling_params.n > 1 and not streaming:
        raise InvalidRequestError(
            f"n={sampling_params.n} with stream=false: a non-streaming request (Triton's generate) gets exactly one "
            "response and each completion needs its own; send stream=true (generate_stream or a gRPC stream) or n=1",
            param="n",
        )
    return LLMRequest(
        prompt=prompt,
        sampling_params=sampling_params,
        lora_name=lora_name,
        stream=streaming,
        exclude_input_in_output=False
        if exclude_input_in_output is None
        else bool(_first(exclude_input_in_output, "exclude_input_in_output")),
    )
