"""Greedy tokens of the engine equal Hugging Face ``generate``, whatever the batching does.

Oracle: ``transformers`` ``generate(do_sample=False)`` on the same checkpoint, one prompt at a
time without padding. Each engine configuration (prefix cache cold/warm, chunked prefill on/off,
forced preemption, alone vs in a batch) must give exactly those tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint.store import hf_greedy_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPT_LENGTHS = [1, 2, 3, 4, 5, 8, 9, 13, 16, 17, 30, 33, 47, 64]


def random_prompts(lengths: list[int], seed: int = 1, shared_prefix: int = 0) -> list[list[int]]:
    """Random token-id prompts of the given lengths; the first ``shared_prefix`` tokens are common."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 49000, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(3, 49000, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference tokens: HF generate per prompt (no padding)."""
    from transformers import AutoModelForCausalLM

    return hf_greedy_tokens(AutoModelForCausalLM.from_pretrained(model_dir).eval(), prompts, max_new_tokens)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(model_dir, **overrides) -> LLM:
    config = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=128, max_model_len=256, dtype="float32")
    config.update(overrides)
    return LLM(str(model_dir), **config)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENGTHS, shared_prefix=0) + random_prompts([3, 11, 20], seed=2, shared_prefix=12)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts):
    return hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("path", ["cpu-default", "fp32-panels", "screened-head"])
def test_greedy_batch_equals_hf(tiny_llama_dir, prompts, reference, path, monkeypatch):
    """fp32-panels: the fp32 linears on the engine's panel GEMM whatever the CPU picks (AVX2-only AMD picks it).
    screened-head: greedy picks read from the lm head's bf16 copy and recomputed in float32 where they can win
    (``engine.model.head_screen``; CPUs with bf16 units pick it), whatever the CPU."""
    import engine.model
    from engine import cpu_ops

    if path == "fp32-panels":
        if not cpu_ops.float_gemv_available():
            pytest.skip("the float GEMV kernels are held off or not built here")
        monkeypatch.setattr(engine.model, "float_panels_fast", lambda: True)
    llm = make_llm(tiny_llama_dir)
    model = llm.engine.runner.model
    if path == "fp32-panels":
        assert model.layers[0].gate_up.panels_gated and model.min_rows == 1
    if path == "screened-head":
        model.head_screen = engine.model.build_head_screen(model.lm_head.weight)
        calls = []
        screen_logits = cpu_ops.screen_logits
        monkeypatch.setattr(cpu_ops, "screen_logits", lambda *a: calls.append(1) or screen_logits(*a))
    outputs = llm.generate(prompts, GREEDY)
    if path == "screened-head":
        assert calls
    assert tokens(outputs) == reference
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    llm.engine.check_invariants()


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_greedy_other_architectures_equal_hf(tmp_path, model_type):
    from engine.checkpoint.store import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / model_type, seed=3, model_type=model_type)
    prompts = random_prompts([1, 5, 9, 16, 23], seed=4)
    llm = make_llm(model_dir)
    assert tokens(llm.generate(prompts, GREEDY)) == hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    llm.engine.check_invariants()


def test_prefix_cache_cold_and_warm_give_same_tokens(tiny_llama_dir, prompts, reference):
    llm = make_llm(tiny_llama_dir)
    cold = tokens(llm.generate(prompts, GREEDY))
    hits_before = llm.engine.get_stats().prefix_cache_hits_tokens_total
    warm = tokens(llm.generate(prompts, GREEDY))
    stats = llm.engine.get_stats()
    assert cold == warm == reference
    assert stats.prefix_cache_hits_tokens_total > hits_before
    llm.engine.check_invariants()


def test_chunked_prefill_on_and_off_give_same_tokens(tiny_llama_dir, prompts, reference):
    chunked = make_llm(tiny_llama_dir, max_num_batched_tokens=7, enable_prefix_caching=False)
    whole = make_llm(
        tiny_llama_dir, max_num_batched_tokens=256, enable_chunked_prefill=False, enable_prefix_caching=False
    )
    assert tokens(chunked.generate(prompts, GREEDY)) == reference
    assert tokens(whole.generate(prompts, GREEDY)) == reference
    assert chunked.engine.get_stats().num_steps_total > whole.engine.get_stats().num_steps_total
    chunked.engine.check_invariants()
    whole.engine.check_invariants()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_forced_preemption_gives_same_tokens(tiny_llama_dir, prompts, reference, prefix_caching):
    llm = make_llm(tiny_llama_dir, num_kv_blocks=24, max_model_len=80, enable_prefix_caching=prefix_caching)
    assert tokens(llm.generate(prompts, GREEDY)) == reference
    assert llm.engine.get_stats().num_preemptions_total > 0
    llm.engine.check_invariants()


def test_alone_equals_inside_batch_of_32(tiny_llama_dir):
    prompts = random_prompts([5 + (i * 7) % 40 for i in range(32)], seed=5, shared_prefix=6)
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=64)
    batch = tokens(llm.generate(prompts, GREEDY))
    alone = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    for i in (0, 13, 31):
        assert tokens(alone.generate([prompts[i]], GREEDY)) == [batch[i]]
    llm.engine.check_invariants()


@pytest.mark.integration
def test_real_smollm2_greedy_equals_hf(smollm2_dir):
    llm = LLM(str(smollm2_dir), max_model_len=512, num_kv_blocks=128, dtype="float32")
    tok = llm.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Here is a short poem about the sea:\n"]
    prompts = [tok(t).input_ids for t in texts]
    chat = llm.apply_chat_template("What is the boiling point of water?")
    prompts.append(chat)
    sp = SamplingParams(temperature=0, max_tokens=32)
    outputs = llm.generate(prompts, sp)
    reference = hf_greedy(smollm2_dir, prompts, 32)
    # HF stops at EOS too (eos_token_id from generation_config), so lengths match as well.
    assert tokens(outputs) == reference
    assert outputs[0].outputs[0].text == tok.decode(reference[0], skip_special_tokens=True)
    llm.engine.check_invariants()


#: Chat questions whose first-token logprobs (top 10) the bf16 tie test reads.
TIE_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain what a neural network is in one sentence.",
    "How do I make a cup of tea?",
    "What is 12 times 7?",
    "What is your favourite book and why?",
)


@pytest.mark.integration
def test_real_smollm2_bf16_top_logprobs_have_no_ties_where_fp32_has_none(smollm2_dir):
    """bf16 logits from the lm head's GEMM are rounded to 8 bits (0.125 apart near 20): before the exact top
    was recomputed, 5 of these 6 questions had tied values among their 10 top first-token logprobs (up to 4 ties)
    and the France question chose "L" on a tie. The fp32 engine's top 10 hold no ties, nor may bf16's."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=10)
    top = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(smollm2_dir), dtype=dtype, max_model_len=256, num_kv_blocks=64)
        outs = llm.generate(list(TIE_PROMPTS), params, chat=True)
        top[dtype] = [sorted(o.outputs[0].logprobs[0].values(), reverse=True)[:10] for o in outs]
    for prompt, fp32, bf16 in zip(TIE_PROMPTS, top["float32"], top["bfloat16"]):
        assert len(set(fp32)) == len(fp32) == 10, prompt
        assert len(set(bf16)) == len(bf16) == 10, f"{prompt}: tied bf16 logprobs {bf16}"


@pytest.mark.integration
def test_real_smollm2_bf16_answers_the_readme_question_as_fp32_does(smollm2_dir):
    """The question of the README's `lmforge generate` example, chat, greedy: fp32 ranks "The" 0.08 nats above
    "L" as the first token, so small bf16 differences decide it. With the RMSNorm weights folded into the bf16
    weights the engine answered "L'Étoile, la Marseillaise, ..."; kept apart, as Hugging Face bf16 does, it
    answers as fp32 does."""
    params = SamplingParams(temperature=0, max_tokens=12)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(smollm2_dir), dtype=dtype, max_model_len=256, num_kv_blocks=64)
        text = llm.generate(["What is the capital of France?"], params, chat=True)[0].outputs[0].text
        assert text.startswith("The capital of France is Paris"), f"{dtype}: {text!r}"


def test_bfloat16_tracks_hf_bfloat16(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    prompts = random_prompts([3, 10, 21], seed=6)
    llm = make_llm(tiny_llama_dir, dtype="bfloat16")
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    outs = tokens(llm.generate(prompts, GREEDY))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    matched = total = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):  # teacher-forced: HF's choice after each engine prefix
            logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
            matched += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), out))
            total += len(out)
    assert matched / total >= 0.8, f"bf16 engine agrees with HF bf16 on {matched}/{total} tokens"
    llm.engine.check_invariants()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_pads_its_packed_linears_to_the_fast_row_count(tiny_llama_dir, dtype):
    """A model with oneDNN-packed float linears runs steps of 1 to 3 tokens with zero rows up to
    ``PACKED_MIN_ROWS`` (oneDNN's kernels below that are slower); the real rows' logits are those of the
    unpadded step, and the padded rows are never stored in the KV cache. fp32 on Intel is not padded (one
    row takes MKL's GEMV on the plain weight), nor where fp32 runs the engine's panel GEMM (``float_panels``)."""
    from engine.model import PACKED_MIN_ROWS, float_panels, packed_rows, pad_rows
    from engine.platform import mkl_gemv_fast
    from engine.scheduler import ScheduledSequence, SchedulerOutput
    from engine.sequence import Sequence

    x = torch.ones(2, 3)
    assert torch.equal(pad_rows(x, 4), torch.cat((x, torch.zeros(2, 3)))) and pad_rows(x, 2) is x
    llm = make_llm(tiny_llama_dir, dtype=dtype)
    runner = llm.engine.runner
    fp32_unpadded = dtype == "float32" and (mkl_gemv_fast() or float_panels("cpu", torch.float32))
    if packed_rows("cpu", getattr(torch, dtype)) is None or fp32_unpadded:
        assert runner.model.min_rows == 1
        return
    assert runner.model.min_rows == PACKED_MIN_ROWS
    seq = Sequence("a", None, random_prompts([12], seed=9)[0], GREEDY, None, None)
    llm.engine.block_manager.allocate_slots(seq, seq.num_tokens + 3)
    seq.num_computed_tokens = seq.num_tokens - 1
    for proposals in ([], [5], [5, 6]):
        out = SchedulerOutput([ScheduledSequence(seq, 1 + len(proposals), proposals)], 1 + len(proposals), [])
        runner.kv_cache.zero_()
        padded = runner.execute(out)  # [1 + m, vocab]
        written = runner.kv_cache.clone()
        runner.model.min_rows = 1
        runner.kv_cache.zero_()
        plain = runner.execute(out)
        runner.model.min_rows = PACKED_MIN_ROWS
        assert torch.equal(written, runner.kv_cache)  # the zero rows wrote no K/V
        tolerance = 0.02 if dtype == "bfloat16" else 1e-4
        torch.testing.assert_close(padded, plain, rtol=tolerance, atol=tolerance)
        assert torch.equal(padded.argmax(-1), plain.argmax(-1))
