"""``Sequence``: one request's tokens, its progress through the model and its KV blocks."""

from __future__ import annotations

import enum
import time

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Life cycle of a request: WAITING -> RUNNING (-> WAITING on preemption) -> FINISHED_*."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the step that ran it failed (model, sampler or detokenizer)

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"``, ``"error"``, or ``None`` while unfinished."""
        return self.value if self.finished else None


class Sequence:
    """One request: prompt + generated tokens and how many of them are in the KV cache.

    The scheduler advances ``num_computed_tokens``; tokens ``[num_computed_tokens, num_tokens)``
    still need a forward pass (the whole prompt at first, one token per decode step, everything
    again after a preemption by recompute). ``block_table[i]`` is the physical KV block holding
    tokens ``[i * block_size, (i + 1) * block_size)``; ``block_hashes[i]`` the chained hash of
    that block once it is full and computed.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        generator: torch.Generator | None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.generator = generator
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.output_text = ""
        #: trailing characters of ``output_text`` that may begin a stop string: not shown until the next token
        self.stop_holdback_chars = 0
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
        self.num_preemptions = 0
        self.last_scheduled_step = 0  # the scheduler's step counter when it last ran (fair scheduling order)
        self.last_admitted_step = 0  # ... when it last moved from waiting to running
        self.group_id = request_id  # the request this completion belongs to (``SamplingParams.n``)
        self.index = 0  # its completion index in that request
        self.error: str | None = None  # why it finished with FINISHED_ERROR
        # Speculative decoding: tokens proposed after the last one (not part of token_ids until
        # the target accepts them) and the [len, vocab] draft distributions they were drawn from.
        self.spec_token_ids: list[int] = []
        self.spec_probs = None
        # LoRA: the adapter it runs with (an ``engine.lora.LoRARequest``, ``None`` for the base) and that
        # adapter's 64-bit prefix-cache key, the parent hash of its first KV block (so no block is shared
        # across adapters).
        self.lora_request = None
        self.lora_hash: int | None = None
        # Structured output: the request's grammar (engine.structured_output.SequenceGrammar), if any.
        self.grammar = None
        # Prompt logprobs (``params.prompt_logprobs``): one entry per prompt token scored so far, the
        # first ``None``; ``None`` when not asked (or asked of the request's first sequence only).
        self.prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def waits_for_grammar(self) -> bool:
        """Its structured-output grammar is still compiling (the scheduler does not admit it yet)."""
        return self.grammar is not None and not self.grammar.ready

    @property
    def skips_prefix_cache(self) -> bool:
        """Its prompt logprobs are not all computed: cached positions would have no logits, so the
        prompt is computed in full."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token is missing from the KV cache."""
        return self.num_uncomputed_tokens > 1

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
