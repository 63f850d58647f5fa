"""Verification of proposed tokens: exact argmax match (greedy) or rejection sampling.

Speculative sampling (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via
Speculative Decoding", algorithm 1; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", algorithm 2). Given ``m`` proposed tokens ``x_1..x_m``
drawn from draft distributions ``q_1..q_m`` and the target's distributions ``p_1..p_{m+1}`` at
the same positions (one forward pass): accept ``x_j`` with probability ``min(1, p_j(x_j) /
q_j(x_j))``; at the first rejection draw the replacement from ``norm(max(0, p_j - q_j))`` and
stop; if all ``m`` are accepted draw a bonus token from ``p_{m+1}``. Every emitted token is then
distributed exactly as if drawn from the target one at a time.

A proposer without a distribution (``ngram``) drew ``x_j`` deterministically: ``q_j`` is then
one-hot at ``x_j``, so ``x_j`` is accepted with probability ``p_j(x_j)`` and the replacement is
drawn from ``p_j`` with ``x_j`` removed.

Under greedy decoding ``p_j`` is one-hot at the target's argmax: a proposal is accepted iff it
equals the argmax, and the first mismatch is replaced by the argmax; the output is exactly the
target's greedy output.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.sampler import Sampler


@dataclasses.dataclass
class VerifyResult:
    """Outcome of verifying one request's proposals.

    Attributes:
        token_ids: tokens to append, ``num_accepted`` accepted proposals then one more (the
            replacement of the first rejected proposal, or the bonus token when all passed).
        num_accepted: proposals accepted (0 .. m).
    """

    token_ids: list[int]
    num_accepted: int


def verify_greedy(target_argmax: list[int], proposal: list[int]) -> VerifyResult:
    """Exact-match verification.

    Args:
        target_argmax: the target's argmax at the ``m + 1`` verified positions.
        proposal: the ``m`` proposed tokens.
    """
    tokens: list[int] = []
    for drafted, best in zip(proposal, target_argmax):
        tokens.append(best)
        if drafted != best:
            return VerifyResult(tokens, len(tokens) - 1)
    tokens.append(target_argmax[len(proposal)])
    return VerifyResult(tokens, len(proposal))


def rejection_sample(
    target_probs: torch.Tensor,
    proposal: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Speculative sampling of one request.

    Args:
        target_probs: ``[m + 1, vocab]`` float32 target probabilities (after temperature,
            top-k, top-p, penalties) at the positions of the last accepted token and the ``m``
            proposals.
        proposal: the ``m`` proposed token ids.
        draft_probs: ``[m, vocab]`` distributions the proposals were drawn from, or ``None``
            for a deterministic proposer (one-hot ``q``).
        generator: the request's generator (uniform draws and the replacement / bonus draw).

    Returns:
        The tokens to append and how many proposals were accepted.
    """
    m = len(proposal)
    if target_probs.shape[0] != m + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows for {m} proposals; expected m + 1 = {m + 1}")
    uniforms = torch.rand(m, generator=generator, device=target_probs.device).tolist() if m else []
    tokens: list[int] = []
    for j, x in enumerate(proposal):
        p = target_probs[j]
        p_x = float(p[x])
        q_x = 1.0 if draft_probs is None else float(draft_probs[j, x])
        if uniforms[j] * q_x < p_x:  # u < p(x) / q(x), without dividing by a zero q(x)
            tokens.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere only by rounding: p itself is the answer
            residual = p
        tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
        return VerifyResult(tokens, j)
    tokens.append(int(torch.multinomial(target_probs[m], 1, generator=generator)))
    return VerifyResult(tokens, m)


def verify_request(
    logits: torch.Tensor, seq, proposal: list[int], draft_probs: torch.Tensor | None
) -> tuple[VerifyResult, list[dict[int, float] | None]]:
    """Verify one request's proposals from the target's logits; also the logprobs it asked for.

    The target distribution at each position is what ``engine.sampler.Sampler`` would sample
    from there: repetition penalty over the tokens before that position (proposals included),
    then temperature, top-k, top-p.

    Args:
        logits: ``[m + 1, vocab]`` target logits at the last accepted token and the ``m`` proposals
            (float32; the model dtype for a plain greedy request).
        seq: the ``Sequence`` (its params, tokens and generator).
        proposal: the ``m`` proposed tokens.
        draft_probs: ``[m, vocab]`` draft distributions, or ``None`` (one-hot proposals).

    Returns:
        The verification result and, per emitted token, its logprobs entry (``None`` entries
        when the request did not ask for logprobs).
    """
    p = seq.params
    if p.repetition_penalty != 1.0:
        logits = logits.clone()
        seen = set(seq.token_ids)
        for j in range(logits.shape[0]):
            if j:
                seen.add(proposal[j - 1])
            ids = torch.tensor(sorted(seen), dtype=torch.long, device=logits.device)
            values = logits[j, ids]
            logits[j, ids] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if p.greedy:
        result = verify_greedy(logits.argmax(dim=-1).tolist(), proposal)
    else:
        probs = torch.stack([Sampler._probs(row, p.temperature, p.top_k, p.top_p) for row in logits])  # [m + 1, vocab]
        result = rejection_sample(probs, proposal, draft_probs, seq.generator)
    if p.logprobs is None:
        return result, [None] * len(result.token_ids)
    raw = torch.log_softmax(logits, dim=-1)
    entries = []
    for j, token in enumerate(result.token_ids):
        entry = {token: float(raw[j, token])}
        if p.logprobs > 0:
            values, ids = torch.topk(raw[j], p.logprobs)
            entry.update({int(t): float(v) for t, v in zip(ids, values)})
        entries.append(entry)
    return result, entries
