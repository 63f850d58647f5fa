"""Token selection for a batch of requests: grammar masks, greedy, temperature, min-p, top-k, top-p, bias,
penalties, logprobs."""

from __future__ import annotations

import dataclasses

import torch

from engine import cpu_ops
from engine.sequence import Sequence


@dataclasses.dataclass
class SampleResult:
    """Chosen tokens and, for requests that asked, their log-probabilities."""

    token_ids: list[int]  # one per sampled sequence
    logprobs: list[dict[int, float] | None]  # sampled token + top-``logprobs`` alternatives


class Sampler:
    """Samples one token per sequence from ``[S, vocab]`` float32 logits.

    Per row, in vLLM's order: the structured-output grammar's mask (disallowed tokens -inf, so
    logprobs and the top alternatives are those of allowed tokens, as in vLLM); ``logit_bias``
    added; while a request has fewer than ``min_tokens`` new tokens, its end-of-sequence and
    ``stop_token_ids`` logits set to -inf;
    repetition penalty (Hugging Face / CTRL form over prompt and output: positive logits
    divided, negative multiplied); frequency and presence penalties over the output tokens
    (OpenAI's definition: ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``).
    Greedy rows then take the argmax. Other rows: temperature, min-p, top-k, top-p (nucleus,
    Holtzman et al. 2019), then a draw with the request's own ``torch.Generator`` so a given
    ``seed`` reproduces its tokens whatever else is in the batch.

    Args:
        eos_token_ids: the checkpoint's end-of-sequence ids (blocked under ``min_tokens``).
    """

    def __init__(self, eos_token_ids: set[int] | None = None) -> None:
        self.eos_token_ids = set(eos_token_ids or ())

    @staticmethod
    def is_plain_greedy(seqs: list[Sequence]) -> bool:
        """Every request takes the argmax of unchanged logits without logprobs (any logits dtype will do)."""
        return Sampler.is_masked_greedy(seqs) and all(s.params.structured_outputs is None for s in seqs)

    @staticmethod
    def is_masked_greedy(seqs: list[Sequence]) -> bool:
        """Every request takes the argmax without logprobs, and grammar masks (``apply_grammars``) are all
        that change the logits: the masks can go on the model-dtype logits before ``Model.compute_logits``
        refines them, and the pick stays an argmax."""
        return all(s.params.greedy and not s.params.adjusts_logits and s.params.logprobs is None for s in seqs)

    @staticmethod
    def apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set the entries of ``logits [S, vocab]`` that row ``i``'s grammar disallows to -inf, in place."""
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:
            grammars = [seqs[i].grammar for i in constrained]
            grammars[0].compiler.mask_logits(logits, grammars, constrained)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masked: bool = False) -> SampleResult:
        """Pick each row's token. ``masked``: ``logits`` already hold the grammar masks and the rows are
        masked greedy (``is_masked_greedy``), so each row takes its argmax."""
        if masked or self.is_plain_greedy(seqs):
            # one pass over each row in its own dtype (engine.cpu_ops.argmax: ~5x torch.max on [64, 49152] bf16)
            return SampleResult(cpu_ops.argmax(logits).tolist(), [None] * len(seqs))
        logits = self.process_logits(logits, seqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        # every greedy row's argmax in one pass (one torch call per row cost ~0.1 ms each)
        picked = dict(zip(greedy, cpu_ops.argmax(logits[greedy]).tolist())) if greedy else {}
        tokens: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            row = logits[i]
            if p.greedy:
                tokens.append(picked[i])
            else:
                probs = self._probs(row, p.temperature, p.top_k, p.top_p, p.min_p)
                tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
        return SampleResult(tokens, self._logprobs(raw_logprobs, tokens, seqs))

    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``[S, vocab]`` logits -> a copy with grammar masks, bias, ``min_tokens`` blocking and penalties applied."""
        if not any(s.params.changes_logits for s in seqs):
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        self.apply_grammars(logits, seqs)
        for i, seq in enumerate(seqs):
            p = seq.params
            if not p.changes_logits:
                continue
            row = logits[i]  # a view: the updates below write into ``logits``
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
                row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
            if seq.num_output_tokens < p.min_tokens:
                blocked = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                blocked = sorted(t for t in blocked if t < vocab)
                if blocked:
                    row[torch.tensor(blocked, dtype=torch.long, device=row.device)] = float("-inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
                ids, counts = torch.unique(torch.tensor(seq.output_token_ids, dtype=torch.long), return_counts=True)
                ids = ids.to(row.device)
                row[ids] -= p.frequency_penalty * counts.to(row.device, row.dtype) + p.presence_penalty
        return logits

    @staticmethod
    def _probs(
        row: torch.Tensor, temperature: float, top_k: int | None, top_p: float, min_p: float = 0.0
    ) -> torch.Tensor:
        """``[vocab]`` logits -> ``[vocab]`` probabilities after temperature, min-p, top-k and top-p."""
        row = row / temperature
        if min_p > 0.0:
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < min_p * probs.max(), float("-inf"))
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
