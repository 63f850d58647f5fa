"""Speculative decoding through the engine: exact under greedy, distribution-preserving under sampling.

Oracles: the same engine without speculation (greedy tokens must be identical, whatever the
proposer, prefix caching, preemption or stop conditions), and for sampling the token
distribution of non-speculative sampling over many seeded trials (chi-square). The draft is the
target itself (every proposal accepted: the bonus path and stops inside long accepted runs) or
the target with noise on its weights (about half the proposals rejected).
"""

from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import chi2_contingency

from engine import LLM, SamplingParams
from tests.engine.test_engine_greedy import random_prompts

CONFIG = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=128, max_model_len=256, dtype="float32")
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose n-grams repeat (the ngram proposer finds matches) and random ones."""
    g = torch.Generator().manual_seed(21)
    phrase = torch.randint(3, 49000, (7,), generator=g).tolist()
    return [phrase * 3, phrase[:4] + torch.randint(3, 49000, (9,), generator=g).tolist() + phrase] + random_prompts(
        [5, 19, 33], seed=22
    )


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A random tiny Llama with untied embeddings: varied greedy output (the tied one repeats its input)."""
    from engine.checkpoint.store import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("target"), seed=0, tie_word_embeddings=False)


def noisy_copy(source, out, scale: float):
    """``source`` with Gaussian noise (``scale`` x each tensor's std) on every weight, same tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def noisy_draft_dir(target_dir, tmp_path_factory):
    """The target with 6% noise on its weights: about half its greedy proposals hold."""
    return noisy_copy(target_dir, tmp_path_factory.mktemp("noisy-draft"), 0.06)


@pytest.fixture(scope="module")
def models(tiny_llama_dir, target_dir):
    return {"tied": tiny_llama_dir, "untied": target_dir}


@pytest.fixture(scope="module")
def prompts(models):
    """Per model: the repetitive prompts, and ``P + continuation(P) + P`` for the untied model (whose
    own output never repeats), so that ngram proposals exist and only some of them hold."""
    plain = LLM(str(models["untied"]), **CONFIG)
    base = random_prompts([6, 11], seed=24)
    continuations = tokens(plain.generate(base, GREEDY))
    copies = [p + c + p for p, c in zip(base, continuations)]
    return {"tied": repetitive_prompts(), "untied": repetitive_prompts() + copies}


@pytest.fixture(scope="module")
def reference(models, prompts):
    """Greedy tokens of each model without speculation."""
    return {name: tokens(LLM(str(path), **CONFIG).generate(prompts[name], GREEDY)) for name, path in models.items()}


def spec_llm(model_dir, method: str, draft=None, **overrides) -> LLM:
    config = dict(
        CONFIG,
        speculative_method=method,
        num_speculative_tokens=4,
        speculative_disable_by_batch_size=None,
        speculative_adaptive=False,  # k = 4 every step: the tests exercise verification, not the k choice
    )
    if method == "draft":
        config.update(speculative_model=str(draft or model_dir), speculative_draft_dtype=CONFIG["dtype"])
    config.update(overrides)
    return LLM(str(model_dir), **config)


def check_all_freed(llm) -> None:
    engine = llm.engine
    engine.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    proposer = engine.proposer
    if hasattr(proposer, "block_manager"):
        proposer.check_invariants()
        assert proposer.block_manager.num_used_blocks == 0 and not proposer.shadows


@pytest.mark.parametrize(
    "model,method,draft",
    [("tied", "ngram", None), ("untied", "ngram", None), ("untied", "draft", "self"), ("untied", "draft", "noisy")],
)
def test_greedy_equals_no_speculation(models, prompts, noisy_draft_dir, reference, model, method, draft):
    llm = spec_llm(models[model], method, noisy_draft_dir if draft == "noisy" else None)
    cold = tokens(llm.generate(prompts[model], GREEDY))
    warm = tokens(llm.generate(prompts[model], GREEDY))  # prefix cache hits on the second pass
    assert cold == reference[model] and warm == reference[model]
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits_tokens_total > 0
    assert stats.spec_decode_num_draft_tokens_total > 0
    if draft == "self":  # the target drafting for itself: every proposal is accepted
        assert stats.spec_decode_acceptance_rate == 1.0
        assert stats.spec_decode_mean_accepted_length > 4.0
    elif model == "tied":  # it repeats its last token: the ngram proposals all hold
        assert stats.spec_decode_acceptance_rate > 0.9
    else:  # some proposals accepted, some rejected
        assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    check_all_freed(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_with_preemption_equals_no_speculation(target_dir, noisy_draft_dir, prompts, reference, method):
    llm = spec_llm(target_dir, method, noisy_draft_dir, num_kv_blocks=30, max_model_len=100)
    assert tokens(llm.generate(prompts["untied"], GREEDY)) == reference["untied"]
    assert llm.engine.get_stats().num_preemptions_total > 0
    check_all_freed(llm)


def test_batch_size_switch_off_gives_same_tokens(target_dir, noisy_draft_dir, prompts, reference):
    """No proposals while 3 or more requests are enqueued (running or waiting); the two longest go on alone."""
    llm = spec_llm(target_dir, "draft", noisy_draft_dir, speculative_disable_by_batch_size=3)
    untied = prompts["untied"]
    lengths = [8] * (len(untied) - 2) + [GREEDY.max_tokens] * 2
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    assert tokens(llm.generate(untied, params)) == [ref[:n] for ref, n in zip(reference["untied"], lengths)]
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts_total > 0  # once fewer than 3 requests are left
    check_all_freed(llm)


def test_stops_inside_an_accepted_run_truncate_like_without_speculation(target_dir):
    plain = LLM(str(target_dir), **CONFIG)
    spec = spec_llm(target_dir, "draft")  # self-draft: runs of 5 accepted tokens per step
    prompt = random_prompts([9], seed=23)[0]
    full = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    stop_token = full.token_ids[6]  # mid-run: tokens 1..5 come in the first speculative step, 6..10 in the next
    stop_text = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cases = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=20, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=8),  # max_tokens mid-run
        SamplingParams(temperature=0, max_tokens=20, logprobs=2),
    ]
    for params in cases:
        want = plain.generate(prompt, params)[0].outputs[0]
        got = spec.generate(prompt, params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), params
        if params.logprobs is not None:
            assert len(got.logprobs) == len(want.logprobs)
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert spec.engine.get_stats().spec_decode_acceptance_rate == 1.0
    check_all_freed(spec)


@pytest.fixture(scope="module")
def small_vocab_dirs(tmp_path_factory):
    """A 64-token-vocabulary target (prompts and outputs use ids < 64; EOS ignored) and an unrelated draft."""
    from engine.checkpoint.store import make_tiny_llama

    target = make_tiny_llama(tmp_path_factory.mktemp("small-vocab"), seed=3, vocab_size=64, tie_word_embeddings=False)
    draft = make_tiny_llama(
        tmp_path_factory.mktemp("small-vocab-draft"), seed=99, vocab_size=64, tie_word_embeddings=False
    )
    return target, draft


def with_token_frequencies(draft_dir, out, token_ids: list[int]):
    """A copy of ``draft_dir`` whose ``token_frequencies.json`` ranks ``token_ids`` (the reduced draft head)."""
    import json
    import shutil

    shutil.copytree(draft_dir, out)
    counts = list(range(len(token_ids), 0, -1))
    (out / "token_frequencies.json").write_text(json.dumps({"token_ids": token_ids, "counts": counts}))
    return out


@pytest.mark.parametrize("method", ["ngram", "draft", "draft-reduced-head", "draft-confidence-stop"])
def test_sampling_distribution_equals_no_speculation(small_vocab_dirs, method, tmp_path):
    """Chi-square (contingency) of the tokens at output positions 1..3 over 600 seeded trials each.

    A 64-token vocabulary keeps the cells few; temperature 0.3 sharpens the random models'
    near-flat distributions, so p and q peak on different tokens and a sampler that kept every
    proposal fails the test (checked). ngram: one-hot proposals from the context, kept with
    probability p(x); draft: an unrelated model, so accept, reject and residual draws all happen.
    """
    target, draft = small_vocab_dirs
    overrides = {}
    if method == "draft-reduced-head":  # q is zero outside 24 of the 64 tokens
        method, draft = "draft", with_token_frequencies(draft, tmp_path / "reduced", list(range(40, 3, -3)))
        overrides = dict(speculative_draft_vocab_size=24)
    if method == "draft-confidence-stop":  # proposals end after a draw of q(x) < 0.5: the length depends on q
        method, overrides = "draft", dict(speculative_draft_confidence_threshold=0.5)
    trials = 600
    prompt = [5, 9, 17, 5, 9, 17, 5, 9]
    base = dict(temperature=0.3, max_tokens=4, ignore_eos=True)
    big = dict(CONFIG, num_kv_blocks=2 * trials * 4, max_num_batched_tokens=8192, max_num_seqs=trials)
    plain = LLM(str(target), **big)
    spec = spec_llm(target, method, draft, num_speculative_tokens=3, **big, **overrides)
    if "speculative_draft_vocab_size" in overrides:
        assert spec.engine.proposer.head_ids.numel() == 24
    want = tokens(plain.generate([prompt] * trials, [SamplingParams(seed=i, **base) for i in range(trials)]))
    got = tokens(spec.generate([prompt] * trials, [SamplingParams(seed=10_000 + i, **base) for i in range(trials)]))
    stats = spec.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    for position in (1, 2, 3):
        a = [t[position] for t in want]
        b = [t[position] for t in got]
        cells = [v for v in sorted(set(a) | set(b)) if a.count(v) + b.count(v) >= 10]  # sparse tail out
        table = [[a.count(v) for v in cells], [b.count(v) for v in cells]]
        p_value = chi2_contingency(table).pvalue
        assert p_value > 1e-3, f"position {position}: p={p_value:.1e}, counts {table}"
    check_all_freed(spec)


def test_abort_mid_speculation_frees_every_block(target_dir, noisy_draft_dir):
    llm = spec_llm(target_dir, "draft", noisy_draft_dir)
    engine = llm.engine
    for i, prompt in enumerate(repetitive_prompts()[:3]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=60))
    for _ in range(4):
        engine.step()
    assert engine.get_stats().spec_decode_num_drafts_total > 0
    assert engine.proposer.block_manager.num_used_blocks > 0
    engine.abort_request(["r0", "r1", "r2"])
    check_all_freed(llm)


def test_draft_with_another_tokenizer_or_vocab_is_refused(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    from engine.checkpoint.store import make_tiny_llama

    other_vocab = make_tiny_llama(tmp_path / "vocab", seed=1, vocab_size=49160)
    with pytest.raises(ValueError, match="vocab_size=49160"):
        spec_llm(tiny_llama_dir, "draft", other_vocab)
    other_tokenizer = make_tiny_llama(tmp_path / "tokenizer", seed=1)
    tok = AutoTokenizer.from_pretrained(other_tokenizer)
    tok.add_tokens(["<lmforge-extra-token>"])
    tok.save_pretrained(other_tokenizer)
    with pytest.raises(ValueError, match="another tokenizer"):
        spec_llm(tiny_llama_dir, "draft", other_tokenizer)


def test_draft_defaults_to_the_distilled_student_of_the_model(tmp_path, tiny_llama_dir, monkeypatch):
    import shutil

    from engine.checkpoint.store import read_manifest, write_manifest

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no `lmforge distill` output"):
        spec_llm(tiny_llama_dir, "draft", speculative_model=None)
    student = tmp_path / "runs" / "distill" / "final"
    shutil.copytree(tiny_llama_dir, student)
    manifest = read_manifest(student)
    manifest.method, manifest.parent = "distill", str(tiny_llama_dir)
    write_manifest(student, manifest)
    llm = spec_llm(tiny_llama_dir, "draft", speculative_model=None)
    assert llm.engine.proposer.path == student.resolve()


@pytest.mark.integration
def test_real_smollm2_greedy_equals_no_speculation(smollm2_dir):
    paragraph = (
        "The city library will close for renovation from the first of March until the end of June. Books can be "
        "returned at the community centre on Oak Street, which is open every day from nine until six."
    )
    plain = LLM(str(smollm2_dir), max_model_len=512, num_kv_blocks=96, dtype="float32")
    prompts = [plain.apply_chat_template(f"Rewrite this paragraph in simpler words:\n\n{paragraph}")]
    params = SamplingParams(temperature=0, max_tokens=24)
    want = tokens(plain.generate(prompts, params))
    del plain
    spec = LLM(str(smollm2_dir), max_model_len=512, num_kv_blocks=96, dtype="float32", speculative_method="ngram")
    assert tokens(spec.generate(prompts, params)) == want
    assert spec.engine.get_stats().spec_decode_num_accepted_tokens_total > 0
    spec.engine.check_invariants()


def test_n_completions_and_penalties_with_speculation_equal_no_speculation(target_dir, prompts):
    """``n`` sequences per request each speculate; options verification does not model
    (frequency penalty, logit_bias, min_tokens) get no proposals and keep the sampler's tokens."""
    plain = LLM(str(target_dir), **CONFIG)
    spec = spec_llm(target_dir, "draft")  # self-draft: every proposal of a speculating request holds
    cases = [
        SamplingParams(n=3, temperature=0, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=16, frequency_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=16, logit_bias={7: 5.0}),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=16, ignore_eos=False),
    ]
    prompt = prompts["untied"][0]
    for params in cases:
        want = [[c.token_ids for c in o.outputs] for o in plain.generate([prompt], params)]
        got = spec.generate([prompt], params)
        assert [[c.token_ids for c in o.outputs] for o in got] == want, params
        assert [c.index for c in got[0].outputs] == list(range(params.n))
    stats = spec.engine.get_stats()
    assert stats.spec_decode_num_drafts_total > 0  # the n=3 request speculated
    check_all_freed(spec)
    penalised = spec_llm(target_dir, "draft")
    penalised.generate([prompt], SamplingParams(temperature=0, max_tokens=16, frequency_penalty=1.5))
    assert penalised.engine.get_stats().spec_decode_num_drafts_total == 0
    check_all_freed(penalised)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_adaptive_k_gives_same_tokens(target_dir, noisy_draft_dir, prompts, reference, method):
    llm = spec_llm(target_dir, method, noisy_draft_dir, speculative_adaptive=True)
    assert tokens(llm.generate(prompts["untied"], GREEDY)) == reference["untied"]
    assert llm.engine.get_stats().spec_decode_num_drafts_total > 0
    check_all_freed(llm)


def test_adaptive_k_switches_off_a_draft_that_is_never_right(target_dir, prompts, reference, tmp_path):
    """A draft of random weights (about 1/vocab accepted): after a few rejections each request only probes."""
    from engine.checkpoint.store import make_tiny_llama

    stranger = make_tiny_llama(tmp_path / "stranger", seed=7, tie_word_embeddings=False)
    fixed = spec_llm(target_dir, "draft", stranger)
    adaptive = spec_llm(target_dir, "draft", stranger, speculative_adaptive=True)
    for llm in (fixed, adaptive):
        assert tokens(llm.generate(prompts["untied"], GREEDY)) == reference["untied"]
        check_all_freed(llm)
    fixed_stats, stats = fixed.engine.get_stats(), adaptive.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens_total <= 2
    assert 0 < stats.spec_decode_num_draft_tokens_total < fixed_stats.spec_decode_num_draft_tokens_total / 4


def test_reduced_draft_head_gives_same_tokens(target_dir, noisy_draft_dir, prompts, reference, tmp_path):
    """The noisy draft with logits for 2000 tokens only: proposals come from that set, output is the target's."""
    freq = [int(t) for t in torch.randperm(49152, generator=torch.Generator().manual_seed(5))[:1500]]
    draft = with_token_frequencies(noisy_draft_dir, tmp_path / "reduced", freq)
    llm = spec_llm(target_dir, "draft", draft, speculative_draft_vocab_size=2000)
    ids = set(llm.engine.proposer.head_ids.tolist())
    assert len(ids) == 2000 and set(freq) <= ids and set(range(500)) <= ids  # frequent, then the lowest ids
    assert tokens(llm.generate(prompts["untied"], GREEDY)) == reference["untied"]
    assert llm.engine.get_stats().spec_decode_num_draft_tokens_total > 0
    check_all_freed(llm)
    whole = spec_llm(target_dir, "draft", draft, speculative_draft_vocab_size=None)
    assert whole.engine.proposer.head_ids is None


def test_int8_draft_keeps_a_reduced_int8_head(target_dir, noisy_draft_dir, prompts, reference, tmp_path):
    """An int8-weight-only draft's reduced head holds the stored INT8 rows and scales of the frequent tokens:
    its logits are those columns of the whole INT8 head's; greedy output stays the target's."""
    from compress.quantize.methods import quantize
    from engine.quant.int8 import Int8WeightOnlyLinear

    freq = [int(t) for t in torch.randperm(49152, generator=torch.Generator().manual_seed(6))[:1500]]
    int8 = quantize(noisy_draft_dir, tmp_path / "int8", method="int8-weight-only")
    draft = with_token_frequencies(int8, tmp_path / "reduced", freq)
    llm = spec_llm(target_dir, "draft", draft, speculative_draft_vocab_size=2000)
    proposer = llm.engine.proposer
    layer = proposer.head.int8_layer
    assert isinstance(layer, Int8WeightOnlyLinear) and layer.weight_int8.shape[0] == 2000
    whole = proposer.runner.model.lm_head
    x = torch.randn(3, whole.int8_layer.in_features, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(proposer.head(x), whole(x)[:, proposer.head_ids], rtol=0, atol=0)
    assert tokens(llm.generate(prompts["untied"], GREEDY)) == reference["untied"]
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    check_all_freed(llm)


def check_one_call_equals_op_by_op(int8_dir, monkeypatch, kv_cache_dtype: str | None = None) -> None:
    """A bf16 INT8 draft's forward of 3 requests with 1, 2 and 3 new tokens (crossing a block, one request
    not sampling) through ``cpu_ops.decode_layers`` gives the logits and KV writes of the op-by-op
    forward bit for bit (float layers unpacked there, as the op runs them), with a bf16 or an int8 KV cache."""
    from engine import cpu_ops
    from engine.scheduler import ScheduledSequence, SchedulerOutput
    from engine.sequence import Sequence
    from engine.spec_decode import DraftProposer

    draft = DraftProposer(int8_dir, "bfloat16", "cpu", 4, 256, 64, kv_cache_dtype=kv_cache_dtype)
    assert draft.runner.kv_cache.dtype == (torch.int8 if kv_cache_dtype == "int8" else torch.bfloat16)
    model = draft.runner.model
    assert cpu_ops.int8_decode_available(), "the C++ decode kernels did not build"
    assert model.int8_decode_weights() is not None
    g = torch.Generator().manual_seed(3)
    seqs = [
        Sequence(str(i), None, torch.randint(3, 49000, (9 + 5 * i,), generator=g).tolist(), GREEDY, None, None)
        for i in range(3)
    ]
    for new, seq in zip((1, 3, 3), seqs):  # of which 1, 2, 3 run: the first and last sample
        assert draft.block_manager.allocate_slots(seq, seq.num_prompt_tokens + 8)
        draft._logits(SchedulerOutput([ScheduledSequence(seq, seq.num_prompt_tokens)], seq.num_prompt_tokens, []))
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.token_ids += torch.randint(3, 49000, (new,), generator=g).tolist()
    step = SchedulerOutput([ScheduledSequence(seq, n) for seq, n in zip(seqs, (1, 2, 3))], 6, [])
    cache = draft.runner.kv_cache.clone()
    fused = draft._logits(step)
    fused_cache = draft.runner.kv_cache.clone()
    draft.runner.kv_cache.copy_(cache)
    for layer in model.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            linear.packed = linear.packed_halves = None  # a float unit unpacked, as the C++ op runs it
    with monkeypatch.context() as m:
        m.setattr(cpu_ops, "int8_decode_available", lambda: False)
        assert model.int8_decode_weights() is None
        assert torch.equal(fused, draft._logits(step)) and fused.shape == (2, 49152)
    assert torch.equal(fused_cache, draft.runner.kv_cache)


def test_bf16_int8_draft_runs_its_decoder_in_one_call_with_the_same_numbers(
    target_dir, noisy_draft_dir, prompts, reference, tmp_path, monkeypatch
):
    """A bf16 int8-weight-only draft runs its forwards of up to 8 tokens (steady rounds: a token or two per
    request) through ``cpu_ops.decode_layers`` with the numbers of the op-by-op forward (its float
    unit kept); a prompt's catch-up keeps the op-by-op path. Greedy output stays the target's."""
    from compress.quantize.methods import quantize
    from engine import cpu_ops

    int8 = quantize(noisy_draft_dir, tmp_path / "int8", method="int8-weight-only")
    assert json.loads((int8 / "lmforge.json").read_text())["config"]["float_modules"]  # a unit kept in float
    check_one_call_equals_op_by_op(int8, monkeypatch)

    calls = []
    op = cpu_ops.decode_layers
    monkeypatch.setattr(cpu_ops, "decode_layers", lambda *args, **kw: calls.append(args[0].shape[0]) or op(*args, **kw))
    llm = spec_llm(target_dir, "draft", int8, speculative_draft_dtype="bfloat16")
    assert tokens(llm.generate(prompts["untied"], GREEDY)) == reference["untied"]
    assert calls and max(calls) <= 8
    check_all_freed(llm)


def test_one_call_draft_with_qkv_biases_and_every_linear_int8_and_its_switches(tmp_path, monkeypatch):
    """A Qwen2 draft (q/k/v biases) with every linear INT8 runs the one-call path with the op-by-op numbers;
    switching the INT8 GEMV or the engine's kernels off turns the one-call path off."""
    from compress.quantize.methods import quantize
    from engine import cpu_ops
    from engine.checkpoint.store import make_tiny_llama
    from engine.model import Model
    from engine.quant.int8 import weight_only_cpu_kernel

    parent = make_tiny_llama(tmp_path / "qwen2", seed=2, model_type="qwen2")
    int8 = quantize(parent, tmp_path / "int8", method="int8-weight-only", float_units=0)
    check_one_call_equals_op_by_op(int8, monkeypatch)
    check_one_call_equals_op_by_op(int8, monkeypatch, kv_cache_dtype="int8")  # the int8 KV cache read and written
    model = Model(int8, torch.bfloat16, "cpu", 64)
    weights = model.int8_decode_weights()
    _, _, scales, biases, _, _ = weights  # (weights, row sums, scales, biases, Hadamard blocks, norms)
    assert all(s is not None for s in scales) and all(b is not None for b in biases[0::4])
    for switch in (weight_only_cpu_kernel, cpu_ops.use_cpu_kernels):
        try:
            switch(False)
            assert model.int8_decode_weights() is None
        finally:
            switch(True)
    assert model.int8_decode_weights() is not None


def test_draft_confidence_stop_proposes_less_and_keeps_greedy_output(target_dir, noisy_draft_dir, prompts, reference):
    """With a confidence stop the draft ends a request's proposals after an unsure token: fewer proposed
    tokens, a larger share of them accepted, the target's greedy tokens."""
    counts = {}
    for threshold in (0.0, 0.9):
        llm = spec_llm(target_dir, "draft", noisy_draft_dir, speculative_draft_confidence_threshold=threshold)
        assert tokens(llm.generate(prompts["untied"], GREEDY)) == reference["untied"]
        s = llm.engine.get_stats()
        counts[threshold] = (s.spec_decode_num_draft_tokens_total, s.spec_decode_num_accepted_tokens_total)
        check_all_freed(llm)
    (all_proposed, all_accepted), (proposed, accepted) = counts[0.0], counts[0.9]
    assert 0 < proposed < all_proposed
    assert accepted / proposed > all_accepted / all_proposed


def test_bad_token_frequency_file_names_its_path(target_dir, noisy_draft_dir, tmp_path):
    from engine.checkpoint.store import CheckpointError

    draft = with_token_frequencies(noisy_draft_dir, tmp_path / "bad", [])
    (draft / "token_frequencies.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="token_frequencies.json"):
        spec_llm(target_dir, "draft", draft)


def test_bf16_speculative_engine_takes_the_plain_argmax_path(target_dir, prompts):
    """In bf16, greedy steps of a speculative engine take the argmax of the model-dtype logits as a plain
    engine does (no float32 copy), and with every step switched off (batch size) its tokens are exactly the
    plain engine's: same forward, same picks. bf16 differences elsewhere come only from the batch shapes."""
    bf16 = dict(CONFIG, dtype="bfloat16")
    want = tokens(LLM(str(target_dir), **bf16).generate(prompts["untied"], GREEDY))
    off = spec_llm(target_dir, "ngram", dtype="bfloat16", speculative_disable_by_batch_size=1)
    on = spec_llm(target_dir, "ngram", dtype="bfloat16")
    seen: list[bool] = []
    for llm in (off, on):
        execute = llm.engine.runner.execute
        llm.engine.runner.execute = lambda out, float_logits=True, mask=None, execute=execute: (
            seen.append(float_logits) or execute(out, float_logits, mask)
        )
    assert tokens(off.generate(prompts["untied"], GREEDY)) == want
    assert off.engine.get_stats().spec_decode_num_drafts_total == 0
    on.generate(prompts["untied"], GREEDY)
    assert on.engine.get_stats().spec_decode_num_accepted_tokens_total > 0
    assert seen and not any(seen)
    check_all_freed(on)


def test_ngram_corpus_gives_same_tokens(target_dir, prompts, reference, tmp_path):
    """ngram with a corpus holding the continuations of half the prompts (and noise): tokens unchanged."""
    from engine.spec_decode import NgramCorpus

    g = torch.Generator().manual_seed(3)
    seqs = [p + r for p, r in zip(prompts["untied"][::2], reference["untied"][::2])]
    noise = [torch.randint(3, 49000, (40,), generator=g).tolist() for _ in range(4)]
    own = spec_llm(target_dir, "ngram", ngram_prompt_lookup_min=2)
    llm = spec_llm(target_dir, "ngram", ngram_prompt_lookup_min=2)
    llm.engine.proposer.corpus = NgramCorpus(seqs + noise)
    for engine in (own, llm):
        assert tokens(engine.generate(prompts["untied"], GREEDY)) == reference["untied"]
        check_all_freed(engine)
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    assert stats.spec_decode_num_accepted_tokens_total > own.engine.get_stats().spec_decode_num_accepted_tokens_total


def test_ngram_corpus_file_is_read_by_the_engine(target_dir, tmp_path):
    corpus = tmp_path / "replies.jsonl"
    corpus.write_text('{"text": "one two three four five six"}\n')
    llm = spec_llm(target_dir, "ngram", speculative_ngram_corpus=str(corpus))
    assert len(llm.engine.proposer.corpus) > 0
