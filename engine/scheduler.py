"""Continuous-batching scheduler: one token budget per step, no prefill/decode phases.

After vLLM's v1 scheduler: each step spends at most ``max_num_batched_tokens`` tokens. Running
requests go first (a decode costs one token, an unfinished chunked prefill the rest of its
prompt up to the budget); then waiting requests join in arrival order while the budget, the
``max_num_seqs`` limit and the KV pool allow. When a running request cannot get a block, the
newest running request is preempted by recompute: its blocks are freed (hashed blocks stay in
the prefix cache) and it waits again with prompt + generated tokens as its new prompt.

Fair scheduling bounds what one request can take from the others. A request (all its ``n``
sequences, one *group*) is *large* when it has more than ``fair_share_seqs`` unfinished sequences
or more than ``long_prefill_token_threshold`` prompt tokens left to compute. While any regular
request runs or waits, the large ones together run at most ``fair_share_seqs`` sequences and
``fair_share_tokens`` tokens per step (least recently run first, so all of them progress), regular
requests are admitted before them, and a regular request that finds no seat or no KV block takes
one from a large request (its newest sequence not run this step is preempted). A step then costs
about what it would without the large request, so a regular request's latency stays within a
small factor of its latency alone. With only large requests (or only regular ones) the step is
first come, first served as before.
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


@dataclasses.dataclass
class FairShare:
    """What the large requests (``large``: group ids) may still take in this step: sequences and tokens."""

    large: set[str]
    seqs: int
    tokens: int

    def room(self, seq: Sequence) -> int:
        """Tokens a large request's ``seq`` may run now (0: it waits for a later step)."""
        return min(self.tokens, seq.num_uncomputed_tokens) if self.seqs > 0 else 0


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
        self._step = 0  # steps scheduled (``Sequence.last_scheduled_step`` orders the large requests' turns)

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
        """Pick this step's tokens; allocates their KV slots (preempting when the pool is full).

        Running sequences go first, then waiting ones join; while large requests are bounded
        (``FairShare``) the regular requests, running then waiting, go before the large ones.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        kv_copies: list[tuple[int, int, int]] = []
        self._step += 1
        share = self._fair_share()
        if share is None:
            budget = self._schedule_running(list(self.running), budget, scheduled, preempted, None)
            if not preempted:
                budget = self._admit_waiting(list(self.waiting), budget, scheduled, kv_copies, None, preempted)
        else:
            regular = [s for s in self.running if s.group_id not in share.large]
            budget = self._schedule_running(regular, budget, scheduled, preempted, share)
            waiting = [s for s in self.waiting if s.group_id not in share.large]
            budget = self._admit_waiting(waiting, budget, scheduled, kv_copies, share, preempted)
            large = sorted((s for s in self.running if s.group_id in share.large), key=lambda s: s.last_scheduled_step)
            budget = self._schedule_running(large, budget, scheduled, preempted, share)
            if not preempted:
                waiting = [s for s in self.waiting if s.group_id in share.large]
                budget = self._admit_waiting(waiting, budget, scheduled, kv_copies, share, preempted)
        scheduled.sort(key=lambda s: s.num_new_tokens > 1)  # decodes first (stable)
        return SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget, preempted, kv_copies)

    def _schedule_running(
        self,
        seqs: list[Sequence],
        budget: int,
        scheduled: list[ScheduledSequence],
        preempted: list[Sequence],
        share: "FairShare | None",
    ) -> int:
        """Schedule running ``seqs`` in order (decode, speculative verification or the next prefill chunk);
        returns the budget left."""
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            limit = budget if share is None or seq.group_id not in share.large else min(budget, share.room(seq))
            if limit <= 0:
                seq.spec_token_ids, seq.spec_probs = [], None  # not run this step: its proposals are stale
                continue
            spec = self._speculative_tokens(seq, limit)
            if spec and self.block_manager.allocate_slots(seq, 1 + len(spec)):
                self._take(ScheduledSequence(seq, 1 + len(spec), spec), scheduled, share)
                budget -= 1 + len(spec)
                continue
            n = min(seq.num_uncomputed_tokens, limit)
            if self._allocate_or_preempt(seq, n, preempted, scheduled, share):
                self._take(ScheduledSequence(seq, n), scheduled, share)
                budget -= n
        return budget

    def _take(self, item: ScheduledSequence, scheduled: list[ScheduledSequence], share: "FairShare | None") -> None:
        scheduled.append(item)
        item.seq.last_scheduled_step = self._step
        if share is not None and item.seq.group_id in share.large:
            share.seqs -= 1
            share.tokens -= item.num_new_tokens

    def _fair_share(self) -> "FairShare | None":
        """This step's ``FairShare``, or ``None`` when nothing is bounded (fairness off, or no regular request
        alongside a large one)."""
        cfg = self.config
        if cfg.fair_share_tokens is None:
            return None
        sizes: dict[str, int] = {}
        long_prefill: set[str] = set()
        for seq in (*self.running, *self.waiting):
            sizes[seq.group_id] = sizes.get(seq.group_id, 0) + 1
            if seq.num_uncomputed_tokens > cfg.long_prefill_token_threshold:
                long_prefill.add(seq.group_id)
        large = {g for g, size in sizes.items() if size > cfg.fair_share_seqs} | long_prefill
        if not large or len(large) == len(sizes):
            return None
        return FairShare(large, cfg.fair_share_seqs, cfg.fair_share_tokens)

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

    def _allocate_or_preempt(
        self,
        seq: Sequence,
        n: int,
        preempted: list[Sequence],
        scheduled: list[ScheduledSequence],
        share: "FairShare | None" = None,
    ) -> bool:
        """Allocate ``n`` slots for running ``seq``, preempting requests not yet run this step (a large
        request's newest sequence first, else the newest); False if ``seq`` itself was preempted."""
        while not self.block_manager.allocate_slots(seq, n):
            victim = self._victim(scheduled, share) or seq
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _victim(self, scheduled: list[ScheduledSequence], share: "FairShare | None", large_only: bool = False):
        """The running sequence to preempt: not run this step; of a large request while bounded, the newest."""
        taken = {id(item.seq) for item in scheduled}
        candidates = [s for s in self.running if id(s) not in taken]
        if share is not None:
            large = [s for s in candidates if s.group_id in share.large]
            if large or large_only:
                return large[-1] if large else None
        elif large_only:
            return None
        return candidates[-1] if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_token_ids, seq.spec_probs = [], None
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def _admit_waiting(
        self,
        queue: list[Sequence],
        budget: int,
        scheduled: list[ScheduledSequence],
        kv_copies: list[tuple[int, int, int]],
        share: "FairShare | None" = None,
        preempted: list[Sequence] | None = None,
    ) -> int:
        """Move the waiting requests of ``queue`` (in order) into the running set while budget, seat and blocks
        allow; returns the budget left.

        A request whose prompt continues a running request's computed tokens past their common
        cached blocks gets those K/V slots copied (``kv_copies``) instead of recomputing them. A
        request waiting for a prefix a running request computes now is passed over this step (it
        hits the cache next step); the others keep their order. While ``share`` bounds large
        requests, regular requests go first and may take a large request's seat or blocks.

        With LoRA, the running requests use at most ``max_loras`` adapters: a request of another
        adapter waits (keeping its place) while that many are running, and so do the adapter requests
        behind it (no adapter starves); base requests pass.
        """
        preempted = [] if preempted is None else preempted
        in_flight = self._in_flight_hashes()
        bm = self.block_manager
        # their computed K/V exists before this step (not that of the ones admitted in it)
        donors = [s for s in self.running if s.last_admitted_step != self._step]
        active_loras = {s.lora_request for s in self.running if s.lora_request is not None}
        lora_held = False  # an adapter request waits for a LoRA slot: the adapter requests behind it wait too

        def make_room(seq: Sequence) -> bool:
            return self._make_room(seq, scheduled, share, preempted, donors)

        for seq in queue:
            if budget <= 0:
                break
            limit = budget if share is None or seq.group_id not in share.large else min(budget, share.room(seq))
            if limit <= 0:
                break
            if seq.waits_for_grammar:
                continue  # its structured-output grammar is still compiling
            lora = seq.lora_request
            if lora is not None and (
                lora_held or (lora not in active_loras and len(active_loras) >= self.config.max_loras)
            ):
                lora_held = True
                continue  # keeps its place in the queue
            use_cache = not seq.skips_prefix_cache  # prompt logprobs need the logits of every prompt position
            cached = bm.find_cached_prefix(seq) if use_cache else []
            if bm.enable_prefix_caching and use_cache and self._prefix_in_flight(seq, len(cached), in_flight):
                continue  # a running request is computing this prefix now: wait one step and hit it
            if len(self.running) >= self.config.max_num_seqs and not make_room(seq):
                break
            partial = bm.find_partial_block(seq, cached, donors) if donors and use_cache else None
            copied = partial[1] if partial else 0
            remaining = seq.num_tokens - len(cached) * bm.block_size - copied
            if remaining > limit and not self.config.enable_chunked_prefill:
                break
            n = min(remaining, limit)
            admitted = bm.allocate_slots(seq, copied + n, cached)
            while not admitted and make_room(seq):
                # the freed blocks may include the partial block's donor: compute those tokens instead
                partial, remaining, copied = None, remaining + copied, 0
                n = min(remaining, limit)
                admitted = bm.allocate_slots(seq, n, cached)
            if not admitted:
                break
            self._start_running(seq, n, cached, partial, kv_copies, scheduled, share)
            budget -= n
            if lora is not None:
                active_loras.add(lora)
            if bm.enable_prefix_caching:
                in_flight.update(bm.full_block_hashes(seq)[len(cached) :])
        return budget

    def _make_room(
        self,
        seq: Sequence,
        scheduled: list[ScheduledSequence],
        share: "FairShare | None",
        preempted: list[Sequence],
        donors: list[Sequence],
    ) -> bool:
        """Preempt a large request's sequence for regular ``seq`` (while bounded); False if none can go."""
        if share is None or seq.group_id in share.large:
            return False
        victim = self._victim(scheduled, share, large_only=True)
        if victim is None:
            return False
        self._preempt(victim)
        preempted.append(victim)
        if victim in donors:
            donors.remove(victim)
        return True

    def _start_running(
        self,
        seq: Sequence,
        n: int,
        cached: list,
        partial: tuple[int, int] | None,
        kv_copies: list[tuple[int, int, int]],
        scheduled: list[ScheduledSequence],
        share: "FairShare | None",
    ) -> None:
        """Move admitted ``seq`` from waiting to running with ``n`` tokens to compute this step.

        ``partial`` is ``(donor block, tokens)`` of a running request's K/V slots copied into the
        sequence's first uncached block (``kv_copies``) instead of recomputing them.
        """
        bm = self.block_manager
        copied = partial[1] if partial else 0
        if partial:
            kv_copies.append((partial[0], seq.block_table[len(cached)], copied))
            seq.num_computed_tokens += copied
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = len(cached) * bm.block_size + copied
        bm.record_prefix_query(seq, cached, copied)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.last_admitted_step = self._step
        self.running.append(seq)
        self._take(ScheduledSequence(seq, n), scheduled, share)

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
