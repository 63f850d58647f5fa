"""Speculative decoding parts alone: the ngram proposer, verification, configuration errors.

Oracle of the sampling tests: the target distribution itself. Over many trials of rejection
sampling on a tiny vocabulary, the first emitted token must follow ``p_1`` and, given that the
first proposal was accepted, the second must follow ``p_2`` (chi-square goodness of fit).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine import EngineConfig
from engine.spec_decode import NgramCorpus, NgramProposer, rejection_sample, verify_greedy
from engine.spec_decode.speculator import (
    REFIT_EVERY,
    ROUND_PRIOR,
    VERIFY_PRIOR,
    AcceptanceTracker,
    CostModel,
    StepCosts,
    choose_k,
    expected_tokens,
    pays_per_round,
)

VOCAB = 6
TRIALS = 20000


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ngram = NgramProposer(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix (2, 6, 7) does not occur earlier; (6, 7) does, latest at 6..7 -> followed by 2, 6, 7
    assert ngram.propose_tokens(tokens, 3) == [2, 6, 7]
    assert ngram.propose_tokens(tokens, 10) == [8, 9, 1, 6, 7, 2, 6, 7]  # no match with 10 after it: the earliest
    assert ngram.propose_tokens([3, 9, 9, 9, 9, 9, 9], 3) == [9, 9, 9]  # a loop: not the overlapping latest match
    assert ngram.propose_tokens([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix
    assert ngram.propose_tokens([4, 4], 2) == [4]
    assert ngram.propose_tokens([4], 2) == []
    assert NgramProposer(min_n=2, max_n=2).propose_tokens([1, 2, 9, 3, 2], 2) == []  # (3, 2) unseen; 1-grams not tried


def test_ngram_prefers_longer_match_over_later_short_one():
    ngram = NgramProposer(min_n=1, max_n=3)
    tokens = [1, 2, 3, 40, 41, 9, 3, 50, 1, 2, 3]
    assert ngram.propose_tokens(tokens, 2) == [40, 41]  # (1, 2, 3) beats the later (3) -> 50


def test_ngram_corpus_chains_the_most_frequent_continuation_of_the_longest_match():
    corpus = NgramCorpus([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [9, 2, 3, 7, 8], [6, 3, 7]], max_n=3)
    # (2, 3) -> 4 twice, 7 once; then (2, 3, 4) -> 5; (3, 4, 5) is unknown, and so is (4, 5): stop
    assert corpus.propose_tokens([0, 2, 3], 4) == [4, 5]
    assert corpus.propose_tokens([9, 2, 3], 1) == [7]  # the 3-gram (9, 2, 3) beats the 2-gram's majority
    assert corpus.propose_tokens([0, 0, 3], 2) == []  # 1-grams are never looked up in a corpus
    assert corpus.propose_tokens([6, 3], 3) == [7, 8]  # (6, 3) -> 7, then (3, 7) -> 8 of another record
    assert NgramCorpus([[1, 2, 5], [1, 2, 6], [1, 2, 6]]).propose_tokens([1, 2], 1) == [6]


def test_ngram_with_corpus_tries_own_long_matches_then_the_corpus_then_own_single_tokens():
    corpus = NgramCorpus([[7, 8, 30, 31], [5, 6, 40]], max_n=3)
    ngram = NgramProposer(min_n=1, max_n=3, corpus=corpus)
    assert ngram.propose_tokens([7, 8, 20, 21, 7, 8], 2) == [20, 21]  # own 2-gram (7, 8) first
    assert ngram.propose_tokens([1, 7, 8], 2) == [30, 31]  # no own match: the corpus
    assert ngram.propose_tokens([4, 9, 4], 2) == [9, 4]  # neither: own 1-gram (4)
    assert NgramProposer(min_n=2, max_n=3, corpus=corpus).propose_tokens([4, 9, 4], 2) == []


def test_ngram_corpus_from_jsonl_reads_records_and_names_bad_files(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from engine.errors import UsageError

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    good = tmp_path / "replies.jsonl"
    good.write_text('{"text": "the cat sat on the mat and the cat sat down"}\n')
    corpus = NgramCorpus.from_jsonl(good, tokenizer)
    ids = tokenizer("the cat sat on the mat and the cat sat down").input_ids
    assert corpus.propose_tokens(ids[:2], 3) == ids[2:5]
    with pytest.raises(UsageError, match="speculative_ngram_corpus=.*missing.jsonl.*not found"):
        NgramCorpus.from_jsonl(tmp_path / "missing.jsonl", tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(UsageError, match="bad.jsonl:2"):
        NgramCorpus.from_jsonl(bad, tokenizer)


def test_verify_greedy_keeps_matching_prefix_then_the_argmax():
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]).token_ids == [4, 5, 6, 7]  # all accepted + bonus
    result = verify_greedy([4, 9, 6, 7], [4, 5, 6])
    assert (result.token_ids, result.num_accepted) == ([4, 9], 1)
    result = verify_greedy([3, 5, 6, 7], [4, 5, 6])
    assert (result.token_ids, result.num_accepted) == ([3], 0)
    assert verify_greedy([8], []).token_ids == [8]


def _random_dists(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, VOCAB, generator=g) * 1.5, dim=-1)


def _assert_follows(samples: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = expected[keep] * counts[keep].sum() / expected[keep].sum()
    stat, p_value = chisquare(counts[keep].numpy(), expected.numpy())
    assert p_value > 1e-3, f"chi-square {stat:.1f}, p={p_value:.2e}: counts {counts.tolist()} vs {expected.tolist()}"


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_sampling_emits_the_target_distribution(deterministic_draft):
    target = _random_dists(3, seed=1)  # p_1, p_2, p_3 for 2 proposals
    target[0, 4] = 0.0  # a token the target never emits
    target[0] /= target[0].sum()
    draft = _random_dists(2, seed=2)
    g = torch.Generator().manual_seed(3)
    first, second_given_accept, accepted = [], [], 0
    for _ in range(TRIALS):
        if deterministic_draft:
            proposal, q = [2, 1], None  # one-hot q (the ngram case)
        else:
            proposal = [
                int(torch.multinomial(draft[0], 1, generator=g)),
                int(torch.multinomial(draft[1], 1, generator=g)),
            ]
            q = draft
        result = rejection_sample(target, proposal, q, g)
        assert 1 <= len(result.token_ids) == result.num_accepted + 1 <= 3
        assert result.token_ids[: result.num_accepted] == proposal[: result.num_accepted]
        first.append(result.token_ids[0])
        if result.num_accepted >= 1:
            second_given_accept.append(result.token_ids[1])
        accepted += result.num_accepted
    _assert_follows(first, target[0])
    _assert_follows(second_given_accept, target[1])
    assert accepted > 0
    assert all(rejection_sample(target[:2], [4], None, g).token_ids[0] != 4 for _ in range(200))  # p(4) = 0: never kept


def test_rejection_sampling_checks_shapes():
    with pytest.raises(ValueError, match="expected m \\+ 1"):
        rejection_sample(_random_dists(2, 0), [1, 2], None, None)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(speculative_method="medusa"), "speculative_method='medusa'"),
        (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens=0"),
        (dict(speculative_method="draft", num_speculative_tokens=-2), "num_speculative_tokens=-2"),
        (dict(num_speculative_tokens=3), "without speculative_method"),
        (dict(speculative_model="x"), "without speculative_method"),
        (dict(speculative_method="ngram", speculative_model="x"), "uses no model"),
        (dict(speculative_method="draft", speculative_ngram_corpus="c.jsonl"), "serves the ngram proposer"),
        (dict(speculative_ngram_corpus="c.jsonl"), "without speculative_method"),
        (
            dict(speculative_method="ngram", ngram_prompt_lookup_min=3, ngram_prompt_lookup_max=2),
            "ngram_prompt_lookup_min=3",
        ),
        (dict(speculative_method="ngram", ngram_prompt_lookup_min=0), "ngram_prompt_lookup_min=0"),
        (dict(speculative_method="ngram", speculative_disable_by_batch_size=0), "speculative_disable_by_batch_size=0"),
        (dict(speculative_method="draft", speculative_draft_dtype="int4"), "speculative_draft_dtype='int4'"),
        (
            dict(speculative_method="draft", speculative_draft_confidence_threshold=1.0),
            "speculative_draft_confidence_threshold=1.0",
        ),
        (
            dict(speculative_method="ngram", num_speculative_tokens=8, max_num_batched_tokens=8),
            "max_num_batched_tokens=8",
        ),
    ],
)
def test_bad_speculative_configs_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_speculative_defaults():
    assert EngineConfig().speculative_method is None
    assert EngineConfig(speculative_method="ngram").num_speculative_tokens >= 1
    assert EngineConfig(speculative_method="draft", num_speculative_tokens=2).num_speculative_tokens == 2


def test_expected_tokens_and_choose_k():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert choose_k(0.0, 0.05, 4) == 0  # nothing accepted: any proposal only costs
    assert choose_k(0.9, 0.05, 4) == 4  # cheap and accepted: as many as allowed
    assert choose_k(0.9, 0.0, 0) == 0
    # alpha 0.6 at cost 0.3 per token: k=1 gives 1.6/1.3 = 1.23, k=2 1.96/1.6 = 1.225, k=3 2.18/1.9
    assert choose_k(0.6, 0.3, 4) == 1
    assert choose_k(0.3, 0.5, 4) == 0  # 1.3/1.5 < 1
    # the same request among 3 others: the time k adds slows all 4, so it must gain 4 times as much
    assert choose_k(0.6, 0.05, 4) == 4 and choose_k(0.6, 0.05, 4, num_others=3) == 2  # 4.96/1.1 > 5.18/1.15
    assert choose_k(0.15, 0.05, 4) == 1 and choose_k(0.15, 0.05, 4, num_others=3) == 0  # 4.15/1.05 < 4


def test_new_requests_start_from_the_engine_wide_acceptance():
    from engine.spec_decode.speculator import ACCEPTANCE_PRIOR, Speculator

    spec = Speculator(EngineConfig(speculative_method="ngram"), NgramProposer())
    assert spec.new_request_prior() == (ACCEPTANCE_PRIOR, ROUND_PRIOR)  # nothing verified yet
    spec.engine_counts = [1.0, 9.0]
    spec.engine_rounds = [10.0, 1.0, 20.0]
    (accepted, rejected), round_prior = spec.new_request_prior()
    assert accepted / (accepted + rejected) == pytest.approx(0.1) and accepted + rejected == pytest.approx(3.0)
    assert round_prior == pytest.approx((ROUND_PRIOR[0], 0.1 * ROUND_PRIOR[0], 2.0 * ROUND_PRIOR[0]))
    assert spec._adapt("new", 4, cost=0.05) == 1  # alpha 0.1 alone: 1.1 / 1.05 > 1
    assert spec._adapt("other", 4, cost=0.05, num_others=3) == 0


def test_acceptance_tracker_counts_tested_positions():
    t = AcceptanceTracker()
    prior = t.alpha
    for _ in range(30):
        t.update(4, 4)  # all accepted: no rejection tested
    assert t.alpha > 0.99 > prior
    for _ in range(60):
        t.update(4, 1)  # one accepted, then a rejection
    assert t.alpha == pytest.approx(0.5, abs=0.01)


def test_rejected_probes_wait_twice_as_long():
    from engine.spec_decode.speculator import PROBE_EVERY, PROBE_EVERY_MAX, Speculator

    spec = Speculator(EngineConfig(speculative_method="ngram"), NgramProposer())
    track = spec.tracks["r"] = AcceptanceTracker()
    track.accepted = 0.0  # nothing accepted so far: k = 0, only probes
    waits = []
    for _ in range(5):
        steps = 1
        while spec._adapt("r", 4, cost=0.05) == 0:
            steps += 1
        waits.append(steps)
        track.update(1, 0)  # the probe is rejected
    assert waits == [min(PROBE_EVERY * 2**i, PROBE_EVERY_MAX) for i in range(5)]
    spec._adapt("r", 4, cost=0.05)
    while spec._adapt("r", 4, cost=0.05) == 0:
        pass
    track.update(1, 1)  # an accepted probe: back to the short wait
    assert track.probe_every == PROBE_EVERY


def test_cost_model_fits_step_time_and_adds_the_proposer():
    cost = CostModel(propose_prior=0.25)
    assert cost.costs(1) == (0.0, VERIFY_PRIOR, 0.25)  # nothing measured yet
    for _ in range(10):  # 10 ms a plain decode, 1 ms per more verified token, 2 ms per verifying request
        cost.observe_step(1, 0, 0.010)
        cost.observe_step(4, 1, 0.015)
        cost.observe_step(3, 1, 0.014)
    a, b, c = cost.fit()
    assert (a, b, c) == pytest.approx((0.009, 0.001, 0.002))
    assert cost.costs(1) == (0.0, VERIFY_PRIOR, 0.25)  # proposer not timed yet
    cost.observe_propose(3, 1, 0.006)  # 2 ms per proposed position
    costs = cost.costs(1)
    assert costs.fixed == pytest.approx(0.2) and costs.verify == pytest.approx(0.001 / 0.010)
    assert costs.per_token == pytest.approx((0.001 + 0.002) / 0.010)
    assert cost.costs(2).per_token == pytest.approx((0.001 + 0.002) / 0.011)
    cost.observe_propose(1, 4, 0.0)  # a round for 4 requests at once costs each of them less
    assert cost.costs(1).per_token < costs.per_token
    only_spec = CostModel(propose_prior=0.25)
    only_spec.observe_step(4, 1, 0.012)
    only_spec.observe_propose(1, 1, 0.0)
    assert only_spec.fit() is None and only_spec.costs(1) == (0.0, VERIFY_PRIOR, 0.25)  # no plain step to compare
    assert choose_k(0.6, 0.05, 4, fixed_cost=0.0) == 4
    assert choose_k(0.6, 0.05, 4, fixed_cost=2.0) == 0  # a fixed cost that no run of 0.6 pays back


def test_cost_model_refits_every_few_steps():
    """``costs`` reuses the step fit until ``REFIT_EVERY`` more steps were observed (a fit is ~2% of a step)."""
    cost = CostModel(propose_prior=0.25)
    cost.observe_propose(1, 1, 0.001)
    for _ in range(8):
        cost.observe_step(1, 0, 0.010)
        cost.observe_step(2, 1, 0.012)
    first = cost.costs(1)
    for _ in range(REFIT_EVERY - 1):
        cost.observe_step(2, 1, 0.020)  # verifying got dearer
    assert cost.costs(1) == first
    cost.observe_step(2, 1, 0.020)
    assert cost.costs(1).per_token > first.per_token
    assert cost.recent_fit() == cost.fit()


def test_cost_model_fit_ignores_a_step_far_above_the_others():
    """One verifying step that took 50 plain steps (the process was preempted) must not make verifying
    look dear: one request alone, so tokens and verifying requests move together (1 + 1 tokens)."""
    cost = CostModel(propose_prior=0.25)
    for i in range(60):
        cost.observe_step(1, 0, 0.010)
        if i % 4 == 0:
            cost.observe_step(2, 1, 0.0105)
    cost.observe_step(2, 1, 0.5)
    a, b, c = cost.fit()
    # tokens and verifying move together here: the extra 0.5 ms is read as per token (c = 0), not split
    # by a minimum-norm solution (b 3.5 ms, c < 0 clipped to 0: 7x the true cost of a proposed token)
    assert (a, b, c) == pytest.approx((0.0095, 0.0005, 0.0), abs=1e-9)


def test_a_step_speculates_only_when_its_gain_beats_the_fixed_and_per_token_cost():
    from types import SimpleNamespace

    from engine.spec_decode.speculator import Speculator

    spec = Speculator(EngineConfig(speculative_method="ngram"), NgramProposer())
    seqs = [SimpleNamespace(request_id=r) for r in "ab"]
    for r, accepted in zip("ab", (1.0, 3.0)):
        spec.tracks[r] = AcceptanceTracker((accepted, 9.0))  # alpha 0.1 and 0.25
    # 4 requests, 7% to verify at all, 1% per token: (4 + 0.1) / 1.08 < 4, (4 + 0.1 + 0.25) / 1.09 < 4
    assert not spec.step_pays(seqs[:1], [1], 4, 0.07, 0.01)
    assert not spec.step_pays(seqs, [1, 1], 4, 0.07, 0.01)
    assert spec.step_pays(seqs, [1, 1], 1, 0.07, 0.01)  # one request alone: 1.35 / 1.09 > 1
    assert not spec.step_pays(seqs, [0, 0], 1, 0.0, 0.01)  # nothing proposed gains nothing
    spec.tracks["a"].probing = True
    assert spec.step_pays(seqs, [1, 1], 4, 0.07, 0.01)  # a probe goes ahead
    assert not spec.step_pays(seqs, [0, 1], 4, 0.07, 0.01)  # unless it proposed nothing


def test_a_self_stopping_proposer_proposes_its_cap_or_nothing_by_its_past_rounds():
    """A draft with a confidence stop ends its own runs: a request gets ``k_max`` (the draft stops early on
    its own) while its rounds gained more than they cost, else none; the i.i.d. ``choose_k`` would have
    capped it at 1 here (alpha 0.45 at 0.19 per token)."""
    from engine.spec_decode.speculator import Speculator

    proposer = _RecordingProposer()
    proposer.stops_itself = True
    spec = Speculator(EngineConfig(speculative_method="ngram", max_model_len=2048), proposer)
    assert choose_k(0.45, 0.19, 3) == 1
    track = spec.tracks["a"] = AcceptanceTracker((0.45, 0.55), round_prior=(1.0, 0.9, 1.9))
    assert spec._adapt("a", 3, cost=0.19) == 3  # 1.9 / (1 + 0.19 * 1.9) > 1
    track.rounds, track.round_accepted, track.round_proposed = 1.0, 0.1, 1.2
    assert spec._adapt("a", 3, cost=0.19) == 0  # 1.1 / 1.23 < 1
    assert spec.expected_gain(track, 1) == (pytest.approx(0.1), 1.0)  # at most k positions
    assert pays_per_round(0.5, 1.0, 0.19) and not pays_per_round(0.5, 1.0, 0.19, num_others=3)  # 4.5 / 1.19 < 4
    track.update(3, 2)
    assert track.gain_per_round == pytest.approx((0.95 * 0.1 + 2) / (0.95 + 1))


class _RecordingProposer:
    """Proposes ``k`` copies of token 1 and records each round's ``ks``; ``last_catch_up`` as a draft sets it."""

    stops_itself = False

    def __init__(self, catch_up: int = 1):
        self.rounds: list[list[int]] = []
        self.last_catch_up = catch_up

    def propose(self, seqs, ks):
        from engine.spec_decode.proposer import Proposal

        self.rounds.append(list(ks))
        return [Proposal([1] * k) for k in ks]

    def free(self, request_id):
        pass


def _decoding_sequence(request_id: str = "a"):
    from engine import SamplingParams
    from engine.sequence import Sequence

    seq = Sequence(request_id, None, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=200), None, None)
    seq.num_computed_tokens = 2  # one token to decode
    return seq


def test_a_request_whose_steps_never_pay_still_probes():
    """A request whose own k is > 0 but whose step does not pay (here: a fixed cost of 5 plain steps)
    counts those steps as idle and probes after PROBE_EVERY of them; before, it never proposed again."""
    from engine.spec_decode.speculator import CALIBRATE_EVERY, PROBE_EVERY, Speculator

    proposer = _RecordingProposer()
    spec = Speculator(EngineConfig(speculative_method="ngram", max_model_len=2048), proposer)
    spec.cost.costs = lambda batch: StepCosts(5.0, 0.01, 0.0)
    seq = _decoding_sequence()
    proposed_at = []
    for step in range(1, 2 * PROBE_EVERY + 4):
        before = len(proposer.rounds)
        spec.propose([seq])
        if len(proposer.rounds) > before:
            proposed_at.append(step)
            seq.spec_token_ids, seq.spec_probs = [], None
    # steps 1..8 idle, the probe at 9; the next 8 idle steps are 10..18 less the calibration step 16: probe at 19
    assert CALIBRATE_EVERY == 16 and proposed_at == [PROBE_EVERY + 1, 2 * PROBE_EVERY + 3]


def test_a_round_that_prefilled_the_draft_is_not_timed():
    """The draft's first round for a request prefills its prompt: a one-off cost, not a per-position one."""
    from engine.spec_decode.speculator import STEADY_CATCH_UP, Speculator

    proposer = _RecordingProposer(catch_up=40)
    config = EngineConfig(speculative_method="ngram", speculative_adaptive=False, max_model_len=2048)
    spec = Speculator(config, proposer)
    spec.propose([_decoding_sequence()])
    assert len(proposer.rounds) == 1 and spec.cost.propose_s is None
    proposer.last_catch_up = STEADY_CATCH_UP
    spec.propose([_decoding_sequence("b")])
    assert spec.cost.propose_s is not None and spec.cost.propose_s >= 0.0


def test_reduced_head_keeps_outlier_channels_and_the_fp32_row_rule():
    """A draft's reduced head is the chosen rows of the whole head: a ``w8a8`` head keeps its outlier
    input channels (same logits as those columns of the whole head); an fp32 head packs only the
    engine's fp32 row range."""
    from engine.model import Linear, fp32_packed_rows, packed_rows
    from engine.quant.int8 import W8A8Linear
    from engine.spec_decode.draft import reduced_head

    g = torch.Generator().manual_seed(3)
    w8 = torch.randint(-127, 128, (96, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(96, generator=g) / 100
    outliers = torch.tensor([2, 17, 40])
    whole = Linear(None, int8_layer=W8A8Linear(w8, scale, None, outlier_channels=outliers), dtype=torch.float32)
    ids = torch.tensor([0, 5, 33, 95])
    head = reduced_head(whole, ids, "cpu", torch.float32)
    assert torch.equal(head.int8_layer.outlier_channels, outliers)
    x = torch.randn(3, 64, generator=g)
    x[:, outliers] *= 30.0
    torch.testing.assert_close(head(x), whole(x)[:, ids], rtol=0, atol=0)

    fp32 = reduced_head(Linear(torch.randn(96, 64, generator=g)), ids, "cpu", torch.float32)
    assert fp32.pack_rows == fp32_packed_rows() == packed_rows("cpu", torch.float32)


def test_waiting_requests_count_towards_the_disable_batch_size():
    """``speculative_disable_by_batch_size`` counts enqueued requests, running and waiting (as vLLM does):
    a burst's first decoding requests get no proposals while the rest of the burst still waits."""
    from engine.spec_decode.speculator import Speculator

    proposer = _RecordingProposer()
    config = EngineConfig(
        speculative_method="ngram", speculative_adaptive=False, speculative_disable_by_batch_size=4, max_model_len=2048
    )
    spec = Speculator(config, proposer)
    spec.propose([_decoding_sequence("a"), _decoding_sequence("b")], num_waiting=2)
    assert proposer.rounds == []
    spec.propose([_decoding_sequence("a"), _decoding_sequence("b")], num_waiting=1)
    assert proposer.rounds == [[config.num_speculative_tokens] * 2]
