"""Triton over gRPC streaming: one bidirectional stream per engine request on one shared channel.

``TritonBackend.generate`` streams one prompt's ``n`` completions as ``Piece``s; ``merged``
interleaves the pieces of every prompt of a ``Plan`` as they arrive, one reader task per prompt
feeding one queue, so the server-sent-event writer can take every piece that is already waiting
at once (``drain``) and send a choice's new tokens in one event when it fell behind.

Responses are read straight from Triton's protobuf (``raw_output_contents``, one pass over the
outputs): a piece per engine step costs no ``numpy`` arrays or per-output lookups.

Faults answer honestly (``model_error``, ``transport_error``): a model that is not loaded or
reloading ("unknown model", "no available versions"), a dead Python-backend stub ("Stub process
is not healthy"), an unreachable or restarting Triton (gRPC ``UNAVAILABLE``) and a model instance
that stopped answering are 503s with ``Retry-After``; only the model's own refusals
(``INVALID_ARG``) are 400s. The model sends a heartbeat (an empty response, skipped here) while
a streaming request is quiet (``deploy.triton_llm.HEARTBEAT_INTERVAL_S``), so a request that
hears nothing for ``stall_timeout_s`` is on an instance that died (Triton 2.51 holds its requests
until the model is unloaded): it is cancelled and answered 503 at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
import weakref
from collections.abc import AsyncIterator

import numpy as np

from deploy.openai.prompts import Plan
from deploy.openai.protocol import OpenAIError, unavailable
from deploy.triton import api_key_headers

#: Seconds without any response (a token or a heartbeat) after which a request's model instance is taken for
#: dead (the model sends a heartbeat every 0.3 s while a streaming request is quiet).
STALL_TIMEOUT_S = 1.0


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
    prompt_logprobs: list[dict[int, float] | None] | None = None  # the request's first response, when asked

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
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


class TritonBackend:
    """Generation requests to Triton's decoupled LLM model over one gRPC channel.

    Args:
        grpc_url: Triton's gRPC address.
        api_key: sent as Triton's gRPC key metadata (``deploy.triton.api_key_headers``; ``lmforge serve --api-key``
            restricts Triton's APIs with the same key).
        stall_timeout_s: see the module docstring.
    """

    def __init__(self, grpc_url: str, api_key: str | None = None, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.grpc_url = grpc_url
        self.client = None
        self.headers = api_key_headers(api_key, grpc=True) or None
        self.stall_timeout_s = stall_timeout_s
        self.shutting_down = False
        self.queues: weakref.WeakSet[PieceQueue] = weakref.WeakSet()  # the requests in flight

    def shut_down(self) -> None:
        """The server is stopping: every request in flight, and any that arrives now, ends with a 503
        (``shutting_down_error``): a started stream with an error event and ``[DONE]``, before Triton goes away.
        Called on the event loop."""
        self.shutting_down = True
        for queue in list(self.queues):
            queue.queue.put_nowait(SHUTTING_DOWN)

    async def start(self) -> None:
        # optional or heavy dependency: imported only on the path that needs it
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(self.grpc_url)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def ready(self, model: str) -> bool:
        try:
            return bool(await self.client.is_model_ready(model, headers=self.headers))
        except Exception:  # noqa: BLE001 - Triton not reachable: not ready
            return False

    async def generate(
        self, model: str, prompt_ids: list[int], sampling: dict, prompt_index: int, n: int
    ) -> AsyncIterator[Piece]:
        """Stream the pieces of one prompt's ``n`` completions until every one has finished.

        A request refused at once because the model instance Triton gave it has a dead stub, or that heard
        nothing at all (not even a heartbeat) for ``stall_timeout_s``, is cancelled and sent again (at most
        ``DEAD_INSTANCE_RETRIES`` times): with several instances Triton gives it another one.

        Raises:
            OpenAIError: Triton answered an error (400 for bad input, 503 while the model or Triton recovers,
                else 500), or the request heard nothing for ``stall_timeout_s`` (503).
        Closing the iterator early cancels the gRPC stream (Triton aborts the engine request).
        """
        for attempt in range(DEAD_INSTANCE_RETRIES + 1):
            heard = False
            try:
                async for piece in self._generate_once(model, prompt_ids, sampling, prompt_index, n):
                    heard = True
                    yield piece
                return
            except OpenAIError as exc:
                if heard or not exc.retry_elsewhere or attempt == DEAD_INSTANCE_RETRIES:
                    raise
            await asyncio.sleep(0.05)

    async def _generate_once(
        self, model: str, prompt_ids: list[int], sampling: dict, prompt_index: int, n: int
    ) -> AsyncIterator[Piece]:
        """One Triton request of ``generate``."""
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

        try:
            responses = self.client.stream_infer(requests(), headers=self.headers)
        except Exception as exc:  # noqa: BLE001 - the call could not even start: Triton is unreachable
            raise transport_error(exc) from exc
        pending = set(range(n))
        stream = aiter(responses)
        heard = False  # any response, a heartbeat included
        try:
            while True:
                try:
                    # not asyncio.wait_for: on Python 3.11 it returns a response that arrives together with a
                    # cancellation and drops the cancellation, so a request whose client left ran to its end
                    async with asyncio.timeout(self.stall_timeout_s):
                        result, error = await anext(stream)
                    heard = True
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    stalled = unavailable(
                        f"the model {model} stopped answering this request ({self.stall_timeout_s:.1f} s without a "
                        "response or heartbeat: its instance died or is stuck); it is being reloaded, retry"
                    )
                    # never answered at all: Triton gave it to a dead instance; it is cancelled, another may take it
                    stalled.retry_elsewhere = not heard
                    raise stalled from None
                except OpenAIError:
                    raise
                except Exception as exc:  # noqa: BLE001 - grpc's AioRpcError and the like: Triton went away
                    raise transport_error(exc) from exc
                if error is not None:
                    raise model_error(error.message())
                piece = _piece(result.get_response(), prompt_index)
                if piece.finish_reason == "error":  # the engine failed this request's step
                    raise OpenAIError(500, "the engine failed this request; retry it", type_="server_error")
                if is_heartbeat(piece):
                    continue
                if piece.finish_reason is not None:
                    pending.discard(piece.index)
                yield piece
                if not pending:
                    return
            raise unavailable(f"Triton closed the stream of {model} before the request finished; retry")
        finally:
            finished.set()
            if pending:
                responses.cancel()


#: Starts of the error messages deploy/triton_llm.py sends for its own failures (Triton's gRPC
#: stream carries the message only, not the code): a dead engine (UNAVAILABLE) and the rest (INTERNAL).
MODEL_UNAVAILABLE_PREFIX = "the engine of "
MODEL_INTERNAL_PREFIXES = ("internal error", "the engine failed this request", "unreadable request")


#: Parts of Triton's own error messages for a model that cannot answer now: not loaded (unloaded, reloading after a
#: fault), or its Python-backend stub died. The supervisor of ``lmforge serve`` loads it again.
TRITON_UNAVAILABLE_MARKERS = (
    "unknown model",
    "no available versions",
    "is not ready",
    "Stub process",
    "is not healthy",
    "Failed to process the request(s) for model instance",
    "Socket closed",
    "failed to connect",
)


#: Triton's refusal of a request sent to an instance whose Python-backend stub died (another instance may take it).
DEAD_STUB_MARKERS = ("Stub process", "is not healthy", "Failed to process the request(s) for model instance")
#: Times ``TritonBackend.generate`` sends again a request refused for a dead stub.
DEAD_INSTANCE_RETRIES = 2


def model_error(message: str) -> OpenAIError:
    """An error response from Triton -> 503 (the model's engine is dead, the model is not loaded or reloading,
    its stub died: retry), 500 (the model's own failure) or 400 (it refused the request: INVALID_ARG), with
    the model's ``param`` when its message starts with a request field (``logit_bias: ...``)."""
    if message.startswith(MODEL_UNAVAILABLE_PREFIX) and " is dead " in message:
        return unavailable(message)
    if any(marker in message for marker in TRITON_UNAVAILABLE_MARKERS):
        error = unavailable(f"{message}; the model is being loaded again, retry")
        error.retry_elsewhere = any(marker in message for marker in DEAD_STUB_MARKERS)
        return error
    if message.startswith(MODEL_INTERNAL_PREFIXES):
        return OpenAIError(500, message, type_="server_error")
    return OpenAIError(400, message, param=_leading_field(message))


#: Request fields the model's error messages start with (``"logit_bias has ..."``, ``"n=3 is over ..."``).
MODEL_ERROR_FIELDS = frozenset(
    "n stop stop_token_ids logit_bias logprobs max_tokens min_tokens temperature top_p top_k min_p seed "
    "presence_penalty frequency_penalty repetition_penalty ignore_eos prompt text_input prompt_token_ids".split()
)


def _leading_field(message: str) -> str | None:
    """The request field a model error message starts with, or ``None``."""
    head = message.split(" ", 1)[0].split("=", 1)[0].split(":", 1)[0].split("[", 1)[0]
    return head if head in MODEL_ERROR_FIELDS else None


def transport_error(exc: Exception) -> OpenAIError:
    """A failed gRPC call (Triton unreachable, restarting, or it dropped the stream) -> 503 with Retry-After."""
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return unavailable(f"Triton is unavailable ({type(exc).__name__}: {text[:200]}); retry")


def is_heartbeat(piece: "Piece") -> bool:
    """The model's keep-alive response of a quiet stream: no text, no tokens, no logprobs, no finish."""
    return not piece.text and not piece.token_ids and piece.finish_reason is None and piece.logprobs is None


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
    prompt_logprobs = raw.get("prompt_logprobs")
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
        None if prompt_logprobs is None else _logprobs(_bytes_element(prompt_logprobs)),
    )


def _int32(raw: bytes | None) -> int:
    return 0 if not raw else int.from_bytes(raw[:4], "little", signed=True)


def _logprobs(text: bytes) -> list[dict[int, float] | None]:
    return [None if entry is None else {int(k): v for k, v in entry.items()} for entry in json.loads(text)]


#: Put into every ``PieceQueue`` by ``TritonBackend.shut_down``.
SHUTTING_DOWN = object()


def shutting_down_error() -> OpenAIError:
    """The 503 of a request the stopping server ends (``lmforge serve`` interrupted or ``--stop``)."""
    return OpenAIError(503, "the server is shutting down", type_="server_error", code="server_shutting_down")


class PieceQueue:
    """The pieces of every prompt of a ``Plan`` as they arrive: one reader task per prompt feeds one queue.

    ``drain`` returns every piece already waiting, so a slow consumer sends many steps of a
    completion at once instead of one event per step. ``aclose`` cancels the readers (and
    with them the Triton requests still running). ``TritonBackend.shut_down`` ends it with a 503.
    """

    def __init__(self, backend: TritonBackend, plan: Plan) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.remaining = len(plan.prompts)
        self.tasks = [
            asyncio.create_task(self._pump(backend.generate(plan.model.name, ids, plan.sampling, i, plan.n)))
            for i, ids in enumerate(plan.prompts)
        ]
        backend.queues.add(self)
        if backend.shutting_down:
            self.queue.put_nowait(SHUTTING_DOWN)

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
        if item is SHUTTING_DOWN:
            raise shutting_down_error()
        return item

    async def drain(self) -> list[Piece]:
        """Wait for at least one piece (or the end), then return every piece already queued; [] at the end.

        Raises:
            OpenAIError: a prompt's Triton request failed, or the server is shutting down (503).
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
