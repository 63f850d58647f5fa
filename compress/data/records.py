"""Records: the JSONL files every stage reads, and the one default held-out split.

``read_jsonl`` reads any JSONL file of the project (data splits, training metrics, load-test
samples, prompts) against a schema and names ``file:line`` in every error. A data record is
``{"messages": [{"role", "content"}, ...]}`` or ``{"text": ...}`` (``compress.data.prepare.validate_record``
is its schema); ``read_records`` reads a file of them. The default split is the one ``lmforge data`` writes
with its default settings (the English chatterbot corpus, deduplicated and filtered across both
splits): it is made once and cached in ``CACHE/data/default-<key>/``, where ``<key>`` hashes the
settings and the corpus version (``compress.checkpoint.store.cache_dir``), so evaluation, quantization
calibration and the benchmarks' prompts all use the same validation dialogs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.checkpoint.store import cache_dir
from compress.data.prepare import DataConfig, DataError, iter_jsonl, prepare, validate_record
from compress.errors import LmforgeError

SPLITS = ("train", "val")

#: ``schema(value, source, line)``: the record in canonical form, or raises ``ValueError`` (an
#: ``LmforgeError`` subclass for preference) whose message starts with ``source:line``.
Schema = Callable[[Any, str, int], Any]


def read_jsonl(
    path: str | Path,
    schema: Schema | None = None,
    error: type[LmforgeError] = DataError,
    *,
    torn_tail_ok: bool = False,
) -> list[Any]:
    """The values of the non-blank lines of a JSONL file, each checked by ``schema``.

    Args:
        path: the file; it must exist (each caller says what a missing one means).
        schema: see ``Schema``; None keeps each JSON value as it is.
        error: the error class the caller's command reports (the message is the same).
        torn_tail_ok: skip a last line that is not JSON (a writer stopped mid-line).

    Raises:
        ``error``: the file is not UTF-8, a line is not JSON, or the schema rejects it (names file:line).
    """
    path = Path(path)
    try:
        return [
            value if schema is None else schema(value, str(path), line_no)
            for line_no, value in iter_jsonl(path, error, torn_tail_ok=torn_tail_ok)
        ]
    except ValueError as exc:
        if isinstance(exc, error):
            raise
        raise error(str(exc)) from exc


def read_records(path: str | Path, error: type[LmforgeError] = DataError) -> list[dict[str, Any]]:
    """The records of a JSONL file (e.g. ``val.jsonl`` of ``lmforge data``), canonical form.

    Args:
        path: the file.
        error: the error class the caller's command reports (the message is the same).

    Raises:
        ``error``: missing file, a line that is not JSON or not a record (names file:line), or no records.
    """
    path = Path(path)
    if not path.is_file():
        raise error(f"--data {path}: file not found; pass a val.jsonl written by `lmforge data`")
    records = read_jsonl(path, validate_record, error)
    if not records:
        raise error(f"{path}: no records")
    return records


def default_data_dir() -> Path:
    """The directory of ``lmforge data``'s default output, made on first use and cached.

    Raises:
        DataError: the chatterbot corpus is not installed (names the package to install).
    """
    config = dataclasses.asdict(DataConfig())
    try:
        corpus = importlib.metadata.version("chatterbot-corpus")
    except importlib.metadata.PackageNotFoundError:
        corpus = "none"
    key = hashlib.sha1(json.dumps({"config": config, "corpus": corpus}, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "data" / f"default-{key}"
    if not (out / "data_report.json").is_file():
        prepare(DataConfig(), out, verbose=False)
    return out


@functools.lru_cache(maxsize=2)
def _default_split(split: str) -> tuple[tuple[dict[str, Any], ...], str]:
    name = "validation" if split == "val" else "training"
    records = read_records(default_data_dir() / f"{split}.jsonl")
    return tuple(records), f"chatterbot:english (lmforge data {name} split)"


def default_split_records(split: str = "val") -> tuple[list[dict[str, Any]], str]:
    """A split of the default data (module docstring) and a description of where it came from.

    Returns:
        ``(records, name)``; the records are copies (callers may edit them).

    Raises:
        DataError: ``split`` is neither ``train`` nor ``val``; the corpus is not installed.
    """
    if split not in SPLITS:
        raise DataError(f"split={split!r}: use 'train' or 'val'")
    records, name = _default_split(split)
    return [json.loads(json.dumps(r)) for r in records], name


def encode_record(tokenizer, record: dict[str, Any], *, max_length: int = 512) -> tuple[list[int], list[bool]]:
    """Token ids of a record and which of them are scored.

    Returns:
        ``(ids, scored)``, both of length ``T <= max_length``; ``scored[t]`` says whether token
        ``t`` counts in the perplexity (assistant reply tokens of a chat, every token of a text;
        token 0 is never scored: nothing predicts it).

    Raises:
        DataError: a ``messages`` record with a tokenizer that has no chat template.
    """
    if "text" in record:
        ids = tokenizer(record["text"], truncation=True, max_length=max_length)["input_ids"]
        return ids, [False] + [True] * (len(ids) - 1)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "records with 'messages' need a tokenizer with a chat template (tokenizer_config.json: "
            "chat_template); use {'text'} records"
        )
    messages = record["messages"]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []  # character ranges of the assistant replies (with their end-of-turn marker)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)) if i else 0
        end = len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
        spans.append((start, end))
    encoding = tokenizer(
        text, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_length
    )
    scored = [any(s <= begin < e for s, e in spans) for begin, _ in encoding["offset_mapping"]]
    if scored:
        scored[0] = False
    return encoding["input_ids"], scored
