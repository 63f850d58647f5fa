"""Prompts for the load test: held-out dialogs by default, or a JSONL file of the user's.

A prompt is the text the client sends as ``text_input``. The optional shared system prompt is
put in front of every prompt, so all requests share a prefix of whole KV blocks that the
engine's prefix cache can reuse (the same idea as vLLM's ``--enable-prefix-caching`` benchmarks
with a common system prompt).
"""

from __future__ import annotations

import functools
from pathlib import Path

from compress.data.records import default_split_records
from engine.checkpoint.store import CheckpointError, resolve_checkpoint
from engine.errors import UsageError
from engine.records import read_jsonl


class PromptError(UsageError):
    """A prompt source that is missing, malformed or empty; the message names the file and line."""


def load_prompts(path: str | Path | None = None, *, limit: int | None = None) -> list[str]:
    """Prompts from ``path`` (JSONL), or the held-out English dialogs when ``path`` is ``None``.

    JSONL records may be ``{"prompt": str}``, ``{"text_input": str}``, ``{"text": str}`` or
    ``{"messages": [{"role", "content"}, ...]}`` (the ``lmforge data`` format; the last user
    turn is the prompt). ``limit`` keeps the first ``limit`` prompts.

    Raises:
        PromptError: the file is missing, a line is not JSON or has none of those fields, or
            nothing is left.
    """
    prompts = _jsonl_prompts(Path(path)) if path is not None else held_out_dialog_prompts()
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise PromptError(f"no prompts in {path or 'the held-out dialogs'}; give a JSONL file with 'prompt' records")
    return prompts


def _jsonl_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise PromptError(f"prompts file {path} does not exist; pass a JSONL file, one record a line")
    return read_jsonl(path, lambda record, source, line: _record_prompt(record, f"{source}:{line}"), PromptError)


def _record_prompt(record: object, where: str) -> str:
    if isinstance(record, dict):
        for key in ("prompt", "text_input", "text"):
            if isinstance(record.get(key), str) and record[key].strip():
                return record[key]
        messages = record.get("messages")
        if isinstance(messages, list):
            users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
            if users and isinstance(users[-1], str) and users[-1].strip():
                return users[-1]
    raise PromptError(f"{where}: expected a 'prompt', 'text_input', 'text' or 'messages' field with text")


def held_out_dialog_prompts() -> list[str]:
    """The user prompt of each held-out English chatterbot-corpus dialog.

    Held out means the validation split of ``lmforge data`` with its defaults
    (``compress.data.records.default_split_records``: deduplicated and filtered together with the
    training split, so no prompt was trained on). Prompts are deduplicated, order kept.

    Raises:
        DataError: the ``chatterbot-corpus`` package is not installed.
    """
    return list(_held_out_dialog_prompts())


@functools.lru_cache(maxsize=1)
def _held_out_dialog_prompts() -> tuple[str, ...]:
    records, name = default_split_records("val")
    prompts = [_record_prompt(record, f"{name}[{k}]") for k, record in enumerate(records)]
    return tuple(dict.fromkeys(p.strip() for p in prompts if p.strip()))


def with_system_prompt(prompts: list[str], system_prompt: str | None) -> list[str]:
    """Put the shared ``system_prompt`` (and a blank line) in front of every prompt."""
    if not system_prompt:
        return list(prompts)
    return [f"{system_prompt}\n\n{p}" for p in prompts]


def render_chat(prompts: list[str], checkpoint: str, system_prompt: str | None = None) -> list[str]:
    """Each prompt as a user turn (after an optional system turn) in ``checkpoint``'s chat template.

    The result is the exact text an instruct model expects (``add_generation_prompt=True``), so
    the server, which takes plain ``text_input``, answers instead of continuing the prompt.

    Raises:
        PromptError: the checkpoint cannot be resolved or its tokenizer has no chat template.
    """
    # here, not at the top: the load generator's processes import this module and never render a template
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_checkpoint(checkpoint)))
    except (CheckpointError, OSError) as exc:
        raise PromptError(f"chat template of {checkpoint}: {exc}") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"{checkpoint}: its tokenizer has no chat template; drop --chat-template")
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [
        tokenizer.apply_chat_template(
            system + [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
