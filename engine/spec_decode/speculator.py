"""``Speculator``: the engine's side of speculative decoding, one object per engine.

Per step: ``propose`` (before scheduling) gives each decoding request up to ``k`` proposed
tokens (``seq.spec_token_ids``), unless the batch has ``speculative_disable_by_batch_size``
requests or more (requests whose sampling options verification does not model, see
``verifiable``, get no proposals); the scheduler then runs each such request with ``1 + m`` tokens (its last
token and the ``m`` proposals that fit the budget) in the same forward pass as every other
request; ``sample`` turns the step's logits into the new tokens of every sampled request:
one token for a plain row, the accepted proposals plus one for a speculative one
(``rejection.verify_request``). The scheduler then counts only the accepted positions as
computed and frees blocks that hold only rejected slots.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.scheduler import speculative_room
from engine.spec_decode.draft import DraftProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.rejection import verify_request

logger = logging.getLogger(__name__)


def verifiable(seq) -> bool:
    """Whether ``rejection.verify_request`` reproduces the sampler's distribution for ``seq``.

    It applies the repetition penalty, temperature, top-k and top-p per position; a request
    with min-p, ``logit_bias``, frequency/presence penalties, or still under ``min_tokens``
    decodes one token per step instead (its tokens stay exactly the sampler's).
    """
    p = seq.params
    return not (
        p.min_p > 0.0
        or p.logit_bias
        or p.frequency_penalty
        or p.presence_penalty
        or seq.num_output_tokens < p.min_tokens
    )


class Speculator:
    """Proposes, verifies and counts for an engine.

    Args:
        config: the engine's resolved configuration (``speculative_method`` set).
        proposer: the source of proposals.

    Attributes:
        num_drafts / num_draft_tokens / num_accepted_tokens: request-steps that verified
            proposals, proposed tokens verified, and of those accepted (``EngineStats``).
    """

    def __init__(self, config: EngineConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @classmethod
    def build(cls, config: EngineConfig, target_dir: Path, tokenizer, vocab_size: int) -> "Speculator | None":
        """The speculator of ``config`` (``None`` when ``speculative_method`` is ``None``).

        Raises:
            ValueError: a draft with another tokenizer, too short a context, or none found.
        """
        if config.speculative_method is None:
            return None
        if config.speculative_method == "ngram":
            return cls(config, NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max))
        draft = DraftProposer.for_target(
            config, target_dir, tokenizer, vocab_size, [Path.cwd() / "runs", target_dir.parent]
        )
        return cls(config, draft)

    # ---------------------------------------------------------------- before scheduling

    def propose(self, running: list) -> None:
        """Set ``spec_token_ids`` (and ``spec_probs``) of the decoding requests among ``running``.

        A proposer that raises only costs this step its proposals (logged); decoding goes on.
        """
        limit = self.config.speculative_disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return
        seqs, ks = [], []
        for seq in running:
            k = min(self.config.num_speculative_tokens, speculative_room(seq, self.config.max_model_len))
            if seq.num_uncomputed_tokens == 1 and k > 0 and verifiable(seq):
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        try:
            proposals = self.proposer.propose(seqs, ks)
        except Exception:  # noqa: BLE001 - speculation is optional; the step decodes without it
            logger.exception("speculative proposer failed; this step decodes without proposals")
            for seq in seqs:
                self.proposer.free(seq.request_id)
            return
        for seq, proposal in zip(seqs, proposals):
            seq.spec_token_ids, seq.spec_probs = proposal.token_ids, proposal.probs

    # ---------------------------------------------------------------- after the forward pass

    def sample(self, sampler, logits: torch.Tensor, items: list) -> tuple[list[list[int]], list[list]]:
        """New tokens (and logprobs entries) of every sampled item of a step.

        Args:
            sampler: the engine's ``Sampler`` (plain rows, batched).
            logits: ``[R, vocab]`` float32, ``item.num_sampled_rows`` consecutive rows per item.
            items: the step's ``ScheduledSequence``s that sample, in ``out.scheduled`` order.

        Returns:
            Per item, its new token ids and their logprobs entries (``None`` when not asked).
        """
        if not any(
            item.spec_token_ids for item in items
        ):  # nothing proposed (e.g. switched off): the plain path, no copy
            result = sampler(logits, [item.seq for item in items])
            return [[t] for t in result.token_ids], [[entry] for entry in result.logprobs]
        starts, row = [], 0
        for item in items:
            starts.append(row)
            row += item.num_sampled_rows
        plain = [i for i, item in enumerate(items) if not item.spec_token_ids]
        tokens: list[list[int]] = [[] for _ in items]
        logprobs: list[list] = [[] for _ in items]
        if plain:
            rows = torch.tensor([starts[i] for i in plain], dtype=torch.long, device=logits.device)
            result = sampler(logits.index_select(0, rows), [items[i].seq for i in plain])
            for i, token, entry in zip(plain, result.token_ids, result.logprobs):
                tokens[i], logprobs[i] = [token], [entry]
        for i, item in enumerate(items):
            m = len(item.spec_token_ids)
            if not m:
                continue
            seq = item.seq
            q = None if seq.spec_probs is None else seq.spec_probs[:m]
            verified, entries = verify_request(logits[starts[i] : starts[i] + m + 1], seq, item.spec_token_ids, q)
            tokens[i], logprobs[i] = verified.token_ids, entries
            self.num_drafts += 1
            self.num_draft_tokens += m
            self.num_accepted_tokens += verified.num_accepted
        return tokens, logprobs

    def free(self, request_id: str) -> None:
        """Forget a finished request (the draft's blocks are freed)."""
        self.proposer.free(request_id)
