"""``SamplingParams``: how one request picks its tokens and when it stops (vLLM field names)."""

from __future__ import annotations

import dataclasses
import math

from engine.errors import UsageError  # a ValueError: a refused field is a usage error (exit 2)

#: Smallest temperature > 0: logits / temperature overflow float32 below it (use 0 for greedy).
MIN_TEMPERATURE = 1e-5
#: ``torch.Generator.manual_seed`` takes an unsigned 64-bit seed.
MAX_SEED = 2**64 - 1


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding parameters, validated at construction.

    Attributes:
        temperature: softmax temperature; ``0`` means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1] (Holtzman et al. 2019, "The Curious Case of
            Neural Text Degeneration").
        top_k: keep the ``top_k`` most likely tokens; ``None`` keeps all.
        max_tokens: most new tokens to generate (>= 1).
        seed: seed of this request's own ``torch.Generator`` (reproducible sampling).
        stop: a string or list of strings; generation stops before the first occurrence and
            the stop string is not part of the returned text.
        stop_token_ids: token ids that end generation (the token is kept in ``token_ids``).
        ignore_eos: keep generating after the end-of-sequence token.
        repetition_penalty: > 0; values > 1 discourage tokens already in prompt or output
            (Keskar et al. 2019, CTRL; the Hugging Face formulation).
        logprobs: return the log-probability of each sampled token and of the ``logprobs``
            most likely tokens; ``None`` returns none.
        n: completions per request; they share the prompt's KV blocks through the prefix cache
            (the first computes them, the others hit them). With a ``seed``, completion ``i``
            samples with ``seed + i``.
        min_tokens: no end-of-sequence token, ``stop_token_ids`` or ``stop`` string ends
            generation before this many new tokens (<= ``max_tokens``).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token already in
            the output (OpenAI / vLLM definition; prompt tokens do not count).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per occurrence in
            the output.
        min_p: in [0, 1]; drop tokens whose probability (after temperature) is below ``min_p``
            times the most likely token's (Nguyen et al. 2024, "Min P Sampling").
        logit_bias: ``{token_id: bias}``, bias in [-100, 100], added to the logits before
            penalties and sampling (also for greedy requests). JSON string keys are accepted.

    Raises:
        UsageError (a ValueError): a field out of range or of the wrong type (the message names it). Limits
            that depend on the model (vocabulary, context length) are checked by
            ``check_for_model`` when the engine adds the request.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0 or not math.isfinite(self.temperature):
            raise UsageError(f"temperature={self.temperature!r}; it must be a finite number >= 0 (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise UsageError(
                f"temperature={self.temperature!r} is below {MIN_TEMPERATURE} and would overflow the logits; "
                "use 0 for greedy"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise UsageError(f"top_p={self.top_p!r}; it must be in (0, 1]")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise UsageError(f"top_k={self.top_k!r}; it must be an integer >= 1, or None for no limit")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise UsageError(f"max_tokens={self.max_tokens!r}; it must be an integer >= 1")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise UsageError(f"seed={self.seed!r}; it must be an integer in [0, 2**64 - 1], or None")
        self.stop = _check_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise UsageError(f"stop_token_ids={self.stop_token_ids!r}; it must be a list of non-negative token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise UsageError(f"ignore_eos={self.ignore_eos!r}; it must be a bool")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise UsageError(
                f"repetition_penalty={self.repetition_penalty!r}; it must be a finite number > 0 (1 = off)"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise UsageError(f"logprobs={self.logprobs!r}; it must be an integer >= 0, or None")
        if not _is_int(self.n) or self.n < 1:
            raise UsageError(f"n={self.n!r}; it must be an integer >= 1 (completions per prompt)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise UsageError(
                f"min_tokens={self.min_tokens!r}; it must be an integer in [0, max_tokens={self.max_tokens}]"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise UsageError(f"{name}={value!r}; it must be a number in [-2, 2] (0 = off)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise UsageError(f"min_p={self.min_p!r}; it must be a number in [0, 1] (0 = off)")
        self.logit_bias = _check_logit_bias(self.logit_bias)

    def check_for_model(self, vocab_size: int, max_model_len: int, num_prompt_tokens: int) -> None:
        """Check the fields whose limits are the model's (called by the engine for every request).

        Args:
            vocab_size: the model's vocabulary size (token ids are in ``[0, vocab_size)``).
            max_model_len: the engine's longest prompt + output, in tokens.
            num_prompt_tokens: this request's prompt length, in tokens.

        Raises:
            UsageError (a ValueError): a token id outside the vocabulary, more ``logprobs`` than tokens, or a
                prompt + ``max_tokens`` over ``max_model_len`` (the message names the field and fix).
        """
        bad_ids = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad_ids:
            raise UsageError(f"stop_token_ids={bad_ids[:5]} are outside the vocabulary [0, {vocab_size}); remove them")
        bad_bias = sorted(t for t in (self.logit_bias or {}) if t >= vocab_size)
        if bad_bias:
            raise UsageError(
                f"logit_bias has token ids {bad_bias[:5]} outside the vocabulary [0, {vocab_size}); remove them"
            )
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise UsageError(
                f"logprobs={self.logprobs} > the vocabulary size {vocab_size}; ask for at most {vocab_size}"
            )
        if num_prompt_tokens + self.max_tokens > max_model_len:
            raise UsageError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({self.max_tokens}) = "
                f"{num_prompt_tokens + self.max_tokens} "
                f"> max_model_len={max_model_len}; set max_tokens <= "
                f"{max(max_model_len - num_prompt_tokens, 0)} or shorten the prompt"
            )

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax."""
        return self.temperature == 0

    @property
    def changes_logits(self) -> bool:
        """Whether any penalty or bias changes the logits before the token is chosen."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """Build from a JSON-like dict (e.g. Triton ``sampling_parameters``).

        Raises:
            UsageError (a ValueError): an unknown field (named) or a bad value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


def _check_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise UsageError(f"stop={stop!r}; it must be a string or a list of strings")
    if any(s == "" for s in stop):
        raise UsageError("stop contains an empty string; remove it")
    return list(stop)


def _check_logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise UsageError(f"logit_bias={bias!r}; it must be a mapping {{token_id: bias}}")
    checked: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_int(token) or token < 0:
            raise UsageError(f"logit_bias key {key!r}; keys must be non-negative token ids")
        if not _is_number(value) or not -100.0 <= value <= 100.0:
            raise UsageError(f"logit_bias[{key!r}]={value!r}; biases must be numbers in [-100, 100]")
        checked[token] = float(value)
    return checked or None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
