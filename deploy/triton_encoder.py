"""Triton Python-backend models for an ONNX sentence encoder (bundled server).

* ``TritonPythonModel``: ``text`` STRING ``[batch, 1]`` -> ``embeddings`` FP32
  ``[batch, hidden]``: tokenizes inside and runs the exported ``model.onnx`` (pooling head
  included) with ONNX Runtime. With dynamic batching, ``execute`` receives several requests and
  runs them as one ONNX Runtime batch.
* ``TokenizerModel``: the first step of the full-container ensemble, ``text`` -> INT64 token
  tensors padded to ``max_length`` (so the ONNX Runtime backend's dynamic batcher can merge
  requests of equal shape).

A thin ``model.py`` in the repository imports these classes (``lmforge export`` writes it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from deploy.encoder import POOLED_OUTPUT, OnnxEncoder, load_tokenizer, tokenize


def _version_dir(args: dict) -> Path:
    return Path(args["model_repository"]) / args["model_version"]


def _texts(request) -> list[str]:
    """The request's ``text`` tensor ``[n, 1]`` as ``n`` strings.

    Raises:
        ValueError: an empty or non-UTF-8 text (names the field).
    """
    tensor = pb_utils.get_input_tensor_by_name(request, "text")
    if tensor is None:
        raise ValueError("text: missing; send the input text as `text`")
    texts = []
    for value in tensor.as_numpy().reshape(-1):
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        if not text.strip():
            raise ValueError("text: empty string; send non-empty text")
        texts.append(text)
    return texts


def _error(message: str):
    """An error response for bad input (HTTP 400 / gRPC INVALID_ARGUMENT)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))


class TritonPythonModel:
    """Text -> sentence embeddings with ONNX Runtime (the encoder for the bundled server)."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        threads = config.get("parameters", {}).get("intra_op_num_threads", {}).get("string_value")
        self.encoder = OnnxEncoder(_version_dir(args), num_threads=int(threads) if threads else None)

    def execute(self, requests):
        """One ONNX Runtime call for all valid requests; a bad request gets its own error."""
        texts_per_request: list[list[str] | str] = []
        for request in requests:
            try:
                texts_per_request.append(_texts(request))
            except (ValueError, UnicodeDecodeError) as exc:
                texts_per_request.append(str(exc))
        batch = [t for texts in texts_per_request if isinstance(texts, list) for t in texts]
        embeddings = self.encoder.encode(batch) if batch else np.zeros((0, self.encoder.info.hidden_size), np.float32)
        responses, start = [], 0
        for texts in texts_per_request:
            if isinstance(texts, str):
                responses.append(_error(texts))
                continue
            rows = embeddings[start : start + len(texts)]  # [n, hidden]
            start += len(texts)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(POOLED_OUTPUT, rows)]))
        return responses


class TokenizerModel:
    """Text -> padded token tensors (the ensemble's first step in the full Triton container)."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        max_length = int(config["parameters"]["max_length"]["string_value"])
        self.output_names = [o["name"] for o in config["output"]]
        self.tokenizer = load_tokenizer(_version_dir(args), max_length, pad_to_length=max_length)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                texts = _texts(request)
            except (ValueError, UnicodeDecodeError) as exc:
                responses.append(_error(str(exc)))
                continue
            encoded = tokenize(self.tokenizer, texts, self.output_names)  # name -> [n, max_length]
            tensors = [pb_utils.Tensor(name, array) for name, array in encoded.items()]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
