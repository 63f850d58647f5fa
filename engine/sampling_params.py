"""``SamplingParams``: how one request picks its tokens and when it stops (vLLM field names)."""

from __future__ import annotations

import dataclasses
import json
import math

from engine.errors import InvalidRequestError  # a InvalidRequestError (a ValueError) naming the field (``param``)

#: Smallest temperature > 0: logits / temperature overflow float32 below it (use 0 for greedy).
MIN_TEMPERATURE = 1e-5
#: ``torch.Generator.manual_seed`` takes an unsigned 64-bit seed.
MAX_SEED = 2**64 - 1


#: The fields of ``StructuredOutputsParams`` that name a constraint; exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint on the generated text, enforced as a token mask at sampling time (vLLM's shape).

    Exactly one field is set:

    Attributes:
        json: a JSON schema (a dict or its JSON text); the output is one JSON value valid against it.
        regex: a regular expression (Rust ``regex`` syntax, matched in full).
        choice: a list of strings; the output is exactly one of them.
        grammar: a context-free grammar, Lark or GBNF (llama.cpp) syntax.
        json_object: ``True``: the output is one JSON object (any keys).

    Raises:
        InvalidRequestError (a ValueError): none or several fields set, or a field of the wrong type (named).
            Whether a schema, pattern or grammar compiles is known only when it is compiled
            (``engine.structured_output``).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            which = "none" if not given else " and ".join(given)
            raise InvalidRequestError(
                f"structured_outputs sets {which}; set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
                param="structured_outputs",
            )
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"structured_outputs.json is not valid JSON ({exc}); send a JSON schema", param="structured_outputs"
                ) from exc
            if not isinstance(parsed, (dict, bool)):
                raise InvalidRequestError(
                    "structured_outputs.json must be a JSON schema (an object)", param="structured_outputs"
                )
        elif self.json is not None and not isinstance(self.json, dict):
            raise InvalidRequestError(
                f"structured_outputs.json={self.json!r}; it must be a JSON schema (an object)",
                param="structured_outputs",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(
                    f"structured_outputs.{name}={value!r}; it must be a non-empty string", param="structured_outputs"
                )
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise InvalidRequestError(
                    f"structured_outputs.choice={self.choice!r}; it must be a non-empty list of non-empty strings",
                    param="structured_outputs",
                )
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise InvalidRequestError(
                f"structured_outputs.json_object={self.json_object!r}; it must be true or omitted",
                param="structured_outputs",
            )

    @property
    def kind(self) -> str:
        """The field that is set: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, canonical spec text)``: equal constraints have equal keys (the compile cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            return kind, json.dumps(value, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(value)
        if kind == "json_object":
            return kind, ""
        return kind, value

    @classmethod
    def from_value(cls, value: object) -> "StructuredOutputsParams | None":
        """``None``, an instance, or a dict of its fields (JSON requests) -> an instance.

        Raises:
            InvalidRequestError (a ValueError): not a dict, an unknown field (named), or a bad value.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(
                f"structured_outputs={value!r}; it must be an object with one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
                param="structured_outputs",
            )
        unknown = sorted(set(value) - set(STRUCTURED_OUTPUT_KINDS))
        if unknown:
            raise InvalidRequestError(
                f"structured_outputs has unknown field(s) {unknown}; known: {', '.join(STRUCTURED_OUTPUT_KINDS)}",
                param="structured_outputs",
            )
        return cls(**value)


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding parameters, validated at construction.

    Attributes:
        temperature: softmax temperature; ``0`` means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1] (Holtzman et al. 2019, "The Curious Case of
            Neural Text Degeneration").
        top_k: keep the ``top_k`` most likely tokens; ``None`` keeps all.
        max_tokens: most new tokens to generate (>= 1; 0 with ``prompt_logprobs``: score the prompt only).
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
        structured_outputs: a ``StructuredOutputsParams`` (or a dict of its fields): only tokens
            that keep the output inside its language are sampled, end-of-sequence only where the
            output is complete, and the request finishes (``"stop"``) once nothing can follow.
            Such a request gets no speculative proposals.
        prompt_logprobs: return the log-probability of each prompt token (``None`` for the first)
            and of the ``prompt_logprobs`` most likely tokens at its position; ``None`` returns none.
            The prompt is then computed in full rather than taken from the prefix cache.

    Raises:
        InvalidRequestError (a ValueError): a field out of range or of the wrong type (the message names it,
            ``param`` holds its name). Limits
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
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0 or not math.isfinite(self.temperature):
            raise InvalidRequestError(
                f"temperature={self.temperature!r}; it must be a finite number >= 0 (0 = greedy)", param="temperature"
            )
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature={self.temperature!r} is below {MIN_TEMPERATURE} and would overflow the logits; "
                "use 0 for greedy",
                param="temperature",
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p={self.top_p!r}; it must be in (0, 1]", param="top_p")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise InvalidRequestError(
                f"top_k={self.top_k!r}; it must be an integer >= 1, or None for no limit", param="top_k"
            )
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise InvalidRequestError(
                f"prompt_logprobs={self.prompt_logprobs!r}; it must be an integer >= 0, or None",
                param="prompt_logprobs",
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens={self.max_tokens!r}; it must be an integer >= 1", param="max_tokens")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise InvalidRequestError(
                "max_tokens=0 generates nothing; it must be >= 1, or set prompt_logprobs to score the prompt only",
                param="max_tokens",
            )
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequestError(
                f"seed={self.seed!r}; it must be an integer in [0, 2**64 - 1], or None", param="seed"
            )
        self.stop = _check_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError(
                f"stop_token_ids={self.stop_token_ids!r}; it must be a list of non-negative token ids",
                param="stop_token_ids",
            )
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos={self.ignore_eos!r}; it must be a bool", param="ignore_eos")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError(
                f"repetition_penalty={self.repetition_penalty!r}; it must be a finite number > 0 (1 = off)",
                param="repetition_penalty",
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise InvalidRequestError(
                f"logprobs={self.logprobs!r}; it must be an integer >= 0, or None", param="logprobs"
            )
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n={self.n!r}; it must be an integer >= 1 (completions per prompt)", param="n")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens={self.min_tokens!r}; it must be an integer in [0, max_tokens={self.max_tokens}]",
                param="min_tokens",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name}={value!r}; it must be a number in [-2, 2] (0 = off)", param=name)
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p={self.min_p!r}; it must be a number in [0, 1] (0 = off)", param="min_p")
        self.logit_bias = _check_logit_bias(self.logit_bias)
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if self.structured_outputs is not None and self.max_tokens == 0:
            raise InvalidRequestError(
                "structured_outputs with max_tokens=0 generates nothing; set max_tokens >= 1", param="max_tokens"
            )

    def check_for_model(self, vocab_size: int, max_model_len: int, num_prompt_tokens: int) -> None:
        """Check the fields whose limits are the model's (called by the engine for every request).

        Args:
            vocab_size: the model's vocabulary size (token ids are in ``[0, vocab_size)``).
            max_model_len: the engine's longest prompt + output, in tokens.
            num_prompt_tokens: this request's prompt length, in tokens.

        Raises:
            InvalidRequestError (a ValueError): a token id outside the vocabulary, more ``logprobs`` than tokens, or a
                prompt + ``max_tokens`` over ``max_model_len`` (the message names the field and fix).
        """
        bad_ids = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad_ids:
            raise InvalidRequestError(
                f"stop_token_ids={bad_ids[:5]} are outside the vocabulary [0, {vocab_size}); remove them",
                param="stop_token_ids",
            )
        bad_bias = sorted(t for t in (self.logit_bias or {}) if t >= vocab_size)
        if bad_bias:
            raise InvalidRequestError(
                f"logit_bias has token ids {bad_bias[:5]} outside the vocabulary [0, {vocab_size}); remove them",
                param="logit_bias",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise InvalidRequestError(
                    f"{name}={value} > the vocabulary size {vocab_size}; ask for at most {vocab_size}", param=name
                )
        if num_prompt_tokens + self.max_tokens > max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({self.max_tokens}) = "
                f"{num_prompt_tokens + self.max_tokens} "
                f"> max_model_len={max_model_len}; set max_tokens <= "
                f"{max(max_model_len - num_prompt_tokens, 0)} or shorten the prompt",
                param="max_tokens",
            )

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax."""
        return self.temperature == 0

    @property
    def changes_logits(self) -> bool:
        """Whether any penalty, bias or grammar changes the logits before the token is chosen."""
        return self.adjusts_logits or self.structured_outputs is not None

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias or ``min_tokens`` changes the logits (a grammar's mask aside)."""
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
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}", param=unknown[0]
            )
        return cls(**values)


def _check_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError(f"stop={stop!r}; it must be a string or a list of strings", param="stop")
    if any(s == "" for s in stop):
        raise InvalidRequestError("stop contains an empty string; remove it", param="stop")
    return list(stop)


def _check_logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias={bias!r}; it must be a mapping {{token_id: bias}}", param="logit_bias")
    checked: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.strip().isdigit() else key
        if not _is_int(token) or token < 0:
            raise InvalidRequestError(
                f"logit_bias key {key!r}; keys must be non-negative token ids", param="logit_bias"
            )
        if not _is_number(value) or not -100.0 <= value <= 100.0:
            raise InvalidRequestError(
                f"logit_bias[{key!r}]={value!r}; biases must be numbers in [-100, 100]", param="logit_bias"
            )
        checked[token] = float(value)
    return checked or None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
