"""``POST /v1/embeddings``: sentence embeddings from the repository's encoder models, through Triton.

The encoder is the Python-backend model ``lmforge export`` writes for a sentence encoder
(``deploy.triton_encoder``): ``text`` STRING ``[batch, 1]`` -> ``embeddings`` FP32 ``[batch, hidden]``,
the exported graph's sentence-transformers head included (mean pooling over the attention mask, then
L2 normalisation when the checkpoint has a ``Normalize`` module). The frontend checks and counts the
inputs with the encoder's own tokenizer, sends them in Triton requests of at most the model's
``max_batch_size`` texts (concurrently), and answers OpenAI's shape, each vector as floats or, with
``encoding_format=base64``, as the base64 of its little-endian float32 bytes (what OpenAI sends and
its SDK decodes).

Token-id inputs are embedded through the model's text input: leading and trailing special tokens
(``[CLS]``, ``[SEP]``) aside, which the model adds as for any text, they are decoded with the
encoder's vocabulary and refused unless the text tokenizes back to exactly those ids, so the vector
is always that of the ids sent. Inputs longer than the model's ``max_length`` tokens are refused (not cut).
"""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import orjson
from fastapi.responses import Response
from pydantic import ValidationError

from deploy.openai.models import EncoderModel, ServedModel, model_card
from deploy.openai.protocol import EmbeddingRequest, OpenAIError, validation_error
from deploy.openai.triton_client import TritonBackend, model_error, transport_error

#: Inputs per request at most (OpenAI's limit for its embedding models).
MAX_INPUTS = 2048


class OpenAIServingEmbedding:
    """``/v1/embeddings`` for the encoders of the repository (``deploy.openai.models.discover_encoders``)."""

    def __init__(
        self, encoders: dict[str, EncoderModel], backend: TritonBackend, models: dict[str, ServedModel]
    ) -> None:
        self.encoders, self.backend, self.models = encoders, backend, models

    @staticmethod
    def _card(encoder: EncoderModel) -> dict:
        return model_card(encoder.name, encoder.created, encoder.version_dir, None, encoder.max_length)

    def cards(self) -> list[dict]:
        """The encoders' OpenAI model cards (``GET /v1/models`` lists them after the LLMs)."""
        return [self._card(encoder) for encoder in self.encoders.values()]

    def card(self, name: str) -> dict:
        return self._card(self.encoders[name])

    async def check_ready(self) -> None:
        """Raises: OpenAIError: 503 when Triton does not have every served encoder ready."""
        ready = [await self.backend.ready(name) for name in self.encoders]
        if not all(ready):
            raise OpenAIError(503, "Triton is not ready", type_="server_error")

    async def create(self, body: bytes) -> Response:
        """Answer one request body.

        Raises:
            OpenAIError: 400 a bad body (the message names the field: ``input.3``, ``dimensions``...);
                404 an unknown model; 503 Triton or the model is unavailable.
        """
        try:
            request = EmbeddingRequest.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        encoder = self._find(request.model)
        if request.dimensions is not None and request.dimensions != encoder.hidden_size:
            raise OpenAIError(
                400,
                f"dimensions={request.dimensions}: {encoder.name} gives {encoder.hidden_size}-dimensional embeddings "
                f"only (no shorter ones); leave dimensions out or send {encoder.hidden_size}",
                param="dimensions",
            )
        texts, num_tokens = self._inputs(request, encoder)
        vectors = await self._embed(encoder, texts)  # [len(texts), hidden] float32
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(vector, request.encoding_format)}
            for i, vector in enumerate(vectors)
        ]
        answer = {
            "object": "list",
            "data": data,
            "model": encoder.name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            "created": int(time.time()),
        }
        return Response(orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")

    def _find(self, name: str) -> EncoderModel:
        encoder = self.encoders.get(name)
        if encoder is not None:
            return encoder
        served = sorted(self.encoders)
        if name in self.models or any(name in m.adapters for m in self.models.values()):
            raise OpenAIError(
                400,
                f"model `{name}` is a generative model; /v1/embeddings serves the encoder models {served}",
                param="model",
            )
        raise OpenAIError(
            404,
            f"the embedding model `{name}` does not exist; served: {served}",
            param="model",
            code="model_not_found",
        )

    def _inputs(self, request: EmbeddingRequest, encoder: EncoderModel) -> tuple[list[str], int]:
        """The texts to embed and their number of tokens (special tokens included, as the model sees them).

        Raises:
            OpenAIError: 400 naming ``input`` or ``input.I``: empty, too many, too long, ids out of the
                vocabulary or that do not round-trip through the encoder's tokenizer.
        """
        given = request.input
        if isinstance(given, str):
            items, params = [given], ["input"]
        elif given and all(isinstance(i, int) for i in given):
            items, params = [list(given)], ["input"]
        else:
            items, params = list(given), [f"input.{i}" for i in range(len(given))]
        if not items:
            raise OpenAIError(400, "input: empty list; send a string, a list of strings or token ids", param="input")
        if len(items) > MAX_INPUTS:
            raise OpenAIError(
                400, f"input: {len(items)} inputs, over the limit of {MAX_INPUTS}; split the request", param="input"
            )
        texts = [self._text(item, param, encoder) for item, param in zip(items, params)]
        num_tokens = 0
        for encoding, param in zip(encoder.tokenizer.encode_batch(texts), params):
            length = len(encoding.ids)
            if length > encoder.max_length:
                raise OpenAIError(
                    400,
                    f"{param}: {length} tokens, over {encoder.name}'s limit of {encoder.max_length}; shorten it",
                    param=param,
                    code="context_length_exceeded",
                )
            num_tokens += length
        return texts, num_tokens

    @staticmethod
    def _text(item: str | list[int], param: str, encoder: EncoderModel) -> str:
        if isinstance(item, str):
            if not item.strip():
                raise OpenAIError(400, f"{param}: empty text; send non-empty text", param=param)
            return item
        ids = list(item)
        vocab_size = encoder.tokenizer.get_vocab_size()
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if not ids or bad is not None:
            problem = "no token ids" if not ids else f"token id {bad} is outside the vocabulary [0, {vocab_size})"
            raise OpenAIError(400, f"{param}: {problem}", param=param)
        special = _special_ids(encoder)
        start, end = 0, len(ids)
        while start < end and ids[start] in special:  # [CLS] ... [SEP]: the model adds them as for text
            start += 1
        while end > start and ids[end - 1] in special:
            end -= 1
        inner = ids[start:end]
        if any(i in special for i in inner):
            token = encoder.tokenizer.id_to_token(next(i for i in inner if i in special))
            raise OpenAIError(
                400,
                f"{param}: special token {token} inside the ids (the model takes text: only leading and trailing "
                "special tokens are accepted, and added again as for text); send the text instead",
                param=param,
            )
        text = encoder.tokenizer.decode(inner, skip_special_tokens=False)
        if not text.strip() or encoder.tokenizer.encode(text, add_special_tokens=False).ids != inner:
            raise OpenAIError(
                400,
                f"{param}: these token ids do not read back as text that {encoder.name}'s tokenizer splits into the "
                "same ids (the model takes text); send the text instead",
                param=param,
            )
        return text

    async def _embed(self, encoder: EncoderModel, texts: list[str]) -> np.ndarray:
        """``[len(texts), hidden]`` float32: one Triton request per ``max_batch_size`` texts, concurrently."""
        size = encoder.max_batch_size
        parts = await asyncio.gather(
            *(self._infer(encoder, texts[start : start + size]) for start in range(0, len(texts), size))
        )
        return np.concatenate(parts, axis=0)

    async def _infer(self, encoder: EncoderModel, texts: list[str]) -> np.ndarray:
        # optional or heavy dependency: imported only on the path that needs it
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.utils import InferenceServerException

        text = grpcclient.InferInput("text", [len(texts), 1], "BYTES")
        text.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
        output = grpcclient.InferRequestedOutput("embeddings")
        try:
            result = await self.backend.client.infer(
                encoder.name, [text], outputs=[output], headers=self.backend.headers
            )
        except InferenceServerException as exc:
            raise model_error(exc.message() or str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - grpc's AioRpcError and the like: Triton went away
            raise transport_error(exc) from exc
        vectors = result.as_numpy("embeddings")
        if vectors is None or vectors.shape != (len(texts), encoder.hidden_size):
            shape = None if vectors is None else vectors.shape
            raise OpenAIError(500, f"{encoder.name} answered embeddings of shape {shape}", type_="server_error")
        return vectors.astype(np.float32, copy=False)


def _special_ids(encoder: EncoderModel) -> set[int]:
    """The ids of the tokenizer's special tokens ([CLS], [SEP], [PAD], [UNK]...)."""
    return {i for i, token in encoder.tokenizer.get_added_tokens_decoder().items() if token.special}


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """One embedding as JSON floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
