"""Triton over gRPC streaming: one bidirectional stream per engine request on one shared channel.

``TritonBackend.generate`` streams one prompt's ``n`` completions as ``Piece``s; ``merged``
interleaves the pieces of every prompt of a ``Plan`` as they arrive.
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


@dataclasses.dataclass
class Piece:
    """One Triton response: a completion's new text and tokens."""

    prompt_index: int
    index: int  # completion index within its prompt
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int


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
                piece = _piece(result, prompt_index)
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


def _piece(result, prompt_index: int) -> Piece:
    def one(name):
        value = result.as_numpy(name)
        return None if value is None else value.reshape(-1)

    text = one("text_output")
    finish = one("finish_reason")
    logprobs = one("logprobs")
    ids = one("output_token_ids")
    return Piece(
        prompt_index=prompt_index,
        index=int(one("index")[0]),
        text=text[0].decode("utf-8") if text is not None and len(text) else "",
        token_ids=[] if ids is None else ids.tolist(),
        logprobs=None if logprobs is None else [{int(k): v for k, v in e.items()} for e in json.loads(logprobs[0])],
        finish_reason=None if finish is None or not len(finish) else finish[0].decode(),
        num_input_tokens=int(one("num_input_tokens")[0]),
        num_output_tokens=int(one("num_output_tokens")[0]),
    )


async def merged(backend: TritonBackend, plan: Plan) -> AsyncIterator[Piece]:
    """The pieces of every prompt of ``plan``, as they arrive (one Triton request per prompt)."""
    if len(plan.prompts) == 1:
        async for piece in backend.generate(plan.model.name, plan.prompts[0], plan.sampling, 0, plan.n):
            yield piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, ids: list[int]) -> None:
        try:
            async for piece in backend.generate(plan.model.name, ids, plan.sampling, i, plan.n):
                queue.put_nowait(piece)
            queue.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(plan.prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
