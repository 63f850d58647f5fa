"""ONNX export (Hugging Face Optimum) and ONNX Runtime dynamic INT8 quantization.

Two steps, each producing a checkpoint directory (``model.onnx`` + ``config.json`` + tokenizer
files + ``lmforge.json``):

* ``export_onnx``: ``optimum.exporters.onnx.main_export`` traces the PyTorch model. Causal LMs
  use the task ``text-generation-with-past`` (inputs ``input_ids``, ``attention_mask``,
  ``position_ids``, ``past_key_values.{i}.key|value``; outputs ``logits`` and ``present.{i}.*``),
  so ``optimum.onnxruntime.ORTModelForCausalLM`` generates with its KV cache. Encoders such as
  all-MiniLM-L6-v2 use ``feature-extraction`` (output ``last_hidden_state``; pool it with
  ``mean_pool``).
* ``quantize_onnx_int8``: ``onnxruntime.quantization.quantize_dynamic`` stores the weights of
  the chosen operators as INT8 (symmetric, per output channel by default) and quantizes
  activations on the fly at run time (ONNX Runtime dynamic quantization, ``MatMulInteger`` /
  ``DynamicQuantizeLinear``).
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path
from typing import Any

import onnx
import torch
from onnxruntime.quantization import QuantType, quantize_dynamic
from optimum.exporters.onnx import main_export

from engine.checkpoint.outputs import CHECKPOINT, staged_output_dir
from engine.checkpoint.store import (
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    read_manifest,
    resolve_checkpoint,
    write_manifest,
)

ONNX_MODEL_NAME = "model.onnx"

#: Optimum export tasks lmforge uses, and whether the source must be a supported causal LM.
EXPORT_TASKS: dict[str, bool] = {
    "text-generation-with-past": True,
    "feature-extraction": False,
}

#: ``onnxruntime.quantization.QuantType`` names accepted for the weights.
WEIGHT_TYPES = ("QInt8", "QUInt8")

#: Above this size an ONNX file must keep its tensors in external data (protobuf 2 GiB limit).
_EXTERNAL_DATA_THRESHOLD_BYTES = 1_800_000_000


@dataclasses.dataclass(frozen=True)
class OnnxExportConfig:
    """How a checkpoint is exported to ONNX (recorded in the manifest under ``config``).

    Attributes:
        task: an Optimum export task, one of ``EXPORT_TASKS``.
        opset: ONNX opset; ``None`` lets Optimum pick the model's default.
    """

    task: str = "text-generation-with-past"
    opset: int | None = None

    def __post_init__(self) -> None:
        if self.task not in EXPORT_TASKS:
            raise ValueError(f"task={self.task!r} is not supported; use one of {sorted(EXPORT_TASKS)}")
        if self.opset is not None and not 11 <= self.opset <= 21:
            raise ValueError(f"opset={self.opset} is out of range; use an ONNX opset between 11 and 21, or None")


@dataclasses.dataclass(frozen=True)
class OnnxInt8Config:
    """ONNX Runtime dynamic INT8 quantization settings (recorded in the manifest).

    Attributes:
        weight_type: ``QInt8`` (signed, symmetric) or ``QUInt8``.
        per_channel: one scale per output channel of each weight instead of one per tensor.
        reduce_range: 7-bit weights, for CPUs without VNNI that could saturate.
        op_types_to_quantize: operator types whose weights are stored in INT8 (``MatMul`` covers
            every linear layer; ``Gather`` the embedding table).
        nodes_to_exclude: ONNX node names left in fp32.
    """

    weight_type: str = "QInt8"
    per_channel: bool = True
    reduce_range: bool = False
    op_types_to_quantize: tuple[str, ...] = ("MatMul", "Gather")
    nodes_to_exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"weight_type={self.weight_type!r} is not supported; use one of {WEIGHT_TYPES}")
        if not self.op_types_to_quantize:
            raise ValueError("op_types_to_quantize is empty; name at least one operator type, e.g. ('MatMul',)")


def onnx_num_parameters(model_path: str | Path) -> int:
    """Number of elements over all initializers (weights) of an ONNX model, without loading data."""
    model = onnx.load(str(model_path), load_external_data=False)
    total = 0
    for tensor in model.graph.initializer:
        count = 1
        for dim in tensor.dims:
            count *= dim
        total += count
    return total


def _onnx_size_bytes(directory: Path) -> int:
    """Bytes of the ONNX graph and its external data files."""
    return sum(
        f.stat().st_size
        for f in directory.iterdir()
        if f.suffix in (".onnx", ".onnx_data") or f.name.endswith(".onnx.data")
    )


def _write_onnx_manifest(
    directory: Path, *, source: str, parent: str, method: str, config: dict[str, Any], dtype: str
) -> None:
    write_manifest(
        directory,
        Manifest(
            source=source,
            parent=parent,
            method=method,
            config=config,
            dtype=dtype,
            num_parameters=onnx_num_parameters(directory / ONNX_MODEL_NAME),
            size_bytes=_onnx_size_bytes(directory),
        ),
    )


def _source_of(checkpoint_dir: Path) -> str:
    return read_manifest(checkpoint_dir).source if (checkpoint_dir / MANIFEST_NAME).is_file() else str(checkpoint_dir)


def export_onnx(checkpoint_dir: str | Path, output_dir: str | Path, *, task: str, opset: int | None = None) -> Path:
    """Export a checkpoint to ONNX with Optimum.

    Args:
        checkpoint_dir: a checkpoint (name, ``.gguf`` or directory; see ``resolve_checkpoint``).
        output_dir: the new checkpoint directory: new, empty or an earlier checkpoint (replaced).
            ``OutputDirError`` otherwise (``engine.checkpoint.outputs``).
        task: ``text-generation-with-past`` for causal LMs (exports the KV-cache inputs and
            outputs), ``feature-extraction`` for encoders (``last_hidden_state``
            ``[batch, seq, hidden]``).
        opset: ONNX opset, ``None`` for Optimum's default.

    Returns:
        ``output_dir`` holding ``model.onnx``, ``config.json``, tokenizer files and a manifest
        (method ``onnx-export``, parent = the source checkpoint, config = ``OnnxExportConfig``).

    Raises:
        ValueError: unknown ``task`` or bad ``opset`` (names the field).
        CheckpointError: missing or corrupt source, or a non-causal model for a generation task.
    """
    config = OnnxExportConfig(task=task, opset=opset)
    source_dir = resolve_checkpoint(checkpoint_dir, causal_lm=EXPORT_TASKS[task])
    output_dir = Path(output_dir)
    with staged_output_dir(output_dir, kind=CHECKPOINT, sources=(source_dir,)) as tmp, warnings.catch_warnings():
        # the tracer warns about constants that transformers' mask code builds; the exported graph is checked below
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        main_export(
            str(source_dir),
            tmp,
            task=task,
            opset=opset,
            library_name="transformers",  # plain model outputs, even for sentence-transformers dirs
            do_validation=False,  # the tests compare against PyTorch with stated tolerances
            local_files_only=True,
        )
        if not (tmp / ONNX_MODEL_NAME).is_file():
            raise CheckpointError(
                f"{tmp / ONNX_MODEL_NAME}: the exporter wrote no model; files: {sorted(p.name for p in tmp.iterdir())}"
            )
        _write_onnx_manifest(
            tmp,
            source=_source_of(source_dir),
            parent=str(source_dir),
            method="onnx-export",
            config=dataclasses.asdict(config),
            dtype="float32",
        )
    return output_dir


def quantize_onnx_int8(
    onnx_dir: str | Path,
    output_dir: str | Path,
    *,
    config: OnnxInt8Config | None = None,
    parent: str | Path | None = None,
) -> Path:
    """Quantize an exported ONNX checkpoint's weights to INT8 with ONNX Runtime (dynamic).

    Args:
        onnx_dir: a directory written by ``export_onnx`` (``model.onnx`` + config + tokenizer).
        output_dir: the new checkpoint directory: new, empty or an earlier checkpoint (replaced).
            ``OutputDirError`` otherwise (``engine.checkpoint.outputs``).
        config: quantization settings; ``OnnxInt8Config()`` (QInt8, per-channel) by default.
        parent: the manifest's ``parent``; defaults to ``onnx_dir`` (``lmforge quantize`` passes
            the PyTorch checkpoint when the fp32 export was only an intermediate step).

    Returns:
        ``output_dir`` with the INT8 ``model.onnx``, the other files of ``onnx_dir`` and a
        manifest (method ``onnx-int8``, config = export config + quantization config).

    Raises:
        CheckpointError: ``onnx_dir`` has no ``model.onnx`` (names the file).
    """
    config = config or OnnxInt8Config()
    onnx_dir = Path(onnx_dir)
    model_path = onnx_dir / ONNX_MODEL_NAME
    if not model_path.is_file():
        raise CheckpointError(
            f"{model_path}: missing; export the checkpoint first with compress.quantize.onnx.export_onnx (or "
            "lmforge quantize --method onnx-int8)"
        )
    export_manifest = read_manifest(onnx_dir) if (onnx_dir / MANIFEST_NAME).is_file() else None
    output_dir = Path(output_dir)
    sources = (onnx_dir,) if parent is None else (onnx_dir, parent)
    with staged_output_dir(output_dir, kind=CHECKPOINT, sources=sources) as tmp:
        for file in onnx_dir.iterdir():
            if (
                file.is_file()
                and file.suffix != ".onnx"
                and file.name != MANIFEST_NAME
                and "onnx_data" not in file.name
                and not file.name.endswith(".onnx.data")
            ):
                shutil.copy2(file, tmp / file.name)
        quantize_dynamic(
            model_path,
            tmp / ONNX_MODEL_NAME,
            op_types_to_quantize=list(config.op_types_to_quantize),
            per_channel=config.per_channel,
            reduce_range=config.reduce_range,
            weight_type=getattr(QuantType, config.weight_type),
            nodes_to_exclude=list(config.nodes_to_exclude),
            use_external_data_format=_onnx_size_bytes(onnx_dir) > _EXTERNAL_DATA_THRESHOLD_BYTES,
        )
        export_config = export_manifest.config if export_manifest else {}
        _write_onnx_manifest(
            tmp,
            source=export_manifest.source if export_manifest else str(onnx_dir),
            parent=str(parent if parent is not None else onnx_dir),
            method="onnx-int8",
            config={"export": export_config, "quantization": dataclasses.asdict(config)},
            dtype="int8",
        )
    return output_dir


def mean_pool(last_hidden_state, attention_mask):
    """Sentence embeddings as the mask-weighted mean of token states (Sentence-BERT pooling).

    Reimers & Gurevych 2019, "Sentence-BERT"; the pooling all-MiniLM-L6-v2 was trained with.

    Args:
        last_hidden_state: ``[batch, seq, hidden]`` float tensor.
        attention_mask: ``[batch, seq]`` of 0/1.

    Returns:
        ``[batch, hidden]`` float32 tensor.
    """
    hidden = torch.as_tensor(last_hidden_state).float()
    mask = torch.as_tensor(attention_mask).float().unsqueeze(-1)  # [batch, seq, 1]
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
