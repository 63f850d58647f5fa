"""OpenAI-compatible HTTP API in front of the running Triton server (FastAPI + uvicorn).

    python -m deploy.openai --repo model_repository --grpc-url 127.0.0.1:8001 --port 9000
    (or ``lmforge serve --repo model_repository --openai-port 9000``, which starts both)

Every generation is forwarded to Triton over gRPC streaming (``tritonclient.grpc.aio``, one
bidirectional stream per request on one shared channel), so Triton stays the server: its
scheduling, its metrics and the engine's ``lmforge_*`` metrics count every request. The frontend
tokenizes (the chat template of the checkpoint named by the model's ``1/model.json``), checks
the request, and turns Triton's responses into OpenAI's JSON and server-sent events.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/embeddings`` (the repository's sentence encoders),
``POST /tokenize`` and ``POST /detokenize`` (vLLM's bodies). With ``--api-key`` every ``/v1`` route needs
``Authorization: Bearer KEY``.

Request bodies (``protocol``) are checked strictly, like OpenAI's own API: a field of the wrong
type, an out-of-range value or an unknown field is a 400 naming the field (vLLM's extra fields
``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``
are accepted, e.g. through the client's ``extra_body``). Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 bad input, 401 missing or wrong key,
404 unknown model, 500 a failure inside the server or the model, 503 the model's engine died (it is
being reloaded; retry). A client that disconnects mid-stream cancels its gRPC stream; Triton tells
the model, which aborts the engine request and frees its KV blocks.

The modules, one room each (importing this package imports none of them):

* ``protocol``: request bodies (pydantic) and the OpenAI error type and shape;
* ``models``: the LLMs and encoders of the model repository (``ServedModel``, ``discover_models``,
  ``EncoderModel``, ``discover_encoders``);
* ``prompts``: prompts built and checked, the ``Plan`` sent to Triton;
* ``tools``, ``tool_parsers``: tool calling (``tools``, ``tool_choice``; ``--tool-call-parser``);
* ``triton_client``: the gRPC client (``TritonBackend``) and the merging of its streams;
* ``serving_common``, ``serving_completions``, ``serving_chat``, ``serving_models``,
  ``serving_embedding``, ``serving_tokenization``: one serving class per endpoint (whole responses,
  server-sent events, usage, logprobs);
* ``app``: the FastAPI application (thin routes, auth, error handlers) and the command line.
"""
