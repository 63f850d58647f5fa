"""``EngineStats``: counters and gauges of an engine, for logs and Prometheus."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    """A snapshot of the engine (gauges now, counters since start).

    Attributes:
        num_running: requests holding KV blocks.
        num_waiting: requests queued (new or preempted).
        kv_cache_usage: fraction of KV blocks held by requests (0..1; cached free blocks excluded).
        num_preemptions_total: preemptions by recompute.
        prefix_cache_queries_tokens_total: prompt tokens looked up in the prefix cache.
        prefix_cache_hits_tokens_total: of those, tokens served from the cache.
        num_prompt_tokens_total: prompt tokens of admitted requests.
        num_generation_tokens_total: tokens sampled.
        num_requests_finished_total: requests finished (any reason).
        num_steps_total: engine steps run.
        num_kv_blocks: size of the KV pool in blocks.
        num_free_kv_blocks / num_cached_kv_blocks: blocks free / refcount-0 but cached.
        spec_decode_num_drafts_total: request-steps that verified at least one proposed token.
        spec_decode_num_draft_tokens_total: proposed tokens verified by the target.
        spec_decode_num_accepted_tokens_total: of those, tokens the target accepted.
        structured_output_num_compiles_total / _compile_seconds_total: grammars compiled and the
            seconds spent compiling them (each constraint compiles once, then comes from the cache).
        structured_output_mask_seconds_total: seconds the engine thread spends masking logits to the
            grammars (bitmask fill and apply; a fill that ran on the mask thread during the forward counts
            only as the wait for it); ``_num_mask_steps_total``: engine steps that masked;
            ``_num_masked_tokens_total``: rows masked (one per constrained sequence per step).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries_tokens_total: int
    prefix_cache_hits_tokens_total: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_requests_finished_total: int
    num_steps_total: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_cached_kv_blocks: int
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    structured_output_num_compiles_total: int = 0
    structured_output_compile_seconds_total: float = 0.0
    structured_output_mask_seconds_total: float = 0.0
    structured_output_num_mask_steps_total: int = 0
    structured_output_num_masked_tokens_total: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens (0 when nothing was queried)."""
        q = self.prefix_cache_queries_tokens_total
        return self.prefix_cache_hits_tokens_total / q if q else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 when nothing was proposed)."""
        n = self.spec_decode_num_draft_tokens_total
        return self.spec_decode_num_accepted_tokens_total / n if n else 0.0

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens emitted per speculative request-step: 1 + accepted / drafts (0 without drafts)."""
        n = self.spec_decode_num_drafts_total
        return 1.0 + self.spec_decode_num_accepted_tokens_total / n if n else 0.0
