"""The OpenAI frontend when Triton or a client misbehaves, without a server: Triton's errors mapped to honest
statuses (503 + Retry-After while a model or Triton recovers, 400 with ``param`` for refusals), a stream that
goes silent (a dead instance) cancelled with a 503, heartbeats skipped, and clients that leave before their
answer is ready noticed while the request still waits; request bodies judged before anything is sent (a body
that is not a JSON object refused, a chat message with empty content taken as OpenAI takes it). The live paths are
in tests/deploy/test_deploy_openai.py."""

from __future__ import annotations

import asyncio
import json
import types

import grpc
import numpy as np
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from deploy.openai.models import ServedModel
from deploy.openai.prompts import chat_prompt, completion_prompts
from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, validation_error
from deploy.openai.serving_common import ClientGone, unless_disconnected
from deploy.openai.triton_client import Piece, TritonBackend, is_heartbeat, model_error, transport_error


@pytest.mark.parametrize(
    "message",
    [
        "Request for unknown model: 'llm' has no available versions",
        "Request for unknown model: 'llm' is not found",
        "Failed to process the request(s) for model instance 'llm_0_0', message: Stub process 'llm_0_0' is not "
        "healthy.",
        "the engine of llm is dead (EngineDeadError: x); it is being reloaded, retry",
    ],
)
def test_a_model_that_is_recovering_is_a_503_with_retry_after(message):
    error = model_error(message)
    assert error.status == 503 and error.type == "server_error" and error.headers == {"Retry-After": "5"}


@pytest.mark.parametrize(
    "message, param",
    [
        ("logit_bias has token ids [50000] outside the vocabulary [0, 49152); remove them", "logit_bias"),
        ("stop_token_ids=[99999] are outside the vocabulary [0, 49152); remove them", "stop_token_ids"),
        ("n=200 is over the limit of 128 completions per prompt", "n"),
        ("text_input: empty prompt; send some text", "text_input"),
        ("something else went wrong", None),
    ],
)
def test_a_refusal_is_a_400_naming_the_field(message, param):
    error = model_error(message)
    assert error.status == 400 and error.param == param and error.headers == {}


def test_a_grpc_failure_is_a_503():
    class Unavailable(grpc.RpcError):
        def details(self):
            return "failed to connect to all addresses"

    error = transport_error(Unavailable())
    assert error.status == 503 and "failed to connect" in error.message


def _piece(**changes) -> Piece:
    values = dict(
        prompt_index=0,
        index=0,
        text="",
        token_ids=[],
        logprobs=None,
        finish_reason=None,
        num_input_tokens=3,
        num_output_tokens=0,
    )
    return Piece(**{**values, **changes})


def test_heartbeats_are_told_from_output():
    assert is_heartbeat(_piece())
    assert not is_heartbeat(_piece(token_ids=[7]))  # a token whose text is not complete yet
    assert not is_heartbeat(_piece(text="a"))
    assert not is_heartbeat(_piece(finish_reason="stop"))


class SilentCall:
    """A gRPC stream that sends one heartbeat and then nothing (its model instance died)."""

    def __init__(self, first):
        self.items, self.cancelled = [first], False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop()
        await asyncio.sleep(3600)

    def cancel(self):
        self.cancelled = True


def heartbeat_response(index=0):
    """What ``stream_infer`` yields for a heartbeat of completion ``index``: (result, error)."""
    names = ["text_output", "index", "num_input_tokens", "num_output_tokens", "output_token_ids"]
    contents = [
        (0).to_bytes(4, "little"),
        index.to_bytes(4, "little"),
        (3).to_bytes(4, "little"),
        (0).to_bytes(4, "little"),
        np.array([], dtype="<i8").tobytes(),
    ]
    proto = types.SimpleNamespace(outputs=[types.SimpleNamespace(name=n) for n in names], raw_output_contents=contents)
    return types.SimpleNamespace(get_response=lambda: proto), None


def test_a_request_on_a_dead_instance_fails_with_a_503_and_is_cancelled():
    call = SilentCall(heartbeat_response())
    backend = TritonBackend("127.0.0.1:1", stall_timeout_s=0.2)
    backend.client = types.SimpleNamespace(stream_infer=lambda requests, headers=None: call)

    async def run():
        return [piece async for piece in backend.generate("llm", [1, 2, 3], {"max_tokens": 4}, 0, 1)]

    with pytest.raises(OpenAIError) as info:
        asyncio.run(asyncio.wait_for(run(), 10))
    assert info.value.status == 503 and "stopped answering" in info.value.message
    assert call.cancelled


class ChattyCall:
    """A gRPC stream with a response ready at every read (a busy request: one per engine step)."""

    def __init__(self):
        self.reads, self.cancelled = 0, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        self.reads += 1
        return heartbeat_response()

    def cancel(self):
        self.cancelled = True


def test_a_cancel_that_meets_a_response_still_ends_the_request():
    """Closing a request (its client left, the server stops) cancels the task reading its stream. A response
    that is ready in the same turn of the event loop must not swallow that cancellation: the request would
    run to its end while its client is gone (Python 3.11's ``asyncio.wait_for`` did)."""
    backend = TritonBackend("127.0.0.1:1", stall_timeout_s=5.0)

    async def run(turns_before_cancel: int) -> ChattyCall:
        call = ChattyCall()
        backend.client = types.SimpleNamespace(stream_infer=lambda requests, headers=None: call)
        reader = asyncio.create_task(anext(backend.generate("llm", [1, 2, 3], {"max_tokens": 4}, 0, 1)))
        for _ in range(turns_before_cancel):
            await asyncio.sleep(0)
        reader.cancel()
        done, _ = await asyncio.wait({reader}, timeout=2.0)
        if not done:  # the cancellation was lost: cancel again so the loop can close, then fail
            reader.cancel()
            await asyncio.wait({reader}, timeout=2.0)
        assert done and reader.cancelled(), f"cancelled after {turns_before_cancel} turns: still reading"
        return call

    for turns in range(1, 41):
        call = asyncio.run(run(turns))
        assert call.cancelled and call.reads <= turns


def test_a_client_that_leaves_while_its_request_waits_is_noticed():
    async def never():
        await asyncio.sleep(3600)

    polls = []

    async def is_disconnected():
        polls.append(1)
        return len(polls) >= 2

    with pytest.raises(ClientGone):
        asyncio.run(asyncio.wait_for(unless_disconnected(never(), is_disconnected), 10))

    async def quick():
        return 42

    assert asyncio.run(unless_disconnected(quick(), is_disconnected)) == 42


def test_a_request_refused_for_a_dead_stub_is_sent_again_to_another_instance():
    class Refused:
        """An instance whose stub died: Triton refuses at once."""

        def __init__(self):
            self.done = False

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.done:
                raise StopAsyncIteration
            self.done = True
            message = (
                "Failed to process the request(s) for model instance 'llm_0_0', message: Stub process is not healthy."
            )
            return None, types.SimpleNamespace(message=lambda: message)

        def cancel(self):
            pass

    calls = []
    backend = TritonBackend("127.0.0.1:1")
    backend.client = types.SimpleNamespace(stream_infer=lambda requests, headers=None: calls.append(1) or Refused())

    async def run():
        return [piece async for piece in backend.generate("llm", [1, 2, 3], {"max_tokens": 4}, 0, 1)]

    with pytest.raises(OpenAIError) as info:
        asyncio.run(asyncio.wait_for(run(), 10))
    assert info.value.status == 503 and len(calls) == 3  # the first try and two more, then the honest 503


def test_a_503_is_answered_in_openais_shape_with_retry_after():
    from deploy.openai.app import error_response
    from deploy.openai.protocol import unavailable

    response = error_response(unavailable("the model llm is being reloaded; retry"))
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert response.headers["content-type"] == "application/json"
    body = __import__("json").loads(response.body)
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "model_unavailable"


def test_a_request_that_never_heard_back_is_sent_again_then_answered_503():
    calls = []

    class Mute(SilentCall):
        def __init__(self):
            super().__init__(None)
            self.items = []  # not even a heartbeat: Triton gave it to an instance whose stub is dead

    def stream_infer(requests, headers=None):
        calls.append(Mute())
        return calls[-1]

    backend = TritonBackend("127.0.0.1:1", stall_timeout_s=0.1)
    backend.client = types.SimpleNamespace(stream_infer=stream_infer)

    async def run():
        return [piece async for piece in backend.generate("llm", [1, 2, 3], {"max_tokens": 4}, 0, 1)]

    with pytest.raises(OpenAIError) as info:
        asyncio.run(asyncio.wait_for(run(), 10))
    assert info.value.status == 503 and len(calls) == 3 and all(call.cancelled for call in calls)


@pytest.mark.parametrize(
    "body, kind", [("[1, 2]", "an array"), ('"hi"', "a string"), ("null", "null"), ("3", "a number")]
)
def test_a_body_that_is_not_a_json_object_is_named_as_such(body, kind):
    for request_type in (ChatCompletionRequest, CompletionRequest):
        with pytest.raises(ValidationError) as refused:
            request_type.model_validate_json(body)
        error = validation_error(refused.value)
        assert error.status == 400 and error.param is None
        assert error.message == f"the request body must be a JSON object, not {kind}"


def test_empty_chat_content_is_a_prompt_but_an_empty_completion_prompt_is_refused(tiny_llama_dir):
    """As OpenAI's API: a chat message may have empty content (the template still makes a prompt of it); a blank
    completion prompt or an empty messages list is a 400 naming the field."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = ServedModel("llm", tiny_llama_dir, tokenizer, max_model_len=256, created=0)
    messages = [{"role": "user", "content": ""}]
    ids = chat_prompt(ChatCompletionRequest(model="llm", messages=messages), model)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")  # the template's turns
    assert ids == tokenizer(rendered, add_special_tokens=False).input_ids
    for prompt in ("", "  \n"):
        with pytest.raises(OpenAIError) as refused:
            completion_prompts(CompletionRequest(model="llm", prompt=prompt), model)
        assert refused.value.status == 400 and refused.value.param == "prompt" and "empty prompt" in str(refused.value)
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate_json(json.dumps({"model": "llm", "messages": []}))
    assert validation_error(refused.value).param == "messages"


def test_a_server_shutting_down_ends_the_requests_in_flight_and_new_ones_with_a_503():
    from deploy.openai.triton_client import PieceQueue

    class Streaming(TritonBackend):
        """One piece, then a long generation (the stream is in flight when the server stops)."""

        async def generate(self, model, prompt_ids, sampling, prompt_index, n):
            yield _piece(text="Hello", token_ids=[7], num_output_tokens=1)
            await asyncio.sleep(3600)

    backend = Streaming("127.0.0.1:1")
    plan = types.SimpleNamespace(model=types.SimpleNamespace(name="llm"), prompts=[[1, 2, 3]], sampling={}, n=1)

    async def run():
        pieces = PieceQueue(backend, plan)
        first = await pieces.drain()
        backend.shut_down()
        try:
            with pytest.raises(OpenAIError) as in_flight:
                await pieces.drain()
        finally:
            await pieces.aclose()
        late = PieceQueue(backend, plan)  # a request that arrives while the server stops
        try:
            with pytest.raises(OpenAIError) as arriving:
                await late.drain()
        finally:
            await late.aclose()
        return first, in_flight.value, arriving.value

    first, in_flight, arriving = asyncio.run(asyncio.wait_for(run(), 10))
    assert [p.text for p in first] == ["Hello"]
    for error in (in_flight, arriving):
        assert error.status == 503 and error.message == "the server is shutting down"
        assert error.body()["error"]["type"] == "server_error" and error.headers == {"Retry-After": "5"}
