"""What the engine returns: ``RequestOutput`` (vLLM-shaped) and per-request timing metrics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (the engine produces ``index`` 0 only)."""

    index: int
    text: str  # cumulative decoded text (stop string excluded)
    token_ids: list[int]  # cumulative generated token ids
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob} when asked
    error: str | None = None  # with finish_reason "error": what failed (exception type and message)


@dataclasses.dataclass
class RequestMetrics:
    """Timing of one request, in ``time.monotonic()`` seconds."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (arrival -> first sampled token)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (``None`` with fewer than 2 tokens or unfinished)."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclasses.dataclass
class RequestOutput:
    """State of one request after a step (or at its end when ``finished``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with ``SamplingParams.prompt_logprobs``: per prompt token {token_id: logprob} (the token's own
    # first, then the top ``prompt_logprobs``), ``None`` for the first token (nothing precedes it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    lora_request: object = None  # the ``engine.lora.LoRARequest`` it ran with (``None``: the base)
