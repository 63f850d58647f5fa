"""Sentence embeddings from an ONNX encoder (all-MiniLM-L6-v2 and other BERT-like models).

Export (``prepare_encoder_onnx``): ``compress.quantize.onnx.export_onnx(task="feature-extraction")``
gives a graph with output ``last_hidden_state`` ``[batch, seq, hidden]``. We append the
sentence-transformers head to the graph -- mean pooling over the attention mask (Reimers &
Gurevych 2019, Sentence-BERT) and, when the checkpoint's ``modules.json`` has a ``Normalize``
module, L2 normalisation -- as a second output ``embeddings`` ``[batch, hidden]``. The same
``model.onnx`` then serves both the ONNX Runtime backend of the full Triton container and the
Python-backend model of the bundled server, and clients send text, not token ids.

Run time (``OnnxEncoder``): tokenizer + ``onnxruntime.InferenceSession`` on that graph.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer

from compress.quantize.onnx import export_onnx
from engine.checkpoint.store import resolve_checkpoint

ENCODER_INFO_NAME = "encoder.json"
POOLED_OUTPUT = "embeddings"


@dataclasses.dataclass(frozen=True)
class EncoderInfo:
    """What the serving side needs to know about an exported encoder (``encoder.json``).

    Attributes:
        hidden_size: embedding width (384 for MiniLM-L6).
        input_names: the graph's INT64 inputs (``input_ids``, ``attention_mask``, maybe
            ``token_type_ids``), in graph order.
        normalize: whether the graph L2-normalises the pooled embedding.
        max_length: tokens per text; longer texts are truncated.
    """

    hidden_size: int
    input_names: list[str]
    normalize: bool
    max_length: int = 256

    def write(self, directory: Path) -> Path:
        path = Path(directory) / ENCODER_INFO_NAME
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, directory: Path) -> "EncoderInfo":
        path = Path(directory) / ENCODER_INFO_NAME
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"{path}: missing or not an encoder description ({exc}); re-run `lmforge export`") from exc


def sentence_transformers_normalizes(checkpoint_dir: Path) -> bool:
    """True when the checkpoint's ``modules.json`` lists a ``Normalize`` module."""
    modules = Path(checkpoint_dir) / "modules.json"
    if not modules.is_file():
        return False
    return any(m.get("type", "").endswith(".Normalize") for m in json.loads(modules.read_text()))


def add_pooling_head(model, *, normalize: bool):
    """Append mean pooling (and L2 normalisation) to a feature-extraction graph, in place.

    Args:
        model: ``onnx.ModelProto`` with inputs ``attention_mask`` ``[batch, seq]`` (INT64) and
            output ``last_hidden_state`` ``[batch, seq, hidden]``; opset >= 13 (axes as inputs).

    Returns:
        The model, with a new output ``embeddings`` ``[batch, hidden]`` FP32.

    Raises:
        ValueError: the graph lacks those tensors or uses an older opset.
    """
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        raise ValueError(f"ONNX opset {opset} is too old for the pooling head; export with opset >= 13")
    graph = model.graph
    if "attention_mask" not in {i.name for i in graph.input} or "last_hidden_state" not in {
        o.name for o in graph.output
    }:
        raise ValueError(
            "the graph needs input attention_mask and output last_hidden_state (export with task feature-extraction)"
        )
    hidden_size = _hidden_size(graph)
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([-1], dtype=np.int64), "pool_axis_last"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "pool_axis_seq"),
            numpy_helper.from_array(np.array(1e-9, dtype=np.float32), "pool_eps"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Cast", ["attention_mask"], ["pool_mask_f"], to=TensorProto.FLOAT),  # [b, s]
            helper.make_node("Unsqueeze", ["pool_mask_f", "pool_axis_last"], ["pool_mask_3d"]),  # [b, s, 1]
            helper.make_node("Mul", ["last_hidden_state", "pool_mask_3d"], ["pool_masked"]),  # [b, s, h]
            helper.make_node("ReduceSum", ["pool_masked", "pool_axis_seq"], ["pool_sum"], keepdims=0),  # [b, h]
            helper.make_node("ReduceSum", ["pool_mask_3d", "pool_axis_seq"], ["pool_count"], keepdims=0),  # [b, 1]
            helper.make_node("Max", ["pool_count", "pool_eps"], ["pool_count_safe"]),
            helper.make_node("Div", ["pool_sum", "pool_count_safe"], ["pool_mean" if normalize else POOLED_OUTPUT]),
        ]
    )
    if normalize:  # sentence-transformers Normalize: x / max(||x||_2, eps)
        graph.node.extend(
            [
                helper.make_node("ReduceL2", ["pool_mean", "pool_axis_last"], ["pool_norm"], keepdims=1),  # [b, 1]
                helper.make_node("Max", ["pool_norm", "pool_eps"], ["pool_norm_safe"]),
                helper.make_node("Div", ["pool_mean", "pool_norm_safe"], [POOLED_OUTPUT]),
            ]
        )
    graph.output.append(helper.make_tensor_value_info(POOLED_OUTPUT, TensorProto.FLOAT, ["batch_size", hidden_size]))
    onnx.checker.check_model(model)
    return model


def _hidden_size(graph) -> int:
    output = next(o for o in graph.output if o.name == "last_hidden_state")
    dims = output.type.tensor_type.shape.dim
    if len(dims) != 3 or not dims[2].dim_value:
        raise ValueError("last_hidden_state must have a static hidden size [batch, seq, hidden]")
    return int(dims[2].dim_value)


def prepare_encoder_onnx(checkpoint: str | Path, out_dir: Path, *, max_length: int = 256) -> EncoderInfo:
    """Export an encoder checkpoint to ``out_dir/model.onnx`` with the pooling head, plus its
    tokenizer files and ``encoder.json``.

    Raises:
        CheckpointError: missing/corrupt checkpoint (from ``compress``). ValueError: see
        ``add_pooling_head``.
    """
    source = resolve_checkpoint(checkpoint, causal_lm=False)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmforge-encoder-") as tmp:
        exported = export_onnx(source, Path(tmp) / "onnx", task="feature-extraction")
        model = onnx.load(str(exported / "model.onnx"))
        normalize = sentence_transformers_normalizes(source)
        add_pooling_head(model, normalize=normalize)
        onnx.save(model, str(out_dir / "model.onnx"))
        for file in exported.iterdir():
            if file.is_file() and file.suffix != ".onnx":
                shutil.copy2(file, out_dir / file.name)
    info = EncoderInfo(
        hidden_size=_hidden_size(model.graph),
        input_names=[i.name for i in model.graph.input],
        normalize=normalize,
        max_length=max_length,
    )
    info.write(out_dir)
    return info


def load_tokenizer(model_dir: Path, max_length: int, *, pad_to_length: int | None = None):
    """The checkpoint's fast tokenizer (``tokenizer.json``, Hugging Face ``tokenizers``), set to
    truncate at ``max_length`` and pad to the longest text (or to ``pad_to_length``).

    ``tokenizers`` alone imports in milliseconds, which keeps model loading in Triton quick.

    Raises:
        ValueError: ``tokenizer.json`` is missing (names the file and the fix).
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing; re-run `lmforge export` for this encoder")
    tokenizer = Tokenizer.from_file(str(path))
    pad_token = "[PAD]"
    special = Path(model_dir) / "special_tokens_map.json"
    if special.is_file():
        value = json.loads(special.read_text()).get("pad_token", pad_token)
        pad_token = value["content"] if isinstance(value, dict) else value
    pad_id = tokenizer.token_to_id(pad_token)
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token=pad_token, length=pad_to_length)
    return tokenizer


def tokenize(tokenizer, texts: list[str], input_names: list[str]) -> dict[str, np.ndarray]:
    """Encode a batch: ``{input_ids, attention_mask, token_type_ids}`` -> ``[batch, seq]`` int64,
    only the names the graph takes."""
    encodings = tokenizer.encode_batch(texts)
    fields = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
    return {name: np.array([getattr(e, fields[name]) for e in encodings], dtype=np.int64) for name in input_names}


class OnnxEncoder:
    """Text -> sentence embeddings with the tokenizer and ONNX Runtime (CPU).

    Args:
        model_dir: a directory written by ``prepare_encoder_onnx``.
        num_threads: ONNX Runtime intra-op threads (``None``: its default).
    """

    def __init__(self, model_dir: str | Path, *, num_threads: int | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.info = EncoderInfo.read(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir, self.info.max_length)
        options = ort.SessionOptions()
        if num_threads:
            options.intra_op_num_threads = num_threads
        self.session = ort.InferenceSession(
            str(self.model_dir / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )

    def tokenize(self, texts: list[str]) -> dict[str, np.ndarray]:
        """Token tensors ``{name: [batch, seq] int64}`` for the graph inputs (padded to the longest)."""
        return tokenize(self.tokenizer, texts, self.info.input_names)

    def encode(self, texts: list[str]) -> np.ndarray:
        """Embeddings ``[len(texts), hidden]`` FP32 (pooled, normalised as the checkpoint says).

        Raises:
            ValueError: ``texts`` is empty or holds an empty string.
        """
        if not texts:
            raise ValueError("text: no input text; send at least one string")
        if any(not t for t in texts):
            raise ValueError("text: empty string; send non-empty text")
        (embeddings,) = self.session.run([POOLED_OUTPUT], self.tokenize(texts))
        return embeddings.astype(np.float32)
