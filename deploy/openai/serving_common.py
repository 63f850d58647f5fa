"""What every generating endpoint shares: the request path (parse, plan, Triton stream), whole
responses and server-sent events, usage counting and logprobs formatting.

A serving class (``serving_completions``, ``serving_chat``) subclasses ``OpenAIServing`` and
only says how one choice looks, whole (``choice``) and streamed (``render``).

A client that goes away is noticed within ``DISCONNECT_POLL_S`` whatever the mode: while its
request waits for the first output (queued behind others) and, without ``stream``, until the
whole answer is ready, ``Request.is_disconnected`` is polled and the Triton requests are
cancelled (Triton aborts them in the engine); a streamed response is cancelled by the server when
its writes fail. An error after the stream started ends it with an error event and ``[DONE]``.

The streaming path does per step only what it must: the pieces already waiting are merged per
choice (``coalesce``: one event carries several tokens when the writer fell behind), each event is
the stream's constant head (id, object, created, model: encoded once) plus ``orjson`` of its
choices, and the events of one wake-up go out as one write. Text comes detokenized from the
engine (once, incrementally); the frontend never decodes tokens except for logprobs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable

import orjson
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from deploy.openai.models import ServedModel
from deploy.openai.prompts import Plan, make_plan
from deploy.openai.protocol import OpenAIError, validation_error
from deploy.openai.triton_client import Piece, PieceQueue, TritonBackend, coalesce

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: How often a request that has nothing to send yet checks whether its client is still connected (seconds).
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready (its Triton requests are cancelled)."""


async def unless_disconnected(work: Awaitable, is_disconnected: Callable[[], Awaitable[bool]] | None):
    """``await work``, polling ``is_disconnected`` every ``DISCONNECT_POLL_S`` meanwhile.

    Raises:
        ClientGone: the client left first (``work`` is cancelled).
    """
    task = asyncio.ensure_future(work)
    if is_disconnected is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, piece: Piece, offset: int) -> dict:
    """``/v1/completions`` logprobs of one piece (``text_offset`` from ``offset`` characters)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    position = offset
    for token_id, entry in zip(piece.token_ids, piece.logprobs or []):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        top.append({token_text(tokenizer, t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echo_logprobs(tokenizer, prompt_ids: list[int], prompt_logprobs: list | None, piece: Piece | None) -> dict:
    """``/v1/completions`` logprobs with ``echo``: the prompt's tokens (the first with ``null``s, as
    OpenAI and vLLM), then the piece's (``piece=None``: the prompt alone), offsets from 0."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    position = 0
    for token_id, entry in zip(prompt_ids, prompt_logprobs or [None] * len(prompt_ids)):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else entry.get(token_id))
        top.append(
            None
            if entry is None
            else {token_text(tokenizer, t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])}
        )
        offsets.append(position)
        position += len(text)
    if piece is not None:
        generated = completion_logprobs(tokenizer, piece, position)
        tokens += generated["tokens"]
        token_logprobs += generated["token_logprobs"]
        top += generated["top_logprobs"]
        offsets += generated["text_offset"]
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer, piece: Piece, top_k: int) -> dict:
    """``/v1/chat/completions`` logprobs of one piece (at most ``top_k`` alternatives per token)."""
    content = []
    for token_id, entry in zip(piece.token_ids, piece.logprobs or []):
        text = token_text(tokenizer, token_id)
        alternatives = sorted(entry.items(), key=lambda kv: -kv[1])[:top_k]
        content.append(
            {
                "token": text,
                "logprob": entry.get(token_id),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (s := token_text(tokenizer, t)), "logprob": lp, "bytes": list(s.encode())}
                    for t, lp in alternatives
                ],
            }
        )
    return {"content": content}


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason in OpenAI's words (``length`` or ``stop``)."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def joined(pieces: list[Piece]) -> Piece:
    """One completion's pieces as one (text, token ids and logprobs concatenated; the last reason)."""
    first = pieces[0]
    return Piece(
        first.prompt_index,
        first.index,
        "".join(p.text for p in pieces),
        [t for p in pieces for t in p.token_ids],
        [e for p in pieces for e in (p.logprobs or [])],
        pieces[-1].finish_reason,
        0,
        0,
        prompt_logprobs=next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None),
    )


class Usage:
    """Token counts summed over every prompt and completion; ``prompt_tokens_details.cached_tokens``
    counts the prompt tokens the engine's prefix cache served (what load clients read as hits)."""

    def __init__(self, plan: Plan) -> None:
        self.prompt = [0] * len(plan.prompts)
        self.cached = [0] * len(plan.prompts)
        self.completion: dict[tuple[int, int], int] = {}

    def add(self, piece: Piece) -> None:
        self.prompt[piece.prompt_index] = piece.num_input_tokens
        self.completion[(piece.prompt_index, piece.index)] = piece.num_output_tokens
        if piece.num_cached_tokens is not None:
            self.cached[piece.prompt_index] = piece.num_cached_tokens

    def body(self) -> dict:
        prompt, completion = sum(self.prompt), sum(self.completion.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached)},
        }


@dataclasses.dataclass
class StreamState:
    """One streamed response: its id and time, and what its chunks so far have said."""

    plan: Plan
    ident: str
    kind: str  # the chunks' ``object``
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    offsets: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # characters sent per choice
    started: set[int] = dataclasses.field(default_factory=set)  # choices whose first chunk is sent
    prompt_logprobs: dict[int, list] = dataclasses.field(default_factory=dict)  # per prompt, once Triton sent them
    tool_parsers: dict[int, object] = dataclasses.field(default_factory=dict)  # chat with tools: per choice

    def __post_init__(self) -> None:
        head = {"id": self.ident, "object": self.kind, "created": self.created, "model": self.plan.served_name}
        self._head = b"data: " + orjson.dumps(head)[:-1] + b',"choices":'  # encoded once per stream
        self._tail = b',"usage":null}\n\n' if self.plan.include_usage else b"}\n\n"

    def chunk(self, choices: list[dict], usage_body: dict | None = None) -> bytes:
        """One server-sent event with ``choices`` (and ``usage`` when the client asked for it)."""
        if usage_body is not None and self.plan.include_usage:
            return self._head + orjson.dumps(choices) + b',"usage":' + orjson.dumps(usage_body) + b"}\n\n"
        return self._head + orjson.dumps(choices) + self._tail


class OpenAIServing:
    """The request path of a generating endpoint: body -> ``Plan`` -> Triton -> JSON or SSE.

    Subclasses set the request schema, the id prefix and the ``object`` names, and implement
    ``choice`` (one whole choice) and ``render`` (one streamed piece as server-sent events).
    """

    request_type: type
    id_prefix: str
    object_kind: str
    chunk_kind: str

    def __init__(self, models: dict[str, ServedModel], backend: TritonBackend) -> None:
        self.models, self.backend = models, backend

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    async def create(self, body: bytes, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> Response:
        """Answer one request body (``is_disconnected``: the HTTP request's, see the module docstring).

        Raises:
            OpenAIError: a bad body (400), an unknown model (404), or Triton's error before any
                output (its status); later errors end the stream with an error event.
        """
        try:
            plan = make_plan(self.request_type.model_validate_json(body), self.models)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        pieces = PieceQueue(self.backend, plan)
        try:
            # Triton's errors before any output become HTTP errors
            first = await unless_disconnected(pieces.drain(), is_disconnected)
        except ClientGone:
            await pieces.aclose()
            return Response(status_code=499)  # nobody reads it
        except BaseException as exc:
            await pieces.aclose()
            if isinstance(exc, OpenAIError) and exc.status == 400 and exc.message.startswith("structured_outputs"):
                exc.param = plan.structured_param  # the engine refused the constraint: name the field that sent it
            raise
        if not first:
            await pieces.aclose()
            raise OpenAIError(500, "no output from Triton", type_="server_error")
        if plan.stream:
            return StreamingResponse(self.sse(plan, first, pieces), media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            whole = await unless_disconnected(self.whole(plan, first, pieces), is_disconnected)
            return Response(orjson.dumps(whole), media_type="application/json")
        except ClientGone:
            return Response(status_code=499)
        finally:
            await pieces.aclose()

    async def whole(self, plan: Plan, first: list[Piece], pieces: PieceQueue) -> dict:
        """The whole response once every completion has finished."""
        collected: dict[tuple[int, int], list[Piece]] = {}
        prompt_logprobs: dict[int, list] = {}  # sent once per prompt, on whichever completion answered first
        usage = Usage(plan)
        batch = first
        while batch:
            for piece in batch:
                collected.setdefault((piece.prompt_index, piece.index), []).append(piece)
                usage.add(piece)
                if piece.prompt_logprobs is not None:
                    prompt_logprobs[piece.prompt_index] = piece.prompt_logprobs
            batch = await pieces.drain()
        choices = []
        for key in sorted(collected):
            piece = joined(collected[key])
            piece.prompt_logprobs = prompt_logprobs.get(key[0])
            choices.append(self.choice(plan, key[0] * plan.n + key[1], piece))
        return {
            "id": self.new_id(),
            "object": self.object_kind,
            "created": int(time.time()),
            "model": plan.served_name,
            "choices": choices,
            "usage": usage.body(),
        }

    async def sse(self, plan: Plan, first: list[Piece], pieces: PieceQueue):
        """Server-sent events as pieces arrive (the pieces waiting at each wake-up merged per
        choice and written at once), then usage (if asked) and ``[DONE]``."""
        state = StreamState(plan, self.new_id(), self.chunk_kind)
        usage = Usage(plan)
        try:
            batch = first
            while batch:
                events = []
                for piece in coalesce(batch):
                    usage.add(piece)
                    if piece.prompt_logprobs is not None:
                        state.prompt_logprobs[piece.prompt_index] = piece.prompt_logprobs
                    events.append(self.render(state, piece))
                yield b"".join(events)
                batch = await pieces.drain()
            if plan.include_usage:
                yield state.chunk([], usage.body())
        except OpenAIError as exc:
            yield b"data: " + orjson.dumps(exc.body()) + b"\n\n"
        except Exception as exc:  # noqa: BLE001 - the stream has started: the client gets an error event
            error = OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")
            yield b"data: " + orjson.dumps(error.body()) + b"\n\n"
        finally:
            await pieces.aclose()  # on a disconnect too: cancels the Triton requests
        yield b"data: [DONE]\n\n"

    def choice(self, plan: Plan, index: int, piece: Piece) -> dict:
        """One whole choice of the response (``piece``: the completion's pieces joined)."""
        raise NotImplementedError

    def render(self, state: StreamState, piece: Piece) -> bytes:
        """One streamed piece (a choice's new text, maybe several steps of it) as server-sent events."""
        raise NotImplementedError
