"""LoRA adapters in the engine: greedy tokens of each adapter in a mixed batch equal PEFT's ``PeftModel`` alone.

Oracle: ``peft.PeftModel`` on the base (``generate(do_sample=False)``, one prompt at a time). Adapters are made
with PEFT (``init_lora_weights=False`` and a random ``B``, so every adapter changes the output) or trained by
``lmforge finetune --lora``. Also: the prefix cache never shares KV across adapters; eviction and reload with one
slot; bad adapters fail alone; bf16 and INT8 bases track the adapted fp32 model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.checkpoint.store import Manifest, hf_greedy_tokens, make_tiny_llama, write_manifest
from engine.lora import LoRAError
from tests.engine.test_engine_greedy import random_prompts
from tests.engine.test_engine_requests import run_to_end

GREEDY = SamplingParams(temperature=0, max_tokens=8)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: (rank, target modules) of the three test adapters: different ranks, fused and unfused targets
ADAPTERS = {
    "a1": (4, ["q_proj", "v_proj"]),
    "a2": (8, ALL_MODULES),
    "a3": (16, ["o_proj", "up_proj", "down_proj"]),
}


def make_peft_adapter(base: Path, out: Path, rank: int, targets: list[str], seed: int, b_std: float = 0.5) -> Path:
    """A PEFT LoRA adapter of ``base`` with random A and B (``B ~ N(0, b_std)``), saved to ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, b_std)
    peft_model.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path | None, state_dict: dict | None = None):
    """``PeftModel`` of ``adapter`` on ``base`` (fp32, eval); the plain base for ``adapter=None``. ``state_dict``
    replaces the base's weights first (the dequantized INT8 weights)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    if state_dict is not None:
        head = state_dict.pop("lm_head.weight", None)
        if head is not None:
            model.lm_head.weight = torch.nn.Parameter(head)  # unties the quantized head
        model.load_state_dict(state_dict, strict=False)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def lora_llm(model_dir, **overrides) -> LLM:
    config = dict(
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        max_model_len=256,
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
    )
    config.update(overrides)
    return LLM(str(model_dir), **config)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for i, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        path = make_peft_adapter(tiny_llama_dir, root / name, rank, targets, seed=10 + i)
        made[name] = LoRARequest(name, i + 1, str(path))
    return made


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([3, 9, 17, 30], seed=7)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, adapters, prompts) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens of every prompt, per adapter (``None``: the base)."""
    out = {}
    for name in [None, *adapters]:
        model = peft_model(tiny_llama_dir, None if name is None else Path(adapters[name].lora_path))
        out[name] = hf_greedy_tokens(model, prompts, GREEDY.max_tokens)
    return out


def test_mixed_batch_equals_peft_per_adapter_in_one_forward_per_step(tiny_llama_dir, adapters, prompts, reference):
    names = [None, *adapters]
    assert all(reference[n] != reference[None] for n in adapters)  # every adapter changes the greedy output
    llm = lora_llm(tiny_llama_dir)
    engine = llm.engine
    calls, step_loras = [], []
    forward, execute = engine.runner.model.forward, engine.runner.execute

    def counting_forward(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    def recording_execute(out, *args, **kwargs):
        step_loras.append({item.seq.lora_request for item in out.scheduled})
        return execute(out, *args, **kwargs)

    engine.runner.model.forward, engine.runner.execute = counting_forward, recording_execute
    batch = [(p, name) for p in prompts for name in names]  # every prompt under every adapter and the base
    outputs = llm.generate(
        [p for p, _ in batch], GREEDY, lora_request=[None if n is None else adapters[n] for _, n in batch]
    )
    for (prompt, name), out in zip(batch, outputs):
        assert out.outputs[0].token_ids == reference[name][prompts.index(prompt)], f"adapter {name}, prompt {prompt}"
        assert out.lora_request == (None if name is None else adapters[name])
    assert len(calls) == engine.num_steps_total  # one forward pass per step, whatever the adapters
    assert max(len(s) for s in step_loras) == 4  # some steps mixed three adapters and the base
    engine.check_invariants()
    assert engine.list_loras() == {1, 2, 3}


def test_prefix_cache_blocks_are_shared_by_one_adapter_never_across_adapters(tiny_llama_dir, adapters):
    prompt = random_prompts([41], seed=11)[0]  # 10 full blocks of 4 before the last token
    llm = lora_llm(tiny_llama_dir)
    a1, a2 = adapters["a1"], adapters["a2"]

    def run(lora):
        out = llm.generate([prompt], GREEDY, lora_request=lora)[0]
        return out.metrics.num_cached_tokens, out.outputs[0].token_ids

    cached_a1, tokens_a1 = run(a1)
    cached_a2, tokens_a2 = run(a2)
    cached_base, tokens_base = run(None)
    cached_a1_again, tokens_a1_again = run(a1)
    cached_a2_again, _ = run(a2)
    assert (cached_a1, cached_a2, cached_base) == (0, 0, 0)  # the same tokens, three different KV caches
    assert cached_a1_again == cached_a2_again == 40  # the same adapter shares its blocks
    assert tokens_a1_again == tokens_a1 and len({tuple(tokens_a1), tuple(tokens_a2), tuple(tokens_base)}) == 3
    bm = llm.engine.block_manager
    seq_hashes = {}
    for lora in (a1, a2, None):
        from engine.sequence import Sequence

        seq = Sequence("probe", None, prompt, GREEDY, None, None)
        seq.lora_request, seq.lora_hash = lora, None if lora is None else llm.engine.lora_manager.check(lora)
        seq_hashes[lora] = bm.full_block_hashes(seq)
        assert len(bm.find_cached_prefix(seq)) == 10
    assert len({h[0] for h in seq_hashes.values()}) == 3  # different from the first block on
    llm.engine.check_invariants()


def test_a_running_request_of_another_adapter_never_donates_its_kv(tiny_llama_dir, adapters, reference, prompts):
    """Two requests with the same prompt in flight together: the partial-block copy between running requests
    (``BlockManager.find_partial_block``) happens within one adapter, never across."""
    llm = lora_llm(tiny_llama_dir, enable_prefix_caching=True)
    engine = llm.engine
    prompt = prompts[3]  # 30 tokens: 7 full blocks and 2 tokens
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("first", prompt, long, lora_request=adapters["a1"])
    for _ in range(3):
        engine.step()
    engine.add_request("other", prompt, GREEDY, lora_request=adapters["a3"])
    engine.add_request("same", prompt, GREEDY, lora_request=adapters["a1"])
    finals = run_to_end(engine, 200)
    assert finals["other"].metrics.num_cached_tokens == 0
    assert finals["same"].metrics.num_cached_tokens == 29  # every token but the last, from a1's first request
    assert finals["other"].outputs[0].token_ids == reference["a3"][3]
    assert finals["same"].outputs[0].token_ids == reference["a1"][3]
    engine.check_invariants()


def test_one_slot_two_adapters_in_flight_evicts_and_reloads(tiny_llama_dir, adapters, prompts, reference):
    llm = lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    seen = []
    execute = engine.runner.execute

    def recording_execute(out, *args, **kwargs):
        seen.append({item.seq.lora_request.lora_name for item in out.scheduled if item.seq.lora_request})
        return execute(out, *args, **kwargs)

    engine.runner.execute = recording_execute
    names = ["a1", "a2", "a1", "a2", None, "a2", "a1", "a2"]
    batch_prompts = [prompts[i % len(prompts)] for i in range(len(names))]
    outputs = llm.generate(
        batch_prompts, GREEDY, lora_request=[None if n is None else adapters[n] for n in names]
    )  # a1 is evicted from memory when a2 is checked (max_cpu_loras=1), with its requests waiting
    for name, prompt, out in zip(names, batch_prompts, outputs):
        assert out.outputs[0].token_ids == reference[name][prompts.index(prompt)], f"adapter {name}"
        assert out.outputs[0].finish_reason == "length"
    assert all(len(s) <= 1 for s in seen)  # never two adapters in one step
    order = [next(iter(s)) for s in seen if s]
    switches = sum(a != b for a, b in zip(order, order[1:]))
    manager = engine.lora_manager
    assert switches >= 1 and manager.num_loads_total >= 3 and manager.num_evictions_total >= 2  # reloaded
    engine.check_invariants()


def test_adapter_files_removed_while_queued_fail_only_its_requests(
    tiny_llama_dir, adapters, prompts, reference, tmp_path
):
    doomed_dir = shutil.copytree(adapters["a2"].lora_path, tmp_path / "doomed")
    doomed = LoRARequest("doomed", 9, str(doomed_dir))
    llm = lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    engine.add_request("good-0", prompts[0], GREEDY, lora_request=adapters["a1"])
    engine.add_request("bad-0", prompts[1], GREEDY, lora_request=doomed)
    engine.add_request("good-1", prompts[2], GREEDY, lora_request=adapters["a1"])  # evicts the doomed one
    engine.add_request("base", prompts[3], GREEDY)
    shutil.rmtree(doomed_dir)
    finals = run_to_end(engine, 200)
    bad = finals["bad-0"].outputs[0]
    assert bad.finish_reason == "error" and "no such adapter directory" in bad.error and "doomed" in bad.error
    assert finals["good-0"].outputs[0].token_ids == reference["a1"][0]
    assert finals["good-1"].outputs[0].token_ids == reference["a1"][2]
    assert finals["base"].outputs[0].token_ids == reference[None][3]
    engine.check_invariants()


def test_remove_lora_keeps_queued_requests_on_their_own_weights(tiny_llama_dir, adapters, prompts, reference):
    llm = lora_llm(tiny_llama_dir)
    engine = llm.engine
    engine.add_request("r", prompts[2], GREEDY, lora_request=adapters["a3"])
    engine.step()
    assert engine.remove_lora(3) and 3 not in engine.list_loras()
    # the id goes to another adapter; the queued request still runs on a3's weights (read again from disk)
    engine.add_request("s", prompts[2], GREEDY, lora_request=LoRARequest("other", 3, adapters["a1"].lora_path))
    finals = {}
    for _ in range(100):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert finals["r"].outputs[0].token_ids == reference["a3"][2]
    assert finals["s"].outputs[0].token_ids == reference["a1"][2]


# ------------------------------------------------------------------------------------ bad input


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def _copy(adapter: LoRARequest, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(adapter.lora_path, tmp_path / name))


def bad_rank(adapters, tmp_path, tiny):
    return LoRARequest("big", 5, str(make_peft_adapter(tiny, tmp_path / "big", 32, ["q_proj"], seed=1))), (
        "rank 32",
        "max_lora_rank=16",
    )


def bad_hidden_size(adapters, tmp_path, tiny):
    other = make_tiny_llama(tmp_path / "wide", seed=1, hidden_size=128, intermediate_size=256)
    path = make_peft_adapter(other, tmp_path / "wide-adapter", 4, ["q_proj"], seed=1)
    return LoRARequest("wide", 5, str(path)), ("q_proj.lora_A takes 128 inputs", "hidden_size is 64")


def bad_vocab(adapters, tmp_path, tiny):
    path = _copy(adapters["a1"], tmp_path, "vocab")
    write_manifest(path, Manifest(source="x", method="finetune-lora", config={"base": {"vocab_size": 32000}}))
    return LoRARequest("vocab", 5, str(path)), ("vocab_size=32000", "49152")


def bad_missing(adapters, tmp_path, tiny):
    return LoRARequest("gone", 5, str(tmp_path / "nowhere")), ("lora_path=", "no such adapter directory")


def bad_a_file(adapters, tmp_path, tiny):
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes((Path(adapters["a1"].lora_path) / "adapter_model.safetensors").read_bytes())
    return LoRARequest("file", 5, str(path)), ("lora_path=", "is a file, not an adapter directory")


def bad_pickle_only(adapters, tmp_path, tiny):
    path = _copy(adapters["a1"], tmp_path, "pickled")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    return LoRARequest("pickled", 5, str(path)), ("no adapter_model.safetensors", "adapter_model.bin", "pickled")


def bad_truncated(adapters, tmp_path, tiny):
    path = _copy(adapters["a1"], tmp_path, "truncated")
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    return LoRARequest("truncated", 5, str(path)), ("corrupt or truncated",)


def bad_config(adapters, tmp_path, tiny):
    path = _copy(adapters["a1"], tmp_path, "dora")
    config = json.loads((path / "adapter_config.json").read_text())
    _write_json(path / "adapter_config.json", {**config, "use_dora": True})
    return LoRARequest("dora", 5, str(path)), ("use_dora=True", "DoRA")


def bad_module(adapters, tmp_path, tiny):
    path = make_peft_adapter(tiny, tmp_path / "head", 4, ["q_proj", "lm_head"], seed=2)
    return LoRARequest("head", 5, str(path)), ("lm_head", "the engine adapts q_proj")


def bad_id(adapters, tmp_path, tiny):
    return LoRARequest("impostor", 1, adapters["a2"].lora_path), ("lora_int_id=1 is adapter 'a1'",)


@pytest.mark.parametrize(
    "make",
    [
        bad_rank,
        bad_hidden_size,
        bad_vocab,
        bad_missing,
        bad_a_file,
        bad_pickle_only,
        bad_truncated,
        bad_config,
        bad_module,
        bad_id,
    ],
)
def test_a_bad_adapter_fails_alone_naming_the_field(make, tiny_llama_dir, adapters, prompts, reference, tmp_path):
    llm = lora_llm(tiny_llama_dir)
    engine = llm.engine
    engine.add_request("good", prompts[1], GREEDY, lora_request=adapters["a1"])
    bad, words = make(adapters, tmp_path, tiny_llama_dir)
    with pytest.raises(LoRAError) as info:
        engine.add_request("bad", prompts[0], GREEDY, lora_request=bad)
    for word in words:
        assert word in str(info.value)
    finals = {}
    for _ in range(100):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert set(finals) == {"good"} and finals["good"].outputs[0].token_ids == reference["a1"][1]
    engine.check_invariants()


def test_lora_requests_need_enable_lora_and_a_lora_request(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)
    with pytest.raises(LoRAError, match="enable_lora=True"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=adapters["a1"])
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="max_cpu_loras=1 < max_loras=2"):
        LLM(str(tiny_llama_dir), enable_lora=True, max_loras=2, max_cpu_loras=1)
    lora = lora_llm(tiny_llama_dir)
    with pytest.raises(LoRAError, match="lora_request="):
        lora.engine.add_request("x", [5, 6, 7], GREEDY, lora_request="a1")


# ------------------------------------------------------------------------------------ bf16 and INT8 bases


@pytest.mark.parametrize(("scheme", "dtype"), [(None, "bfloat16"), ("w8a8", "float32"), ("weight-only", "bfloat16")])
def test_adapters_on_bf16_and_int8_bases_track_the_adapted_model(scheme, dtype, tmp_path):
    """An adapter made on the fp32 base runs on its bf16 and INT8 versions: teacher-forced, the engine's greedy
    tokens agree with ``PeftModel`` on the (dequantized) base as well as the base alone agrees with HF."""
    from tests.engine.test_engine_int8 import write_int8_checkpoint

    src = make_tiny_llama(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=256)
    state = None
    model_dir = src
    if scheme is not None:
        state = write_int8_checkpoint(src, tmp_path / "int8", scheme)
        model_dir = tmp_path / "int8"
    adapter = make_peft_adapter(src, tmp_path / "adapter", 8, ALL_MODULES, seed=4, b_std=0.05)
    reference = peft_model(src, adapter, dict(state) if state else None)
    llm = lora_llm(model_dir, dtype=dtype, max_num_batched_tokens=128)
    if scheme is not None:
        assert llm.engine.runner.is_int8
    lora = LoRARequest("a", 1, str(adapter))
    test_prompts = random_prompts([4, 9, 15, 22, 30, 7], seed=23)
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(test_prompts + test_prompts, params, lora_request=[lora] * 6 + [None] * 6)
    adapted, plain = outs[:6], outs[6:]
    assert [o.outputs[0].token_ids for o in adapted] != [o.outputs[0].token_ids for o in plain]
    matched = total = 0
    with torch.inference_mode():
        for prompt, out in zip(test_prompts, adapted):
            ids = torch.tensor([prompt + out.outputs[0].token_ids])
            choice = reference(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
            matched += sum(a == b for a, b in zip(choice, out.outputs[0].token_ids))
            total += len(choice)
    assert matched / total >= 0.8, f"adapter on the {scheme or dtype} base agrees with PEFT on {matched}/{total}"
    llm.engine.check_invariants()


# ------------------------------------------------------------------------------------ the real model


@pytest.mark.integration
def test_smollm2_adapter_trained_by_lmforge_finetune_equals_peft_in_a_mixed_batch(smollm2_dir, tmp_path):
    """``lmforge finetune --lora`` for a few steps, then that adapter, two PEFT adapters of other ranks and the
    base in one batch on SmolLM2-135M (fp32): each adapter's greedy tokens equal ``PeftModel``'s alone."""
    from compress.data.prepare import DataConfig, prepare
    from engine.checkpoint.store import read_manifest
    from lmforge_cli import main

    data = tmp_path / "data"
    prepare(DataConfig(), data, verbose=False)
    for name, keep in (("train.jsonl", 32), ("val.jsonl", 4)):
        lines = (data / name).read_text().splitlines()[:keep]
        (data / name).write_text("\n".join(lines) + "\n")
    run = tmp_path / "ft"
    status = main(
        ["finetune", "--model", str(smollm2_dir), "--data", str(data), "--run-dir", str(run), "--lora"]
        + ["--lora-r", "8", "--max-steps", "3", "--micro-batch-size", "2", "--max-length", "48", "--lr", "1e-2"]
        + ["--eval-every", "0", "--precision", "fp32", "--no-progress"]
    )
    assert status == 0
    trained = run / "final"
    assert read_manifest(trained).parent == str(smollm2_dir)
    loras = {
        "trained": LoRARequest("trained", 1, str(trained)),
        "r4": LoRARequest("r4", 2, str(make_peft_adapter(smollm2_dir, tmp_path / "r4", 4, ["q_proj", "v_proj"], 1))),
        "r16": LoRARequest(
            "r16", 3, str(make_peft_adapter(smollm2_dir, tmp_path / "r16", 16, ["gate_proj", "down_proj"], 2, 0.05))
        ),
    }
    llm = LLM(
        str(smollm2_dir),
        dtype="float32",
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        max_model_len=256,
        num_kv_blocks=128,
        block_size=16,
    )
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "Name three colors."]
    prompts = [llm.apply_chat_template(c) for c in chats]
    names = [None, *loras]
    params = SamplingParams(temperature=0, max_tokens=12)
    batch = [(p, n) for p in prompts for n in names]
    outs = llm.generate([p for p, _ in batch], params, lora_request=[loras.get(n) for _, n in batch])
    got = {(tuple(p), n): o.outputs[0].token_ids for (p, n), o in zip(batch, outs)}
    for name in names:
        expected = hf_greedy_tokens(
            peft_model(smollm2_dir, None if name is None else Path(loras[name].lora_path)), prompts, 12
        )
        for prompt, want in zip(prompts, expected):
            assert got[(tuple(prompt), name)] == want, f"adapter {name}"
    assert any(got[(tuple(p), "trained")] != got[(tuple(p), None)] for p in prompts)  # training changed it
    llm.engine.check_invariants()
