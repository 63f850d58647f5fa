"""Triton over gRPC streaming: one bidirectional stream per engine request on one shared channel.

``TritonBackend.generate`` streams one prompt's ``n`` completions as ``Piece``s; ``merged``
interleaves the pieces of every prompt of a ``Plan`` as they arrive, one reader task per prompt
feeding one queue, so the server-sent-event writer can take every piece that is already waiting
at once (``drain``) and send a choice's new tokens in one event when it fell behind.

Responses are read straight from Triton's protobuf (``raw_output_contents``, one pass over the
outputs): a piece per engine step costs no ``numpy`` arrays or per-output lookups.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator

import numpy as np

from deploy.openai.prompts import Plan
from deploy.openai.protocol import OpenAIError


@dataclasses.dataclass(slots=True)
class Piece:
    """One Triton response (or several merged): a completion's new text and tokens."""

    prompt_index: int
    index: int  # completion index within its prompt
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (last response)

    def extend(self, later: "Piece") -> None:
        """Append a later piece of the same completion (its text, tokens, counts and finish)."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason = later.finish_reason
        self.num_input_tokens, self.num_output_tokens = later.num_input_tokens, later.num_output_tokens
        if later.num_cached_tokens is not None:
            self.num_cached_tokens = later.num_cached_tokens


class TritonBackend:
    """Generation requests to Triton's decoupled LLM model over one gRPC channel."""

    def __init__(self, grpc_url: str) -> None:
        self.grpc_url = grpc_url
        self.client = None

    async def start(self) -> None:
        # optional or heavy dependency: imported only on the path that needs it
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(self.grpc_url)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def ready(self, model: str) -> bool:
        try:
            return bool(await self.client.is_model_ready(model))
        except Exception:  # noqa: BLE001 - Triton not reachable: not ready
            return False

    async def generate(
        self, model: str, prompt_ids: list[int], sampling: dict, prompt_index: int, n: int
    ) -> AsyncIterator[Piece]:
        """Stream the pieces of one prompt's ``n`` completions until every one has finished.

        Raises:
            OpenAIError: Triton answered an error (400 for bad input, else 500).
        Closing the iterator early cancels the gRPC stream (Triton aborts the engine request).
        """
        # optional or heavy dependency: imported only on the path that needs it
        import tritonclient.grpc.aio as grpcclient

        inputs = [
            grpcclient.InferInput("prompt_token_ids", [len(prompt_ids)], "INT64"),
            grpcclient.InferInput("stream", [1], "BOOL"),
            grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
        ]
        inputs[0].set_data_from_numpy(np.asarray(prompt_ids, dtype=np.int64))
        inputs[1].set_data_from_numpy(np.array([True]))
        inputs[2].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
        finished = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}
            await finished.wait()  # keep our side open until the last response

        responses = self.client.stream_infer(requests())
        pending = set(range(n))
        try:
            async for result, error in responses:
                if error is not None:
                    raise model_error(error.message())
                piece = _piece(result.get_response(), prompt_index)
                if piece.finish_reason == "error":  # the engine failed this request's step
                    raise OpenAIError(500, "the engine failed this request; retry it", type_="server_error")
                if piece.finish_reason is not None:
                    pending.discard(piece.index)
                yield piece
                if not pending:
                    return
            raise OpenAIError(500, "Triton closed the stream before the request finished", type_="server_error")
        finally:
            finished.set()
            if pending:
                responses.cancel()


#: Starts of the error messages deploy/triton_llm.py sends for its own failures (Triton's gRPC
#: stream carries the message only, not the code): a dead engine (UNAVAILABLE) and the rest (INTERNAL).
MODEL_UNAVAILABLE_PREFIX = "the engine of "
MODEL_INTERNAL_PREFIXES = ("internal error", "the engine failed this request", "unreadable request")


def model_error(message: str) -> OpenAIError:
    """The model's error response -> 503 (its engine is dead and being reloaded), 500 (its own
    failure) or 400 (it refused the request: INVALID_ARG)."""
    if message.startswith(MODEL_UNAVAILABLE_PREFIX) and " is dead " in message:
        return OpenAIError(503, message, type_="server_error")
    if message.startswith(MODEL_INTERNAL_PREFIXES):
        return OpenAIError(500, message, type_="server_error")
    return OpenAIError(400, message)


def _bytes_element(raw: bytes) -> bytes:
    """The single element of a serialized BYTES tensor (4-byte little-endian length, then the bytes)."""
    return raw[4 : 4 + int.from_bytes(raw[:4], "little")]


def _piece(response, prompt_index: int) -> Piece:
    """A ``ModelInferResponse`` of the LLM model as a ``Piece`` (one pass over its outputs).

    Raises:
        OpenAIError: a response without raw output contents (not what Triton sends) or without ``index``.
    """
    if len(response.raw_output_contents) != len(response.outputs):
        raise OpenAIError(500, "Triton sent a response without raw output contents", type_="server_error")
    raw = {tensor.name: content for tensor, content in zip(response.outputs, response.raw_output_contents)}
    if "index" not in raw:
        raise OpenAIError(500, "Triton's response has no 'index' output; re-export the model", type_="server_error")
    text = raw.get("text_output")
    finish = raw.get("finish_reason")
    logprobs = raw.get("logprobs")
    ids = raw.get("output_token_ids")
    cached = raw.get("num_cached_tokens")
    return Piece(
        prompt_index,
        _int32(raw["index"]),
        _bytes_element(text).decode("utf-8") if text else "",
        np.frombuffer(ids, dtype="<i8").tolist() if ids else [],
        None if logprobs is None else _logprobs(_bytes_element(logprobs)),
        _bytes_element(finish).decode() if finish else None,
        _int32(raw.get("num_input_tokens")),
        _int32(raw.get("num_output_tokens")),
        None if cached is None else _int32(cached),
    )


def _int32(raw: bytes | None) -> int:
    return 0 if not raw else int.from_bytes(raw[:4], "little", signed=True)


def _logprobs(text: bytes) -> list[dict[int, float]]:
    return [{int(k): v for k, v in entry.items()} for entry in json.loads(text)]


class PieceQueue:
    """The pieces of every prompt of a ``Plan`` as they arrive: one reader task per prompt feeds one queue.

    ``drain`` returns every piece already waiting, so a slow consumer sends many steps of a
    completion at once instead of one event per step. ``aclose`` cancels the readers (and
    with them the Triton requests still running).
    """

    def __init__(self, backend: TritonBackend, plan: Plan) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.remaining = len(plan.prompts)
        self.tasks = [
            asyncio.create_task(self._pump(backend.generate(plan.model.name, ids, plan.sampling, i, plan.n)))
            for i, ids in enumerate(plan.prompts)
        ]

    async def _pump(self, pieces: AsyncIterator[Piece]) -> None:
        put = self.queue.put_nowait
        try:
            async for piece in pieces:
                put(piece)
            put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            put(exc)
        finally:
            await pieces.aclose()

    def _take(self, item) -> Piece | None:
        if item is None:
            self.remaining -= 1
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def drain(self) -> list[Piece]:
        """Wait for at least one piece (or the end), then return every piece already queued; [] at the end.

        Raises:
            OpenAIError: a prompt's Triton request failed.
        """
        out: list[Piece] = []
        while self.remaining and not out:
            piece = self._take(await self.queue.get())
            if piece is not None:
                out.append(piece)
            while self.remaining and not self.queue.empty():
                piece = self._take(self.queue.get_nowait())
                if piece is not None:
                    out.append(piece)
        return out

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._each()

    async def _each(self):
        while pieces := await self.drain():
            for piece in pieces:
                yield piece

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Consecutive pieces of the same completion merged into one, in arrival order of their first piece."""
    merged: dict[tuple[int, int], Piece] = {}
    for piece in pieces:
        key = (piece.prompt_index, piece.index)
        if key in merged:
            merged[key].extend(piece)
        else:
            merged[key] = dataclasses.replace(piece, token_ids=list(piece.token_ids))
    return list(merged.values())
