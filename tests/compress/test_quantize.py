"""lmforge quantize: each INT8 method on a tiny GQA Llama reloads and agrees with its fp32 parent."""

from __future__ import annotations

import dataclasses
import json

import onnx
import pytest
import torch
from safetensors import safe_open

from compress.evaluate.quality import (
    AGREEMENT_PROMPTS,
    EvalConfig,
    agreement,
    evaluate,
    greedy_tokens,
    load_for_eval,
)
from compress.quantize.methods import (
    METHODS,
    Int8WeightOnlyConfig,
    LlmInt8Config,
    OnnxInt8MethodConfig,
    W8A8Config,
    load_int8_model,
    make_quantizer,
    quantize,
)
from engine.checkpoint.store import CheckpointError, make_tiny_llama, read_manifest
from engine.errors import UsageError
from engine.quant.int8 import Int8WeightOnlyLinear, W8A8Linear, quantize_weight_per_channel

PROMPTS = AGREEMENT_PROMPTS[:3]
CONFIGS = {
    "int8-weight-only": Int8WeightOnlyConfig(float_units=0),  # every layer INT8 (the default's float unit: below)
    "w8a8": W8A8Config(),
    "llm-int8": LlmInt8Config(),
    "onnx-int8": OnnxInt8MethodConfig(),
}


def expected_config(method):
    config = dataclasses.asdict(CONFIGS[method])
    return {"scheme": CONFIGS[method].scheme, **config} if hasattr(CONFIGS[method], "scheme") else config


@pytest.fixture(scope="module")
def quantized_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {
        method: quantize(
            tiny_llama_dir, root / method, method=method, **({"float_units": 0} if method in FLOAT_UNITS else {})
        )
        for method in METHODS
    }


FLOAT_UNITS = ("int8-weight-only",)  # methods whose default keeps a sensitive unit float


@pytest.fixture(scope="module")
def parent_tokens(tiny_llama_dir):
    loaded = load_for_eval(tiny_llama_dir, num_threads=1)
    return greedy_tokens(loaded.model, loaded.tokenizer, PROMPTS, max_new_tokens=16)


@pytest.mark.parametrize("method", list(METHODS))
def test_quantized_tiny_model_reloads_and_agrees_with_parent(method, quantized_dirs, parent_tokens, tiny_llama_dir):
    out = quantized_dirs[method]
    manifest = read_manifest(out)
    assert manifest.method == method and manifest.parent == str(tiny_llama_dir) and manifest.dtype == "int8"
    assert manifest.config == json_like(expected_config(method))
    assert method not in "".join(p.name for p in out.iterdir())  # config lives in the manifest, not in file names
    loaded = load_for_eval(out, num_threads=1)
    tokens = greedy_tokens(loaded.model, loaded.tokenizer, PROMPTS, max_new_tokens=16)
    assert agreement(parent_tokens, tokens) >= 0.75


def json_like(value):
    """Tuples become lists, as after a JSON round trip."""
    if isinstance(value, dict):
        return {k: json_like(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_like(v) for v in value]
    return value


@pytest.mark.parametrize(("method", "layer_cls"), [("int8-weight-only", Int8WeightOnlyLinear), ("w8a8", W8A8Linear)])
def test_int8_format_and_runtime_modules(method, layer_cls, quantized_dirs):
    out = quantized_dirs[method]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["lmforge_int8_scheme"] == CONFIGS[method].scheme
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_int8").dtype == torch.int8
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == (64,)
        # tied: only the head's copy is INT8; a rotated w8a8 stores its vocabulary tables (untied) in bf16
        embed_dtype = torch.bfloat16 if method == "w8a8" else torch.float32
        assert f.get_tensor("model.embed_tokens.weight").dtype == embed_dtype
        head_int8 = method == "int8-weight-only"  # w8a8 keeps the head float by default (it adds the most KL)
        assert ("lm_head.weight_int8" in keys) == head_int8
        assert not any(k.endswith(".outlier_channels") for k in keys)  # none by default
        rotated = method == "w8a8"  # its default rotation: each down_proj's input, and the residual stream
        for i in range(2):
            assert (f"model.layers.{i}.mlp.down_proj.input_hadamard" in keys) == rotated
        assert not any(k.endswith(".input_hadamard") and ".down_proj." not in k for k in keys)
        if rotated:  # the norms folded into the next layers, the head untied (float) with the final norm in it
            assert torch.equal(f.get_tensor("model.layers.0.mlp.down_proj.input_hadamard"), torch.tensor([64]))
            assert torch.equal(f.get_tensor("model.norm.weight"), torch.ones(64))
            assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16  # vocabulary tables in bf16 when rotated
    assert "model.layers.0.self_attn.q_proj.weight" not in keys and ("lm_head.weight" in keys) == rotated
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is not rotated
    model = load_int8_model(out)
    assert isinstance(model.model.layers[1].mlp.down_proj, layer_cls)
    assert getattr(model.model.layers[1].mlp.down_proj, "input_hadamard", None) == (64 if rotated else None)
    assert isinstance(model.lm_head, layer_cls if head_int8 else torch.nn.Linear)
    assert isinstance(model.model.embed_tokens.weight, torch.nn.Parameter)
    assert not any("torch.ao" in type(m).__module__ for m in model.modules())


def test_int8_skip_filter_and_biases(tmp_path):
    parent = make_tiny_llama(tmp_path / "qwen2", seed=1, model_type="qwen2")  # q/k/v carry biases
    out = quantize(parent, tmp_path / "q", method="w8a8", skip_modules=["lm_head", "mlp.down_proj"])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.down_proj.weight" in keys and "model.layers.0.mlp.up_proj.weight_int8" in keys
    assert "model.layers.0.self_attn.q_proj.bias" in keys and "lm_head.weight_int8" not in keys
    assert "model.layers.0.mlp.down_proj.input_hadamard" not in keys  # float: stored for its unrotated input
    reference = load_for_eval(parent).model
    model = load_int8_model(out)
    assert isinstance(model.lm_head, torch.nn.Linear)  # float, untied by the default rotation
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    ids = torch.tensor([[1, 400, 5000, 31, 77]])  # [1, 5]
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids).logits
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_former_dynamic_checkpoint_loads_as_w8a8_and_the_method_names_its_replacement(quantized_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    legacy = tmp_path / "dynamic"
    shutil.copytree(quantized_dirs["w8a8"], legacy)
    save_file(
        load_file(str(legacy / "model.safetensors")), str(legacy / "model.safetensors"), metadata={"format": "pt"}
    )
    model = load_int8_model(legacy)
    assert isinstance(model.model.layers[0].self_attn.q_proj, W8A8Linear)
    with pytest.raises(ValueError, match="'dynamic'.*replaced: use --method w8a8"):
        make_quantizer("dynamic")


def test_llm_int8_uses_bitsandbytes_layers(quantized_dirs):
    import bitsandbytes as bnb

    out = quantized_dirs["llm-int8"]
    model = load_for_eval(out).model
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear8bitLt) and layer.weight.dtype == torch.int8
    assert layer.state.threshold == 6.0
    assert not isinstance(model.lm_head, bnb.nn.Linear8bitLt)


def test_onnx_int8_graph_uses_integer_matmuls(quantized_dirs, tiny_llama_dir):
    out = quantized_dirs["onnx-int8"]
    ops = {node.op_type for node in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node}
    assert "MatMulInteger" in ops
    assert read_manifest(out).size_bytes < read_manifest(tiny_llama_dir).size_bytes / 3


def test_every_kind_is_evaluable_and_metrics_go_into_manifests(quantized_dirs, tiny_llama_dir):
    records = [
        {
            "messages": [
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello! How are you?"},
            ]
        },
        {"text": "The quick brown fox jumps over the lazy dog."},
    ]
    checkpoints = [tiny_llama_dir, *quantized_dirs.values()]
    config = EvalConfig(agreement_tokens=8, latency_tokens=8, latency_repeats=2, num_threads=1)
    results = evaluate(checkpoints, records=records, data_name="inline", config=config, log=lambda _: None)
    kinds = [m["kind"] for m in results.values()]
    assert kinds == ["pytorch", "int8", "int8", "llm-int8", "onnx"]
    base = results[str(tiny_llama_dir)]
    assert base["greedy_agreement"] == 1.0
    for path, metrics in results.items():
        assert abs(metrics["perplexity"] / base["perplexity"] - 1) < 0.02
        assert metrics["decode_ms_per_token"] > 0
        assert read_manifest(path).metrics["perplexity"] == metrics["perplexity"]
    assert base["kl_mean"] == 0 and base["same_top1"] == 1.0
    for method in ("int8-weight-only", "w8a8"):
        assert 0 < results[str(quantized_dirs[method])]["kl_mean"] < 0.01
    for method in ("int8-weight-only", "w8a8", "llm-int8", "onnx-int8"):
        assert base["linear_weight_bytes"] / results[str(quantized_dirs[method])]["linear_weight_bytes"] > 3.5


def test_bad_inputs_name_the_field_or_file(tiny_llama_dir, tmp_path, capsys):
    import lmforge_cli

    with pytest.raises(ValueError, match="method='int4'"):
        make_quantizer("int4")
    with pytest.raises(ValueError, match="unknown option.*bits"):
        make_quantizer("w8a8", bits=4)
    with pytest.raises(ValueError, match="threshold="):
        make_quantizer("llm-int8", threshold=-1.0)
    with pytest.raises(ValueError, match="skip_modules="):
        make_quantizer("int8-weight-only", skip_modules="lm_head")
    with pytest.raises(CheckpointError, match="missing.*not found"):
        quantize(tmp_path / "missing", tmp_path / "out", method="w8a8")
    with pytest.raises(CheckpointError, match="--model: method 'w8a8' needs a causal LM.*config.json"):
        quantize("minilm-l6", tmp_path / "out", method="w8a8")
    with pytest.raises(CheckpointError, match="model.safetensors.*weight_int8"):
        load_int8_model(tiny_llama_dir)
    assert not (tmp_path / "out").exists()
    out = str(tmp_path / "o")
    for flags, needle in [
        (["--method", "int4"], "--method 'int4'"),
        (["--method", "w8a8", "--threshold", "5"], "--threshold: not an option of --method w8a8"),
        (["--method", "w8a8", "--smoothquant-alpha", "7"], "smoothquant_alpha=7.0: it must be in [0, 1]"),
        (["--method", "dynamic"], "use --method w8a8"),
    ]:
        assert lmforge_cli.main(["quantize", "--model", str(tiny_llama_dir), *flags, "--out", out]) == 2, flags
        assert needle in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.integration
def test_int8_smollm2_stays_close_to_fp32(smollm2_dir, tmp_path):
    from compress.evaluate.quality import (
        default_heldout_records,
        quality_metrics,
        reference_logprobs,
    )

    records = default_heldout_records()[0][:6]
    fp32 = load_for_eval(smollm2_dir, num_threads=2)
    reference = reference_logprobs(fp32.model, fp32.tokenizer, records)
    ppl_fp32 = quality_metrics(fp32.model, fp32.tokenizer, records)["perplexity"]
    del fp32
    for method, max_kl, min_top1 in (("int8-weight-only", 0.01, 0.95), ("w8a8", 0.04, 0.9)):
        out = (
            quantize(smollm2_dir, tmp_path / method, method=method, calibration_records=8)
            if method == "w8a8"
            # 2 records rank the float unit (default 8): 121 forward passes of SmolLM2 either way
            else quantize(smollm2_dir, tmp_path / method, method=method, sensitivity_records=2)
        )
        loaded = load_for_eval(out, num_threads=2)
        m = quality_metrics(loaded.model, loaded.tokenizer, records, reference)
        # measured on these 6 dialogs: weight-only KL ~0.004, w8a8 ~0.01
        assert m["kl_mean"] < max_kl and m["same_top1"] > min_top1, (method, m)
        assert abs(m["perplexity"] / ppl_fp32 - 1) < 0.05
        # measured 2.16x: the fp32 embedding table (113 MB) stays float; the int8 linears and head are ~4x smaller
        assert read_manifest(smollm2_dir).size_bytes / read_manifest(out).size_bytes > 2.1


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_smoothquant_keeps_the_fp32_function_and_flattens_outliers(model_type, tmp_path):
    from compress.quantize.smooth import activation_absmax, smooth_model

    model = load_for_eval(make_tiny_llama(tmp_path / model_type, seed=2, model_type=model_type), num_threads=1).model
    with torch.no_grad():  # plant an outlier channel in the MLP input, as in real LLMs
        model.model.layers[0].post_attention_layernorm.weight[5] = 40.0
    ids = torch.tensor([[1, 400, 5000, 31, 77, 900, 12]])  # [1, 7]
    with torch.no_grad():
        expected = model(ids).logits
    name = "model.layers.0.mlp.gate_proj"
    before = activation_absmax(model, [ids], {name})[name]
    assert smooth_model(model, [ids], alpha=0.8) == 14  # 7 linear layers in each of 2 layers
    after = activation_absmax(model, [ids], {name})[name]
    with torch.no_grad():
        got = model(ids).logits
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert after.max() / after.median() < before.max() / before.median() / 4
    with pytest.raises(ValueError, match="smoothquant_alpha=1.5"):
        smooth_model(model, [ids], alpha=1.5)


def test_out_dir_that_is_not_a_checkpoint_is_refused_and_kept(tiny_llama_dir, tmp_path, monkeypatch):
    from compress.quantize.methods import quantize
    from engine.checkpoint.outputs import OutputDirError

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(OutputDirError, match="precious: not empty and not an earlier lmforge checkpoint"):
        quantize(tiny_llama_dir, precious, method="w8a8", smoothquant_alpha=None)
    assert (precious / "notes.txt").read_text() == "keep me"
    monkeypatch.chdir(precious)
    with pytest.raises(OutputDirError, match="working directory"):
        quantize(tiny_llama_dir, ".", method="w8a8", smoothquant_alpha=None)
    with pytest.raises(OutputDirError, match="would replace the input"):
        quantize(tiny_llama_dir, tiny_llama_dir, method="w8a8", smoothquant_alpha=None)


def test_quantizing_a_quantized_checkpoint_is_refused(tiny_llama_dir, tmp_path):
    from compress.quantize.methods import quantize
    from engine.checkpoint.store import CheckpointError

    once = quantize(tiny_llama_dir, tmp_path / "once", method="w8a8", smoothquant_alpha=None)
    with pytest.raises(CheckpointError, match="already quantized \\(method w8a8\\)"):
        quantize(once, tmp_path / "twice", method="w8a8", smoothquant_alpha=None)


def test_w8a8_calibrated_alpha_and_float_units_load_everywhere(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from compress.quantize.calibration import calibration_batches
    from compress.quantize.sensitivity import quantization_units, unit_sensitivity
    from compress.quantize.smooth import calibrate_alpha, smooth_groups, smooth_model
    from engine import LLM, SamplingParams

    model = load_for_eval(tiny_llama_dir, num_threads=1).model
    batches = calibration_batches(AutoTokenizer.from_pretrained(tiny_llama_dir), data=None, num_records=2)
    with torch.no_grad():
        expected = model(batches[0]).logits
    grid = (0.2, 0.5, 0.8)
    alphas = calibrate_alpha(model, batches, grid)
    assert set(alphas) == {g.layers[0] for g in smooth_groups(model)} and set(alphas.values()) <= set(grid)
    smooth_model(model, batches, alpha=alphas)
    with torch.no_grad():
        assert torch.allclose(model(batches[0]).logits, expected, atol=1e-4, rtol=1e-4)  # same fp32 function

    def w8a8(linear):
        return W8A8Linear(*quantize_weight_per_channel(linear.weight))

    units = quantization_units(model)
    assert len(units) == 4 * len(model.model.layers) + 1 and units[0][0] == "model.layers.0.self_attn.q_proj"
    sensitivity = unit_sensitivity(model, batches, w8a8, units)
    assert all(v >= 0 for v in sensitivity.values()) and max(sensitivity.values()) > 0
    assert all(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n.endswith("proj"))  # restored

    out = quantize(
        tiny_llama_dir,
        tmp_path / "mixed",
        method="w8a8",
        smoothquant_alpha_grid=grid,
        float_units=2,
        calibration_records=2,
        sensitivity_records=2,
    )
    floats = read_manifest(out).config["float_modules"]
    assert 1 <= len(floats) <= 3 * 2  # two fused groups (a qkv group has three linears)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for name in floats:
        assert name + ".weight" in keys and name + ".weight_int8" not in keys
    loaded = load_int8_model(out)
    assert all(not isinstance(loaded.get_submodule(n), W8A8Linear) for n in floats)
    assert sum(isinstance(m, W8A8Linear) for m in loaded.modules()) == 7 * len(loaded.model.layers) - len(floats)
    llm = LLM(str(out), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64)
    assert llm.engine.runner.is_int8
    llm.generate([[1, 400, 5000, 31]], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match="smoothquant_alpha_grid"):
        W8A8Config(smoothquant_alpha_grid=(0.5, 1.5))
    with pytest.raises(ValueError, match="float_units=-1"):
        W8A8Config(float_units=-1)
    with pytest.raises(ValueError, match="outlier_channels=-1"):
        W8A8Config(outlier_channels=-1)
    with pytest.raises(ValueError, match="outlier_modules=.*names no INT8 linear layer"):
        quantize(
            tiny_llama_dir, tmp_path / "none", method="w8a8", outlier_channels=8, outlier_modules=("no_such_layer",)
        )
    assert not (tmp_path / "none").exists()


def test_weight_only_default_keeps_its_most_sensitive_unit_float(tiny_llama_dir, tmp_path):
    out = quantize(tiny_llama_dir, tmp_path / "wo", method="int8-weight-only")
    float_modules = read_manifest(out).config["float_modules"]
    assert read_manifest(out).config["float_units"] == 1 and 1 <= len(float_modules) <= 3
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for name in float_modules:
        assert f"{name}.weight_int8" not in keys
        assert f"{name}.weight" in keys or name == "lm_head"  # a float head tied to the embeddings is stored once
    model = load_int8_model(out)
    assert isinstance(model.get_submodule(float_modules[0]), torch.nn.Linear)
    assert sum(isinstance(m, Int8WeightOnlyLinear) for m in model.modules()) > 0


def test_w8a8_outlier_channels_are_stored_and_load_everywhere(tiny_llama_dir, tmp_path):
    from engine import LLM, SamplingParams

    out = quantize(
        tiny_llama_dir,
        tmp_path / "split",
        method="w8a8",
        skip_modules=(),
        outlier_channels=8,
        outlier_modules=("lm_head", "o_proj"),  # down_proj's rotated input spreads its outliers instead
        calibration_records=4,
    )
    config = read_manifest(out).config
    assert config["outlier_channels"] == 8 and "lm_head" in config["outlier_layers"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        head = f.get_tensor("lm_head.outlier_channels")
        assert head.dtype == torch.int64 and head.shape == (8,) and torch.equal(head, head.sort().values)
        assert f.get_tensor("model.layers.0.self_attn.o_proj.outlier_channels").shape == (8,)
        assert "model.layers.0.mlp.up_proj.outlier_channels" not in set(f.keys())
    model = load_int8_model(out)
    assert torch.equal(model.lm_head.outlier_channels, head)
    assert model.model.layers[0].mlp.up_proj.outlier_channels is None
    reference = load_for_eval(tiny_llama_dir).model
    ids = torch.tensor([[1, 400, 5000, 31, 77]])  # [1, 5]
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids).logits
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    llm = LLM(str(out), dtype="bfloat16", block_size=4, num_kv_blocks=64, max_model_len=64)
    assert torch.equal(llm.engine.runner.model.lm_head.int8_layer.outlier_channels, head)
    outputs = llm.generate([[1, 400, 5000, 31]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(outputs[0].outputs[0].token_ids) == 4
    llm.engine.check_invariants()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_rotations_keep_the_fp32_function(model_type, tmp_path):
    """QuaRot-style rotations (compress.quantize.rotate): the residual stream, then SmoothQuant, then down_proj's
    online input rotation; the float model computes the same logits, the head is untied, the norms are ones."""
    from compress.quantize.calibration import load_smoothed_model
    from compress.quantize.rotate import RotatedInputLinear, orthogonal_rotation, rotated_inputs

    parent = make_tiny_llama(tmp_path / model_type, seed=4, model_type=model_type)
    reference = load_for_eval(parent, num_threads=1).model
    rotated = load_smoothed_model(parent, alpha=0.5, data=None, num_records=2, rotation_block=32)
    assert rotated_inputs(rotated) == {f"model.layers.{i}.mlp.down_proj": 32 for i in range(2)}
    assert isinstance(rotated.model.layers[0].mlp.down_proj, RotatedInputLinear)
    assert rotated.lm_head.weight is not rotated.model.embed_tokens.weight and not rotated.config.tie_word_embeddings
    assert torch.equal(rotated.model.norm.weight, torch.ones(64))
    assert not torch.allclose(rotated.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    ids = torch.tensor([[1, 400, 5000, 31, 77, 9, 12]])  # [1, 7]
    with torch.no_grad():
        expected, got = reference(ids).logits, rotated(ids).logits  # [1, 7, vocab]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    q = orthogonal_rotation(64)
    torch.testing.assert_close(q @ q.T, torch.eye(64, dtype=torch.float64))
    q = orthogonal_rotation(48)  # no Hadamard matrix of that size: a random rotation
    torch.testing.assert_close(q @ q.T, torch.eye(48, dtype=torch.float64))
    with pytest.raises(UsageError, match="rotation block 48"):
        load_smoothed_model(parent, alpha=None, data=None, num_records=1, rotation_block=48)
