"""The checkpoint contract: named sources, GGUF conversion and cache, manifest, bad input."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.checkpoint.store import (
    CheckpointError,
    Manifest,
    check_gguf,
    describe_weights,
    named_source_path,
    read_manifest,
    resolve_checkpoint,
    update_metrics,
    write_manifest,
)
from engine.cli import hf_generate
from lmforge_cli import main


def test_tiny_manifest_counts_parameters(tiny_llama_dir):
    manifest = read_manifest(tiny_llama_dir)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    expected = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    assert manifest.num_parameters == expected
    assert manifest.size_bytes == sum(f.stat().st_size for f in Path(tiny_llama_dir).glob("*.safetensors"))
    assert manifest.dtype == "float32"
    assert manifest.method == "random-init"


def test_manifest_roundtrip_and_metrics(tmp_path):
    write_manifest(tmp_path, Manifest(source="x", parent="p", method="finetune", config={"lr": 1e-4}))
    update_metrics(tmp_path, {"perplexity": 12.5})
    m = read_manifest(tmp_path)
    assert (m.source, m.parent, m.method, m.config, m.metrics) == (
        "x",
        "p",
        "finetune",
        {"lr": 1e-4},
        {"perplexity": 12.5},
    )


def test_missing_path_names_it(tmp_path):
    with pytest.raises(CheckpointError, match="not-there.*not found"):
        resolve_checkpoint(tmp_path / "not-there")


def test_unknown_named_source_lists_known():
    with pytest.raises(CheckpointError, match="smollm2-135m"):
        named_source_path("gpt-17")


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: missing"):
        resolve_checkpoint(tmp_path)


def test_truncated_safetensors_named(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        resolve_checkpoint(broken)
    weights.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt"):
        describe_weights(broken)


def test_unsupported_architecture(gpt2_like_dir):
    with pytest.raises(CheckpointError, match="unsupported architecture.*llama, mistral, qwen2"):
        resolve_checkpoint(gpt2_like_dir)


def test_corrupt_and_truncated_gguf(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + b"\x00" * 64)
    with pytest.raises(CheckpointError, match="fake.gguf: not a GGUF file"):
        resolve_checkpoint(fake)
    real = named_source_path("smollm2-135m")
    truncated = tmp_path / "truncated.gguf"
    with real.open("rb") as f:
        truncated.write_bytes(f.read(real.stat().st_size // 3))
    with pytest.raises(CheckpointError, match="truncated.gguf: corrupt or truncated"):
        check_gguf(truncated)


def test_minilm_named_source_is_an_encoder():
    path = resolve_checkpoint("minilm-l6", causal_lm=False)
    assert (path / "config.json").is_file()
    with pytest.raises(CheckpointError, match="unsupported architecture 'bert'|model_type='bert'"):
        resolve_checkpoint("minilm-l6")


@pytest.mark.integration
def test_gguf_conversion_is_cached_and_matches_direct_load(smollm2_dir):
    manifest = read_manifest(smollm2_dir)
    assert manifest.method == "convert-gguf" and manifest.source == "smollm2-135m"
    assert manifest.num_parameters == 134_515_008  # SmolLM2-135M, tied embeddings counted once
    start = time.perf_counter()
    again = resolve_checkpoint("smollm2-135m")
    assert again == smollm2_dir and time.perf_counter() - start < 2.0  # cache hit, no reconversion
    assert read_manifest(again).created_at == manifest.created_at

    gguf = named_source_path("smollm2-135m")
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    cached = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 216, 30, 4301, 29]])
    with torch.no_grad():
        a, b = direct(ids).logits, cached(ids).logits
    # Same fp32 tensors written and read back: equal up to float rounding (stated tolerance 1e-5).
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.integration
def test_real_model_knows_paris(smollm2_dir):
    reply = hf_generate("smollm2-135m", "What is the capital of France?", chat=True, max_tokens=20)
    assert "Paris" in reply


def test_cli_help_lists_subcommands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for name in ("info", "generate"):
        assert name in out


def test_a_fresh_gguf_conversion_prints_one_line_and_keeps_the_ggufs_special_tokens(tmp_path):
    """`lmforge info` on an empty cache converts the embedded GGUF: stderr is our one line (no progress bar
    or tokenizer notice of transformers'), and the tokenizer is the GGUF's: no BOS added, EOS <|im_end|>."""
    env = {**os.environ, "LMFORGE_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "lmforge_cli", "info", "--model", "smollm2-135m"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=True)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("converting SmolLM2-135M-Instruct") and "(once)" in lines[0]
    checkpoint = Path(done.stdout.splitlines()[0].removeprefix("checkpoint: "))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    hello = tokenizer("Hello world").input_ids
    assert hello == tokenizer("Hello world", add_special_tokens=False).input_ids and len(hello) == 2
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
