"""INT8 checkpoints (weight-only, w8a8, former ``dynamic``) run the INT8 layers and track the dequantized model."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint.store import Manifest, make_tiny_llama, write_manifest
from engine.quant.int8 import (
    INT8_SCALE_SUFFIX,
    INT8_WEIGHT_SUFFIX,
    LAYERS,
    OUTLIER_CHANNELS_SUFFIX,
    dequantize_weight,
    quantize_weight_per_channel,
    scheme_metadata,
)
from tests.engine.test_engine_greedy import random_prompts

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_int8_checkpoint(src, dst, scheme: str | None, outliers: bool = False) -> dict[str, torch.Tensor]:
    """Quantize every decoder linear and the (tied) LM head of ``src`` into ``dst``; return the dequantized state dict.

    ``scheme=None`` writes the former ``dynamic`` layout: no scheme metadata, head kept float. ``outliers``: q/k/v
    (one fused layer: the same channels), down_proj and the head get 8 outlier input channels.
    """
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    state = load_file(str(src / "model.safetensors"))
    stored, dequantized = {}, {}
    if scheme is not None:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: the head's copy is quantized
    for name, tensor in state.items():
        if (name.endswith(".weight") and name.split(".")[-2] in LINEARS) or name == "lm_head.weight":
            w8, scale = quantize_weight_per_channel(tensor)
            prefix = name.removesuffix(".weight")
            stored[prefix + INT8_WEIGHT_SUFFIX], stored[prefix + INT8_SCALE_SUFFIX] = w8, scale
            if outliers and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "down_proj", "lm_head"):
                stored[prefix + OUTLIER_CHANNELS_SUFFIX] = torch.arange(8) * 5 + (name.split(".")[-2] == "down_proj")
            dequantized[name] = dequantize_weight(w8, scale)
        else:
            stored[name] = tensor
            dequantized[name] = tensor
    save_file(stored, str(dst / "model.safetensors"), metadata=scheme_metadata(scheme) if scheme else None)
    method = {"weight-only": "int8-weight-only", "w8a8": "w8a8", None: "dynamic"}[scheme]
    write_manifest(dst, Manifest(source=str(src), parent=str(src), method=method, dtype="int8"))
    return dequantized


@pytest.mark.parametrize(
    ("scheme", "dtype", "outliers"),
    [
        ("weight-only", "bfloat16", False),
        ("w8a8", "float32", False),
        ("w8a8", "bfloat16", False),
        ("w8a8", "bfloat16", True),
        (None, "float32", False),
    ],
)
def test_int8_checkpoint_matches_dequantized_hf(scheme, dtype, outliers, tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_tiny_llama(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=256)
    dequantized = write_int8_checkpoint(src, tmp_path / "int8", scheme, outliers)
    hf = AutoModelForCausalLM.from_pretrained(src).eval()
    if scheme is not None:
        hf.lm_head.weight = torch.nn.Parameter(dequantized.pop("lm_head.weight"))  # unties the head
    hf.load_state_dict(dequantized, strict=False)
    llm = LLM(str(tmp_path / "int8"), dtype=dtype, block_size=4, num_kv_blocks=128, max_model_len=128)
    runner = llm.engine.runner
    assert runner.is_int8
    layer_cls = LAYERS[scheme or "w8a8"]
    assert isinstance(runner.layers[0].qkv.int8_layer, layer_cls)
    lm_head = runner.model.lm_head
    assert isinstance(lm_head.int8_layer, layer_cls) if scheme else lm_head.int8_layer is None
    if outliers:
        assert lm_head.int8_layer.outlier_channels.tolist() == list(range(0, 40, 5))
        assert runner.layers[0].qkv.int8_layer.outlier_channels is not None
        assert runner.layers[0].o.int8_layer.outlier_channels is None
    matched, total = teacher_forced_agreement(llm, hf)
    assert matched / total >= 0.8, f"INT8 engine agrees with the dequantized model on {matched}/{total} tokens"
    llm.engine.check_invariants()


def teacher_forced_agreement(llm, hf) -> tuple[int, int]:
    """``(matched, total)``: HF's greedy choice after each prefix of the engine's greedy output (6 prompts x 8)."""
    prompts = random_prompts([4, 9, 15, 22, 30, 7], seed=23)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    matched = total = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt + out.outputs[0].token_ids])
            hf_choice = hf(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()  # [8]
            matched += sum(a == b for a, b in zip(hf_choice, out.outputs[0].token_ids))
            total += len(hf_choice)
    return matched, total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotated_w8a8_checkpoint_runs_in_the_engine_and_tracks_its_parent(dtype, tmp_path):
    """``lmforge quantize --method w8a8`` rotates by default (residual stream, down_proj inputs): the engine runs the
    online rotation in its INT8 layers, and its float path (the CUDA one) gets the weight of the unrotated input."""
    from transformers import AutoModelForCausalLM

    from compress.quantize.methods import quantize
    from engine.model import WeightLoader, load_state_dict
    from engine.quant.int8 import INPUT_HADAMARD_SUFFIX, W8A8Linear, block_hadamard

    src = make_tiny_llama(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=256)
    out = quantize(src, tmp_path / "w8a8", method="w8a8", calibration_records=4)
    llm = LLM(str(out), dtype=dtype, block_size=4, num_kv_blocks=128, max_model_len=128)
    down = llm.engine.runner.layers[0].down.int8_layer
    assert isinstance(down, W8A8Linear) and down.input_hadamard == 64
    assert llm.engine.runner.layers[0].o.int8_layer.input_hadamard is None
    hf = AutoModelForCausalLM.from_pretrained(src).eval()  # the fp32 parent
    matched, total = teacher_forced_agreement(llm, hf)
    assert matched / total >= 0.8, f"rotated w8a8 engine agrees with its fp32 parent on {matched}/{total} tokens"
    llm.engine.check_invariants()
    tensors = load_state_dict(out)
    prefix = "model.layers.1.mlp.down_proj"
    assert tensors[prefix + INPUT_HADAMARD_SUFFIX].tolist() == [64]
    w = WeightLoader(tensors, out, torch.float32, "cpu")._float_weight(prefix)  # [128, 256]: W' H
    x = torch.randn(3, 256)
    stored = dequantize_weight(tensors[prefix + INT8_WEIGHT_SUFFIX], tensors[prefix + INT8_SCALE_SUFFIX])  # W'
    expected = block_hadamard(x, 64).double() @ stored.double().T  # what the INT8 layer computes, less rounding
    torch.testing.assert_close(x.double() @ w.double().T, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
