"""``RequestLimits``: the per-request limits every entry point enforces (Python API, Triton, OpenAI).

One definition, held by ``EngineConfig.limits``, so ``LLM.generate``, the Triton model and the
OpenAI frontend refuse the same requests with the same messages. The checks are ordered by cost:
the counts and sizes a request states (``n``, prompts x ``n``, stop strings, ``logit_bias``,
prompt characters) are checked before its prompt is tokenized, and the token counts after.
Every refusal is an ``InvalidRequestError`` (a ``ValueError``) whose ``param`` names the field.

Defaults follow vLLM's where it has one (``max_logprobs`` 20) and OpenAI's API otherwise
(``n`` and prompts x ``n`` at most 128); the stop and ``logit_bias`` bounds keep the per-token
work of one request small (every stop string is searched after every token; every bias entry is
added to every step's logits).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import InvalidRequestError, UsageError

#: ``RequestLimits`` field -> default.
DEFAULT_MAX_N = 128
DEFAULT_MAX_CHOICES = 128
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
DEFAULT_MAX_STOP = 16
DEFAULT_MAX_STOP_CHARS = 256
DEFAULT_MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_LOGIT_BIAS = 1024
DEFAULT_MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Per-request limits (see the module docstring for where they apply).

    Attributes:
        max_n: completions per prompt (``SamplingParams.n``).
        max_choices: prompts x ``n`` of one API request (the OpenAI API takes a list of prompts).
        max_prompt_chars: prompt text, in characters, checked before tokenizing.
        max_prompt_tokens: prompt tokens; ``None`` takes ``max_model_len - 1`` (one token left to generate).
        max_tokens: ``SamplingParams.max_tokens``; ``None`` takes ``max_model_len`` (prompt + output must
            fit ``max_model_len`` anyway).
        max_stop: stop strings per request.
        max_stop_chars: characters of one stop string.
        max_stop_token_ids: entries of ``stop_token_ids``.
        max_logit_bias: entries of ``logit_bias``.
        max_logprobs: ``SamplingParams.logprobs`` and ``prompt_logprobs`` (top tokens returned per position).

    Raises:
        UsageError (a ValueError): a limit that is not a positive integer.
    """

    max_n: int = DEFAULT_MAX_N
    max_choices: int = DEFAULT_MAX_CHOICES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_stop: int = DEFAULT_MAX_STOP
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
    max_logprobs: int = DEFAULT_MAX_LOGPROBS

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name in ("max_prompt_tokens", "max_tokens"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"limits.{field.name}={value!r}; it must be an integer >= 1")

    @classmethod
    def from_value(cls, value: "RequestLimits | dict[str, Any] | None") -> "RequestLimits":
        """``RequestLimits``, a dict of its fields (``model.json``) or ``None`` (the defaults).

        Raises:
            UsageError (a ValueError): an unknown field (the known ones are listed) or a bad value.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise UsageError(f"limits={value!r}; give a mapping of RequestLimits fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise UsageError(f"limits: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------ before tokenizing

    def check_choices(self, num_prompts: int, n: int) -> None:
        """prompts x ``n`` of one request (before anything is tokenized)."""
        if n > self.max_n:
            raise InvalidRequestError(f"n={n} is over the limit of {self.max_n} completions per prompt", param="n")
        if num_prompts * n > self.max_choices:
            param = "n" if num_prompts == 1 else "prompt"
            raise InvalidRequestError(
                f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} completions is over the limit of "
                f"{self.max_choices} per request; send fewer prompts or a smaller n",
                param=param,
            )

    def check_prompt_text(self, text: str, param: str = "prompt") -> None:
        """A text prompt: at most ``max_prompt_chars`` characters and not blank (the same rule on every path,
        whatever a chat template would add), checked before tokenizing."""
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{param}: {len(text)} characters is over the limit of {self.max_prompt_chars}; shorten it",
                param=param,
            )
        if not text.strip():
            raise InvalidRequestError(f"{param}: empty prompt; send some text", param=param)

    def check_params(self, params: Any) -> None:
        """The sizes a request's sampling parameters state: ``n``, stop strings, stop token ids, ``logit_bias``,
        ``logprobs``, ``prompt_logprobs`` and ``max_tokens`` (when ``self.max_tokens`` is set).

        Args:
            params: a ``SamplingParams``, or the raw mapping of its fields (checked before it is built, so a
                huge ``logit_bias`` is refused by its size before its entries are validated one by one;
                values of the wrong type are left to ``SamplingParams``).

        Raises:
            InvalidRequestError: the first limit exceeded, ``param`` naming the field.
        """
        get = params.get if isinstance(params, dict) else lambda name: getattr(params, name, None)
        n = get("n")
        if _is_int(n):
            self.check_choices(1, n)
        stop = get("stop")
        stop = [stop] if isinstance(stop, str) else stop if isinstance(stop, (list, tuple)) else []
        if len(stop) > self.max_stop:
            raise InvalidRequestError(
                f"stop has {len(stop)} strings; at most {self.max_stop} are allowed", param="stop"
            )
        longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
        if longest > self.max_stop_chars:
            raise InvalidRequestError(
                f"stop has a string of {longest} characters; at most {self.max_stop_chars} are allowed", param="stop"
            )
        ids = get("stop_token_ids")
        if isinstance(ids, (list, tuple)) and len(ids) > self.max_stop_token_ids:
            raise InvalidRequestError(
                f"stop_token_ids has {len(ids)} entries; at most {self.max_stop_token_ids} are allowed",
                param="stop_token_ids",
            )
        bias = get("logit_bias")
        if isinstance(bias, dict) and len(bias) > self.max_logit_bias:
            raise InvalidRequestError(
                f"logit_bias has {len(bias)} entries; at most {self.max_logit_bias} are allowed", param="logit_bias"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = get(name)
            if _is_int(value) and value > self.max_logprobs:
                raise InvalidRequestError(f"{name}={value} is over the limit of {self.max_logprobs}", param=name)
        max_tokens = get("max_tokens")
        if self.max_tokens is not None and _is_int(max_tokens) and max_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"max_tokens={max_tokens} is over the limit of {self.max_tokens}", param="max_tokens"
            )

    # ------------------------------------------------------------ after tokenizing

    def check_prompt_tokens(self, num_tokens: int, max_model_len: int, param: str = "prompt") -> None:
        """A prompt of ``num_tokens`` tokens: within ``max_prompt_tokens`` and leaving room to generate."""
        limit = max_model_len - 1 if self.max_prompt_tokens is None else min(self.max_prompt_tokens, max_model_len - 1)
        if num_tokens > limit:
            raise InvalidRequestError(
                f"{param} has {num_tokens} tokens; at most {limit} are allowed (max_model_len={max_model_len} "
                "keeps one position to generate); shorten it",
                param=param,
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
