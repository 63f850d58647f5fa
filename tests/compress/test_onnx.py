"""ONNX export (Optimum) and ONNX Runtime INT8: the exported graphs agree with PyTorch."""

from __future__ import annotations

import onnx
import pytest
import torch
from optimum.onnxruntime import ORTModelForCausalLM, ORTModelForFeatureExtraction
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from compress.quantize.onnx import export_onnx, mean_pool, quantize_onnx_int8
from engine.checkpoint.store import CheckpointError, read_manifest, resolve_checkpoint

PROMPTS = ["Hello there, how are you today?", "The capital of France is"]
SENTENCES = ["A man is playing a guitar.", "The weather is lovely today.", "Quantization makes models smaller."]


@pytest.fixture(scope="module")
def tiny_onnx_dir(tiny_llama_dir, tmp_path_factory):
    return export_onnx(tiny_llama_dir, tmp_path_factory.mktemp("onnx") / "tiny-onnx", task="text-generation-with-past")


@pytest.fixture(scope="module")
def minilm_onnx_dir(tmp_path_factory):
    return export_onnx("minilm-l6", tmp_path_factory.mktemp("onnx") / "minilm-onnx", task="feature-extraction")


def test_tiny_gqa_export_has_kv_cache_and_manifest(tiny_onnx_dir, tiny_llama_dir):
    graph = onnx.load(str(tiny_onnx_dir / "model.onnx"), load_external_data=False).graph
    inputs = {i.name: i for i in graph.input}
    assert {"input_ids", "attention_mask", "past_key_values.0.key", "past_key_values.1.value"} <= set(inputs)
    kv_heads = inputs["past_key_values.0.key"].type.tensor_type.shape.dim[1].dim_value
    assert kv_heads == 2  # grouped-query attention: 2 KV heads for 4 query heads
    manifest = read_manifest(tiny_onnx_dir)
    assert manifest.method == "onnx-export" and manifest.parent == str(tiny_llama_dir)
    assert manifest.config == {"task": "text-generation-with-past", "opset": None}
    # constant folding merges a few small tensors (norm weights), so counts differ slightly
    assert manifest.num_parameters == pytest.approx(read_manifest(tiny_llama_dir).num_parameters, rel=0.01)
    assert (tiny_onnx_dir / "tokenizer.json").is_file() and (tiny_onnx_dir / "config.json").is_file()


def test_tiny_gqa_onnx_logits_match_pytorch_and_generate_with_cache(tiny_onnx_dir, tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.pad_token = tokenizer.eos_token
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ort_model = ORTModelForCausalLM.from_pretrained(tiny_onnx_dir)
    assert ort_model.can_use_cache
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = reference(**batch).logits
    got = ort_model(**batch).logits
    mask = batch["attention_mask"].bool()
    assert torch.allclose(got[mask], expected[mask], atol=1e-4, rtol=1e-3)
    one = tokenizer(PROMPTS[0], return_tensors="pt")
    expected_ids = reference.generate(**one, max_new_tokens=12, do_sample=False)
    got_ids = ort_model.generate(**one, max_new_tokens=12, do_sample=False, use_cache=True)
    assert got_ids.tolist() == expected_ids.tolist()


def test_minilm_onnx_embeddings_match_pytorch(minilm_onnx_dir):
    source = resolve_checkpoint("minilm-l6", causal_lm=False)
    tokenizer = AutoTokenizer.from_pretrained(source)
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = mean_pool(
            AutoModel.from_pretrained(source).eval()(**batch).last_hidden_state, batch["attention_mask"]
        )
    fp32 = ORTModelForFeatureExtraction.from_pretrained(minilm_onnx_dir)
    got = mean_pool(fp32(**batch).last_hidden_state, batch["attention_mask"])
    assert torch.nn.functional.cosine_similarity(got, expected).min() >= 0.999
    int8_dir = quantize_onnx_int8(minilm_onnx_dir, minilm_onnx_dir.parent / "minilm-int8")
    int8 = ORTModelForFeatureExtraction.from_pretrained(int8_dir)
    got8 = mean_pool(int8(**batch).last_hidden_state, batch["attention_mask"])
    assert torch.nn.functional.cosine_similarity(got8, expected).min() >= 0.98
    assert read_manifest(int8_dir).size_bytes < read_manifest(minilm_onnx_dir).size_bytes / 3


def test_bad_inputs_name_the_field_or_file(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="task="):
        export_onnx(tiny_llama_dir, tmp_path / "x", task="text-classification")
    with pytest.raises(CheckpointError, match="not found"):
        export_onnx(tmp_path / "missing", tmp_path / "x", task="text-generation-with-past")
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        export_onnx("minilm-l6", tmp_path / "x", task="text-generation-with-past")
    with pytest.raises(CheckpointError, match="model.onnx"):
        quantize_onnx_int8(tiny_llama_dir, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
