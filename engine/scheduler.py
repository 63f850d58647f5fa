"""Continuous-batching scheduler: one token budget per step, no prefill/decode phases.

After vLLM's v1 scheduler: each step spends at most ``max_num_batched_tokens`` tokens. Running
requests go first (a decode costs one token, an unfinished chunked prefill the rest of its
prompt up to the budget); then waiting requests join in arrival order while the budget, the
``max_num_seqs`` limit and the KV pool allow. When a running request cannot get a block, the
newest running request is preempted by recompute: its blocks are freed (hashed blocks stay in
the prefix cache) and it waits again with prompt + generated tokens as its new prompt.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


def speculative_room(seq: Sequence, max_model_len: int) -> int:
    """Most tokens that may be proposed after ``seq``: what ``max_tokens`` and ``max_model_len`` leave after the next
    one."""
    return min(seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens - 1)


@dataclasses.dataclass
class ScheduledSequence:
    """One sequence's share of a step."""

    seq: Sequence
    num_new_tokens: int  # tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) run now
    # Proposed tokens verified in this step after the sequence's last token (speculative
    # decoding); they are the last len(spec_token_ids) of the num_new_tokens and not yet in
    # seq.token_ids. Their logits are sampled too: 1 + len(spec_token_ids) rows.
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence (its last logits are sampled)."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == self.seq.num_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Logit rows this sequence needs: 0 (chunk ends before the sequence does), 1, or 1 + proposals."""
        return 1 + len(self.spec_token_ids) if self.samples else 0

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions of this chunk whose logits score the next prompt token and are not scored yet
        (``SamplingParams.prompt_logprobs``; position ``p`` scores prompt token ``p + 1``)."""
        scored = self.seq.prompt_logprobs
        if scored is None:
            return range(0)
        computed = self.seq.num_computed_tokens
        start = max(computed, len(scored) - 1)
        end = min(computed + self.num_new_tokens - len(self.spec_token_ids), self.seq.num_prompt_tokens - 1)
        return range(start, max(start, end))


@dataclasses.dataclass
class SchedulerOutput:
    """What the model runs in one step."""

    scheduled: list[ScheduledSequence]  # decodes (1 token) first, then prefill chunks
    num_batched_tokens: int  # sum of num_new_tokens
    preempted: list[Sequence]  # sent back to the waiting queue during this step
    # (src block, dst block, n): copy the K/V of the first n slots of src into dst before the
    # forward (tokens a newly admitted request shares with a running one past their common full
    # blocks; ``BlockManager.find_partial_block``).
    kv_copies: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, every step, which tokens of which requests the model runs.

    Args:
        config: the engine configuration (budget, limits).
        block_manager: the KV block allocator.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0

    # ---------------------------------------------------------------- queue changes

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark ``seq`` finished with ``status``, remove it from the queues and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens; allocates their KV slots (preempting when the pool is full)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            spec = self._speculative_tokens(seq, budget)
            if spec and self.block_manager.allocate_slots(seq, 1 + len(spec)):
                scheduled.append(ScheduledSequence(seq, 1 + len(spec), spec))
                budget -= 1 + len(spec)
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if self._allocate_or_preempt(seq, n, preempted):
                scheduled.append(ScheduledSequence(seq, n))
                budget -= n
                i += 1
        kv_copies: list[tuple[int, int, int]] = []
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, kv_copies)
        scheduled.sort(key=lambda s: s.num_new_tokens > 1)  # decodes first (stable)
        return SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget, preempted, kv_copies)

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: list[list[int]]) -> None:
        """Record what the model computed in step ``out``: the one place a request's progress advances.

        Each sampling sequence (``item.samples``, in ``out.scheduled`` order) gets its new tokens
        appended. ``num_computed_tokens`` grows by the tokens run, except for a speculative item:
        there only its last token and the accepted proposals count (``len(new tokens)``: the
        accepted ones plus one from the target), the KV of rejected proposals is left to be
        overwritten, and blocks holding only rejected slots are freed. Then newly full blocks
        of accepted tokens enter the prefix cache.

        Args:
            out: the step's ``SchedulerOutput``.
            sampled_token_ids: per sampling sequence, its new token ids.

        Raises:
            ValueError: ``sampled_token_ids`` does not have one entry per sampling sequence.
        """
        sampling = [item for item in out.scheduled if item.samples]
        if len(sampling) != len(sampled_token_ids):
            raise ValueError(
                f"{len(sampled_token_ids)} token lists for {len(sampling)} sampling sequences; give one per sequence"
            )
        new_tokens = {id(item): tokens for item, tokens in zip(sampling, sampled_token_ids)}
        for item in out.scheduled:
            seq, tokens = item.seq, new_tokens.get(id(item), [])
            seq.num_computed_tokens += len(tokens) if item.spec_token_ids else item.num_new_tokens
            seq.token_ids.extend(tokens)
            if item.spec_token_ids:
                self.block_manager.free_unused_tail(seq)
                seq.spec_token_ids, seq.spec_probs = [], None
            self.block_manager.cache_full_blocks(seq)

    def _speculative_tokens(self, seq: Sequence, budget: int) -> list[int]:
        """The proposals of a decoding ``seq`` that fit the budget, ``max_tokens`` and ``max_model_len``.

        Proposals are dropped, never shortened to 0 by preemption: if the pool cannot hold their
        slots the sequence decodes one token as usual.
        """
        if not seq.spec_token_ids or seq.num_uncomputed_tokens != 1:
            return []
        room = min(budget - 1, speculative_room(seq, self.config.max_model_len))
        return seq.spec_token_ids[: max(0, room)]

    def _allocate_or_preempt(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """Allocate ``n`` slots for running ``seq``, preempting newer requests; False if ``seq`` itself was
        preempted."""
        while not self.block_manager.allocate_slots(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_token_ids, seq.spec_probs = [], None
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def _admit_waiting(
        self, budget: int, scheduled: list[ScheduledSequence], kv_copies: list[tuple[int, int, int]]
    ) -> int:
        """Move waiting requests into the running set while budget, seat and blocks allow.

        A request whose prompt continues a running request's computed tokens past their common
        cached blocks gets those K/V slots copied (``kv_copies``) instead of recomputing them.

        With LoRA, the running requests use at most ``max_loras`` adapters: a request of another
        adapter waits (keeping its place) while that many are running, and so do the adapter requests
        behind it (no adapter starves); base requests pass.
        """
        in_flight = self._in_flight_hashes()
        bm = self.block_manager
        donors = list(self.running)  # their computed K/V exists before this step (not the new ones')
        active_loras = {s.lora_request for s in self.running if s.lora_request is not None}
        held: set[int] = set()  # ids of the adapter requests waiting for a LoRA slot
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = next((s for s in self.waiting if not s.waits_for_grammar and id(s) not in held), None)
            if seq is None:
                break  # the rest wait for their structured-output grammars to compile (or for a LoRA slot)
            lora = seq.lora_request
            if lora is not None and (held or (lora not in active_loras and len(active_loras) >= self.config.max_loras)):
                held.add(id(seq))  # keeps its place in the queue
                continue
            use_cache = not seq.skips_prefix_cache  # prompt logprobs need the logits of every prompt position
            cached = bm.find_cached_prefix(seq) if use_cache else []
            if bm.enable_prefix_caching and use_cache and self._prefix_in_flight(seq, len(cached), in_flight):
                break  # a running request is computing this prefix now: wait one step and hit it
            partial = bm.find_partial_block(seq, cached, donors) if donors and use_cache else None
            copied = partial[1] if partial else 0
            remaining = seq.num_tokens - len(cached) * bm.block_size - copied
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            n = min(remaining, budget)
            if not bm.allocate_slots(seq, copied + n, cached):
                break
            if partial:
                kv_copies.append((partial[0], seq.block_table[len(cached)], copied))
                seq.num_computed_tokens += copied
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = len(cached) * bm.block_size + copied
            bm.record_prefix_query(seq, cached, copied)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n
            if lora is not None:
                active_loras.add(lora)
            if bm.enable_prefix_caching:
                in_flight.update(bm.full_block_hashes(seq)[len(cached) :])
        return budget

    def _in_flight_hashes(self) -> set[int]:
        """Hashes of full prompt blocks that running requests have not finished computing."""
        if not self.block_manager.enable_prefix_caching:
            return set()
        bs = self.block_manager.block_size
        hashes: set[int] = set()
        for seq in self.running:
            if seq.is_prefilling:
                hashes.update(self.block_manager.full_block_hashes(seq)[seq.num_computed_tokens // bs :])
        return hashes

    def _prefix_in_flight(self, seq: Sequence, num_cached_blocks: int, in_flight: set[int]) -> bool:
        max_blocks = (seq.num_tokens - 1) // self.block_manager.block_size
        if num_cached_blocks >= max_blocks:
            return False
        return self.block_manager.full_block_hashes(seq)[num_cached_blocks] in in_flight
