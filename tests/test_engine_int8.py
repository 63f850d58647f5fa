"""INT8 ``dynamic`` checkpoints load as dynamic-INT8 linears and track the dequantized model."""

from __future__ import annotations

import shutil

import torch

from compress.checkpoints import Manifest, make_tiny_llama, write_manifest
from compress.int8 import INT8_SCALE_SUFFIX, INT8_WEIGHT_SUFFIX, dequantize_weight, quantize_weight_per_channel
from engine import LLM, SamplingParams
from tests.test_engine_greedy import random_prompts

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_int8_checkpoint(src, dst) -> dict[str, torch.Tensor]:
    """Quantize every decoder linear of ``src`` into ``dst`` (``dynamic`` format); return the dequantized state dict."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    state = load_file(str(src / "model.safetensors"))
    stored, dequantized = {}, {}
    for name, tensor in state.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            w8, scale = quantize_weight_per_channel(tensor)
            prefix = name.removesuffix(".weight")
            stored[prefix + INT8_WEIGHT_SUFFIX], stored[prefix + INT8_SCALE_SUFFIX] = w8, scale
            dequantized[name] = dequantize_weight(w8, scale)
        else:
            stored[name] = tensor
            dequantized[name] = tensor
    save_file(stored, str(dst / "model.safetensors"))
    write_manifest(dst, Manifest(source=str(src), parent=str(src), method="dynamic", dtype="int8"))
    return dequantized


def test_int8_dynamic_checkpoint_matches_dequantized_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_tiny_llama(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=256)
    dequantized = write_int8_checkpoint(src, tmp_path / "int8")
    hf = AutoModelForCausalLM.from_pretrained(src).eval()
    hf.load_state_dict(dequantized, strict=False)
    llm = LLM(str(tmp_path / "int8"), block_size=4, num_kv_blocks=128, max_model_len=128, dtype="float32")
    assert llm.engine.runner.is_int8
    assert isinstance(llm.engine.runner.layers[0].qkv.int8_layer, torch.ao.nn.quantized.dynamic.Linear)
    prompts = random_prompts([4, 9, 15, 22, 30, 7], seed=23)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    matched = total = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            # Teacher-forced agreement: HF's greedy choice after each engine prefix.
            ids = torch.tensor([prompt + out.outputs[0].token_ids])
            logits = hf(ids).logits[0, len(prompt) - 1:-1]  # [8, vocab]
            hf_choice = logits.argmax(-1).tolist()
            matched += sum(a == b for a, b in zip(hf_choice, out.outputs[0].token_ids))
            total += len(hf_choice)
    assert matched / total >= 0.8, f"INT8 engine agrees with the dequantized model on {matched}/{total} tokens"
    llm.engine.check_invariants()
