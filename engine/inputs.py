"""Prompt checks shared by the engine and the serving frontends (one set of rules, one wording).

The engine checks every prompt when a request is added (``LLMEngine.validate_request``); the
OpenAI frontend runs the same checks before it sends anything to Triton, so a bad prompt gets the
same answer on both paths. Each error names the request field (``prompt``, ``messages``,
``prompt.1``...) and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import InvalidRequestError


class PromptError(InvalidRequestError):
    """A prompt the model cannot take.

    Attributes:
        field: the request field that holds the prompt (``prompt``, ``messages``, ``prompt.0``).
        code: a machine-readable reason (``empty_prompt``, ``token_id_out_of_range``,
            ``context_length_exceeded``), as OpenAI's error ``code``.
    """

    def __init__(self, message: str, *, field: str, code: str) -> None:
        super().__init__(message, param=field)
        self.field, self.code = field, code


def check_prompt_length(num_tokens: int, max_model_len: int, *, field: str = "prompt") -> None:
    """Refuse a prompt that leaves no room to generate within ``max_model_len`` tokens.

    Raises:
        PromptError: ``num_tokens >= max_model_len`` (code ``context_length_exceeded``).
    """
    if num_tokens >= max_model_len:
        raise PromptError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {num_tokens}, "
            "which leaves no room to generate (max_model_len); shorten the prompt",
            field=field,
            code="context_length_exceeded",
        )


def check_prompt_token_ids(
    token_ids: Sequence[int], vocab_size: int, max_model_len: int | None = None, *, field: str = "prompt"
) -> list[int]:
    """Check a tokenized prompt: not empty, every id in the vocabulary, room left to generate.

    Args:
        token_ids: the prompt's token ids.
        vocab_size: the model's vocabulary size (ids are in ``[0, vocab_size)``).
        max_model_len: the longest prompt + output in tokens; ``None`` skips the length check.
        field: the request field named in the error.

    Returns:
        ``token_ids`` as a list.

    Raises:
        PromptError: an empty prompt, an id outside the vocabulary, or a prompt of
            ``max_model_len`` tokens or more.
    """
    ids = list(token_ids)
    if not ids:
        raise PromptError(
            f"{field}: empty prompt (no tokens); give at least one token", field=field, code="empty_prompt"
        )
    if any(t < 0 or t >= vocab_size for t in ids):
        raise PromptError(
            f"{field}: token ids must be in the vocabulary [0, {vocab_size})", field=field, code="token_id_out_of_range"
        )
    if max_model_len is not None:
        check_prompt_length(len(ids), max_model_len, field=field)
    return ids
