"""lmforge evaluate: perplexity against a direct computation, masking, agreement, data errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

import lmforge_cli
from compress.evaluate.quality import (
    EvalConfig,
    EvaluationError,
    agreement,
    default_heldout_records,
    encode_record,
    evaluate,
    format_table,
    load_for_eval,
    perplexity,
    quality_metrics,
    read_records,
    reference_logprobs,
)
from engine.checkpoint.store import CheckpointError, read_manifest
from tests.conftest import DIALOG, DIALOG_ASSISTANT_TEXT

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France, and it is lovely in spring."]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_for_eval(tiny_llama_dir, num_threads=1)


def test_perplexity_matches_direct_computation(tiny):
    got, count = perplexity(tiny.model, tiny.tokenizer, [{"text": t} for t in TEXTS])
    total, n = 0.0, 0
    for text in TEXTS:
        ids = tiny.tokenizer(text, return_tensors="pt")["input_ids"]  # [1, T]
        with torch.no_grad():
            loss = tiny.model(input_ids=ids, labels=ids).loss  # mean over T - 1 predictions
        total += float(loss) * (ids.shape[1] - 1)
        n += ids.shape[1] - 1
    assert count == n
    assert got == pytest.approx(math.exp(total / n), rel=1e-4)


def test_chat_records_score_only_assistant_replies(tiny):
    ids, scored = encode_record(tiny.tokenizer, DIALOG)
    assert len(ids) == len(scored) and not scored[0]
    scored_text = tiny.tokenizer.decode([i for i, s in zip(ids, scored) if s])
    assert scored_text == DIALOG_ASSISTANT_TEXT


def test_kl_and_same_top1_against_a_direct_computation(tiny, tiny_llama_dir):
    records = [{"text": t} for t in TEXTS] + [DIALOG]
    reference = reference_logprobs(tiny.model, tiny.tokenizer, records)
    itself = quality_metrics(tiny.model, tiny.tokenizer, records, reference)
    assert itself["kl_mean"] == 0 and itself["kl_max"] == 0 and itself["same_top1"] == 1.0
    perturbed = load_for_eval(tiny_llama_dir).model
    torch.manual_seed(0)
    with torch.no_grad():
        for p in perturbed.model.layers[0].parameters():
            p.add_(torch.randn_like(p) * 0.05)
    got = quality_metrics(perturbed, tiny.tokenizer, records, reference)
    kls, same = [], []
    for record in records:
        ids, scored = encode_record(tiny.tokenizer, record)
        batch = torch.tensor([ids])
        with torch.no_grad():
            p = torch.log_softmax(tiny.model(input_ids=batch).logits[0, :-1].double(), -1)
            q = torch.log_softmax(perturbed(input_ids=batch).logits[0, :-1].double(), -1)
        mask = torch.tensor(scored[1:])
        kls.append(torch.nn.functional.kl_div(q[mask], p[mask], log_target=True, reduction="none").sum(-1))
        same.append(p[mask].argmax(-1) == q[mask].argmax(-1))
    kl, same = torch.cat(kls), torch.cat(same)
    assert got["kl_mean"] > 1e-4
    assert got["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-3)
    assert got["kl_p99"] == pytest.approx(float(torch.quantile(kl, 0.99)), rel=1e-3)
    assert got["same_top1"] == pytest.approx(float(same.double().mean()))
    assert got["perplexity_tokens"] == len(kl)
    with pytest.raises(EvaluationError, match="reference was scored on other tokens"):
        quality_metrics(tiny.model, tiny.tokenizer, records[:2], reference)


def test_agreement_counts_positions_over_the_longer_sequence():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.75
    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2], [5, 6]]) == pytest.approx(4 / 6)


def test_evaluate_writes_metrics_and_table(tiny_llama_dir, tmp_path):
    data = tmp_path / "val.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [DIALOG, {"text": TEXTS[0]}]) + "\n")
    config = EvalConfig(agreement_tokens=6, latency_tokens=8, latency_repeats=2, num_threads=1)
    results = evaluate(
        [tiny_llama_dir], records=read_records(data), data_name=str(data), config=config, log=lambda _: None
    )
    metrics = results[str(tiny_llama_dir)]
    assert metrics["greedy_agreement"] == 1.0 and metrics["eval_data"] == str(data)
    assert metrics["kl_mean"] == 0 and metrics["kl_p99"] == 0 and metrics["same_top1"] == 1.0
    assert metrics["perplexity"] > 1 and metrics["decode_ms_per_token"] > 0
    assert metrics["num_parameters"] == read_manifest(tiny_llama_dir).num_parameters
    assert read_manifest(tiny_llama_dir).metrics["perplexity"] == metrics["perplexity"]
    assert tiny_llama_dir.name in format_table(results)


KV = ("bfloat16", "int8")


def test_engine_rows_judge_a_kv_cache_dtype_against_the_first(tiny_llama_dir, tiny):
    """``kv_cache_dtypes``: the checkpoint runs on the engine once per KV dtype; the engine's teacher-forced
    fp32 logits equal Hugging Face's, the reference row agrees with itself, the int8 row is close, and no
    manifest gets engine metrics."""
    engine_fp32 = load_for_eval(tiny_llama_dir, kv_cache_dtype="auto", engine_dtype="float32", max_model_len=256)
    ids = encode_record(tiny.tokenizer, DIALOG)[0]
    x = torch.tensor([ids])
    torch.testing.assert_close(engine_fp32.model(x).logits, tiny.model(x).logits.float(), atol=2e-4, rtol=1e-4)
    assert engine_fp32.model.generate(x[:, :5], max_new_tokens=3, min_new_tokens=3).shape == (1, 8)
    before = read_manifest(tiny_llama_dir).metrics
    config = EvalConfig(agreement_tokens=4, measure_latency=False, num_threads=1)
    results = evaluate(
        [tiny_llama_dir],
        records=[DIALOG, {"text": TEXTS[1]}],
        config=config,
        log=lambda _: None,
        kv_cache_dtypes=list(KV),
        engine_dtype="bfloat16",
    )
    ref, int8 = results[f"{tiny_llama_dir} [kv bfloat16]"], results[f"{tiny_llama_dir} [kv int8]"]
    assert ref["kind"] == int8["kind"] == "engine" and int8["kv_cache_dtype"] == "int8"
    assert ref["kl_mean"] == 0 and ref["same_top1"] == 1.0 and ref["greedy_agreement"] == 1.0
    assert int8["reference"] == f"{tiny_llama_dir} [kv bfloat16]"
    assert int8["kl_mean"] < 0.05 and int8["same_top1"] >= 0.9  # on a tiny random model the KL may round to 0
    kv = {d: load_for_eval(tiny_llama_dir, kv_cache_dtype=d, engine_dtype="bfloat16", max_model_len=256) for d in KV}
    assert not torch.equal(kv["bfloat16"].model(x).logits, kv["int8"].model(x).logits)  # the int8 cache was read
    assert read_manifest(tiny_llama_dir).metrics == before
    assert "[kv int8]" in format_table(results)
    with pytest.raises(EvaluationError, match="--kv-cache-dtype: unknown fp8"):
        evaluate([tiny_llama_dir], records=[DIALOG], kv_cache_dtypes=["fp8"])


def test_default_heldout_data_is_english_dialogs():
    records, name = default_heldout_records()
    assert len(records) >= 10 and "chatterbot:english" in name
    assert all(r["messages"][1]["role"] == "assistant" for r in records)


def test_bad_inputs_name_the_file_or_field(tiny_llama_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"text": "fine"}) + "\n" + json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n"
    )
    with pytest.raises(EvaluationError, match=r"bad.jsonl:2: messages\[0\]"):
        read_records(bad)
    with pytest.raises(EvaluationError, match="missing.jsonl: file not found"):
        read_records(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="latency_tokens=0"):
        EvalConfig(latency_tokens=0)
    with pytest.raises(CheckpointError, match="nope.*not found"):
        evaluate([tiny_llama_dir, tmp_path / "nope"], records=[{"text": "hi"}])
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        evaluate(["minilm-l6"], records=[{"text": "hi"}])
    assert lmforge_cli.main(["evaluate", str(tmp_path / "nope")]) == 1
    assert "nope: checkpoint not found" in capsys.readouterr().err


def test_evaluate_judges_an_adapter_on_the_int8_base_against_it_on_the_fp32_base(tmp_path):
    """``--lora`` runs one adapter on every checkpoint: the reference's perplexity is ``PeftModel``'s on the fp32
    base, the INT8 base gets KL / same top-1 against it, and no manifest takes the adapted metrics."""
    from engine.checkpoint.store import make_tiny_llama
    from tests.engine.test_engine_int8 import write_int8_checkpoint
    from tests.engine.test_engine_lora import ALL_MODULES, make_peft_adapter, peft_model

    base = make_tiny_llama(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=256)
    write_int8_checkpoint(base, tmp_path / "int8", "w8a8")
    adapter = make_peft_adapter(base, tmp_path / "adapter", 8, ALL_MODULES, seed=4, b_std=0.05)
    records = [DIALOG, {"text": TEXTS[0]}, {"text": TEXTS[1]}]
    config = EvalConfig(agreement_tokens=6, measure_latency=False, num_threads=1)
    results = evaluate([base, tmp_path / "int8"], records=records, config=config, log=lambda _: None, lora=adapter)
    ref, int8 = results[str(base)], results[str(tmp_path / "int8")]
    peft_ppl, _ = perplexity(peft_model(base, adapter), load_for_eval(base).tokenizer, records)
    plain_ppl, _ = perplexity(peft_model(base, None), load_for_eval(base).tokenizer, records)
    assert ref["perplexity"] == pytest.approx(peft_ppl, rel=1e-4) and abs(plain_ppl / peft_ppl - 1) > 1e-3
    assert ref["kl_mean"] == 0 and ref["same_top1"] == 1.0 and ref["lora"] == str(adapter)
    assert format_table(results).splitlines()[-1] == f"each checkpoint with the LoRA adapter {adapter}"
    assert int8["kind"] == "int8" and 0 < int8["kl_mean"] < 0.5 and 0.5 <= int8["same_top1"] <= 1.0
    assert "perplexity" not in read_manifest(base).metrics  # the adapted model's figures stay out of the manifests
    other = make_tiny_llama(tmp_path / "wide", seed=1, hidden_size=64)
    with pytest.raises(ValueError, match="the base.s intermediate_size is 128"):
        evaluate([other], records=records, config=config, log=lambda _: None, lora=adapter)


def test_the_table_prints_whole_checkpoint_names_that_differ_only_at_the_end():
    def row(ppl: float) -> dict:
        return {"kind": "causal-lm", "perplexity": ppl, "size_bytes": 2**20, "decode_ms_per_token": 10.0}

    names = [
        "/ckpt/SmolLM2-135M-Instruct-finetuned-distilled-w8a8",
        "/ckpt/SmolLM2-135M-Instruct-finetuned-distilled-int8-weight-only",
    ]
    lines = format_table({names[0]: row(10.0), names[1]: row(10.5)}).splitlines()
    assert [line.split()[0] for line in lines[2:]] == [n.rsplit("/", 1)[1] for n in names]
    assert len({len(line) for line in lines}) == 1  # one column width for every row and the head


def test_the_table_tells_apart_checkpoints_of_the_same_folder_name():
    def row(ppl: float) -> dict:
        return {"kind": "causal-lm", "perplexity": ppl, "size_bytes": 2**20, "decode_ms_per_token": 10.0}

    names = ["/runs/demo/finetune/final", "/runs/demo/distill/final", "/runs/demo/w8a8"]
    lines = format_table({name: row(10.0 + i) for i, name in enumerate(names)}).splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["finetune/final", "distill/final", "w8a8"]
