"""The chat-record format every stage reads: JSONL lines of ``{"messages": [{"role", "content"}, ...]}``
or ``{"text": str}``, checked line by line, and their token ids under a chat template.

``lmforge data`` writes it, training and evaluation read it, and the engine's n-gram proposer looks up
a corpus of it; the format lives with the runtime so the recipes import it, never the reverse.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine.errors import LmforgeError

ROLES = ("system", "user", "assistant")


class DataError(LmforgeError, ValueError):
    """Bad input data; the message names the file and line and what to fix."""


#: ``schema(value, source, line)``: the record in canonical form, or raises ``ValueError`` (an
#: ``LmforgeError`` subclass for preference) whose message starts with ``source:line``.
Schema = Callable[[Any, str, int], Any]


def read_utf8(path: Path, error: type[LmforgeError] = DataError) -> str:
    """The text of the user file ``path``.

    Raises:
        ``error``: the file is not UTF-8 (names the file and the byte offset).
    """
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})", fix="save it as UTF-8") from exc


def iter_jsonl(
    path: Path, error: type[LmforgeError] = DataError, *, torn_tail_ok: bool = False
) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed value)`` of each non-blank line of a JSONL file.

    With ``torn_tail_ok`` a last line that is not JSON is skipped (its writer was stopped mid-line).

    Raises:
        ``error``: the file is not UTF-8, or a line is not JSON (names file:line).
    """
    lines = read_utf8(path, error).splitlines()
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if torn_tail_ok and line_no == len(lines):
                return
            raise error(f"{path}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        yield line_no, value


def validate_record(obj: Any, source: str, line: int) -> dict[str, Any]:
    """Check one record's shape and return it in canonical form.

    Raises:
        DataError: not an object, neither ``messages`` nor ``text``, a message without a known
            ``role`` or a string ``content`` (names ``source:line`` and the field).
    """
    where = f"{source}:{line}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: record must be a JSON object with 'messages' or 'text', got {type(obj).__name__}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        clean = []
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise DataError(
                    f"{where}: messages[{k}] must be {{'role': one of {list(ROLES)}, 'content': string}}, got {m!r}"
                )
            clean.append({"role": m["role"], "content": m["content"]})
        return {"messages": clean}
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise DataError(f"{where}: 'text' must be a string, got {type(obj['text']).__name__}")
        return {"text": obj["text"]}
    raise DataError(f"{where}: record has neither 'messages' nor 'text' (keys: {sorted(obj)})")


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
