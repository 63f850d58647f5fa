"""``lmforge evaluate --served``: a served model's held-out perplexity, through the real tritonserver.

The tiny random Llama is served in float32 (``llm_f32``, the fixture of test_lmeval_served: loaded into the
session's Triton server, behind a frontend of its own). Its perplexity through ``/v1/completions`` echo +
prompt logprobs must equal the checkpoint's in process, Hugging Face ``transformers`` in float32
(``quality_metrics``, what ``lmforge evaluate`` reports), on the same chat and text records and the same
scored tokens.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.evaluate.quality import add_arguments, quality_metrics, run
from compress.evaluate.served import ServedScoreError, served_model_name, served_quality
from deploy.triton import free_ports
from engine.checkpoint.store import resolve_checkpoint
from tests.deploy.test_lmeval_served import MODEL, f32_frontend  # noqa: F401 - fixture

pytestmark = pytest.mark.integration

RECORDS = [
    {
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris is the capital of France."},
        ]
    },
    {"text": "The quick brown fox jumps over the lazy dog, and then it runs away into the woods."},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name two colours."},
            {"role": "assistant", "content": "Red and blue."},
            {"role": "user", "content": "One more?"},
            {"role": "assistant", "content": "Green."},
        ]
    },
    {"messages": [{"role": "user", "content": "No reply here: nothing is scored."}]},
]


@pytest.fixture(scope="module")
def in_process(tiny_llama_dir) -> tuple:
    """(tokenizer, quality_metrics of the checkpoint in float32 on RECORDS)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return tokenizer, quality_metrics(model, tokenizer, RECORDS)


def test_served_perplexity_equals_the_checkpoint_in_process(f32_frontend, in_process):
    tokenizer, expected = in_process
    assert served_model_name(f32_frontend) == MODEL
    served = served_quality(f32_frontend, MODEL, tokenizer, RECORDS)
    assert served["perplexity_tokens"] == expected["perplexity_tokens"] > 20
    assert served["mean_nll"] == pytest.approx(math.log(expected["perplexity"]), abs=1e-4)
    assert served["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-4)


def test_evaluate_command_adds_the_served_row(f32_frontend, tiny_llama_dir, in_process, tmp_path, capsys):
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "eval.json"
    args = parser.parse_args(
        [str(tiny_llama_dir), "--data", str(data), "--served", f32_frontend, "--no-latency", "--no-write"]
        + ["--agreement-tokens", "4", "--json", str(out)]
    )
    assert run(args) == 0
    results = json.loads(out.read_text())
    local, served = results[str(resolve_checkpoint(tiny_llama_dir))], results[f"served {f32_frontend}"]
    assert served["kind"] == "served" and served["served_model"] == MODEL and served["eval_records"] == len(RECORDS)
    assert served["perplexity_tokens"] == local["perplexity_tokens"]
    assert served["perplexity"] == pytest.approx(local["perplexity"], rel=1e-4)
    assert "kl_mean" not in served and "same_top1" not in served  # not available served
    row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[1:2] == ["served"])
    assert " - " in row and f"{served['perplexity']:.3f}" in row


def test_served_scoring_errors_name_the_fix(f32_frontend, in_process):
    tokenizer, _ = in_process
    with pytest.raises(ServedScoreError, match="HTTP 404.*--served-model"):
        served_quality(f32_frontend, "no-such-model", tokenizer, RECORDS[:1])
    closed = f"http://127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(ServedScoreError, match="start the server"):
        served_quality(closed, MODEL, tokenizer, RECORDS[:1])
    with pytest.raises(ServedScoreError, match="no scored tokens"):
        served_quality(f32_frontend, MODEL, tokenizer, RECORDS[3:])
