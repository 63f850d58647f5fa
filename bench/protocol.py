"""The wire protocols of the load test, without Locust (no gevent patching): Triton's generate
extension for our LLM model, and the OpenAI API (``openai_payload``, ``read_openai_stream``).

Requests: ``POST /v2/models/NAME/generate`` (one JSON answer) or ``/generate_stream`` (server-sent
events, one ``data: {...}`` line per response) with the model's inputs ``text_input``,
``stream``, ``exclude_input_in_output`` and ``sampling_parameters`` (a JSON string of
``SamplingParams`` fields). Responses carry ``text_output`` (the new text when streaming),
``num_input_tokens``, ``num_output_tokens`` and, on the last one, ``finish_reason``; a failed
request answers ``{"error": ...}``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import requests

from engine.errors import LmforgeError


def request_payload(prompt: str, sampling_parameters: dict, *, stream: bool) -> dict:
    """The JSON body of a Triton generate request for our model's inputs."""
    return {
        "text_input": prompt,
        "stream": stream,
        "exclude_input_in_output": True,
        "sampling_parameters": json.dumps(sampling_parameters),
    }


def parse_sse_line(line: bytes) -> dict | None:
    """The JSON event of one SSE line ``data: {...}``; ``None`` for blank lines and comments.

    Raises:
        ValueError: a ``data:`` line whose payload is not a JSON object.
    """
    if not line.startswith(b"data:"):
        return None
    event = json.loads(line[5:].strip().decode("utf-8"))
    if not isinstance(event, dict):
        raise ValueError(f"SSE event is not a JSON object: {line[:200]!r}")
    return event


class StreamError(LmforgeError):
    """The server reported an error, or the stream broke off; the message says which."""


@dataclass
class StreamResult:
    """What one request produced, before it becomes a :class:`RequestSample`."""

    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each text event
    text: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None


def read_stream(response: requests.Response, result: StreamResult) -> None:
    """Consume an SSE body into ``result`` as it arrives (mutated in place, so a failure keeps
    what came before it).

    Raises:
        StreamError: an ``error`` event, a malformed event, or a body that ends before a
            ``finish_reason`` was seen.
    """
    for line in response.iter_lines(chunk_size=None):
        now = time.perf_counter()
        try:
            event = parse_sse_line(line)
        except ValueError as exc:
            raise StreamError(f"malformed SSE event: {exc}") from exc
        if event is None:
            continue
        _apply_event(event, now, result)
    if result.finish_reason is None:
        raise StreamError("stream ended without a final event (finish_reason missing)")


def _apply_event(event: dict, now: float, result: StreamResult) -> None:
    if "error" in event:
        raise StreamError(f"server error: {event['error']}")
    text = event.get("text_output")
    if isinstance(text, str) and text:
        result.chunk_times.append(now)
        result.text += text
    if event.get("num_input_tokens") is not None:
        result.input_tokens = int(event["num_input_tokens"])
    if event.get("num_output_tokens") is not None:
        result.output_tokens = int(event["num_output_tokens"])
    if event.get("finish_reason"):
        result.finish_reason = str(event["finish_reason"])


def _json_object(response: requests.Response) -> dict:
    try:
        body = response.json()
    except ValueError as exc:
        raise StreamError(f"response is not JSON: {response.text[:200]!r}") from exc
    if not isinstance(body, dict):
        raise StreamError(f"response is not a JSON object: {response.text[:200]!r}")
    return body


def read_whole(response: requests.Response, result: StreamResult) -> None:
    """Fill ``result`` from a non-streaming ``/generate`` JSON body.

    Raises:
        StreamError: an ``error`` field or a body that is not JSON.
    """
    body = _json_object(response)
    _apply_event(body, time.perf_counter(), result)
    result.chunk_times = []  # no token timing without a stream


# --------------------------------------------------------------------------------------------
# OpenAI API (our deploy/openai/, `vllm serve`, `llama-server`)
# --------------------------------------------------------------------------------------------

#: ``--endpoint`` values of the OpenAI API and their paths.
OPENAI_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def openai_payload(
    prompt: str, sampling_parameters: dict, *, model: str, endpoint: str, stream: bool, system: str | None = None
) -> dict:
    """The JSON body of an OpenAI ``/v1/chat/completions`` (prompt as one user message, after
    ``system`` as a system message when given) or ``/v1/completions`` request with the same
    sampling fields (and ``response_format`` when ``sampling_parameters`` has one); streamed with usage."""
    body: dict = {
        "model": model,
        "max_tokens": sampling_parameters["max_tokens"],
        "temperature": sampling_parameters.get("temperature", 1.0),
        "top_p": sampling_parameters.get("top_p", 1.0),
    }
    if endpoint == "chat":
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
    else:
        body["prompt"] = prompt
    if sampling_parameters.get("ignore_eos"):
        body["ignore_eos"] = True  # an extension our server, vLLM and llama-server accept
    if sampling_parameters.get("response_format"):
        body["response_format"] = sampling_parameters["response_format"]  # structured output
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def read_openai_stream(response: requests.Response, result: StreamResult) -> None:
    """Consume an OpenAI SSE body (chunks, then ``data: [DONE]``) into ``result`` as it arrives.

    A chunk with new text (``delta.content`` or ``text``) is a token event; ``usage`` (the last
    chunk with ``stream_options.include_usage``) gives the token counts.

    Raises:
        StreamError: an ``error`` event, a malformed event, or a body that ends before
            ``[DONE]`` or without a ``finish_reason``.
    """
    done = False
    for line in response.iter_lines(chunk_size=None):
        now = time.perf_counter()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        try:
            event = json.loads(payload.decode("utf-8"))
        except ValueError as exc:
            raise StreamError(f"malformed SSE event: {line[:200]!r}") from exc
        _apply_openai_event(event, now, result)
    if not done or result.finish_reason is None:
        raise StreamError("stream ended without data: [DONE] and a finish_reason")


def _apply_openai_event(event: dict, now: float, result: StreamResult) -> None:
    if not isinstance(event, dict):
        raise StreamError(f"SSE event is not a JSON object: {str(event)[:200]}")
    if "error" in event:
        raise StreamError(f"server error: {event['error']}")
    for choice in event.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        if isinstance(text, str) and text:
            result.chunk_times.append(now)
            result.text += text
        if choice.get("finish_reason"):
            result.finish_reason = str(choice["finish_reason"])
    usage = event.get("usage")
    if isinstance(usage, dict):
        if usage.get("prompt_tokens") is not None:
            result.input_tokens = int(usage["prompt_tokens"])
        if usage.get("completion_tokens") is not None:
            result.output_tokens = int(usage["completion_tokens"])


def read_openai_whole(response: requests.Response, result: StreamResult) -> None:
    """Fill ``result`` from a non-streaming OpenAI JSON body.

    Raises:
        StreamError: an ``error`` field or a body that is not a JSON object.
    """
    body = _json_object(response)
    for choice in body.get("choices") or []:
        if "message" in choice:
            choice = {**choice, "delta": choice["message"]}
        _apply_openai_event({"choices": [choice]}, time.perf_counter(), result)
    _apply_openai_event({k: v for k, v in body.items() if k != "choices"}, time.perf_counter(), result)
    result.chunk_times = []
