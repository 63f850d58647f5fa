"""Decode steps of a few tokens run every decoder layer in one C++ call (``cpu_ops.decode_layers``) with the numbers of
the op-by-op forward: the same greedy tokens, logprobs and KV cache, for float, weight-only INT8 and w8a8 layers."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams, cpu_ops
from engine.checkpoint.store import make_tiny_llama
from engine.model import Model
from engine.quant.int8 import weight_only_cpu_kernel
from tests.engine.test_engine_greedy import random_prompts
from tests.engine.test_engine_int8 import write_int8_checkpoint

ENGINE = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 128}
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
    return [(list(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in llm.generate(prompts, PARAMS)]


@pytest.mark.parametrize(
    ("kind", "dtype", "kv_cache_dtype"),
    [
        ("float", "bfloat16", "auto"),
        ("float", "float32", "auto"),
        ("float", "bfloat16", "int8"),
        ("weight-only", "bfloat16", "auto"),
        ("weight-only", "bfloat16", "int8"),
        ("w8a8", "bfloat16", "auto"),
        ("w8a8", "float32", "auto"),
        ("rotated w8a8", "bfloat16", "auto"),
    ],
)
def test_decode_steps_in_one_call_equal_the_op_by_op_forward(kind, dtype, kv_cache_dtype, tmp_path, monkeypatch):
    src = make_tiny_llama(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=256)
    if kind == "rotated w8a8":
        from compress.quantize.methods import quantize

        model_dir = quantize(src, tmp_path / "rotated", method="w8a8", calibration_records=4)
    elif kind != "float":
        write_int8_checkpoint(src, tmp_path / "int8", kind)
        model_dir = tmp_path / "int8"
    else:
        model_dir = src
    # no prefix caching: a prompt sent twice would be prefilled another way the second time
    llm = LLM(str(model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False, **ENGINE)
    rows = llm.engine.runner.model.fused_decode_rows()
    if kind == "weight-only" and cpu_ops.decode_layers_available():
        assert rows == 8, "a bf16 weight-only INT8 model runs its decode steps of up to 8 tokens in one call"
    calls = []
    one_call = cpu_ops.decode_layers

    def counted(*args):
        calls.append(args[0].shape[0])
        return one_call(*args)

    monkeypatch.setattr(cpu_ops, "decode_layers", counted)
    prompts = random_prompts([5, 11, 17], seed=3)  # decode steps of 3 tokens crossing blocks of 4
    fused = outputs(llm, prompts) + outputs(llm, prompts[:1])  # then steps of one token
    assert (3 in calls) == (rows >= 3) and (1 in calls) == (rows >= 1)
    with monkeypatch.context() as m:
        m.setattr(Model, "fused_decode_rows", lambda self: 0)
        calls.clear()
        assert outputs(llm, prompts) + outputs(llm, prompts[:1]) == fused
        assert not calls
    llm.engine.check_invariants()


def test_a_step_that_also_prefills_keeps_the_op_by_op_forward(tmp_path, monkeypatch, kernel_path_allows):
    """A step that also prefills a prompt runs op by op; the decodes of the steps after it run in one call."""
    kernel_path_allows("engine", "gemv", "decode")
    src = make_tiny_llama(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=256)
    write_int8_checkpoint(src, tmp_path / "int8", "weight-only")
    llm = LLM(str(tmp_path / "int8"), dtype="bfloat16", **ENGINE)
    if not llm.engine.runner.model.fused_decode_rows():
        pytest.fail(f"the one-call decode did not build here: {cpu_ops.DECODE_KERNELS.reason}")
    calls = []
    one_call = cpu_ops.decode_layers
    monkeypatch.setattr(cpu_ops, "decode_layers", lambda *args: calls.append(args[0].shape[0]) or one_call(*args))
    engine = llm.engine
    engine.add_request("a", random_prompts([6], seed=4)[0], PARAMS)
    for _ in range(3):
        engine.step()
    steps_before = len(calls)
    engine.add_request("b", random_prompts([30], seed=5)[0], PARAMS)  # prefilled beside a's decode
    engine.step()
    assert len(calls) == steps_before, "a step with a prefill ran the one-call decode"
    while engine.has_unfinished_requests():
        engine.step()
    assert 2 in calls
    engine.check_invariants()


def test_switching_the_cpu_kernels_off_turns_the_one_call_decode_off(tmp_path, kernel_path_allows):
    kernel_path_allows("engine", "gemv", "decode")
    src = make_tiny_llama(tmp_path / "fp32", seed=5, hidden_size=128, intermediate_size=256)
    write_int8_checkpoint(src, tmp_path / "int8", "weight-only")
    model = LLM(str(tmp_path / "int8"), dtype="bfloat16", **ENGINE).engine.runner.model
    assert model.fused_decode_rows() == 8
    for switch in (cpu_ops.use_cpu_kernels, weight_only_cpu_kernel):
        try:
            switch(False)
            assert model.fused_decode_rows() == 0
        finally:
            switch(True)
        assert model.fused_decode_rows() == 8
