"""``NgramProposer``: prompt-lookup decoding, proposals copied from the request's own tokens or a corpus.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; the ``ngram`` method of vLLM):
the last ``n`` tokens of prompt + output are searched for earlier in the same sequence, longest
``n`` first (from ``max_n`` down to ``min_n``); at the latest earlier match, the ``k`` tokens
that followed it are the proposal (``propose_tokens`` says which match when several do). No model runs, so a miss costs
nothing but the search. It
pays where the output copies spans of the input (rewriting, summarising, editing code).

A chat reply copies little of its prompt, but a small model's replies repeat the same phrases
from one conversation to the next ("I'm here to help with ..."). An ``NgramCorpus`` (retrieval
of continuations from a datastore, as in He et al. 2023, "REST: Retrieval-Based Speculative
Decoding") holds the most frequent next token of every 2..``max_n``-gram of a corpus of the
model's own replies, e.g. the teacher replies ``lmforge distill`` generates
(``teacher_generated.jsonl``). With one, a sequence's own matches of 2 tokens or more come first,
then the corpus, then its own 1-token matches.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.errors import UsageError
from engine.records import encode_record, read_records
from engine.spec_decode.proposer import Proposal

#: Shortest n-gram an ``NgramCorpus`` matches: a 1-token match in someone else's reply is mostly wrong.
CORPUS_MIN_N = 2
#: Tokens of one corpus record read (longer records are cut).
CORPUS_MAX_RECORD_TOKENS = 4096


class NgramCorpus:
    """The most frequent next token after every ``CORPUS_MIN_N``..``max_n``-gram of some token sequences.

    Args:
        sequences: token id lists.
        max_n: longest n-gram kept (>= ``CORPUS_MIN_N``).

    Ties go to the continuation seen first.
    """

    def __init__(self, sequences: list[list[int]], max_n: int = 4) -> None:
        self.max_n = max(max_n, CORPUS_MIN_N)
        counts: dict[tuple[int, ...], collections.Counter] = {}
        for seq in sequences:
            for n in range(CORPUS_MIN_N, self.max_n + 1):
                for i in range(len(seq) - n):
                    counts.setdefault(tuple(seq[i : i + n]), collections.Counter())[seq[i + n]] += 1
        self.next_token = {key: c.most_common(1)[0][0] for key, c in counts.items()}

    def __len__(self) -> int:
        return len(self.next_token)

    @classmethod
    def from_jsonl(cls, path: str | Path, tokenizer, max_n: int = 4) -> "NgramCorpus":
        """The corpus of a JSONL file of ``lmforge data`` records (``{"messages": [...]}`` rendered with the
        tokenizer's chat template, or ``{"text": ...}``).

        Raises:
            UsageError: the file is missing, a line is not a record (names file:line), or it has no records.
        """
        if not Path(path).is_file():
            raise UsageError(
                f"speculative_ngram_corpus={str(path)!r}: file not found; give a JSONL of chat records, e.g. the "
                "teacher_generated.jsonl of an `lmforge distill` run"
            )
        records = read_records(path, UsageError)
        return cls([encode_record(tokenizer, r, max_length=CORPUS_MAX_RECORD_TOKENS)[0] for r in records], max_n)

    def propose_tokens(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens, each the corpus's most frequent continuation of the longest n-gram that ends
        the sequence (proposed tokens included); ``[]`` when its last ``CORPUS_MIN_N`` tokens are unknown."""
        context = list(token_ids[-self.max_n :])
        proposal: list[int] = []
        while len(proposal) < k:
            for n in range(min(self.max_n, len(context)), CORPUS_MIN_N - 1, -1):
                token = self.next_token.get(tuple(context[-n:]))
                if token is not None:
                    break
            else:
                break
            proposal.append(token)
            context = context[1:] + [token] if len(context) == self.max_n else context + [token]
        return proposal


class NgramProposer:
    """Proposes up to ``k`` tokens by matching the sequence's suffix n-gram earlier in it (or in a corpus).

    Args:
        min_n: shortest suffix to match (>= 1).
        max_n: longest suffix to match (>= ``min_n``).
        corpus: an ``NgramCorpus`` tried when the sequence has no match of ``CORPUS_MIN_N`` tokens or more.

    Raises:
        ValueError: ``min_n < 1`` or ``max_n < min_n``.
    """

    stops_itself = False  # a match proposes the k tokens that followed it

    def __init__(self, min_n: int = 1, max_n: int = 4, corpus: NgramCorpus | None = None) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"ngram sizes min_n={min_n}, max_n={max_n}; need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.corpus = corpus

    def propose(self, seqs: list, ks: list[int]) -> list[Proposal]:
        """``propose_tokens`` for each sequence (``engine.sequence.Sequence``); one-hot proposals."""
        return [Proposal(self.propose_tokens(seq.token_ids, k)) for seq, k in zip(seqs, ks)]

    def free(self, request_id: str) -> None:
        """Nothing to forget: the proposer keeps no state per request."""

    def propose_tokens(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens for a sequence of ``token_ids`` (``[]`` on no match).

        Without a corpus: ``lookup(token_ids, k, min_n)``. With one: the sequence's own matches of
        ``CORPUS_MIN_N`` tokens or more, else the corpus, else (``min_n`` = 1) its own 1-token matches.
        """
        if self.corpus is None or self.min_n >= CORPUS_MIN_N:
            own = self.lookup(token_ids, k, self.min_n)
            return own if own or self.corpus is None else self.corpus.propose_tokens(token_ids, k)
        return (
            self.lookup(token_ids, k, CORPUS_MIN_N)
            or self.corpus.propose_tokens(token_ids, k)
            or self.lookup(token_ids, k, self.min_n, max_n=CORPUS_MIN_N - 1)
        )

    def lookup(self, token_ids: list[int], k: int, min_n: int, max_n: int | None = None) -> list[int]:
        """Prompt lookup with suffixes of ``max_n`` (default ``self.max_n``) down to ``min_n`` tokens.

        The match must end before the last token (the suffix itself is not a match). The latest
        occurrence followed by ``k`` whole tokens wins (in a repeating span the latest overlapping
        occurrence would leave only one token to propose); without one, the earliest occurrence,
        whose continuation is the longest, and the proposal stops at the end of the sequence.
        """
        num_tokens = len(token_ids)
        if k < 1 or num_tokens < min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n if max_n is None else max_n, num_tokens - 1), min_n - 1, -1):
            suffix = tokens[num_tokens - n :]
            windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [L - n, n]: starts 0 .. L - n - 1
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= num_tokens]  # matches followed by k whole tokens
                start = int(full[-1] if full.size else hits[0]) + n
                return token_ids[start : start + k]
        return []
