"""OpenAI-compatible HTTP API in front of the running Triton server (FastAPI + uvicorn).

    python -m deploy.openai_server --repo model_repository --grpc-url 127.0.0.1:8001 --port 9000
    (or ``lmforge serve --repo model_repository --openai-port 9000``, which starts both)

Every generation is forwarded to Triton over gRPC streaming (``tritonclient.grpc.aio``, one
bidirectional stream per request on one shared channel), so Triton stays the server: its
scheduling, its metrics and the engine's ``lmforge_*`` metrics count every request. The frontend
tokenizes (the chat template of the checkpoint named by the model's ``1/model.json``), checks
the request, and turns Triton's responses into OpenAI's JSON and server-sent events.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``. With ``--api-key`` every ``/v1`` route needs
``Authorization: Bearer KEY``.

Request bodies (``deploy.openai_protocol``) are checked strictly, like OpenAI's own API: a field of the wrong type, an
out-of-range value or an unknown field is a 400 naming the field (vLLM's extra fields
``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``
are accepted, e.g. through the client's ``extra_body``). Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 bad input, 401 missing or wrong key,
404 unknown model, 500 a failure inside the server or the model, 503 the model's engine died (it is
being reloaded; retry). A client that disconnects mid-stream
cancels its gRPC stream; Triton tells the model, which aborts the engine request and frees its
KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from deploy.openai_protocol import (
    MAX_CHOICES,
    MAX_PROMPT_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    validation_error,
)

# --------------------------------------------------------------------------------------------
# Served models
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ServedModel:
    """An LLM of the model repository: its Triton name, tokenizer and context length."""

    name: str
    checkpoint: Path
    tokenizer: Any
    max_model_len: int
    created: int
    vocab_size: int = 0  # len(tokenizer), computed once (it is slow: it builds the whole vocabulary)

    def __post_init__(self) -> None:
        if not self.vocab_size:
            self.vocab_size = len(self.tokenizer)


def llm_names(repo: str | Path, names: list[str]) -> list[str]:
    """Those of ``names`` that are LLM models of ``repo`` (``1/model.json`` of kind ``llm``)."""
    found = []
    for name in names:
        try:
            if json.loads((Path(repo) / name / "1" / "model.json").read_text()).get("kind") == "llm":
                found.append(name)
        except (OSError, json.JSONDecodeError):
            continue
    return found


def discover_models(repo: str | Path, names: list[str] | None = None) -> dict[str, ServedModel]:
    """The LLM models of ``repo`` (``*/1/model.json`` with ``kind: llm``), optionally only ``names``.

    Raises:
        ValueError: a named model is not an LLM of the repository, or none is found.
    """
    # optional or heavy dependency: imported only on the path that needs it
    from transformers import AutoTokenizer

    # torch-heavy: imported on use, so importing this module stays light
    from engine.llm_engine import DEFAULT_MAX_MODEL_LEN_CAP

    repo = Path(repo)
    found: dict[str, ServedModel] = {}
    for info_path in sorted(repo.glob("*/1/model.json")):
        name = info_path.parent.parent.name
        if names is not None and name not in names:
            continue
        try:
            info = json.loads(info_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{info_path}: unreadable ({exc}); re-export the model with `lmforge export`") from exc
        if info.get("kind") != "llm":
            continue
        checkpoint = Path(info["checkpoint"])
        if not checkpoint.is_absolute():
            checkpoint = info_path.parent / checkpoint
        config = json.loads((checkpoint / "config.json").read_text())
        max_model_len = (info.get("engine") or {}).get("max_model_len") or min(
            config.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN_CAP), DEFAULT_MAX_MODEL_LEN_CAP
        )
        found[name] = ServedModel(
            name,
            checkpoint,
            AutoTokenizer.from_pretrained(checkpoint),
            int(max_model_len),
            int(info_path.stat().st_mtime),
        )
    missing = sorted(set(names or []) - set(found))
    if missing:
        raise ValueError(
            f"{repo}: no LLM model(s) {missing} (a directory with 1/model.json of kind llm); export them with "
            "`lmforge export`"
        )
    if not found:
        raise ValueError(f"{repo}: no LLM model; export one with `lmforge export --model CKPT --repo {repo}`")
    return found


# --------------------------------------------------------------------------------------------
# Turning a request into engine prompts and sampling parameters
# --------------------------------------------------------------------------------------------


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


def _check_prompt_ids(ids: list[int], model: ServedModel, param: str) -> list[int]:
    vocab = model.vocab_size
    if not ids:
        raise OpenAIError(400, f"{param}: empty prompt; give at least one token", param=param)
    if any(t < 0 or t >= vocab for t in ids):
        raise OpenAIError(400, f"{param}: token ids must be in [0, {vocab})", param=param)
    return ids


def _tokenize(text: str, model: ServedModel, param: str) -> list[int]:
    if len(text) > MAX_PROMPT_CHARS:
        raise OpenAIError(
            400, f"{param}: {len(text)} characters is over the {MAX_PROMPT_CHARS} limit; shorten it", param=param
        )
    return _check_prompt_ids(model.tokenizer(text).input_ids, model, param)


def completion_prompts(request: CompletionRequest, model: ServedModel) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return [_tokenize(prompt, model, "prompt")]
    if not prompt:
        raise OpenAIError(400, "prompt: empty list; give a string, a list of strings or token ids", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [_tokenize(p, model, f"prompt.{i}") for i, p in enumerate(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [_check_prompt_ids(list(prompt), model, "prompt")]
    return [_check_prompt_ids(list(p), model, f"prompt.{i}") for i, p in enumerate(prompt)]


def chat_prompt(request: ChatCompletionRequest, model: ServedModel) -> list[int]:
    messages = []
    for m in request.messages:
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            message["content"] = "".join(part.text for part in m.content)
        messages.append(message)
    if sum(len(m.get("content") or "") for m in messages) > MAX_PROMPT_CHARS:
        raise OpenAIError(
            400, f"messages: over {MAX_PROMPT_CHARS} characters of content; shorten them", param="messages"
        )
    if model.tokenizer.chat_template is None:
        raise OpenAIError(400, f"model {model.name} has no chat template; use /v1/completions", param="messages")
    try:
        ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - a template that refuses these messages (e.g. role order)
        raise OpenAIError(400, f"messages: the chat template refused them ({exc})", param="messages") from exc
    if isinstance(ids, dict):  # BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return _check_prompt_ids(list(ids), model, "messages")


def make_plan(request: CompletionRequest | ChatCompletionRequest, models: dict[str, ServedModel]) -> Plan:
    """Check the request against the model and build what Triton gets.

    Raises:
        OpenAIError: 404 unknown model; 400 a prompt or a parameter the engine refuses, or a
            prompt + ``max_tokens`` beyond the model's context.
    """
    # torch-heavy: imported on use, so importing this module stays light
    from engine.sampling_params import SamplingParams

    model = models.get(request.model)
    if model is None:
        raise OpenAIError(
            404,
            f"the model `{request.model}` does not exist; GET /v1/models lists {sorted(models)}",
            param="model",
            code="model_not_found",
        )
    chat = isinstance(request, ChatCompletionRequest)
    prompts = [chat_prompt(request, model)] if chat else completion_prompts(request, model)
    if len(prompts) * request.n > MAX_CHOICES:
        raise OpenAIError(
            400, f"n x prompts = {len(prompts) * request.n} completions; at most {MAX_CHOICES}", param="n"
        )
    max_tokens = (request.max_completion_tokens or request.max_tokens) if chat else request.max_tokens
    param = "max_completion_tokens" if chat and request.max_completion_tokens else "max_tokens"
    longest = max(len(p) for p in prompts)
    if longest >= model.max_model_len:
        raise OpenAIError(
            400,
            f"this model's maximum context length is {model.max_model_len} tokens; the prompt has {longest}",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = model.max_model_len - longest if chat else 16
    if longest + max_tokens > model.max_model_len:
        raise OpenAIError(
            400,
            f"this model's maximum context length is {model.max_model_len} tokens; you requested "
            f"{longest + max_tokens} "
            f"({longest} in the prompt, {max_tokens} in the completion); reduce {param}",
            param=param,
            code="context_length_exceeded",
        )
    if chat:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
    else:
        logprobs = request.logprobs
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
        SamplingParams(**sampling)  # the engine's own checks, before anything is sent
    except ValueError as exc:
        field = str(exc).split("=", 1)[0].split(" ", 1)[0]
        raise OpenAIError(400, str(exc), param=field if field in sampling else None) from exc
    vocab = model.vocab_size
    if request.logit_bias and any(int(k) >= vocab for k in request.logit_bias):
        raise OpenAIError(400, f"logit_bias: token ids must be in [0, {vocab})", param="logit_bias")
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    if request.stream_options is not None and not request.stream:
        raise OpenAIError(400, "stream_options: only allowed with stream=true", param="stream_options")
    return Plan(model, prompts, sampling, request.n, logprobs, request.stream, include_usage)


# --------------------------------------------------------------------------------------------
# Triton over gRPC streaming
# --------------------------------------------------------------------------------------------


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
                    raise _model_error(error.message())
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


def _model_error(message: str) -> OpenAIError:
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


# --------------------------------------------------------------------------------------------
# OpenAI response shapes
# --------------------------------------------------------------------------------------------


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, piece: Piece, offset: int) -> dict:
    """``/v1/completions`` logprobs of one piece (``text_offset`` from ``offset`` characters)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    position = offset
    for token_id, entry in zip(piece.token_ids, piece.logprobs or []):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        top.append({_token_text(tokenizer, t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer, piece: Piece, top_k: int) -> dict:
    content = []
    for token_id, entry in zip(piece.token_ids, piece.logprobs or []):
        text = _token_text(tokenizer, token_id)
        alternatives = sorted(entry.items(), key=lambda kv: -kv[1])[:top_k]
        content.append(
            {
                "token": text,
                "logprob": entry.get(token_id),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (s := _token_text(tokenizer, t)), "logprob": lp, "bytes": list(s.encode())}
                    for t, lp in alternatives
                ],
            }
        )
    return {"content": content}


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


class Usage:
    """Token counts summed over every prompt and completion."""

    def __init__(self, plan: Plan) -> None:
        self.prompt = [0] * len(plan.prompts)
        self.completion: dict[tuple[int, int], int] = {}

    def add(self, piece: Piece) -> None:
        self.prompt[piece.prompt_index] = piece.num_input_tokens
        self.completion[(piece.prompt_index, piece.index)] = piece.num_output_tokens

    def body(self) -> dict:
        prompt, completion = sum(self.prompt), sum(self.completion.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --------------------------------------------------------------------------------------------
# The application
# --------------------------------------------------------------------------------------------


def create_app(models: dict[str, ServedModel], grpc_url: str, api_key: str | None = None):
    """The FastAPI application (uvicorn runs it; see ``main``)."""
    backend = TritonBackend(grpc_url)

    @asynccontextmanager
    async def lifespan(app):
        await backend.start()
        yield
        await backend.close()

    app = FastAPI(
        title="lmforge OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.backend = backend

    def error(exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def unauthorized(request: Request) -> JSONResponse | None:
        """The 401 for a missing or wrong bearer token (``--api-key``), else None."""
        if api_key is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode()):
            return None
        message = "missing API key; send Authorization: Bearer KEY" if not header else "incorrect API key"
        return error(OpenAIError(401, message, code="invalid_api_key"))

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return error(
            OpenAIError(
                404,
                f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions",
                code="not_found",
            )
        )

    @app.exception_handler(405)
    async def bad_method(request: Request, exc):
        return error(
            OpenAIError(405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed")
        )

    @app.get("/health")
    async def health():
        ready = [await backend.ready(name) for name in models]
        if all(ready):
            return Response(status_code=200)
        return error(OpenAIError(503, "Triton is not ready", type_="server_error"))

    @app.get("/v1/models")
    async def list_models(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        return {
            "object": "list",
            "data": [
                {
                    "id": m.name,
                    "object": "model",
                    "created": m.created,
                    "owned_by": "lmforge",
                    "max_model_len": m.max_model_len,
                }
                for m in models.values()
            ],
        }

    @app.get("/v1/models/{name}")
    async def get_model(name: str, request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        if name not in models:
            return error(OpenAIError(404, f"the model `{name}` does not exist", param="model", code="model_not_found"))
        m = models[name]
        return {
            "id": m.name,
            "object": "model",
            "created": m.created,
            "owned_by": "lmforge",
            "max_model_len": m.max_model_len,
        }

    async def handle(request: Request, schema):
        if (denied := unauthorized(request)) is not None:
            return denied
        body = await request.body()
        try:
            parsed = schema.model_validate_json(body)
            plan = make_plan(parsed, models)
        except ValidationError as exc:
            return error(validation_error(exc))
        except OpenAIError as exc:
            return error(exc)
        chat = schema is ChatCompletionRequest
        top_k = plan.logprobs or 0
        stream = merged(backend, plan)
        try:
            first = await anext(stream)  # Triton's errors before any output become HTTP errors
        except OpenAIError as exc:
            await stream.aclose()
            return error(exc)
        except StopAsyncIteration:
            return error(OpenAIError(500, "no output from Triton", type_="server_error"))
        if plan.stream:
            return StreamingResponse(
                sse(plan, chat, first, stream, top_k),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            return await whole(plan, chat, first, stream, top_k)
        except OpenAIError as exc:
            return error(exc)
        finally:
            await stream.aclose()

    async def whole(plan: Plan, chat: bool, first: Piece, stream, top_k: int) -> dict:
        tokenizer = plan.model.tokenizer
        texts: dict[tuple[int, int], list[str]] = {}
        pieces: dict[tuple[int, int], list[Piece]] = {}
        reasons: dict[tuple[int, int], str | None] = {}
        usage = Usage(plan)

        def take(piece: Piece) -> None:
            key = (piece.prompt_index, piece.index)
            texts.setdefault(key, []).append(piece.text)
            pieces.setdefault(key, []).append(piece)
            reasons[key] = piece.finish_reason
            usage.add(piece)

        take(first)
        async for piece in stream:
            take(piece)
        choices = []
        for key in sorted(texts):
            text = "".join(texts[key])
            index = key[0] * plan.n + key[1]
            joined = Piece(
                key[0],
                key[1],
                text,
                [t for p in pieces[key] for t in p.token_ids],
                [e for p in pieces[key] for e in (p.logprobs or [])],
                reasons[key],
                0,
                0,
            )
            if chat:
                choice = {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": chat_logprobs(tokenizer, joined, top_k) if plan.logprobs is not None else None,
                    "finish_reason": _finish_reason(reasons[key]),
                }
            else:
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": completion_logprobs(tokenizer, joined, 0) if plan.logprobs is not None else None,
                    "finish_reason": _finish_reason(reasons[key]),
                }
            choices.append(choice)
        return {
            "id": _new_id(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": plan.model.name,
            "choices": choices,
            "usage": usage.body(),
        }

    async def sse(plan: Plan, chat: bool, first: Piece, stream, top_k: int):
        tokenizer = plan.model.tokenizer
        ident, created, name = _new_id(chat), int(time.time()), plan.model.name
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage = Usage(plan)
        offsets: dict[tuple[int, int], int] = {}
        started: set[int] = set()

        def chunk(choices: list[dict], usage_body=None) -> str:
            body = {"id": ident, "object": kind, "created": created, "model": name, "choices": choices}
            if plan.include_usage:
                body["usage"] = usage_body
            return f"data: {json.dumps(body)}\n\n"

        def render(piece: Piece) -> str:
            usage.add(piece)
            index = piece.prompt_index * plan.n + piece.index
            logprobs = None
            if chat:
                out = []
                if index not in started:  # the first chunk of a choice names the role
                    started.add(index)
                    out.append(
                        chunk(
                            [
                                {
                                    "index": index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    )
                if plan.logprobs is not None:
                    logprobs = chat_logprobs(tokenizer, piece, top_k)
                delta = {"content": piece.text} if piece.text else {}
                out.append(
                    chunk(
                        [
                            {
                                "index": index,
                                "delta": delta,
                                "logprobs": logprobs,
                                "finish_reason": _finish_reason(piece.finish_reason),
                            }
                        ]
                    )
                )
                return "".join(out)
            key = (piece.prompt_index, piece.index)
            if plan.logprobs is not None:
                logprobs = completion_logprobs(tokenizer, piece, offsets.get(key, 0))
            offsets[key] = offsets.get(key, 0) + len(piece.text)
            return chunk(
                [
                    {
                        "index": index,
                        "text": piece.text,
                        "logprobs": logprobs,
                        "finish_reason": _finish_reason(piece.finish_reason),
                    }
                ]
            )

        try:
            yield render(first)
            async for piece in stream:
                yield render(piece)
            if plan.include_usage:
                yield chunk([], usage.body())
        except OpenAIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        finally:
            await stream.aclose()  # on a disconnect too: cancels the Triton request
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, ChatCompletionRequest)

    return app


def _new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repo", default="model_repository", help="Triton model repository (its LLMs' model.json name the checkpoints)"
    )
    parser.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton's gRPC address (default 127.0.0.1:8001)")
    parser.add_argument("--models", nargs="+", help="LLM models to serve (default: every LLM of the repository)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9000, help="HTTP port (default 9000)")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 routes (also $LMFORGE_API_KEY)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def main(argv: list[str] | None = None) -> int:
    # optional or heavy dependency: imported only on the path that needs it
    import uvicorn

    parser = argparse.ArgumentParser(description="OpenAI-compatible API in front of a running Triton server")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        models = discover_models(args.repo, args.models)
    except ValueError as exc:
        print(f"error: {exc}", flush=True)
        return 1
    api_key = args.api_key or os.environ.get("LMFORGE_API_KEY")
    app = create_app(models, args.grpc_url, api_key)
    print(
        f"OpenAI API on http://{args.host}:{args.port}/v1 for {', '.join(models)} -> Triton gRPC {args.grpc_url}",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
