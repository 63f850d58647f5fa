"""``lmforge export``: write a checkpoint into a Triton model repository.

A causal LM becomes one model, ``NAME``: Python backend, decoupled (streaming), one engine per
instance::

    NAME/config.pbtxt        decoupled Python-backend model (vLLM backend's tensors)
    NAME/1/model.py          thin: imports deploy.triton_llm from the installed lmforge
    NAME/1/model.json        {"kind": "llm", "checkpoint": dir, "engine": {EngineConfig fields}}
    NAME/1/weights/          only with --copy-weights (then "checkpoint" is "weights")
    NAME/1/loras/ADAPTER/    with --lora ADAPTER=DIR: the LoRA adapter, checked against the base and
                             listed in model.json ("lora_adapters"; deploy.lora_adapters)

An encoder (all-MiniLM-L6-v2, any BERT-like checkpoint, or an ONNX feature-extraction export
from ``compress``) becomes ``NAME`` for the bundled server (Python backend running
``model.onnx`` with ONNX Runtime, text in, embeddings out) plus three models for the full
Triton container: ``NAME_onnx`` (``backend: "onnxruntime"``, dynamic batching),
``NAME_tokenizer`` (Python) and ``NAME_ensemble`` (text -> tokenizer -> ONNX Runtime).

``lmforge export --check --repo R`` parses every ``config.pbtxt`` of ``R`` against Triton's
model-config proto and reports the errors by file (also run after every export).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import typing
from pathlib import Path
from typing import Any

import torch

from deploy.encoder import prepare_encoder_onnx
from deploy.lora_adapters import LORA_DIR, MODEL_INFO_KEY, check_adapter_name
from deploy.model_config import (
    CONFIG_NAME,
    check_repository,
    encoder_ensemble_config,
    encoder_onnx_config,
    encoder_python_config,
    llm_config,
    to_text,
    tokenizer_config,
)
from engine import EngineConfig
from engine.checkpoint.model_spec import ModelSpec
from engine.checkpoint.outputs import COPIED_CHECKPOINT, TRITON_MODEL, check_copy, check_output_dir, staged_output_dir
from engine.checkpoint.store import SUPPORTED_CAUSAL_LM_TYPES, check_device, resolve_checkpoint
from engine.cli_options import add_option
from engine.errors import UsageError
from engine.lora import LoRARequest, load_adapter

MODEL_INFO_NAME = "model.json"
VERSION = "1"

#: ``model.py`` written into each version directory: which lmforge class serves the model.
MODEL_PY = '''"""Triton Python-backend entry point written by `lmforge export` ({kind}).

The serving code lives in the installed lmforge ({module}); this file only points Triton at it.
"""

from {module} import {imported}  # noqa: F401
'''

MODEL_PY_CLASSES = {
    "llm": ("deploy.triton_llm", "TritonPythonModel"),
    "encoder": ("deploy.triton_encoder", "TritonPythonModel"),
    "tokenizer": ("deploy.triton_encoder", "TokenizerModel"),
}


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def engine_config_fields() -> dict[str, type]:
    """``EngineConfig`` fields a user may set on the command line: name -> scalar type (``json_object`` for a
    field that takes a mapping, such as ``limits``)."""
    hints = typing.get_type_hints(EngineConfig)
    fields = {}
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        kind = hints[field.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if args else kind
        fields[field.name] = kind if kind in (int, float, str, bool) else json_object
    return fields


def json_object(text: str) -> dict:
    """A command-line JSON object, e.g. ``--limits '{"max_n": 16}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}); give an object such as '{{\"max_n\": 16}}'") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="checkpoint: name (smollm2-135m, minilm-l6), .gguf, directory, or an ONNX export"
    )
    add_option(parser, "--repo", "model_repository", "Triton model repository")
    parser.add_argument("--name", help="model name in the repository (default: from the checkpoint)")
    parser.add_argument(
        "--kind",
        choices=["auto", "llm", "encoder"],
        default="auto",
        help="what the checkpoint is (default: from its config)",
    )
    parser.add_argument("--instances", type=int, default=1, help="model instances (one engine each; default 1)")
    parser.add_argument(
        "--copy-weights", action="store_true", help="copy the checkpoint into NAME/1/weights instead of pointing at it"
    )
    parser.add_argument(
        "--max-length", type=int, default=256, help="encoder: tokens per text (longer texts are truncated)"
    )
    parser.add_argument(
        "--check", action="store_true", help="parse every config.pbtxt in --repo against Triton's model-config proto"
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve a LoRA adapter (PEFT format) as model NAME on this base (repeatable); turns on --enable-lora "
        "and, unless given, sets --max-loras to the number of adapters",
    )
    group = parser.add_argument_group("engine (EngineConfig fields, written to model.json)")
    for name, kind in engine_config_fields().items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, dest=f"engine_{name}", action=argparse.BooleanOptionalAction, default=None)
        else:
            metavar = "JSON" if kind is json_object else kind.__name__.upper()
            group.add_argument(flag, dest=f"engine_{name}", type=kind, default=None, metavar=metavar)


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields given on the command line."""
    prefix = "engine_"
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}


def run(args: argparse.Namespace) -> int:
    if not args.repo.strip():
        raise UsageError("--repo is empty", fix="pass a model repository directory, e.g. --repo model_repository")
    repo = Path(args.repo)
    if args.model is None and not args.check:
        raise UsageError("--model is required", fix="or pass --check to check a repository")
    if args.model is not None:
        written = export(
            args.model,
            repo,
            name=args.name,
            kind=args.kind,
            engine=engine_overrides(args),
            instances=args.instances,
            copy_weights=args.copy_weights,
            max_length=args.max_length,
            loras=parse_lora_flags(args.lora),
        )
        for path in written:
            print(f"wrote {path}")
    return print_check(repo)


def parse_lora_flags(values: list[str]) -> dict[str, Path]:
    """``--lora NAME=DIR`` values -> ``{NAME: DIR}``.

    Raises:
        UsageError: a value without ``=``, a bad or repeated name.
    """
    # the adapter-name rule of the served model

    loras: dict[str, Path] = {}
    for value in values:
        name, sep, directory = value.partition("=")
        if not sep or not directory:
            raise UsageError(f"--lora {value!r}: expected NAME=DIR", fix="e.g. --lora support=runs/ft-lora/final")
        try:
            check_adapter_name(name, "--lora NAME")
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        if name in loras:
            raise UsageError(f"--lora {name}: given twice", fix="give each adapter its own name")
        loras[name] = Path(directory)
    return loras


def print_check(repo: Path) -> int:
    """Check a repository's configs, print one line per file; returns 0 when all parse."""
    checked, problems = check_repository(repo)
    bad = {p.path for p in problems}
    for path in checked:
        if path not in bad:
            print(f"ok    {path}")
    for problem in problems:
        print(f"error {problem.message}")
    print(f"{len(checked) - len(problems)}/{len(checked)} config(s) valid")
    return 1 if problems else 0


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def detect_kind(checkpoint: str | Path) -> str:
    """``llm`` for a supported causal LM, ``encoder`` for anything else with a ``config.json``
    or an ONNX feature-extraction export.

    Raises:
        CheckpointError: the checkpoint cannot be resolved.
    """
    path = resolve_checkpoint(checkpoint, causal_lm=False)
    if (path / "model.onnx").is_file():
        return "encoder"
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    return "llm" if model_type in SUPPORTED_CAUSAL_LM_TYPES else "encoder"


def default_name(checkpoint: str | Path) -> str:
    """A repository name from a checkpoint spec: ``smollm2-135m`` -> ``smollm2_135m``."""
    stem = Path(str(checkpoint)).name or str(checkpoint)
    stem = stem.removesuffix(".gguf")
    return "".join(c if c.isalnum() else "_" for c in stem).strip("_").lower() or "model"


def check_name(name: str) -> str:
    """Raise ``UsageError`` (a ``ValueError``) unless ``name`` is a safe repository directory name."""
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise UsageError(f"--name {name!r}: use letters, digits, '_' and '-' only")
    return name


def export(
    checkpoint: str | Path,
    repo: str | Path,
    *,
    name: str | None = None,
    kind: str = "auto",
    engine: dict[str, Any] | None = None,
    instances: int = 1,
    copy_weights: bool = False,
    max_length: int = 256,
    loras: dict[str, Path] | None = None,
) -> list[Path]:
    """Export a checkpoint into ``repo`` (see the module doc); returns the written config paths.

    Args:
        loras: LoRA adapters served on the LLM, ``{name: adapter directory}`` (copied into the model).

    Raises:
        CheckpointError: missing/corrupt checkpoint. ValueError: a bad name, instance count,
        ``EngineConfig`` field or adapter (names it); UsageError: an adapter named as this model or as another
        model of ``repo``.
    """
    if instances < 1:
        raise UsageError(f"--instances {instances}: it must be >= 1")
    name = check_name(name or default_name(checkpoint))
    detected = detect_kind(checkpoint)
    if kind == "encoder" and detected == "llm":
        raise UsageError(
            f"--kind encoder: {checkpoint} is a causal LM", fix="export it with --kind llm (or --kind auto)"
        )
    kind = detected if kind == "auto" else kind
    repo = Path(repo)
    if repo.exists() and not repo.is_dir():
        raise UsageError(
            f"--repo {repo}: exists and is not a directory", fix="pass a Triton model repository directory"
        )
    for adapter in loras or {}:  # the OpenAI `model` field names a model or an adapter: one name, one meaning
        if adapter == name or (repo / adapter / "config.pbtxt").is_file():
            other = "the --name of this export" if adapter == name else f"{repo / adapter} is a model"
            raise UsageError(
                f"--lora {adapter}: {other} too, and a request's `model` could not tell them apart",
                fix="give the adapter another name",
            )
    source = resolve_checkpoint(checkpoint, causal_lm=False)
    for model_name in [name] if kind == "llm" else encoder_model_names(name):
        check_output_dir(repo / model_name, kind=TRITON_MODEL, sources=(source,))
        check_same_kind(repo / model_name, kind, name)
    if kind == "llm":
        return [
            export_llm(
                checkpoint,
                repo,
                name,
                engine=engine or {},
                instances=instances,
                copy_weights=copy_weights,
                loras=loras or {},
            )
        ]
    if loras:
        raise UsageError(f"--lora applies to LLMs only; {checkpoint} is an encoder")
    if engine:
        raise ValueError(f"engine flags {sorted(engine)} apply to LLMs only; {checkpoint} is an encoder")
    return export_encoder(checkpoint, repo, name, instances=instances, max_length=max_length)


KIND_WORDS = {"llm": "an LLM", "encoder": "an encoder"}


def existing_kind(model_dir: Path) -> tuple[str | None, str | None]:
    """``(kind, source)`` of a model directory an earlier export (or the committed repository) holds: kind
    ``llm`` or ``encoder`` from ``1/model.json``, else from the serving module its ``model.py`` imports, else
    from its config (ONNX Runtime models and ensembles are the container half of an encoder); ``source`` is the
    exported checkpoint (``model.json``'s ``source``) when known. ``(None, None)`` for anything else."""
    info_path = model_dir / VERSION / MODEL_INFO_NAME
    try:
        info = json.loads(info_path.read_text())
        if isinstance(info, dict) and info.get("kind") in KIND_WORDS:
            return info["kind"], info.get("source")
    except (OSError, json.JSONDecodeError):
        pass
    try:
        model_py = (model_dir / VERSION / "model.py").read_text(errors="replace")
    except OSError:
        model_py = ""
    for kind, (module, _) in MODEL_PY_CLASSES.items():
        if f"from {module} import" in model_py:
            return ("encoder" if kind == "tokenizer" else kind), None
    try:
        config = (model_dir / CONFIG_NAME).read_text(errors="replace")
    except OSError:
        return None, None
    if 'backend: "onnxruntime"' in config or 'platform: "ensemble"' in config:
        return "encoder", None
    return None, None


def check_same_kind(model_dir: Path, kind: str, name: str) -> None:
    """Refuse to export ``kind`` over a model directory that holds the other kind (an LLM over an encoder or the
    reverse): the export would leave a mix of both models' files.

    Raises:
        UsageError: naming ``--name``, what the directory holds and where it came from, and the fix.
    """
    held, source = existing_kind(model_dir)
    if held is None or held == kind:
        return
    origin = f" (exported by `lmforge export --model {source}`)" if source else ""
    raise UsageError(
        f"--name {name}: {model_dir} holds {KIND_WORDS[held]} model{origin}, and {KIND_WORDS[kind]} cannot replace it",
        fix=f"choose another --name or remove {model_dir}",
    )


def write_model_dir(repo: Path, name: str, config, kind: str | None) -> Path:
    """Write ``NAME/config.pbtxt`` and, for Python models, ``NAME/1/model.py``; returns the version dir."""
    model_dir = repo / name
    version_dir = model_dir / VERSION
    version_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / CONFIG_NAME).write_text(to_text(config))
    if kind is not None:
        module, cls = MODEL_PY_CLASSES[kind]
        imported = cls if cls == "TritonPythonModel" else f"{cls} as TritonPythonModel"
        (version_dir / "model.py").write_text(MODEL_PY.format(kind=kind, module=module, imported=imported))
    return version_dir


def export_llm(
    checkpoint: str | Path,
    repo: Path,
    name: str,
    *,
    engine: dict[str, Any],
    instances: int,
    copy_weights: bool,
    loras: dict[str, Path] | None = None,
) -> Path:
    """The decoupled LLM model; ``model.json`` holds the checkpoint, every EngineConfig field and the LoRA
    adapters (copied under ``loras/``, each checked against the base first)."""
    source = resolve_checkpoint(checkpoint)
    loras = loras or {}
    if loras:
        if engine.get("enable_lora") is False:
            raise UsageError("--lora with --no-enable-lora", fix="drop --no-enable-lora (adapters need LoRA on)")
        engine = {"enable_lora": True, "max_loras": len(loras), **engine}
    config = EngineConfig(model=str(source), **engine)  # validates the fields (ValueError names them)
    check_lora_adapters(loras, source, config.max_lora_rank)
    check_device(config.device, flag="--device")  # the server would fail on it at load time
    max_positions = json.loads((source / "config.json").read_text()).get("max_position_embeddings")
    if config.max_model_len is not None and isinstance(max_positions, int) and config.max_model_len > max_positions:
        raise UsageError(
            f"--max-model-len {config.max_model_len}: longer than the model's max_position_embeddings={max_positions}",
            fix=f"use at most {max_positions}",
        )
    version_dir = write_model_dir(repo, name, llm_config(name, instance_count=instances), "llm")
    pointer = str(source)
    if copy_weights:
        target = version_dir / "weights"
        check_copy(source, target)
        with staged_output_dir(target, kind=COPIED_CHECKPOINT, sources=(source,)) as tmp:
            shutil.copytree(source, tmp, dirs_exist_ok=True)
        pointer = "weights"
    engine_fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
    info = {"kind": "llm", "source": str(checkpoint), "checkpoint": pointer, "engine": engine_fields}
    lora_root = version_dir / LORA_DIR
    shutil.rmtree(lora_root, ignore_errors=True)  # an earlier export's adapters
    if loras:
        for lora_name, directory in loras.items():
            shutil.copytree(directory, lora_root / lora_name)
        info[MODEL_INFO_KEY] = {lora_name: f"{LORA_DIR}/{lora_name}" for lora_name in loras}
    (version_dir / MODEL_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    return repo / name / CONFIG_NAME


def check_lora_adapters(loras: dict[str, Path], base: Path, max_lora_rank: int) -> None:
    """Read every adapter and check it against the base (``engine.lora.load_adapter``), before anything is written.

    Raises:
        UsageError: an adapter that is missing, corrupt or does not fit the base (``--lora NAME=DIR`` named).
    """
    if not loras:
        return

    spec = ModelSpec.from_checkpoint(base)
    for i, (lora_name, directory) in enumerate(loras.items()):
        try:
            load_adapter(LoRARequest(lora_name, i + 1, str(directory)), spec, max_lora_rank, torch.float32)
        except ValueError as exc:
            raise UsageError(f"--lora {lora_name}={directory}: {exc}") from exc


def _link_or_copy(source: Path, target: Path) -> None:
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def encoder_model_names(name: str) -> tuple[str, str, str, str]:
    """The four repository entries of an encoder export: Python model, ONNX, tokenizer, ensemble."""
    return name, f"{name}_onnx", f"{name}_tokenizer", f"{name}_ensemble"


def export_encoder(checkpoint: str | Path, repo: Path, name: str, *, instances: int, max_length: int) -> list[Path]:
    """The encoder for the bundled server and the three container models (see module doc)."""
    version_dir = repo / name / VERSION
    info = prepare_encoder_onnx(checkpoint, version_dir, max_length=max_length)
    write_model_dir(
        repo, name, encoder_python_config(name, hidden_size=info.hidden_size, instance_count=instances), "encoder"
    )
    (version_dir / MODEL_INFO_NAME).write_text(
        json.dumps({"kind": "encoder", "source": str(checkpoint)}, indent=2) + "\n"
    )

    _, onnx_name, tokenizer_name, ensemble_name = encoder_model_names(name)
    onnx_dir = write_model_dir(
        repo,
        onnx_name,
        encoder_onnx_config(onnx_name, input_names=info.input_names, hidden_size=info.hidden_size),
        None,
    )
    _link_or_copy(version_dir / "model.onnx", onnx_dir / "model.onnx")
    tokenizer_dir = write_model_dir(
        repo,
        tokenizer_name,
        tokenizer_config(tokenizer_name, output_names=info.input_names, max_length=info.max_length),
        "tokenizer",
    )
    for file in version_dir.iterdir():
        if file.is_file() and file.suffix != ".onnx" and file.name not in ("model.py", MODEL_INFO_NAME):
            _link_or_copy(file, tokenizer_dir / file.name)
    ensemble = encoder_ensemble_config(
        ensemble_name,
        tokenizer=tokenizer_name,
        encoder=onnx_name,
        tensor_names=info.input_names,
        hidden_size=info.hidden_size,
    )
    (repo / ensemble_name / VERSION).mkdir(parents=True, exist_ok=True)  # Triton wants a version dir, even empty
    (repo / ensemble_name / CONFIG_NAME).write_text(to_text(ensemble))
    return [repo / n / CONFIG_NAME for n in (name, onnx_name, tokenizer_name, ensemble_name)]
