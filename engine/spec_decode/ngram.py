"""``NgramProposer``: prompt-lookup decoding, proposals copied from the request's own tokens.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; the ``ngram`` method of vLLM):
the last ``n`` tokens of prompt + output are searched for earlier in the same sequence, longest
``n`` first (from ``max_n`` down to ``min_n``); at the latest earlier match, the ``k`` tokens
that followed it are the proposal (``propose_tokens`` says which match when several do). No model runs, so a miss costs
nothing but the search. It
pays where the output copies spans of the input (rewriting, summarising, editing code).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec_decode.proposer import Proposal


class NgramProposer:
    """Proposes up to ``k`` tokens by matching the sequence's suffix n-gram earlier in it.

    Args:
        min_n: shortest suffix to match (>= 1).
        max_n: longest suffix to match (>= ``min_n``).

    Raises:
        ValueError: ``min_n < 1`` or ``max_n < min_n``.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"ngram sizes min_n={min_n}, max_n={max_n}; need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list, ks: list[int]) -> list[Proposal]:
        """``propose_tokens`` for each sequence (``engine.sequence.Sequence``); one-hot proposals."""
        return [Proposal(self.propose_tokens(seq.token_ids, k)) for seq, k in zip(seqs, ks)]

    def free(self, request_id: str) -> None:
        """Nothing to forget: the proposer keeps no state per request."""

    def propose_tokens(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens for a sequence of ``token_ids`` (``[]`` on no match).

        The match must end before the last token (the suffix itself is not a match). The latest
        occurrence followed by ``k`` whole tokens wins (in a repeating span the latest overlapping
        occurrence would leave only one token to propose); without one, the earliest occurrence,
        whose continuation is the longest, and the proposal stops at the end of the sequence.
        """
        num_tokens = len(token_ids)
        if k < 1 or num_tokens < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n :]
            windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [L - n, n]: starts 0 .. L - n - 1
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= num_tokens]  # matches followed by k whole tokens
                start = int(full[-1] if full.size else hits[0]) + n
                return token_ids[start : start + k]
        return []
