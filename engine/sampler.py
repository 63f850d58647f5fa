"""Token selection for a batch of requests: greedy, temperature, top-k, top-p, penalties, logprobs."""

from __future__ import annotations

import dataclasses

import torch

from engine.sequence import Sequence


@dataclasses.dataclass
class SampleResult:
    """Chosen tokens and, for requests that asked, their log-probabilities."""

    token_ids: list[int]  # one per sampled sequence
    logprobs: list[dict[int, float] | None]  # sampled token + top-``logprobs`` alternatives


class Sampler:
    """Samples one token per sequence from ``[S, vocab]`` float32 logits.

    Greedy rows take the argmax. Other rows: repetition penalty (Hugging Face / CTRL form:
    positive logits divided, negative multiplied), temperature, top-k, top-p (nucleus, Holtzman
    et al. 2019), then a draw with the request's own ``torch.Generator`` so a given ``seed``
    reproduces its tokens whatever else is in the batch.
    """

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        if all(s.params.greedy and s.params.repetition_penalty == 1.0 and s.params.logprobs is None for s in seqs):
            return SampleResult(logits.argmax(dim=-1).tolist(), [None] * len(seqs))
        logits = self._apply_penalties(logits, seqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        tokens: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            row = logits[i]
            if p.greedy:
                tokens.append(int(row.argmax()))
            else:
                probs = self._probs(row, p.temperature, p.top_k, p.top_p)
                tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
        return SampleResult(tokens, self._logprobs(raw_logprobs, tokens, seqs))

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        if all(s.params.repetition_penalty == 1.0 for s in seqs):
            return logits
        logits = logits.clone()
        for i, seq in enumerate(seqs):
            penalty = seq.params.repetition_penalty
            if penalty == 1.0:
                continue
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / penalty, values * penalty)
        return logits

    @staticmethod
    def _probs(row: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
        """``[vocab]`` logits -> ``[vocab]`` probabilities after temperature, top-k and top-p."""
        row = row / temperature
        if top_k is not None and top_k < row.shape[0]:
            kth = torch.topk(row, top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(0)
            drop = cumulative - sorted_probs > top_p  # keep the smallest prefix reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs = probs / probs.sum()
        return probs

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], seqs: list[Sequence]) -> list[dict[int, float] | None]:
        results: list[dict[int, float] | None] = []
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            if raw is None or k is None:
                results.append(None)
                continue
            entry = {tokens[i]: float(raw[i, tokens[i]])}
            if k > 0:
                values, ids = torch.topk(raw[i], k)
                entry.update({int(t): float(v) for t, v in zip(ids, values)})
            results.append(entry)
        return results
