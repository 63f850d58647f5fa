"""The FastAPI application (thin routes, auth, error handlers) and the ``python -m deploy.openai`` command.

Each route parses what it needs from the HTTP request and hands it to its serving class; an
``OpenAIError`` raised anywhere becomes OpenAI's error body with its status.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from deploy.openai.models import EncoderModel, ServedModel, discover_encoders, discover_models
from deploy.openai.protocol import OpenAIError
from deploy.openai.serving_chat import OpenAIServingChat
from deploy.openai.serving_completions import OpenAIServingCompletion
from deploy.openai.serving_embedding import OpenAIServingEmbedding
from deploy.openai.serving_models import OpenAIServingModels, check_unique_names
from deploy.openai.serving_tokenization import OpenAIServingTokenization
from deploy.openai.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from deploy.openai.triton_client import STALL_TIMEOUT_S, TritonBackend
from engine.cli_options import add_option


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def api_key_check(api_key: str | None):
    """A dependency that raises the 401 for a missing or wrong bearer token (``--api-key``).

    ``async``: FastAPI runs a plain function dependency on a worker thread, a thread hop per request.
    """

    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode()):
            return
        message = "missing API key; send Authorization: Bearer KEY" if not header else "incorrect API key"
        raise OpenAIError(401, message, code="invalid_api_key")

    return check


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI's error shape for our errors, unknown routes (404) and wrong methods (405)."""

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # a bug of ours: still OpenAI's shape, never text
        message = f"internal error: {type(exc).__name__}: {exc}"
        return error_response(OpenAIError(500, message, type_="server_error"))

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        message = f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions"
        return error_response(OpenAIError(404, message, code="not_found"))

    @app.exception_handler(405)
    async def bad_method(request: Request, exc):
        message = f"method {request.method} not allowed on {request.url.path}"
        return error_response(OpenAIError(405, message, code="method_not_allowed"))


def add_lora_routes(app: FastAPI, serving_models: OpenAIServingModels, auth: list) -> None:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's), one at a time."""
    lora_lock = asyncio.Lock()  # one load or unload at a time (each rewrites multi_lora.json)

    @app.post("/v1/load_lora_adapter", dependencies=auth)
    async def load_lora_adapter(request: Request):
        body = await request.body()
        async with lora_lock:  # the adapter is read and checked on a worker thread, off the event loop
            return PlainTextResponse(await asyncio.to_thread(serving_models.load_lora_adapter, body))

    @app.post("/v1/unload_lora_adapter", dependencies=auth)
    async def unload_lora_adapter(request: Request):
        body = await request.body()
        async with lora_lock:
            return PlainTextResponse(serving_models.unload_lora_adapter(body))


def create_app(
    models: dict[str, ServedModel],
    grpc_url: str,
    api_key: str | None = None,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    encoders: dict[str, EncoderModel] | None = None,
    tool_call_parser: str = DEFAULT_TOOL_PARSER,
) -> FastAPI:
    """The FastAPI application (uvicorn runs it; see ``main``). ``api_key`` guards ``/v1`` and is sent to
    Triton (whose APIs ``lmforge serve --api-key`` restricts with the same key). ``encoders``: the sentence
    encoders ``/v1/embeddings`` serves (``discover_encoders``). ``tool_call_parser``: the format the
    models' tool calls are read in (``deploy.openai.tool_parsers``)."""
    for model in models.values():
        model.tool_call_parser = tool_call_parser
    backend = TritonBackend(grpc_url, api_key, stall_timeout_s)
    serving_models = OpenAIServingModels(models, backend, encoders or {})
    serving_completion = OpenAIServingCompletion(models, backend)
    serving_chat = OpenAIServingChat(models, backend)
    serving_embedding = OpenAIServingEmbedding(encoders or {}, backend, models)
    serving_tokenization = OpenAIServingTokenization(models)

    @asynccontextmanager
    async def lifespan(app):
        await backend.start()
        yield
        await backend.close()

    app = FastAPI(
        title="lmforge OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.backend = backend
    add_error_handlers(app)
    auth = [Depends(api_key_check(api_key))]

    @app.get("/health")
    async def health():
        await serving_models.check_ready()
        await serving_embedding.check_ready()
        return Response(status_code=200)

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        listed = serving_models.list()
        listed["data"] += serving_embedding.cards()
        return listed

    @app.get("/v1/models/{name}", dependencies=auth)
    async def get_model(name: str):
        return serving_embedding.card(name) if name in serving_embedding.encoders else serving_models.get(name)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        return await serving_completion.create(await request.body(), request.is_disconnected)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        return await serving_chat.create(await request.body(), request.is_disconnected)

    @app.post("/v1/embeddings", dependencies=auth)
    async def embeddings(request: Request):
        return await serving_embedding.create(await request.body())

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request):
        return serving_tokenization.tokenize(await request.body())

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request):
        return serving_tokenization.detokenize(await request.body())

    @app.get("/tokenizer_info", dependencies=auth)
    async def tokenizer_info(model: str | None = None):
        return serving_tokenization.tokenizer_info(model)

    add_lora_routes(app, serving_models, auth)
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repo", default="model_repository", help="Triton model repository (its LLMs' model.json name the checkpoints)"
    )
    add_option(parser, "--grpc-url", "127.0.0.1:8001", "Triton's gRPC address")
    parser.add_argument(
        "--models",
        nargs="+",
        help="models to serve: LLMs and sentence encoders (/v1/embeddings) (default: every one of the repository)",
    )
    add_option(parser, "--host", "127.0.0.1", "address to bind")
    add_option(parser, "--port", 9000, "HTTP port")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 routes (also $LMFORGE_API_KEY)")
    parser.add_argument(
        "--stall-timeout-s",
        type=float,
        default=STALL_TIMEOUT_S,
        help="a request that hears nothing from Triton (no token, no heartbeat) this long gets a 503 "
        f"(its model instance died; default {STALL_TIMEOUT_S})",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=DEFAULT_TOOL_PARSER,
        help="the format the models write tool calls in: hermes (<tool_call> blocks: SmolLM2, Hermes, Qwen) or "
        f"llama3_json (Llama 3.x JSON calls); default {DEFAULT_TOOL_PARSER}",
    )
    add_option(parser, "--log-level", "warning", "uvicorn log level")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="OpenAI-compatible API in front of a running Triton server")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.api_key is not None and not args.api_key.strip():
        parser.error("--api-key is empty: the server would accept every client; give the key or leave the flag out")
    try:
        encoders = discover_encoders(args.repo, args.models)
        llms = None if args.models is None else [name for name in args.models if name not in encoders]
        models = discover_models(args.repo, llms)
        check_unique_names(models, encoders)
    except ValueError as exc:
        print(f"error: {exc}", flush=True)
        return 1
    api_key = args.api_key or os.environ.get("LMFORGE_API_KEY")
    app = create_app(models, args.grpc_url, api_key, args.stall_timeout_s, encoders, args.tool_call_parser)
    print(
        f"OpenAI API on http://{args.host}:{args.port}/v1 for {', '.join([*models, *encoders])} -> Triton gRPC "
        f"{args.grpc_url}",
        flush=True,
    )
    # uvloop and httptools: the event loop and HTTP parser built for many small writes (SSE)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        loop="uvloop",
        http="httptools",
    )
    try:
        EndingServer(config, app.state.backend).run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it handled again once its graceful shutdown is done
        return 130
    return 0


class EndingServer(uvicorn.Server):
    """``uvicorn.Server`` that, on SIGINT/SIGTERM, ends the requests in flight before its graceful wait.

    uvicorn stops accepting connections, then waits ``timeout_graceful_shutdown`` for the responses in
    flight and cancels what is left: a stream cut without an ending. ``TritonBackend.shut_down`` first ends
    each one with a 503 (a started stream: an error event and ``[DONE]``), so ``lmforge serve`` can stop
    Triton after the frontend exited.
    """

    def __init__(self, config: uvicorn.Config, backend: TritonBackend) -> None:
        super().__init__(config)
        self.backend = backend

    async def shutdown(self, sockets=None) -> None:
        self.backend.shut_down()
        await super().shutdown(sockets=sockets)


if __name__ == "__main__":
    raise SystemExit(main())
