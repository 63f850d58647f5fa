"""What every proposer returns, and the interface the engine drives them through."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch


@dataclasses.dataclass
class Proposal:
    """Proposed tokens of one request.

    Attributes:
        token_ids: the ``m`` proposed tokens (``m <= k``; may be empty).
        probs: ``[m, vocab]`` float32 distributions they were drawn from (a sampling draft), or
            ``None`` (greedy request, or a deterministic proposer: one-hot ``q``).
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """A source of proposals (``NgramProposer``, ``DraftProposer``).

    Attributes:
        stops_itself: the proposer ends a request's run on its own (a draft's confidence stop), so the
            ``k`` it is given is a cap, not the run's length (``engine.spec_decode.speculator``).
    """

    stops_itself: bool

    def propose(self, seqs: list, ks: list[int]) -> list[Proposal]:
        """Up to ``ks[i]`` tokens to follow each ``seqs[i]`` (an ``engine.sequence.Sequence``)."""

    def free(self, request_id: str) -> None:
        """Forget a request (finished, aborted or failed)."""
