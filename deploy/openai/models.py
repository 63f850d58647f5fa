"""The models the frontend serves: the LLMs of the Triton model repository (``*/1/model.json`` of kind llm),
the LoRA adapters each one serves (``deploy.lora_adapters``: declared at export or loaded at run time), and
the sentence encoders (kind encoder) behind ``/v1/embeddings``."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from deploy.lora_adapters import declared_adapters, runtime_adapters
from deploy.openai.tool_parsers import DEFAULT_TOOL_PARSER


def model_card(name: str, created: int, root: Path, parent: str | None, max_model_len: int) -> dict:
    """An OpenAI model card (``GET /v1/models``): an LLM, one of its LoRA adapters (``parent``: its base)
    or a sentence encoder; ``root`` is the directory it is served from, ``created`` a UNIX time."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "lmforge",
        "root": str(root),
        "parent": parent,
        "max_model_len": max_model_len,
    }


@dataclasses.dataclass
class ServedModel:
    """An LLM of the model repository: its Triton name, tokenizer and context length."""

    name: str
    checkpoint: Path
    tokenizer: Any
    max_model_len: int
    created: int
    vocab_size: int = 0  # len(tokenizer), computed once (it is slow: it builds the whole vocabulary)
    limits: Any = None  # the engine's RequestLimits from model.json (engine.limits; None: the defaults)
    version_dir: Path | None = None  # REPO/NAME/1 (its multi_lora.json holds the run-time adapters)
    engine: dict = dataclasses.field(default_factory=dict)  # model.json's EngineConfig fields
    declared_adapters: dict[str, Path] = dataclasses.field(default_factory=dict)  # lmforge export --lora
    adapters: dict[str, Path] = dataclasses.field(default_factory=dict)  # every adapter served now (name -> dir)
    adapter_created: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> UNIX time loaded
    tool_call_parser: str = DEFAULT_TOOL_PARSER  # the format its tool calls are read in (--tool-call-parser)

    @property
    def lora_enabled(self) -> bool:
        return bool(self.engine.get("enable_lora"))

    def __post_init__(self) -> None:
        # torch-heavy package (engine/__init__): imported on use, so importing this module stays light
        from engine.limits import RequestLimits

        if not self.vocab_size:
            self.vocab_size = len(self.tokenizer)
        self.limits = RequestLimits.from_value(self.limits)


def llm_names(repo: str | Path, names: list[str], kind: str = "llm") -> list[str]:
    """Those of ``names`` that are LLM models of ``repo`` (``1/model.json`` of kind ``llm``), or of ``kind``."""
    found = []
    for name in names:
        try:
            if json.loads((Path(repo) / name / "1" / "model.json").read_text()).get("kind") == kind:
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
        version_dir = info_path.parent
        declared = declared_adapters(info, version_dir)
        model = found[name] = ServedModel(
            name,
            checkpoint,
            AutoTokenizer.from_pretrained(checkpoint),
            int(max_model_len),
            int(info_path.stat().st_mtime),
            limits=(info.get("engine") or {}).get("limits"),
            version_dir=version_dir,
            engine=info.get("engine") or {},
            declared_adapters=declared,
            adapters={**runtime_adapters(version_dir), **declared},
        )
        model.adapter_created = {adapter: model.created for adapter in model.adapters}
    missing = sorted(set(names or []) - set(found))
    if missing:
        raise ValueError(
            f"{repo}: no LLM model(s) {missing} (a directory with 1/model.json of kind llm); export them with "
            "`lmforge export`"
        )
    if not found:
        raise ValueError(f"{repo}: no LLM model; export one with `lmforge export --model CKPT --repo {repo}`")
    return found


@dataclasses.dataclass
class EncoderModel:
    """A sentence encoder of the model repository (``lmforge export`` of an encoder: ``deploy.triton_encoder``).

    Attributes:
        tokenizer: its ``tokenizers.Tokenizer`` without truncation or padding (the frontend counts tokens;
            the Triton model tokenizes again).
        hidden_size: embedding width (``encoder.json``).
        max_length: tokens per text the model takes (``encoder.json``; longer texts are refused here).
        max_batch_size: texts per Triton request (``config.pbtxt``).
    """

    name: str
    version_dir: Path
    tokenizer: Any
    hidden_size: int
    max_length: int
    max_batch_size: int
    created: int


def discover_encoders(repo: str | Path, names: list[str] | None = None) -> dict[str, EncoderModel]:
    """The encoder models of ``repo`` (``*/1/model.json`` with ``kind: encoder``), optionally only those in ``names``.

    Raises:
        ValueError: an encoder's ``encoder.json`` or ``tokenizer.json`` is missing or unreadable.
    """
    # light on purpose (tokenizers alone, no onnx): deploy.encoder writes these files
    from tokenizers import Tokenizer

    found: dict[str, EncoderModel] = {}
    for info_path in sorted(Path(repo).glob("*/1/model.json")):
        name = info_path.parent.parent.name
        if names is not None and name not in names:
            continue
        try:
            if json.loads(info_path.read_text()).get("kind") != "encoder":
                continue
            version_dir = info_path.parent
            info = json.loads((version_dir / "encoder.json").read_text())
            tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - OSError, JSONDecodeError, and tokenizers' own exception
            raise ValueError(
                f"{info_path.parent}: not a readable encoder ({exc}); re-export it with `lmforge export`"
            ) from exc
        tokenizer.no_truncation()
        tokenizer.no_padding()
        config = (version_dir.parent / "config.pbtxt").read_text()
        batch = re.search(r"^max_batch_size:\s*(\d+)", config, re.M)
        found[name] = EncoderModel(
            name,
            version_dir,
            tokenizer,
            int(info["hidden_size"]),
            int(info.get("max_length", 256)),
            int(batch.group(1)) if batch and int(batch.group(1)) > 0 else 1,
            int(info_path.stat().st_mtime),
        )
    return found
