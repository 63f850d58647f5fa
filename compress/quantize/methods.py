"""``lmforge quantize``: INT8 checkpoints from a floating-point causal LM.

Three methods, each a config dataclass (recorded in the manifest's ``config``) and a quantizer
object with two steps, in the manner of torchao / gpt-fast: ``quantize`` makes the quantized
weights and writes a checkpoint directory; ``load`` converts a saved checkpoint into a model
that runs them.

* ``int8-weight-only`` (``Int8WeightOnlyConfig``) and ``w8a8`` (``W8A8Config``): symmetric
  per-output-channel INT8 weights for every ``nn.Linear`` outside ``skip_modules`` (the LM head
  included by default for weight-only, kept float by default for ``w8a8``; embeddings are not
  linear layers), stored in the format of
  ``engine.quant.int8`` with the scheme in the safetensors metadata. Weight-only keeps activations in
  bf16 / fp32; ``w8a8`` quantizes them per token at run time, after SmoothQuant
  (``compress.quantize.smooth``, calibrated on training dialogs) has moved activation outliers into the
  weights. Neither uses the deprecated ``torch.ao.nn.quantized`` modules.
* ``llm-int8`` (``LlmInt8Config``): bitsandbytes LLM.int8() (Dettmers et al. 2022, "LLM.int8():
  8-bit Matrix Multiplication for Transformers at Scale"): row-wise INT8 weights, and input
  columns with an outlier above ``threshold`` computed in 16-bit. Loaded through
  ``transformers`` ``BitsAndBytesConfig(load_in_8bit=True)``; runs on CPU (bitsandbytes >= 0.48)
  and CUDA.
* ``onnx-int8`` (``OnnxInt8MethodConfig``): SmoothQuant, Optimum ONNX export with the KV cache,
  then ONNX Runtime dynamic INT8 (``compress.quantize.onnx``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from optimum.onnxruntime import ORTModelForCausalLM
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from transformers.modeling_utils import no_init_weights

from compress.quantize.calibration import (
    is_skipped,
    load_smoothed_model,
    most_sensitive_units,
    outlier_input_channels,
)
from compress.quantize.onnx import OnnxExportConfig, OnnxInt8Config, export_onnx, quantize_onnx_int8
from compress.quantize.rotate import rotated_inputs
from engine.checkpoint.outputs import CHECKPOINT, check_output_dir, replace_dir, temp_sibling
from engine.checkpoint.store import (
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    check_device,
    describe_weights,
    read_manifest,
    resolve_checkpoint,
    write_manifest,
)
from engine.errors import UsageError
from engine.quant.int8 import (
    INPUT_HADAMARD_SUFFIX,
    INT8_SCALE_SUFFIX,
    INT8_WEIGHT_SUFFIX,
    OUTLIER_CHANNELS_SUFFIX,
    block_hadamard,
    format_microbench,
    gemm_microbench,
    int8_linear,
    model_linear_shapes,
    quantize_weight_per_channel,
    read_scheme,
    scheme_metadata,
)

WEIGHTS_NAME = "model.safetensors"
#: Float vocabulary tables that a rotated ``w8a8`` checkpoint stores in bfloat16: SmolLM2-135M, 44 held-out dialogs,
#: mean KL 0.0067 -> 0.0070, same top-1 96.9% -> 96.6%, 318 -> 210 MiB (two fp32 tables of 49152 x 576 otherwise).
VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight")
#: ``W8A8Config.rotation`` values (``None``: no rotation).
ROTATIONS = ("hadamard", None)


# --------------------------------------------------------------------------------------------
# Configs (one per method)
# --------------------------------------------------------------------------------------------


def _check_skip_modules(skip_modules: tuple[str, ...], field: str = "skip_modules") -> None:
    if isinstance(skip_modules, str) or not all(isinstance(s, str) and s for s in skip_modules):
        raise UsageError(f"{field}={skip_modules!r}: must be a tuple of non-empty module names, e.g. ('lm_head',)")


def _check_float_units(float_units: int, sensitivity_records: int) -> None:
    if float_units < 0:
        raise UsageError(f"float_units={float_units}: must be >= 0 (0: every linear layer in INT8; --float-units)")
    if sensitivity_records < 1:
        raise UsageError(f"sensitivity_records={sensitivity_records}: must be >= 1")


@dataclasses.dataclass(frozen=True)
class Int8WeightOnlyConfig:
    """``int8-weight-only``: per-channel symmetric INT8 weights, activations kept in bf16 / fp32.

    Attributes:
        skip_modules: linear layers kept in floating point: a module is skipped when its
            qualified name equals an entry or ends with ``.`` + entry (``lm_head`` keeps the
            output projection in float; ``mlp.down_proj`` every layer's down projection). By
            default every linear layer is quantized, the LM head included (21% of SmolLM2's
            weights); with tied embeddings only the head's copy is quantized, the embedding
            table stays float.
        float_units: how many fused linear groups stay in floating point: those whose INT8
            weights alone add the most KL per weight on ``sensitivity_records`` calibration records
            (``compress.quantize.sensitivity``). One by default: on SmolLM2-135M a single layer,
            ``model.layers.11.mlp.down_proj``, adds a quarter of the summed per-unit KL (0.0020 of
            0.0084, 16 training dialogs), and keeping it float (0.7% of the weights) takes the
            44 held-out dialogs from mean KL 0.0046, same top-1 97.0%, perplexity +1.62% to
            0.0039, 97.1%, +1.45%.
        sensitivity_records: calibration records that rank the groups.
        calibration_data: JSONL of calibration records; ``None`` = the training split of the
            English chatterbot-corpus dialogs (never the held-out split).
    """

    skip_modules: tuple[str, ...] = ()
    float_units: int = 1
    sensitivity_records: int = 8
    calibration_data: str | None = None
    scheme: ClassVar[str] = "weight-only"

    def __post_init__(self) -> None:
        _check_skip_modules(self.skip_modules)
        _check_float_units(self.float_units, self.sensitivity_records)


@dataclasses.dataclass(frozen=True)
class W8A8Config:
    """``w8a8``: per-channel INT8 weights, per-token dynamic INT8 activations (``engine.quant.int8``).

    Attributes:
        skip_modules: as in ``Int8WeightOnlyConfig``, but the LM head stays float by default:
            with per-token INT8 activations it adds the most KL of any layer, and it is not reliably
            faster than the bf16 head at decode batch sizes (docs/quantization.md); ``()`` quantizes it too.
        outlier_channels: for each INT8 layer of ``outlier_modules``, this many input channels
            (the largest max |x| on the calibration records) get a per-token activation scale of
            their own (``W8A8Linear``); 0 (default): none. For an INT8 head: a few channels of
            SmolLM2's final norm output reach max |x| 50 against a median channel's 3.8; with 32
            of them split off the INT8 head alone adds KL 0.0015 instead of 0.0056 (whole model:
            0.0195 instead of 0.0237).
        outlier_modules: the layers that get outlier channels (names or dotted suffixes).
        smoothquant_alpha: SmoothQuant migration strength (``compress.quantize.smooth``) applied before
            quantization; ``None`` disables it.
        smoothquant_alpha_grid: candidate alphas; when set, each SmoothQuant group gets the one
            with the least W8A8 output error on the calibration records
            (``compress.quantize.smooth.calibrate_alpha``) instead of ``smoothquant_alpha``.
        float_units: how many fused linear groups stay in floating point: those whose INT8 alone
            adds the most KL per weight on ``sensitivity_records`` calibration records
            (``compress.quantize.sensitivity``); 0: every linear layer outside ``skip_modules``
            is INT8.
        sensitivity_records: calibration records that rank the groups (one forward pass of them
            per group).
        calibration_records: records whose activations set the SmoothQuant scales.
        calibration_data: JSONL of calibration records; ``None`` = the training split of the
            English chatterbot-corpus dialogs (never the held-out split).
        rotation: ``"hadamard"`` (default): before SmoothQuant, rotate the residual stream by a random
            Hadamard matrix folded into the weights, and give every ``down_proj`` an online Hadamard
            rotation of ``rotation_block`` input channels (``compress.quantize.rotate``; QuaRot,
            Ashkboos et al. 2024). The float model's function is unchanged; per-token INT8 activations
            lose far less: SmolLM2-135M against fp32, 44 held-out dialogs, mean KL 0.0172 -> 0.0070, same
            top-1 94.7% -> 96.6%, perplexity -0.48% -> +0.79% (docs/quantization.md), for one ``block_hadamard``
            pass over each ``down_proj`` input (~1.5% of a 64-row decode step). The checkpoint stores the
            rotated weights, norm weights of 1 and an untied LM head (``VOCAB_TABLES`` in bf16). With it an
            INT8 head (``skip_modules=()``) adds little (KL 0.0077, top-1 95.9%). ``None``: no rotation.
        rotation_block: channels per block of the online ``down_proj`` rotation (a power of two that
            divides the intermediate size).
    """

    skip_modules: tuple[str, ...] = ("lm_head",)
    smoothquant_alpha: float | None = 0.5
    smoothquant_alpha_grid: tuple[float, ...] | None = None
    outlier_channels: int = 0
    outlier_modules: tuple[str, ...] = ("lm_head",)
    float_units: int = 0
    sensitivity_records: int = 8
    calibration_records: int = 32
    calibration_data: str | None = None
    rotation: str | None = "hadamard"
    rotation_block: int = 64
    scheme: ClassVar[str] = "w8a8"

    def __post_init__(self) -> None:
        _check_skip_modules(self.skip_modules)
        _check_smoothing(self.smoothquant_alpha, self.calibration_records)
        if self.rotation not in ROTATIONS:
            raise UsageError(f"rotation={self.rotation!r}: use 'hadamard' or None (--rotation none)")
        block = self.rotation_block
        if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block & (block - 1):
            raise UsageError(f"rotation_block={block!r}: must be a power of two >= 2 (default 64)")
        grid = self.smoothquant_alpha_grid
        if grid is not None and (isinstance(grid, str) or not grid or any(not 0.0 <= a <= 1.0 for a in grid)):
            raise UsageError(f"smoothquant_alpha_grid={grid!r}: must be a non-empty tuple of alphas in [0, 1]")
        if (
            isinstance(self.outlier_channels, bool)
            or not isinstance(self.outlier_channels, int)
            or not (0 <= self.outlier_channels <= 256)
        ):
            raise UsageError(f"outlier_channels={self.outlier_channels!r}: must be an integer in [0, 256] (0: none)")
        _check_skip_modules(self.outlier_modules, "outlier_modules")
        _check_float_units(self.float_units, self.sensitivity_records)


@dataclasses.dataclass(frozen=True)
class LlmInt8Config:
    """``llm-int8``: bitsandbytes ``Linear8bitLt`` with mixed-precision outlier decomposition.

    Attributes:
        threshold: activation magnitude above which an input column is an outlier computed in
            16-bit (the paper's 6.0).
        skip_modules: modules kept in floating point (``llm_int8_skip_modules``).
        device: ``cpu`` or ``cuda`` (``cuda:N``): where the model is quantized and run.
    """

    threshold: float = 6.0
    skip_modules: tuple[str, ...] = ("lm_head",)
    device: str = "cpu"

    def __post_init__(self) -> None:
        _check_skip_modules(self.skip_modules)
        if not self.threshold > 0:
            raise UsageError(f"threshold={self.threshold}: must be > 0 (6.0 in the LLM.int8() paper)")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise UsageError(f"device={self.device!r}: use 'cpu' or 'cuda' ('cuda:N')")


@dataclasses.dataclass(frozen=True)
class OnnxInt8MethodConfig(OnnxInt8Config):
    """``onnx-int8``: Optimum export task + ONNX Runtime dynamic quantization settings (the fields of
    ``compress.quantize.onnx.OnnxInt8Config``).

    Attributes:
        task: export task (``text-generation-with-past`` for causal LMs).
        smoothquant_alpha / calibration_records / calibration_data: SmoothQuant before export,
            as in ``W8A8Config``.
    """

    task: str = "text-generation-with-past"
    smoothquant_alpha: float | None = 0.8
    calibration_records: int = 32
    calibration_data: str | None = None

    def __post_init__(self) -> None:
        OnnxExportConfig(task=self.task)
        _check_smoothing(self.smoothquant_alpha, self.calibration_records)
        super().__post_init__()

    def ort_config(self) -> OnnxInt8Config:
        """The ONNX Runtime settings alone."""
        return OnnxInt8Config(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(OnnxInt8Config)}
            | {
                "op_types_to_quantize": tuple(self.op_types_to_quantize),
                "nodes_to_exclude": tuple(self.nodes_to_exclude),
            }
        )


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _check_smoothing(alpha: float | None, calibration_records: int) -> None:
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise UsageError(
            f"smoothquant_alpha={alpha}: it must be in [0, 1] (0.5 in the SmoothQuant paper); change "
            "--smoothquant-alpha, or pass --no-smoothquant"
        )
    if calibration_records < 1:
        raise UsageError(f"calibration_records={calibration_records}: it must be >= 1")


def _require_causal_lm(checkpoint: str | Path, method: str) -> Path:
    try:
        return resolve_checkpoint(checkpoint)
    except CheckpointError as exc:
        if "unsupported architecture" in str(exc):
            raise CheckpointError(f"--model: method {method!r} needs a causal LM; {exc}") from exc
        raise


def _copy_side_files(source_dir: Path, target_dir: Path) -> None:
    """Copy config, generation config and tokenizer files (everything but weights and manifest)."""
    for file in source_dir.iterdir():
        if (
            not file.is_file()
            or file.name == MANIFEST_NAME
            or file.suffix in (".safetensors", ".bin", ".onnx", ".gguf")
        ):
            continue
        if file.name.endswith(".safetensors.index.json"):
            continue
        shutil.copy2(file, target_dir / file.name)


def _set_config(path: Path, **fields: Any) -> None:
    """Set ``fields`` in the ``config.json`` at ``path`` (copied from the source checkpoint)."""
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _finish(tmp: Path, output_dir: Path, *, source_dir: Path, method: str, config: dict[str, Any]) -> Path:
    source_manifest = read_manifest(source_dir) if (source_dir / MANIFEST_NAME).is_file() else None
    num_parameters, size_bytes, dtype = describe_weights(tmp)
    write_manifest(
        tmp,
        Manifest(
            source=source_manifest.source if source_manifest else str(source_dir),
            parent=str(source_dir),
            method=method,
            config=config,
            dtype="int8" if method != "llm-int8" or dtype in ("int8", "float32") else dtype,
            num_parameters=num_parameters,
            size_bytes=size_bytes,
        ),
    )
    return replace_dir(tmp, output_dir, kind=CHECKPOINT, sources=(source_dir,))


# --------------------------------------------------------------------------------------------
# Quantizers
# --------------------------------------------------------------------------------------------


class Quantizer(Protocol):
    """A quantization method: ``quantize`` writes a checkpoint, ``load`` runs one."""

    method: ClassVar[str]

    def quantize(self, checkpoint: str | Path, output_dir: str | Path) -> Path: ...

    def load(self, checkpoint_dir: str | Path): ...


@dataclasses.dataclass
class Int8Quantizer:
    """``int8-weight-only`` / ``w8a8``: per-channel INT8 weights in the format of ``engine.quant.int8``.

    The scheme (how activations run) is the config's ``scheme``, written into the safetensors
    metadata, so the engine, ``lmforge evaluate`` and the Triton model pick the same kernels.
    """

    config: Int8WeightOnlyConfig | W8A8Config = dataclasses.field(default_factory=Int8WeightOnlyConfig)

    @property
    def method(self) -> str:
        return "int8-weight-only" if self.config.scheme == "weight-only" else "w8a8"

    def quantized_state_dict(
        self, model, float_modules: tuple[str, ...] = (), outliers: dict[str, torch.Tensor] | None = None
    ) -> dict[str, Any]:
        """Step 1: the checkpoint's tensors with selected linear weights in INT8.

        ``float_modules``: linear layers kept float besides ``skip_modules`` (exact names).
        ``outliers``: ``{module name: int64 [n]}`` outlier input channels (``w8a8``), stored as
        ``X.outlier_channels`` next to an INT8 layer's weights. A ``RotatedInputLinear``'s block
        (``load_smoothed_model``) is stored as ``X.input_hadamard`` when it is INT8; kept float, it
        stores ``W' H`` (``== W D``), the weight of its input before the online rotation. A rotated
        model's float vocabulary tables (``VOCAB_TABLES``: the rotation unties the head) are stored in
        bfloat16, so the checkpoint is no larger than before.

        Each selected ``nn.Linear`` ``X`` contributes ``X.weight_int8`` (int8 ``[out, in]``) and
        ``X.weight_scale`` (float32 ``[out]``) instead of ``X.weight``; everything else stays
        float32. Tensors shared by several names (tied embeddings) are stored once; a quantized
        LM head tied to the embeddings stores its INT8 copy and leaves the embedding table float.
        """
        quantized = {
            name
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
            and not is_skipped(name, self.config.skip_modules)
            and name not in float_modules
        }
        rotated = rotated_inputs(model)
        state: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, tensor in model.state_dict().items():
            module_name, _, leaf = key.rpartition(".")
            if module_name in quantized and leaf == "weight":
                weight_int8, scale = quantize_weight_per_channel(tensor)
                state[module_name + INT8_WEIGHT_SUFFIX] = weight_int8.contiguous()
                state[module_name + INT8_SCALE_SUFFIX] = scale.contiguous()
                if outliers and module_name in outliers:
                    state[module_name + OUTLIER_CHANNELS_SUFFIX] = outliers[module_name].to(torch.long).contiguous()
                if module_name in rotated:
                    state[module_name + INPUT_HADAMARD_SUFFIX] = torch.tensor([rotated[module_name]], dtype=torch.long)
                continue
            if module_name in rotated and leaf == "weight":  # kept float: the weight of the unrotated input
                state[key] = block_hadamard(tensor.detach().float(), rotated[module_name]).contiguous()
                continue
            if tensor.data_ptr() in seen:  # tied to a tensor already stored
                continue
            seen.add(tensor.data_ptr())
            dtype = torch.bfloat16 if rotated and key in VOCAB_TABLES else torch.float32
            state[key] = tensor.detach().to(dtype).contiguous() if tensor.is_floating_point() else tensor.contiguous()
        if not quantized:
            raise UsageError(f"skip_modules={self.config.skip_modules!r} leaves no linear layer to quantize")
        return state

    def quantize(self, checkpoint: str | Path, output_dir: str | Path) -> Path:
        """Quantize ``checkpoint`` into ``output_dir`` (``model.safetensors`` + config + tokenizer + manifest).

        Raises:
            CheckpointError: missing/corrupt checkpoint or a non-causal model (names the file).
        """
        source_dir = _require_causal_lm(checkpoint, self.method)
        c = self.config
        model = load_smoothed_model(
            source_dir,
            alpha=getattr(c, "smoothquant_alpha", None),
            alpha_grid=getattr(c, "smoothquant_alpha_grid", None),
            data=getattr(c, "calibration_data", None),
            num_records=getattr(c, "calibration_records", 1),
            rotation_block=c.rotation_block if getattr(c, "rotation", None) else None,
        )
        float_modules, outliers = [], {}
        if getattr(c, "float_units", 0) or getattr(c, "outlier_channels", 0):
            tokenizer = AutoTokenizer.from_pretrained(source_dir)  # calibration text of both choices
            if getattr(c, "float_units", 0):
                float_modules = most_sensitive_units(model, tokenizer, c)
            if getattr(c, "outlier_channels", 0):
                outliers = outlier_input_channels(model, tokenizer, c, float_modules)
        state = self.quantized_state_dict(model, tuple(float_modules), outliers)
        output_dir = Path(output_dir)
        tmp = temp_sibling(output_dir)
        try:
            save_file(
                state,
                str(tmp / WEIGHTS_NAME),
                metadata={"format": "pt", "lmforge_method": self.method, **scheme_metadata(c.scheme)},
            )
            _copy_side_files(source_dir, tmp)
            if rotated_inputs(model):  # the rotation untied the LM head (rotate.fold_norms)
                _set_config(tmp / "config.json", tie_word_embeddings=False)
            config = {"scheme": c.scheme, **dataclasses.asdict(c)}
            if float_modules:
                config["float_modules"] = float_modules
            if outliers:
                config["outlier_layers"] = sorted(outliers)
            return _finish(tmp, output_dir, source_dir=source_dir, method=self.method, config=config)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, checkpoint_dir: str | Path):
        return load_int8_model(checkpoint_dir)


def load_int8_model(checkpoint_dir: str | Path):
    """Step 2: build the ``transformers`` model and swap in INT8 linear layers.

    Every ``X.weight_int8`` / ``X.weight_scale`` pair becomes the runtime layer of the file's
    scheme (``engine.quant.int8.int8_linear``: ``Int8WeightOnlyLinear`` or ``W8A8Linear``) at module
    ``X``; all other tensors are loaded as stored. Checkpoints of the former ``dynamic`` method
    (same tensors, no scheme metadata) load as ``w8a8``.

    Returns:
        The causal LM in eval mode (``forward`` and ``generate`` as usual, float32 logits).

    Raises:
        CheckpointError: missing files, a scale without its weight (or the reverse), or
            tensors the model does not have / lacks (names the file and the tensors).
    """
    checkpoint_dir = Path(checkpoint_dir)
    weights = checkpoint_dir / WEIGHTS_NAME
    resolve_checkpoint(checkpoint_dir)  # checks config.json, architecture and safetensors headers
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing; an INT8 checkpoint stores its weights there")
    try:
        scheme = read_scheme([weights])
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    state = load_file(str(weights))
    config = AutoConfig.from_pretrained(checkpoint_dir)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    prefixes = sorted(k[: -len(INT8_WEIGHT_SUFFIX)] for k in state if k.endswith(INT8_WEIGHT_SUFFIX))
    if not prefixes:
        raise CheckpointError(
            f"{weights}: no '*{INT8_WEIGHT_SUFFIX}' tensors; not an INT8 checkpoint (lmforge quantize --method "
            "int8-weight-only or w8a8)"
        )
    int8_layers = {}
    for prefix in prefixes:
        scale_key = prefix + INT8_SCALE_SUFFIX
        if scale_key not in state:
            raise CheckpointError(
                f"{weights}: {prefix + INT8_WEIGHT_SUFFIX} has no {scale_key}; re-create the checkpoint"
            )
        int8_layers[prefix] = (
            state.pop(prefix + INT8_WEIGHT_SUFFIX),
            state.pop(scale_key),
            state.pop(prefix + ".bias", None),
            state.pop(prefix + OUTLIER_CHANNELS_SUFFIX, None),
            state.pop(prefix + INPUT_HADAMARD_SUFFIX, None),
        )
    stray = [k for k in state if k.endswith((INT8_SCALE_SUFFIX, OUTLIER_CHANNELS_SUFFIX, INPUT_HADAMARD_SUFFIX))]
    if stray:
        raise CheckpointError(f"{weights}: scales without INT8 weights: {stray[:3]}; re-create the checkpoint")
    # Float tensors first (the quantized modules have a state-dict layout of their own).
    result = model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    expected_missing = {p + ".weight" for p in int8_layers} | {
        p + ".bias" for p in int8_layers
    }  # set on the INT8 module
    if getattr(config, "tie_word_embeddings", False) or "lm_head" in int8_layers:
        expected_missing.add("lm_head.weight")
    missing = [k for k in result.missing_keys if k not in expected_missing]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{weights}: tensors do not match config.json: missing {missing[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}"
        )
    for prefix, (weight_int8, scale, bias, outlier_channels, input_hadamard) in int8_layers.items():
        try:
            model.get_submodule(prefix)
        except AttributeError as exc:
            raise CheckpointError(
                f"{weights}: tensor {prefix + INT8_WEIGHT_SUFFIX} names no module of {config.model_type}; the "
                "file does not match config.json"
            ) from exc
        try:
            layer = int8_linear(scheme, weight_int8, scale, bias, outlier_channels, input_hadamard)
        except ValueError as exc:
            raise CheckpointError(f"{weights}: {prefix}: {exc}; re-create the checkpoint") from exc
        model.set_submodule(prefix, layer)
    return model.eval()


@dataclasses.dataclass
class LlmInt8Quantizer:
    """``llm-int8``: bitsandbytes ``Linear8bitLt`` via ``transformers`` ``BitsAndBytesConfig``."""

    config: LlmInt8Config = dataclasses.field(default_factory=LlmInt8Config)
    method: ClassVar[str] = "llm-int8"

    def bnb_config(self):
        return BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=self.config.threshold,
            llm_int8_skip_modules=list(self.config.skip_modules),
        )

    def quantize(self, checkpoint: str | Path, output_dir: str | Path) -> Path:
        """Load with ``load_in_8bit`` (weights quantized row-wise as they load) and save.

        The saved ``model.safetensors`` holds ``X.weight`` (int8), ``X.SCB`` (float32 row
        scales) and ``X.weight_format`` per quantized layer; ``config.json`` gets the
        ``quantization_config`` that makes ``from_pretrained`` rebuild ``Linear8bitLt``.

        Raises:
            CheckpointError: missing/corrupt checkpoint or a non-causal model.
            UsageError: ``device`` is CUDA but no GPU is visible.
        """
        source_dir = _require_causal_lm(checkpoint, self.method)
        check_device(self.config.device)
        model = AutoModelForCausalLM.from_pretrained(
            source_dir, quantization_config=self.bnb_config(), device_map=self.config.device, dtype=torch.float32
        )
        output_dir = Path(output_dir)
        tmp = temp_sibling(output_dir)
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            _copy_side_files_missing(source_dir, tmp)
            return _finish(
                tmp, output_dir, source_dir=source_dir, method=self.method, config=dataclasses.asdict(self.config)
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, checkpoint_dir: str | Path, device: str | None = None):
        return load_llm_int8_model(checkpoint_dir, device=device or self.config.device)


def _copy_side_files_missing(source_dir: Path, target_dir: Path) -> None:
    """Copy tokenizer files that ``save_pretrained`` of the model did not write."""
    for file in source_dir.iterdir():
        if (
            file.is_file()
            and not (target_dir / file.name).exists()
            and file.name != MANIFEST_NAME
            and file.suffix not in (".safetensors", ".bin", ".onnx", ".gguf")
        ):
            if not file.name.endswith(".safetensors.index.json"):
                shutil.copy2(file, target_dir / file.name)


def load_llm_int8_model(checkpoint_dir: str | Path, *, device: str = "cpu"):
    """Reload a saved ``llm-int8`` checkpoint (``Linear8bitLt`` layers) on ``device``.

    Raises:
        CheckpointError: missing/corrupt files, or ``config.json`` without the bitsandbytes
            ``quantization_config``.
    """
    checkpoint_dir = Path(checkpoint_dir)
    resolve_checkpoint(checkpoint_dir)
    quant = json.loads((checkpoint_dir / "config.json").read_text()).get("quantization_config", {})
    if quant.get("quant_method") != "bitsandbytes" or not quant.get("load_in_8bit"):
        raise CheckpointError(
            f"{checkpoint_dir / 'config.json'}: no bitsandbytes 8-bit quantization_config; not an llm-int8 checkpoint"
        )
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, device_map=device, dtype=torch.float32)
    return model.eval()


@dataclasses.dataclass
class OnnxInt8Quantizer:
    """``onnx-int8``: Optimum ONNX export (with KV cache) + ONNX Runtime dynamic INT8."""

    config: OnnxInt8MethodConfig = dataclasses.field(default_factory=OnnxInt8MethodConfig)
    method: ClassVar[str] = "onnx-int8"

    def quantize(self, checkpoint: str | Path, output_dir: str | Path) -> Path:
        """Export to a temporary fp32 ONNX directory, quantize it into ``output_dir``.

        Raises:
            CheckpointError: missing/corrupt checkpoint or a non-causal model.
        """
        source_dir = (
            _require_causal_lm(checkpoint, self.method)
            if self.config.task == "text-generation-with-past"
            else resolve_checkpoint(checkpoint, causal_lm=False)
        )
        output_dir = Path(output_dir)
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        c = self.config
        with tempfile.TemporaryDirectory(prefix=f".{output_dir.name}-fp32-", dir=output_dir.parent) as tmp:
            export_source = source_dir
            if c.smoothquant_alpha is not None and c.task == "text-generation-with-past":
                export_source = Path(tmp) / "smoothed"
                model = load_smoothed_model(
                    source_dir, alpha=c.smoothquant_alpha, data=c.calibration_data, num_records=c.calibration_records
                )
                model.save_pretrained(export_source, safe_serialization=True)
                _copy_side_files_missing(source_dir, export_source)
                del model
            fp32_dir = export_onnx(export_source, Path(tmp) / "onnx", task=c.task)
            quantize_onnx_int8(fp32_dir, output_dir, config=self.config.ort_config(), parent=source_dir)
        manifest = read_manifest(output_dir)
        manifest.config = dataclasses.asdict(self.config)
        write_manifest(output_dir, manifest)
        return output_dir

    def load(self, checkpoint_dir: str | Path):
        return ORTModelForCausalLM.from_pretrained(checkpoint_dir)


#: ``--method`` name -> (quantizer class, config class).
METHODS: dict[str, tuple[type, type]] = {
    "int8-weight-only": (Int8Quantizer, Int8WeightOnlyConfig),
    "w8a8": (Int8Quantizer, W8A8Config),
    "llm-int8": (LlmInt8Quantizer, LlmInt8Config),
    "onnx-int8": (OnnxInt8Quantizer, OnnxInt8MethodConfig),
}


def make_quantizer(method: str, **config: Any) -> Quantizer:
    """The quantizer of ``method`` with its config built from ``config`` (field names of the config class).

    Raises:
        ValueError: unknown method, unknown config field, or an invalid value (names the field).
    """
    if method == "dynamic":
        raise UsageError(REPLACED_DYNAMIC)
    if method not in METHODS:
        raise UsageError(f"method={method!r} is not supported; use one of {sorted(METHODS)}")
    quantizer_cls, config_cls = METHODS[method]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise UsageError(f"unknown option(s) {unknown} for method {method!r}; its fields are {sorted(fields)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    return quantizer_cls(config_cls(**values))


QUANTIZED_METHODS = ("int8-weight-only", "w8a8", "dynamic", "llm-int8", "onnx-int8")
REPLACED_DYNAMIC = (
    "method 'dynamic' (torch.ao dynamic INT8, per-tensor activations) was replaced: use --method w8a8 (per-token "
    "activation scales, same weight format) or --method int8-weight-only; existing dynamic checkpoints load as w8a8"
)


def quantize(checkpoint: str | Path, output_dir: str | Path, *, method: str, **config: Any) -> Path:
    """Quantize ``checkpoint`` with ``method`` into ``output_dir``; returns ``output_dir``.

    Raises:
        CheckpointError: the input is missing, corrupt or already quantized, or ``output_dir``
            is unsafe to replace (``engine.checkpoint.outputs.OutputDirError``, see ``check_output_dir``).
    """
    quantizer = make_quantizer(method, **config)
    if isinstance(getattr(quantizer.config, "device", None), str):
        check_device(quantizer.config.device)  # before any model is loaded
    source = _require_unquantized(checkpoint)
    output_dir = check_output_dir(output_dir, kind=CHECKPOINT, sources=(source,))
    return quantizer.quantize(source, output_dir)


def _require_unquantized(checkpoint: str | Path) -> Path:
    """The checkpoint's directory, refusing one that an INT8 method already produced."""
    source = resolve_checkpoint(checkpoint, causal_lm=False)  # the method checks the architecture
    manifest = read_manifest(source) if (source / MANIFEST_NAME).is_file() else None
    if manifest is not None and manifest.method in QUANTIZED_METHODS:
        raise CheckpointError(
            f"--model {source}: already quantized (method {manifest.method}); quantize its parent "
            f"{manifest.parent} instead"
        )
    return source


# --------------------------------------------------------------------------------------------
# ``lmforge quantize``
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="checkpoint to quantize: name, .gguf file or directory")
    parser.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)}")
    parser.add_argument(
        "--out",
        required=True,
        help="output checkpoint directory: new, empty, or an earlier lmforge checkpoint (replaced)",
    )
    parser.add_argument(
        "--skip-modules",
        nargs="*",
        default=None,
        metavar="NAME",
        help="linear layers kept in float (default: none for int8-weight-only, lm_head for w8a8 and llm-int8; "
        "the flag alone, with no name, quantizes every linear layer)",
    )
    _add_method_arguments(parser)


def _add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """Each method's own knobs (the help names the methods a flag applies to); unset flags keep its defaults."""
    parser.add_argument("--threshold", type=float, default=None, help="llm-int8: outlier threshold (default 6.0)")
    parser.add_argument("--device", default=None, help="llm-int8: cpu or cuda (default cpu)")
    parser.add_argument(
        "--smoothquant-alpha",
        type=float,
        default=None,
        help="w8a8 (default 0.5) / onnx-int8 (default 0.8): SmoothQuant strength",
    )
    parser.add_argument("--no-smoothquant", action="store_true", help="w8a8 / onnx-int8: quantize without SmoothQuant")
    parser.add_argument(
        "--smoothquant-alpha-grid",
        nargs="+",
        type=float,
        default=None,
        metavar="ALPHA",
        help="w8a8: calibrate SmoothQuant's alpha per layer group among these values (least INT8 output error)",
    )
    parser.add_argument(
        "--float-units",
        type=int,
        default=None,
        help="int8-weight-only / w8a8: keep the N fused linear groups whose INT8 adds the most KL on calibration "
        "records in float (default 1 for int8-weight-only, 0 for w8a8)",
    )
    parser.add_argument(
        "--outlier-channels",
        type=int,
        default=None,
        help="w8a8: input channels of each --outlier-modules layer with a per-token activation scale of their own "
        "(default 0: none; e.g. 32 with --skip-modules and no name for an INT8 LM head)",
    )
    parser.add_argument(
        "--outlier-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="w8a8: layers that get outlier channels (default lm_head)",
    )
    parser.add_argument(
        "--rotation",
        choices=("hadamard", "none"),
        default=None,
        help="w8a8: rotate the residual stream and each down_proj input by random Hadamard matrices before "
        "quantizing (default hadamard; none: the unrotated model)",
    )
    parser.add_argument(
        "--rotation-block",
        type=int,
        default=None,
        help="w8a8: channels per block of the online down_proj rotation (default 64)",
    )
    parser.add_argument(
        "--calibration-data",
        default=None,
        help="int8-weight-only / w8a8 / onnx-int8: JSONL calibration records (default: training dialogs)",
    )
    parser.add_argument(
        "--no-per-channel", action="store_true", help="onnx-int8: one scale per tensor instead of per channel"
    )
    parser.add_argument(
        "--no-microbench",
        action="store_true",
        help="int8-weight-only / w8a8: skip the GEMM microbench that says which variant is fastest on this CPU",
    )
    parser.add_argument(
        "--op-types",
        nargs="+",
        default=None,
        metavar="OP",
        help="onnx-int8: ONNX operator types to quantize (default MatMul Gather)",
    )


def _config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    options = {
        "skip_modules": args.skip_modules,
        "threshold": args.threshold,
        "device": args.device,
        "per_channel": False if args.no_per_channel else None,
        "smoothquant_alpha": args.smoothquant_alpha,
        "smoothquant_alpha_grid": tuple(args.smoothquant_alpha_grid) if args.smoothquant_alpha_grid else None,
        "float_units": args.float_units,
        "outlier_channels": args.outlier_channels,
        "outlier_modules": tuple(args.outlier_modules) if args.outlier_modules else None,
        "calibration_data": args.calibration_data,
        "op_types_to_quantize": args.op_types,
        "rotation_block": args.rotation_block,
    }
    given = {k: v for k, v in options.items() if v is not None}
    if args.no_smoothquant:
        if args.smoothquant_alpha is not None or args.smoothquant_alpha_grid:
            raise UsageError("--no-smoothquant and --smoothquant-alpha(-grid): pass one of them")
        given["smoothquant_alpha"] = None
    if args.rotation is not None:
        given["rotation"] = None if args.rotation == "none" else args.rotation
    fields = {f.name for f in dataclasses.fields(METHODS[args.method][1])} if args.method in METHODS else set(given)
    wrong = sorted(set(given) - fields)
    if wrong:
        flags = ", ".join("--" + k.replace("_", "-") for k in wrong)
        raise UsageError(f"{flags}: not an option of --method {args.method}")
    return given


def run(args: argparse.Namespace) -> int:
    if args.method == "dynamic":
        raise UsageError(f"--method dynamic: {REPLACED_DYNAMIC}")
    if args.method not in METHODS:
        raise UsageError(f"--method {args.method!r} is not supported", fix=f"use one of {', '.join(METHODS)}")
    out = quantize(args.model, args.out, method=args.method, **_config_from_args(args))
    manifest = read_manifest(out)
    print(f"wrote {out}  (method {manifest.method}, {manifest.size_bytes / 2**20:.1f} MiB, parent {manifest.parent})")
    print(json.dumps(manifest.config, sort_keys=True))
    if args.method in ("int8-weight-only", "w8a8") and not args.no_microbench:
        # INT8 is not always the fastest: measure this model's layer shapes here, now.
        results = gemm_microbench(
            model_linear_shapes(out / "config.json"), threads=torch.get_num_threads(), repeats=3, number=3
        )
        print(format_microbench(results))
    return 0
