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

With ``speculative_adaptive`` (default) each request's k is chosen per step from a cost model
(``choose_k``): its per-token acceptance so far (``AcceptanceTracker``; a new request starts
from the engine-wide acceptance) against the measured cost of speculating (a draft forward per
drafted request and position, one more verified position per proposed token, and a fixed cost
per verifying request, relative to a plain decode step, ``CostModel``). The step's other
requests count: extra step time slows every request of the batch, so a request of a batch of B
proposes only where the tokens it gains outweigh B times the time it adds (the dynamic
speculation length of vLLM and SGLang, on measured costs). A request whose proposals do not pay
gets none (k = 0) and is probed with one token after ``PROBE_EVERY`` steps (twice as long after
each rejected probe), so where proposals are not accepted speculation costs little more than
the rare probe.

A proposer that ends its own runs (``stops_itself``: a draft with a confidence threshold stops
after a token it is unsure of) is not asked for an i.i.d. k: the positions it drafts past the
first are the confident ones, accepted more often than its average. Such a request proposes up
to ``num_speculative_tokens`` or nothing, by what its past rounds gained (accepted tokens) and
cost (positions drafted) per round (``pays_per_round``).
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from engine.config import EngineConfig
from engine.scheduler import speculative_room
from engine.spec_decode.draft import DraftProposer
from engine.spec_decode.ngram import NgramCorpus, NgramProposer
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.rejection import verify_request

logger = logging.getLogger(__name__)


def verifiable(seq) -> bool:
    """Whether ``rejection.verify_request`` reproduces the sampler's distribution for ``seq``.

    It applies the repetition penalty, temperature, top-k and top-p per position; a request
    with min-p, ``logit_bias``, frequency/presence penalties, a structured-output grammar (its
    mask is not applied to proposals), or still under ``min_tokens`` decodes one token per step
    instead (its tokens stay exactly the sampler's).
    """
    p = seq.params
    return not (
        p.structured_outputs is not None
        or p.min_p > 0.0
        or p.logit_bias
        or p.frequency_penalty
        or p.presence_penalty
        or seq.num_output_tokens < p.min_tokens
    )


#: Pseudo-counts (accepted, rejected) of a request before its first verification: alpha = 2/3 while
#: the engine has verified nothing, else the engine-wide acceptance with this weight (``Speculator``).
ACCEPTANCE_PRIOR = (2.0, 1.0)
#: Weight of the past in the engine-wide acceptance counts, per verification.
ENGINE_ACCEPTANCE_DECAY = 0.98
#: Weight of the past in a request's acceptance counts, per verification (recent steps count more).
ACCEPTANCE_DECAY = 0.9
#: Pseudo-counts (rounds, accepted tokens, proposed tokens) of a request's verified rounds before its first one,
#: while the engine has verified nothing (else the engine-wide rounds scaled to ``ROUND_PRIOR[0]`` rounds).
ROUND_PRIOR = (2.0, 1.0, 2.0)
#: Weight of the past in a request's per-round counts (``pays_per_round``), per verification. Simulated on the
#: teacher-forced agreement of the distilled draft with 12 chat replies (docs/speculative-decoding.md): a shorter
#: memory (0.9) switched a request off after a few rejections in a row and left it plain for the probe wait.
ROUND_DECAY = 0.95
#: Steps a request with k = 0 waits before it proposes one token again (to see if it pays now);
#: the wait doubles after each probe that is rejected, up to ``PROBE_EVERY_MAX``.
PROBE_EVERY = 8
PROBE_EVERY_MAX = 64
#: Verifying one more position, as a fraction of a plain decode step, until ``CostModel`` has measured it.
VERIFY_PRIOR = 0.05
#: ``CostModel`` refits the step time once this many more decode steps were observed (a fit with its outlier
#: pass takes ~0.4 ms on one thread, ~2% of a bf16 SmolLM2 step; the window holds ``COST_WINDOW`` steps).
REFIT_EVERY = 8
#: A draft position, as a fraction of a plain decode step, until ``CostModel`` has timed the draft.
DRAFT_PROPOSE_PRIOR = 0.25
#: Weight of the past in the proposer's timing average (``CostModel``).
COST_DECAY = 0.9
#: Decode steps ``CostModel`` fits the step time on.
COST_WINDOW = 64
#: Every this many steps the speculator proposes nothing (plain steps for ``CostModel``'s fit).
CALIBRATE_EVERY = 16
#: ``CostModel.fit`` drops steps this many median absolute residuals (and at least ``OUTLIER_FLOOR`` of the
#: median step time) above its first fit, then fits again.
OUTLIER_MADS = 5.0
OUTLIER_FLOOR = 0.1
#: Tokens a draft catches up on in a steady proposal round: the target's correction or bonus token, and
#: the last proposal when all were accepted. A round that caught up on more (a prompt) is not timed.
STEADY_CATCH_UP = 2


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits with ``k`` proposals of per-token acceptance ``alpha``: ``sum_{i<=k} alpha^i``.

    Each proposal is accepted with probability ``alpha`` if all before it were (Leviathan et al.
    2023, eq. 1, with i.i.d. acceptance); one more token comes from the target.
    """
    return sum(alpha**i for i in range(k + 1))


def choose_k(alpha: float, cost_per_token: float, k_max: int, fixed_cost: float = 0.0, num_others: int = 0) -> int:
    """The k in ``0..k_max`` with the most tokens of the whole step per unit of step time.

    A plain step of ``num_others + 1`` requests emits one token each; proposing ``k`` adds
    ``expected_tokens(alpha, k) - 1`` tokens for this request but slows the whole step, so the
    rate is ``(num_others + expected_tokens) / (1 + fixed_cost + cost_per_token * k)``.

    Args:
        alpha: per-token acceptance rate of the request (0..1).
        cost_per_token: time one proposed token adds to a step, as a fraction of a plain decode step.
        k_max: ``num_speculative_tokens`` (or less where the request has no room).
        fixed_cost: time proposing at all adds (whatever k), as a fraction of a plain decode step.
        num_others: the step's other requests (each emits a token whatever this one does).
    """
    best_k, best = 0, 1.0 + num_others
    for k in range(1, k_max + 1):
        rate = (num_others + expected_tokens(alpha, k)) / (1.0 + fixed_cost + cost_per_token * k)
        if rate > best * 1.0001:
            best_k, best = k, rate
    return best_k


def pays_per_round(
    gain: float, positions: float, cost_per_token: float, fixed_cost: float = 0.0, num_others: int = 0
) -> bool:
    """Whether a round that gains ``gain`` accepted tokens for ``positions`` proposed ones emits more tokens
    per unit of step time than a plain step: ``(num_others + 1 + gain) / (1 + fixed_cost + cost_per_token *
    positions) > num_others + 1`` (the step's other requests as in ``choose_k``)."""
    plain = 1.0 + num_others
    return (plain + gain) / (1.0 + fixed_cost + cost_per_token * positions) > plain * 1.0001


class AcceptanceTracker:
    """Per-token acceptance of one request: decayed counts of accepted and rejected proposals.

    A verification of ``m`` proposals with ``a`` accepted tested ``a`` acceptances and, when
    ``a < m``, one rejection (positions after a rejection were not tested), so
    ``accepted / (accepted + rejected)`` estimates the per-token rate of ``expected_tokens``.
    Per verified round it also keeps decayed sums of rounds, accepted and proposed tokens
    (``gain_per_round``, ``proposed_per_round``) for a proposer that ends its own runs.
    """

    def __init__(
        self, prior: tuple[float, float] = ACCEPTANCE_PRIOR, round_prior: tuple[float, float, float] = ROUND_PRIOR
    ) -> None:
        self.accepted, self.rejected = prior
        self.rounds, self.round_accepted, self.round_proposed = round_prior
        self.idle_steps = 0
        self.probe_every = PROBE_EVERY
        self.probing = False

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def gain_per_round(self) -> float:
        """Accepted tokens per verified round (recent rounds weigh more)."""
        return self.round_accepted / self.rounds

    @property
    def proposed_per_round(self) -> float:
        """Proposed tokens per verified round."""
        return self.round_proposed / self.rounds

    def update(self, num_proposed: int, num_accepted: int) -> None:
        self.idle_steps = 0  # steps without proposals are counted from the last verification
        if self.probing:
            self.probing = False
            self.probe_every = PROBE_EVERY if num_accepted else min(2 * self.probe_every, PROBE_EVERY_MAX)
        self.accepted = ACCEPTANCE_DECAY * self.accepted + num_accepted
        self.rejected = ACCEPTANCE_DECAY * self.rejected + (1.0 if num_accepted < num_proposed else 0.0)
        self.rounds = ROUND_DECAY * self.rounds + 1.0
        self.round_accepted = ROUND_DECAY * self.round_accepted + num_accepted
        self.round_proposed = ROUND_DECAY * self.round_proposed + num_proposed


def _lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``(a, b, c)`` of ``y ~ x @ (a, b, c)`` (columns 1, tokens, verifies). Where tokens and verifying do
    not vary apart (one request alone, one proposal per step: always 1 + 1 tokens when verifying) the
    minimum-norm solution splits the intercept between them (a step that verifying makes 5% slower
    reads as b = 35% of a plain step and c < 0), so there the step is fitted as ``a + b * tokens``
    (``c = 0``: the extra time counted per token, the dearer reading for k > 1)."""
    coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    if rank == x.shape[1]:
        return coef
    ab = np.linalg.lstsq(x[:, :2], y, rcond=None)[0]
    return np.array([ab[0], ab[1], 0.0])


class StepCosts(NamedTuple):
    """What speculating adds to a step of plain decodes, as fractions of that step's time."""

    fixed: float  # verifying at all (the multi-token attention path)
    verify: float  # one more verified position
    propose: float  # one proposed position of one request (a draft forward; ~0 for ngram)

    @property
    def per_token(self) -> float:
        """A proposed token, proposing and verifying it."""
        return self.verify + self.propose


class CostModel:
    """What speculating costs, relative to a plain decode step, from measured times.

    * verification: the forward time of the last ``COST_WINDOW`` decode steps fitted (least
      squares) as ``a + b * tokens + c * [any request verifies]``: one more verified position
      costs ``b``, a step that verifies at all ``c`` (the multi-token attention path runs besides
      the decode one; on a 2-core AVX-512 CPU, SmolLM2 bf16 at 1 thread, +3% of a one-request
      step and +7% of a four-request one, about the same for one verifying request as for four).
      Every ``CALIBRATE_EVERY``-th step proposes nothing, so plain steps are always in the fit;
      the fit is redone after every ``REFIT_EVERY`` new steps, not per step.
    * proposing: seconds of the proposer per proposing request and position (a draft forward
      shared by the requests drafted together; ~0 for ngram).

    ``costs(batch)`` gives ``StepCosts`` as fractions of ``a + b * batch``, a plain step;
    ``VERIFY_PRIOR`` per verified token and ``propose_prior`` per proposed one (no fixed part)
    until the fit and the proposer have been measured.
    """

    def __init__(self, propose_prior: float) -> None:
        self.propose_prior = propose_prior
        self.steps: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=COST_WINDOW)
        self.propose_s: float | None = None
        self._fit: tuple[float, float, float] | None = None
        self._steps_since_fit = 0

    def observe_step(self, num_tokens: int, num_speculating: int, seconds: float) -> None:
        """A decode step's forward pass: ``num_tokens`` tokens (proposals included), of which
        ``num_speculating`` requests verified proposals, in ``seconds``."""
        self.steps.append((num_tokens, num_speculating, seconds))
        self._steps_since_fit += 1

    def observe_propose(self, num_positions: int, num_seqs: int, seconds: float) -> None:
        """The proposer took ``seconds`` for ``num_positions`` sequential positions of ``num_seqs`` requests."""
        if num_positions > 0 and num_seqs > 0:
            per = seconds / (num_positions * num_seqs)
            self.propose_s = per if self.propose_s is None else COST_DECAY * self.propose_s + (1 - COST_DECAY) * per

    def fit(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` of the step time, or ``None`` without plain and speculative steps among the last ones."""
        if not self.steps or not any(s == 0 for _, s, _ in self.steps) or all(s == 0 for _, s, _ in self.steps):
            return None
        x = np.array([(1.0, n, 1.0 if s else 0.0) for n, s, _ in self.steps])
        y = np.array([t for _, _, t in self.steps])
        coef = _lstsq(x, y)
        # A step the process spent partly off the CPU (preempted, a page fault storm) is far above the
        # fit; one such step among a few speculative ones made b several times a whole step and switched
        # speculation off until it left the window. Refit without steps far above the first fit.
        resid = y - x @ coef
        keep = resid <= max(OUTLIER_MADS * float(np.median(np.abs(resid))), OUTLIER_FLOOR * float(np.median(y)))
        if keep.sum() < len(y) and (x[keep, 2] == 0).any() and (x[keep, 2] == 1).any():
            x, y = x[keep], y[keep]
            coef = _lstsq(x, y)
        mean_n, mean_s, mean_t = x[:, 1].mean(), x[:, 2].mean(), y.mean()
        b, c = max(float(coef[1]), 0.0), max(float(coef[2]), 0.0)  # costs are never negative
        a = max(mean_t - b * mean_n - c * mean_s, 0.05 * mean_t)
        return a, b, c

    def recent_fit(self) -> tuple[float, float, float] | None:
        """``fit()`` as of at most ``REFIT_EVERY - 1`` steps ago (refitted while there is none)."""
        if self._fit is None or self._steps_since_fit >= REFIT_EVERY:
            self._fit, self._steps_since_fit = self.fit(), 0
        return self._fit

    def costs(self, batch: int) -> StepCosts:
        """What verifying at all, each verified and each proposed token add to a step of ``batch`` plain
        decodes, as fractions of that step."""
        fit = self.recent_fit()
        if fit is None or self.propose_s is None:
            return StepCosts(0.0, VERIFY_PRIOR, self.propose_prior)
        a, b, c = fit
        plain = a + b * batch
        return StepCosts(c / plain, b / plain, self.propose_s / plain)


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
        self.cost = CostModel(propose_prior=DRAFT_PROPOSE_PRIOR if isinstance(proposer, DraftProposer) else 0.0)
        self.stops_itself = proposer.stops_itself  # k is a cap: the proposer ends its own runs
        self.tracks: dict[str, AcceptanceTracker] = {}
        self.engine_counts = [0.0, 0.0]  # decayed (accepted, rejected) of every verification: new requests' prior
        self.engine_rounds = [0.0, 0.0, 0.0]  # decayed (rounds, accepted, proposed) of every verification
        self.num_steps = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @classmethod
    def build(cls, config: EngineConfig, target_dir: Path, tokenizer, vocab_size: int) -> "Speculator | None":
        """The speculator of ``config`` (``None`` when ``speculative_method`` is ``None``).

        Raises:
            ValueError: a draft with another tokenizer, too short a context, or none found; a bad
                ``speculative_ngram_corpus`` (``NgramCorpus.from_jsonl``).
        """
        if config.speculative_method is None:
            return None
        if config.speculative_method == "ngram":
            corpus = None
            if config.speculative_ngram_corpus is not None:
                corpus = NgramCorpus.from_jsonl(
                    config.speculative_ngram_corpus, tokenizer, config.ngram_prompt_lookup_max
                )
            return cls(config, NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max, corpus))
        draft = DraftProposer.for_target(
            config, target_dir, tokenizer, vocab_size, [Path.cwd() / "runs", target_dir.parent]
        )
        return cls(config, draft)

    # ---------------------------------------------------------------- before scheduling

    def propose(self, running: list, num_waiting: int = 0) -> None:
        """Set ``spec_token_ids`` (and ``spec_probs``) of the decoding requests among ``running``.

        No proposals while ``speculative_disable_by_batch_size`` requests or more are enqueued
        (running + ``num_waiting``, as vLLM counts them): a burst of requests would otherwise
        speculate, and prefill its first prompts into the draft, while the rest still wait.
        A proposer that raises only costs this step its proposals (logged); decoding goes on.
        """
        limit = self.config.speculative_disable_by_batch_size
        if limit is not None and len(running) + num_waiting >= limit:
            return
        seqs, ks = [], []
        adaptive = self.config.speculative_adaptive
        if adaptive:
            self.num_steps += 1
            if self.num_steps % CALIBRATE_EVERY == 0:
                return  # a plain step for the cost model
            costs = self.cost.costs(len(running))
        for seq in running:
            k = min(self.config.num_speculative_tokens, speculative_room(seq, self.config.max_model_len))
            if seq.num_uncomputed_tokens == 1 and k > 0 and verifiable(seq):
                if adaptive:
                    k = self._adapt(seq.request_id, k, costs.per_token, 0.0, len(running) - 1)
                    if k == 0:
                        continue
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        if adaptive and not self.step_pays(seqs, ks, len(running), costs.fixed, costs.per_token):
            self._count_idle(seqs)  # else a request whose own k > 0 but whose step never pays would never probe
            return
        start = time.perf_counter()
        try:
            proposals = self.proposer.propose(seqs, ks)
        except Exception:  # noqa: BLE001 - speculation is optional; the step decodes without it
            logger.exception("speculative proposer failed; this step decodes without proposals")
            for seq in seqs:
                self.proposer.free(seq.request_id)
            return
        # positions actually drafted: a draft may stop early (speculative_draft_confidence_threshold). A round
        # that first prefilled a request's prompt into the draft (its first round, or one after the draft pool
        # was full) is not timed: that cost is paid once per request, not per proposed position.
        if getattr(self.proposer, "last_catch_up", 0) <= STEADY_CATCH_UP:
            self.cost.observe_propose(max(len(p.token_ids) for p in proposals), len(seqs), time.perf_counter() - start)
        # the proposer's time is spent now: only verifying the proposals must pay
        lengths = [len(p.token_ids) for p in proposals]
        if adaptive and not self.step_pays(seqs, lengths, len(running), costs.fixed, costs.verify):
            self._count_idle(seqs)
            return  # e.g. ngram found too few matches: a plain step (the draft rolls back unverified tokens)
        for seq, proposal in zip(seqs, proposals):
            seq.spec_token_ids, seq.spec_probs = proposal.token_ids, proposal.probs

    def step_pays(self, seqs: list, ks: list[int], batch: int, fixed: float, cost: float) -> bool:
        """Whether proposing up to ``ks[i]`` tokens after each ``seqs[i]`` is expected to emit more tokens per
        second than a plain step of ``batch`` requests: ``(batch + sum(gain)) / (1 + fixed + cost *
        sum(positions)) > batch`` (``expected_gain``); always when a request is due a probe (else it could
        never learn)."""
        tracks = [self.tracks.get(seq.request_id) for seq in seqs]
        if any(t is not None and t.probing and k for t, k in zip(tracks, ks)):
            return True
        expected = [self.expected_gain(t, k) for t, k in zip(tracks, ks) if t is not None]
        gain, positions = sum(g for g, _ in expected), sum(p for _, p in expected)
        return (batch + gain) / (1.0 + fixed + cost * positions) > batch * 1.0001

    def expected_gain(self, track: AcceptanceTracker, k: int) -> tuple[float, float]:
        """``(accepted tokens, proposed positions)`` expected of a request that may propose up to ``k``: i.i.d.
        acceptance (``expected_tokens``) over ``k`` positions, or for a proposer that ends its own runs what its
        past rounds gained and proposed (at most ``k``)."""
        if not k:
            return 0.0, 0.0
        if self.stops_itself:
            return track.gain_per_round, min(float(k), track.proposed_per_round)
        return expected_tokens(track.alpha, k) - 1.0, float(k)

    def _adapt(self, request_id: str, k_max: int, cost: float, fixed: float = 0.0, num_others: int = 0) -> int:
        """This step's k of a request (``choose_k``; ``k_max`` or 0 by ``pays_per_round`` for a proposer that
        ends its own runs); 1 when a switched-off request is due a probe."""
        track = self.tracks.get(request_id)
        if track is None:
            track = self.tracks[request_id] = AcceptanceTracker(*self.new_request_prior())
        track.probing = False  # a probe is for one step; one that proposed nothing (no ngram match) lapses
        if self.stops_itself:
            gain, positions = self.expected_gain(track, k_max)
            k = k_max if pays_per_round(gain, positions, cost, fixed, num_others) else 0
        else:
            k = choose_k(track.alpha, cost, k_max, fixed, num_others)
        if k == 0:
            track.idle_steps += 1
        if track.idle_steps >= track.probe_every:
            track.idle_steps, track.probing, k = 0, True, max(k, 1)
        return k

    def _count_idle(self, seqs: list) -> None:
        """Requests that chose k > 0 in a step that then proposed nothing (the step did not pay) wait
        towards a probe like those that chose k = 0."""
        for seq in seqs:
            track = self.tracks.get(seq.request_id)
            if track is not None and not track.probing:
                track.idle_steps += 1

    def new_request_prior(self) -> tuple[tuple[float, float], tuple[float, float, float]]:
        """Pseudo-counts of a new request (``AcceptanceTracker``'s two priors): the engine-wide acceptance with
        the weight of ``ACCEPTANCE_PRIOR``, and its rounds scaled to ``ROUND_PRIOR[0]`` rounds."""
        accepted, rejected = self.engine_counts
        if accepted + rejected < 1.0:
            return ACCEPTANCE_PRIOR, ROUND_PRIOR
        weight = sum(ACCEPTANCE_PRIOR) / (accepted + rejected)
        rounds = self.engine_rounds[0]
        round_prior = tuple(n * ROUND_PRIOR[0] / rounds for n in self.engine_rounds)
        return (accepted * weight, rejected * weight), round_prior

    def observe_step(self, out, seconds: float) -> None:
        """Time of a step's forward pass (``engine.llm_engine``): decode-only steps feed ``CostModel``."""
        if out.scheduled and all(item.num_new_tokens == 1 + len(item.spec_token_ids) for item in out.scheduled):
            speculating = sum(1 for item in out.scheduled if item.spec_token_ids)
            self.cost.observe_step(out.num_batched_tokens, speculating, seconds)

    # ---------------------------------------------------------------- after the forward pass

    def sample(self, sampler, logits: torch.Tensor, items: list) -> tuple[list[list[int]], list[list]]:
        """New tokens (and logprobs entries) of every sampled item of a step.

        Args:
            sampler: the engine's ``Sampler`` (plain rows, batched).
            logits: ``[R, vocab]``, ``item.num_sampled_rows`` consecutive rows per item; float32, or the
                model dtype when every item is plain greedy (``Sampler.is_plain_greedy``: argmax only).
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
            track = self.tracks.get(seq.request_id)
            if track is not None:
                track.update(m, verified.num_accepted)
            counts = self.engine_counts
            counts[0] = ENGINE_ACCEPTANCE_DECAY * counts[0] + verified.num_accepted
            counts[1] = ENGINE_ACCEPTANCE_DECAY * counts[1] + (1.0 if verified.num_accepted < m else 0.0)
            rounds = self.engine_rounds
            for i, n in enumerate((1.0, verified.num_accepted, m)):
                rounds[i] = ENGINE_ACCEPTANCE_DECAY * rounds[i] + n
        return tokens, logprobs

    def free(self, request_id: str) -> None:
        """Forget a finished request (the draft's blocks are freed)."""
        self.tracks.pop(request_id, None)
        self.proposer.free(request_id)
