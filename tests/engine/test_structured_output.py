"""Structured output: every completion parses / matches its constraint, whatever the batch does.

Oracles: ``json.loads`` + ``jsonschema.validate`` for JSON schemas, ``re.fullmatch`` for regexes,
membership for choices; an unconstrained request beside constrained ones gives exactly its tokens
alone. The tiny random model samples near-uniformly, so only the mask keeps its output valid.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest
import torch

from engine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output import (
    GrammarCompiler,
    GrammarError,
    SequenceGrammar,
    apply_bitmask,
    bitmask_words,
    byte_level_tokenizer_json,
)

CONFIG = dict(block_size=4, num_kv_blocks=512, max_num_batched_tokens=256, max_model_len=512, dtype="float32")
#: Bounded fields, so even a random model ends the object within ``max_tokens``.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **CONFIG)


@pytest.fixture(autouse=True)
def engine_is_idle_after(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        engine.check_invariants()
        assert not engine.has_unfinished_requests() and not engine.groups and not engine.requests


def constrained(max_tokens: int = 120, **kwargs) -> dict:
    """SamplingParams fields of a request; ``kwargs`` holds one ``StructuredOutputsParams`` field (+ sampling)."""
    kinds = {k: kwargs.pop(k) for k in list(kwargs) if k in ("json", "regex", "choice", "grammar", "json_object")}
    return dict(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kinds), **kwargs)


def assert_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "structured_outputs sets none; set exactly one of json, regex, choice, grammar, json_object"),
        ({"json": PERSON, "regex": "a"}, "structured_outputs sets json and regex; set exactly one"),
        ({"choice": ["a"], "json_object": True}, "sets choice and json_object"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": 3}, "structured_outputs.json=3; it must be a JSON schema"),
        ({"regex": ""}, "structured_outputs.regex=''; it must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice=[]; it must be a non-empty list"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"json_object": "yes"}, "structured_outputs.json_object='yes'"),
    ],
)
def test_structured_outputs_params_name_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_structured_outputs_as_a_dict():
    params = SamplingParams.from_dict({"max_tokens": 8, "structured_outputs": {"choice": ["a", "b"]}})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert params.structured_outputs.key == ("choice", '["a", "b"]')
    with pytest.raises(ValueError, match=r"structured_outputs has unknown field\(s\) \['guided_json'\]"):
        SamplingParams(structured_outputs={"guided_json": {}})
    with pytest.raises(ValueError, match="structured_outputs with max_tokens=0"):
        SamplingParams(max_tokens=0, prompt_logprobs=1, structured_outputs={"regex": "a"})
    # equal schemas written differently share one cache key
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]})
    b = StructuredOutputsParams(json='{"required": ["x"], "type": "object"}')
    assert a.key == b.key


def test_byte_level_vocabulary_is_read_as_bytes(tiny_llama_dir):
    """The GGUF-converted SmolLM2 tokenizer's decoder is a Sequence; llguidance must see "Ġworld" as " world"."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert json.loads(tokenizer.backend_tokenizer.to_str())["decoder"]["type"] == "Sequence"
    assert json.loads(byte_level_tokenizer_json(tokenizer))["decoder"]["type"] == "ByteLevel"
    import llguidance

    ll = llguidance.LLTokenizer(byte_level_tokenizer_json(tokenizer), n_vocab=49152, eos_token=2)
    ids = tokenizer.encode(" hello world\n\t{", add_special_tokens=False)
    assert [ll.decode_bytes([i]) for i in ids] == [tokenizer.decode([i]).encode() for i in ids]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bitmask_bit_t_of_row_i_allows_token_t(native, dtype):
    """llguidance's layout: token t is bit t % 32 of int32 word t // 32 (a vocabulary not a multiple of 32);
    the C++ kernel and the torch path mask the same entries (words of all and of no allowed tokens included)."""
    from engine import cpu_ops

    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    bitmask[0, 1], bitmask[1, 0], bitmask[2, 3] = -1, 0, 0  # all allowed; none; none, past the vocabulary
    wide = torch.randn(3, 128, generator=g).to(dtype)
    logits, masked = wide[:, :101].clone(), wide.clone()[:, :101]  # masked: rows inside wider ones (stride 128)
    cpu_ops.use_cpu_kernels(native)
    try:
        apply_bitmask(masked, bitmask)
    finally:
        cpu_ops.use_cpu_kernels(True)
    for i in range(3):
        for t in range(101):
            allowed = (int(bitmask[i, t // 32]) >> (t % 32)) & 1
            assert masked[i, t] == (logits[i, t] if allowed else float("-inf"))


def test_mask_thread_masks_as_the_engine_thread_does(tiny_llama_dir):
    """``start_masks`` (the fill on the mask thread during the forward) masks the same logits as ``mask_logits``,
    on grammars at different states, and leaves the unconstrained row alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    vocab = 49152
    compiler = GrammarCompiler(tokenizer, vocab, {tokenizer.eos_token_id})
    try:
        grammars = [SequenceGrammar(compiler, StructuredOutputsParams(json=PERSON)) for _ in range(3)]
        for g in grammars:
            g.future.result(timeout=60)
            assert g.poll() is None and g.ready
        for steps, g in enumerate(grammars):  # advance each by 0, 1, 2 allowed tokens
            for _ in range(steps):
                bitmask = torch.full((1, bitmask_words(vocab)), -1, dtype=torch.int32)
                compiler.fill_bitmask([g], [0], bitmask)
                allowed = [t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
                g.accept(allowed[len(allowed) // 2])
                assert g.error is None
        logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        rows = [0, 2, 3]  # row 1 has no grammar
        expected, masked = logits.clone(), logits.clone()
        compiler.mask_logits(expected, grammars, rows)
        pending = compiler.start_masks(grammars, rows, 4)
        pending.apply(masked)
        pending.wait()
        assert torch.equal(masked, expected) and torch.equal(masked[1], logits[1])
        assert all(bool(torch.isinf(masked[r]).any()) for r in rows)
        assert compiler.num_mask_steps == 2 and compiler.num_masked_tokens == 6
    finally:
        compiler.shutdown()


# ---------------------------------------------------------------- outputs


def test_json_schema_output_validates_greedy_and_sampled_n2(llm):
    outputs = llm.generate(
        ["Describe a person as JSON:", "Another person:"],
        [
            SamplingParams(**constrained(json=PERSON, temperature=0)),
            SamplingParams(**constrained(json=PERSON, temperature=1.0, seed=7, n=2)),
        ],
    )
    completions = [c for o in outputs for c in o.outputs]
    assert len(completions) == 3
    for c in completions:
        assert c.finish_reason == "stop", c
        assert_person(c.text)
        assert c.token_ids[-1] != 2  # the grammar ended the request: no end-of-sequence token was needed
    assert completions[1].text != completions[2].text  # n=2 sampled: two matchers, two different objects


def test_regex_choice_and_grammar_outputs_match(llm):
    params = [
        SamplingParams(**constrained(regex=PHONE, temperature=0)),
        SamplingParams(**constrained(regex=PHONE, temperature=1.0, seed=3, n=2)),
        SamplingParams(**constrained(regex="(hello|goodbye) (world|moon)", temperature=1.0, seed=5)),
        SamplingParams(**constrained(choice=CHOICES, temperature=0)),
        SamplingParams(**constrained(choice=CHOICES, temperature=1.0, seed=11, n=3)),
        SamplingParams(**constrained(grammar='root ::= "yes" | "no" | "ye" "s" "!"', temperature=0.9, seed=2)),
    ]
    outs = llm.generate(["Call me at", "Phone:", "Say", "Sentiment:", "Mood:", "Answer:"], params)
    texts = [[c.text for c in o.outputs] for o in outs]
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert all(re.fullmatch(PHONE, t) for t in texts[0] + texts[1]), texts[:2]
    assert re.fullmatch("(hello|goodbye) (world|moon)", texts[2][0]), texts[2]
    assert all(t in CHOICES for t in texts[3] + texts[4]), texts[3:5]
    assert texts[5][0] in ("yes", "no", "yes!")


def test_json_object_output_is_one_object(llm):
    """Any JSON object; ``max_tokens`` bounds the random model's strings, so the object may be cut."""
    params = [
        SamplingParams(**constrained(json_object=True, max_tokens=200, temperature=1.0, seed=s)) for s in range(6)
    ]
    outs = llm.generate(["{}"] * len(params), params)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished, [o.outputs[0].text for o in outs]
    for c in finished:
        assert isinstance(json.loads(c.text), dict)
    for o in outs:  # the cut ones are a prefix of an object
        assert o.outputs[0].text.startswith("{")


def test_constrained_rows_do_not_change_the_unconstrained_ones_beside_them(llm):
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(["The weather today is"], plain)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["Person:", "The weather today is", "Phone:", "Sentiment:", "Person:"],
        [
            SamplingParams(**constrained(json=PERSON, temperature=0)),
            plain,
            SamplingParams(**constrained(regex=PHONE, temperature=0.7, seed=1)),
            SamplingParams(**constrained(choice=CHOICES, temperature=0)),
            SamplingParams(**constrained(json=PERSON, temperature=0.8, seed=4)),
        ],
    )
    assert mixed[1].outputs[0].token_ids == alone
    assert_person(mixed[0].outputs[0].text)
    assert re.fullmatch(PHONE, mixed[2].outputs[0].text)
    assert mixed[3].outputs[0].text in CHOICES
    assert_person(mixed[4].outputs[0].text)


def test_prefix_cache_hit_gives_the_same_constrained_output(llm):
    prompt = "A long shared system prompt that fills several KV blocks before the question: who is it?"
    params = SamplingParams(**constrained(json=PERSON, temperature=0))
    cold = llm.generate([prompt], params)[0]
    warm = llm.generate([prompt], params)[0]
    assert warm.metrics.num_cached_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_person(warm.outputs[0].text)


def test_stop_string_ends_a_constrained_request_first(llm):
    out = llm.generate(["Call:"], SamplingParams(**constrained(regex=PHONE, temperature=0, stop=")")))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert re.fullmatch(r"\([0-9]{3}", out.text), out.text


def test_min_tokens_does_not_outlast_the_grammar(llm):
    out = llm.generate(["Mood:"], SamplingParams(**constrained(choice=CHOICES, temperature=0, min_tokens=20)))[0]
    assert out.outputs[0].text in CHOICES and out.outputs[0].finish_reason == "stop"


def test_compiled_once_per_constraint(llm):
    compiler = llm.engine.grammar_compiler
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["x", "y"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    before = compiler.num_compiles
    llm.generate(["a", "b"], SamplingParams(**constrained(json=schema, temperature=0)))
    llm.generate(["c"], SamplingParams(**constrained(json=json.dumps(dict(reversed(schema.items()))), temperature=0)))
    assert compiler.num_compiles == before + 1


def test_cost_counters_count_each_compile_and_each_masked_token(llm):
    schema = {"type": "object", "properties": {"z": {"enum": ["p", "q"]}}, "required": ["z"]}
    before = llm.engine.get_stats()
    outs = llm.generate(["a", "b"], SamplingParams(**constrained(json=schema, temperature=0)))
    outs += llm.generate(["c"], SamplingParams(**constrained(choice=["yes", "no"], temperature=0)))
    after = llm.engine.get_stats()
    field = "structured_output_{}_total".format

    def delta(name: str) -> float:
        return getattr(after, field(name)) - getattr(before, field(name))

    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert delta("num_compiles") == 2
    assert delta("compile_seconds") > 0 and delta("mask_seconds") > 0
    # every sampled token was masked first; the two schema requests share their steps (one step masks both rows)
    assert delta("num_masked_tokens") == sum(lengths)
    assert delta("num_mask_steps") == max(lengths[:2]) + lengths[2]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "structured_outputs.json: "),
        ({"json": {"$ref": "#/definitions/missing"}}, "structured_outputs.json: "),
        ({"regex": "a(b"}, "structured_outputs.regex: "),
        ({"regex": "a[^\\x00-\\U0010FFFF]b"}, "structured_outputs.regex: "),
        ({"regex": "[a&&b]"}, "structured_outputs.regex: the regex matches no text; fix it"),
        ({"grammar": "root ::= ("}, "structured_outputs.grammar: "),
    ],
)
def test_a_bad_constraint_fails_alone(llm, fields, message):
    plain = SamplingParams(temperature=0, max_tokens=8)
    alone = llm.generate(["Hello there"], plain)[0].outputs[0].token_ids
    bad, good = llm.generate(["x", "Hello there"], [SamplingParams(max_tokens=8, structured_outputs=fields), plain])
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].error.startswith("GrammarError: " + message), bad.outputs[0].error
    assert good.outputs[0].token_ids == alone


class GatedCompiles:
    """Holds every compile of ``compiler`` until ``release`` (the compile itself is the real one)."""

    def __init__(self, compiler: GrammarCompiler, monkeypatch) -> None:
        self.gate = threading.Event()
        real = compiler._compile

        def held(key):
            self.gate.wait(60)
            return real(key)

        monkeypatch.setattr(compiler, "_compile", held)

    def release(self) -> None:
        self.gate.set()


def test_a_compiling_grammar_never_stalls_other_requests(llm, monkeypatch):
    engine = llm.engine
    gate = GatedCompiles(engine.grammar_compiler, monkeypatch)
    schema = {
        "type": "object",
        "properties": {"slow": {"enum": ["p", "q"]}},
        "required": ["slow"],
        "additionalProperties": False,
    }
    engine.add_request("waits", "Q:", SamplingParams(**constrained(json=schema, temperature=0)))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=6))
    finished = {}
    for _ in range(50):
        for out in engine.step():
            finished[out.request_id] = out
        if "plain" in finished and finished["plain"].finished:
            break
    assert finished["plain"].finished and len(finished["plain"].outputs[0].token_ids) == 6
    assert "waits" not in finished and engine.requests["waits"].waits_for_grammar  # still in the queue, untouched
    gate.release()
    for _ in range(100):
        for out in engine.step():
            finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert json.loads(finished["waits"].outputs[0].text)["slow"] in ("p", "q")


def test_a_compile_over_the_time_bound_fails_its_request_alone(llm, monkeypatch):
    engine = llm.engine
    gate = GatedCompiles(engine.grammar_compiler, monkeypatch)
    monkeypatch.setattr(engine.grammar_compiler, "compile_timeout_s", 0.2)
    try:
        slow, plain = llm.generate(
            ["Q:", "Hello"],
            [
                SamplingParams(**constrained(json={"type": "object", "properties": {"t": {"type": "null"}}})),
                SamplingParams(temperature=0, max_tokens=4),
            ],
        )
    finally:
        gate.release()
    assert slow.outputs[0].finish_reason == "error"
    assert "structured_outputs.json: compiling the grammar took longer than 0.2 s" in slow.outputs[0].error
    assert plain.outputs[0].finish_reason == "length" and len(plain.outputs[0].token_ids) == 4


def test_the_time_bound_counts_from_when_the_grammar_tokenizer_is_ready(llm, monkeypatch):
    """Building llguidance's tokenizer (seconds, once per engine) is not the constraint's fault."""
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.spec.vocab_size, engine.eos_token_ids, 0.2)
    built = threading.Event()
    real = compiler._build_tokenizer

    def slow_build():
        built.wait(60)  # released below, after several time bounds have passed
        return real()

    monkeypatch.setattr(compiler, "_build_tokenizer", slow_build)
    monkeypatch.setattr(engine, "grammar_compiler", compiler)
    timer = threading.Timer(1.0, built.set)
    timer.start()
    try:
        out = llm.generate(["Mood:"], SamplingParams(**constrained(choice=CHOICES, temperature=0)))[0]
    finally:
        built.set()
        timer.cancel()
        compiler.shutdown()
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CHOICES


def test_speculative_decoding_skips_constrained_requests(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **CONFIG, speculative_method="ngram", speculative_adaptive=False)
    repeat = "one two three four one two three four one two three four one two three"
    outs = llm.generate(
        [repeat, repeat],
        [
            SamplingParams(**constrained(regex="(one two three four ){2,3}one", temperature=0)),
            SamplingParams(**constrained(json=PERSON, temperature=0)),
        ],
    )
    assert re.fullmatch("(one two three four ){2,3}one", outs[0].outputs[0].text)
    assert_person(outs[1].outputs[0].text)
    assert llm.engine.get_stats().spec_decode_num_draft_tokens_total == 0
    # an unconstrained request of the same engine still speculates
    llm.generate([repeat], SamplingParams(temperature=0, max_tokens=16))
    assert llm.engine.get_stats().spec_decode_num_draft_tokens_total > 0


def test_async_engine_refuses_a_bad_schema_and_serves_on(tiny_llama_dir):
    async def main(engine):
        with pytest.raises(GrammarError, match="structured_outputs.json: Invalid type: strin"):
            async for _ in engine.generate("x", SamplingParams(structured_outputs={"json": {"type": "strin"}})):
                pass
        final = None
        async for out in engine.generate("Mood:", SamplingParams(**constrained(choice=CHOICES, temperature=0))):
            final = out
        return final

    with AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), **CONFIG)) as engine:
        final = asyncio.run(main(engine))
    assert final.outputs[0].text in CHOICES and final.outputs[0].finish_reason == "stop"


@pytest.mark.integration
def test_real_smollm2_json_schema_regex_and_json_object(smollm2_dir):
    llm = LLM(str(smollm2_dir), max_model_len=1024, num_kv_blocks=256, block_size=16)
    ask = "Reply with a JSON object describing a fictional person: name, age, email, tags and whether active."
    prompts = [llm.apply_chat_template(ask)] * 2 + [llm.apply_chat_template("Give me a US phone number.")] * 2
    prompts.append(llm.apply_chat_template("Reply in JSON: what is the capital of France?"))
    outs = llm.generate(
        prompts,
        [
            SamplingParams(**constrained(json=PERSON, temperature=0, max_tokens=200)),
            SamplingParams(**constrained(json=PERSON, temperature=0.8, seed=1, n=2, max_tokens=200)),
            SamplingParams(**constrained(regex=PHONE, temperature=0)),
            SamplingParams(**constrained(regex=PHONE, temperature=0.8, seed=2, n=2)),
            SamplingParams(**constrained(json_object=True, temperature=0, max_tokens=200)),
        ],
    )
    for c in outs[0].outputs + outs[1].outputs:
        assert c.finish_reason == "stop", c.text
        assert_person(c.text)
    assert all(re.fullmatch(PHONE, c.text) for c in outs[2].outputs + outs[3].outputs)
    assert outs[4].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(outs[4].outputs[0].text), dict)


def test_masked_greedy_rows_pick_the_tokens_of_the_float_path(smollm2_dir, monkeypatch):
    """Greedy constrained rows without logprobs are masked on the bf16 logits before their refinement and take the
    argmax (no float32 copy); the same requests asking for a logprob take float32 logits, masked, then the argmax:
    the same tokens. (No prefix cache: the second run must compute the prompts as the first did.)"""
    llm = LLM(
        str(smollm2_dir),
        dtype="bfloat16",
        max_model_len=1024,
        num_kv_blocks=256,
        block_size=16,
        enable_prefix_caching=False,
    )
    runner, masks = llm.engine.runner, []
    execute = runner.execute

    def spy(out, float_logits=True, mask=None):
        masks.append(mask is not None)
        return execute(out, float_logits, mask)

    monkeypatch.setattr(runner, "execute", spy)
    asks = ["a fictional person", "a retired sailor", "a young chemist"]
    prompts = [llm.apply_chat_template(f"Reply with a JSON object describing {who}.") for who in asks]
    fast = llm.generate(prompts, SamplingParams(**constrained(json=PERSON, temperature=0, max_tokens=100)))
    assert masks and all(masks)
    masks.clear()
    slow = llm.generate(prompts, SamplingParams(**constrained(json=PERSON, temperature=0, max_tokens=100, logprobs=1)))
    assert not any(masks)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]
    for o in fast:
        assert_person(o.outputs[0].text)
