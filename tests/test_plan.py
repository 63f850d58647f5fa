"""The planner checked against real tensors: model states, saved activations, KV cache, schedule."""

from __future__ import annotations

import pytest
import torch

from compress.checkpoints import tiny_llama_config
from compress.memory_model import (
    ModelSpec,
    Precision,
    kv_bytes_per_token,
    kv_capacity,
    stage_activation_bytes,
    stage_params,
    state_memory,
    total_params,
)
from compress.pipeline_schedule import bubble_fraction, simulate_1f1b
from compress.plan import Split, TrainingSetup, check_split, plan_training
from lmforge_cli import main

#: Stated tolerance of predicted vs measured activation bytes (the counts agree exactly on
#: torch 2.13 / transformers 4.57, fp32 and bf16; the slack absorbs small changes in saved tensors
#: across versions).
ACTIVATION_TOLERANCE = 0.02


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _model_states_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """Real bytes of parameters, gradients and AdamW state after one optimizer step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return _tensor_bytes(params), _tensor_bytes(p.grad for p in params), _tensor_bytes(states)


def test_model_state_bytes_equal_real_tensors_of_tiny_llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    spec = ModelSpec.from_checkpoint(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    assert total_params(spec) == sum(p.numel() for p in model.parameters())
    predicted = state_memory(stage_params(spec, 0), Precision.FP32, zero_stage=0, data_parallel=1)
    assert (predicted.params_bytes, predicted.grads_bytes, predicted.optimizer_bytes) == _model_states_bytes(model)


def test_model_state_bytes_untied_qwen2_with_biases():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    values = {k: v for k, v in tiny_llama_config(vocab_size=320, tie_word_embeddings=False).to_dict().items()
              if k != "model_type"}
    config = Qwen2Config(**values)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    spec = ModelSpec.from_config(config.to_dict())
    assert spec.qkv_bias and not spec.tie_word_embeddings
    predicted = state_memory(stage_params(spec, 0), Precision.FP32, zero_stage=0, data_parallel=1)
    assert (predicted.params_bytes, predicted.grads_bytes, predicted.optimizer_bytes) == _model_states_bytes(model)


def test_zero_stages_partition_what_the_paper_says():
    spec = ModelSpec(4, 256, 8, 4, 1000, 512)
    params = stage_params(spec, 0)
    full = state_memory(params, Precision.BF16, 0, 8)
    assert full.params_bytes == 2 * params.elements and full.grads_bytes == 2 * params.elements
    z1, z2, z3 = (state_memory(params, Precision.BF16, z, 8) for z in (1, 2, 3))
    assert z1.optimizer_bytes == pytest.approx(full.optimizer_bytes / 8, abs=1) and z1.grads_bytes == full.grads_bytes
    assert z2.grads_bytes == pytest.approx(full.grads_bytes / 8, abs=1) and z2.params_bytes == full.params_bytes
    assert z3.params_bytes == pytest.approx(full.params_bytes / 8, abs=1)


def _measure_saved_activation_peak(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Peak bytes of distinct storages saved for backward (parameters excluded) over forward + backward.

    A storage counts from its first pack until its last saved reference is unpacked by the
    backward pass (Korthikanti et al.'s definition of activation memory).
    """
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
    current, peak = [0], [0]

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in parameters:
            return None, tensor
        if key in live:
            live[key][1] += 1
        else:
            live[key] = [tensor.untyped_storage().nbytes(), 1]
            current[0] += live[key][0]
            peak[0] = max(peak[0], current[0])
        return key, tensor

    def unpack(packed):
        key, tensor = packed
        if key in live:
            live[key][1] -= 1
            if live[key][1] == 0:
                current[0] -= live.pop(key)[0]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(input_ids=ids, labels=ids).loss.backward()
    return peak[0]


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("layers,hidden,heads,kv_heads,inter,batch,seq", [(2, 64, 4, 2, 160, 2, 64), (3, 96, 6, 3, 256, 3, 40)])
def test_activation_bytes_match_measured_peak(precision, checkpointing, layers, hidden, heads, kv_heads, inter, batch, seq):
    """Without checkpointing transformers runs SDPA with ``is_causal`` (the fused path: no mask, K/V at
    KV-head width); gradient checkpointing switches ``use_cache`` off and SDPA gets an explicit mask
    with K/V repeated to the query heads (the masked path). Both are modelled."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size=256, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, intermediate_size=inter)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32 if precision is Precision.FP32 else torch.bfloat16).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    measured = _measure_saved_activation_peak(model, torch.randint(0, 256, (batch, seq)))
    predicted = stage_activation_bytes(ModelSpec.from_config(config.to_dict()), micro_batch=batch, seq_len=seq,
                                       precision=precision, checkpointing=checkpointing,
                                       fused_attention=not checkpointing)
    assert abs(predicted - measured) <= ACTIVATION_TOLERANCE * measured, (predicted, measured)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (2, 4), (4, 4), (4, 8), (8, 3), (3, 16), (6, 24)])
def test_schedule_simulation_confirms_closed_form_bubble(p, m):
    result = simulate_1f1b(p, m, forward_time=1.0, backward_time=2.0)
    assert result.bubble_fraction == pytest.approx(bubble_fraction(p, m), abs=1e-12)
    assert result.step_time == pytest.approx((m + p - 1) * 3.0)
    assert result.max_in_flight == [min(m, p - i) for i in range(p)]  # 1F1B memory bound


def test_kv_bytes_per_token_equal_a_paged_cache_of_that_shape():
    spec = ModelSpec(num_hidden_layers=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                     vocab_size=100, intermediate_size=128)
    num_blocks, block_size = 7, 16
    for dtype, nbytes in ((torch.float16, 2), (torch.float32, 4)):
        cache = [torch.empty(num_blocks, block_size, spec.num_key_value_heads, spec.dim_head, dtype=dtype)
                 for _layer in range(spec.num_hidden_layers) for _k_or_v in range(2)]
        assert kv_bytes_per_token(spec, nbytes) * num_blocks * block_size == _tensor_bytes(cache)
    cap = kv_capacity(spec, budget_bytes=1_000_000, block_size=block_size, max_model_len=100, dtype_bytes=2)
    cache_bytes = _tensor_bytes(torch.empty(cap.num_blocks, block_size, 2, 16, dtype=torch.float16) for _ in range(6))
    assert cache_bytes <= 1_000_000 < cache_bytes + cap.block_bytes
    assert cap.blocks_per_sequence == 7 and cap.max_concurrent_sequences == cap.num_blocks // 7
    capped = kv_capacity(spec, budget_bytes=1_000_000, block_size=block_size, max_model_len=100, dtype_bytes=2,
                         max_num_seqs=2)
    assert capped.num_blocks == 14 < cap.num_blocks and capped.max_concurrent_sequences == 2


def test_bad_input_names_the_constraint():
    spec = ModelSpec(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                     vocab_size=49152, intermediate_size=1536)
    setup = TrainingSetup(seq_len=512, global_batch=8, num_devices=8, device_memory_bytes=2**34)
    with pytest.raises(ValueError, match="num_attention_heads=9 not divisible by tensor degree 2"):
        check_split(spec, Split(4, 2, 1), setup)
    with pytest.raises(ValueError, match="num_hidden_layers=30 not divisible by pipeline degree 4"):
        check_split(spec, Split(2, 1, 4), setup)
    with pytest.raises(ValueError, match="hidden_size=0"):
        ModelSpec(30, 0, 9, 3, 49152, 1536)
    with pytest.raises(ValueError, match="global_batch=-1"):
        TrainingSetup(seq_len=512, global_batch=-1, num_devices=8, device_memory_bytes=2**34)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by tensor_parallel=2"):
        kv_bytes_per_token(spec, 2, tensor_parallel=2)


def test_plan_ranks_feasible_and_explains_infeasible():
    spec = ModelSpec(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                     vocab_size=49152, intermediate_size=1536, tie_word_embeddings=True)
    setup = TrainingSetup(seq_len=2048, global_batch=32, num_devices=6, device_memory_bytes=8 * 2**30)
    entries = plan_training(spec, setup)
    feasible = [e for e in entries if not e.infeasible]
    assert feasible and all(e.total_bytes <= setup.device_memory_bytes for e in feasible)
    assert all(e.split.data * e.split.tensor * e.split.pipeline == 6 for e in entries)
    times = [e.step_time_s for e in feasible]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(times, times[1:]))
    reasons = {r.split(":")[0] for e in entries for r in e.infeasible}
    assert {"memory", "tensor degree", "ZeRO with pipeline"} <= reasons
    # more micro-batches shrink the bubble, so among pipeline splits the step gets shorter
    pp3 = sorted((e for e in feasible if e.split.pipeline == 3 and e.zero_stage == 1 and e.checkpointing),
                 key=lambda e: e.micro_batches)
    assert len(pp3) >= 2 and pp3[-1].step_time_s < pp3[0].step_time_s


def test_cli_plan_from_checkpoint_and_errors(tiny_llama_dir, capsys):
    assert main(["plan", "--model", str(tiny_llama_dir), "--devices", "4", "--seq-len", "128",
                 "--global-batch", "8", "--device-memory-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "best: " in out and "feasible of" in out and "1F1B schedule simulation" in out
    assert main(["plan", "--model", str(tiny_llama_dir), "--mode", "inference", "--device-memory-gib", "1",
                 "--block-size", "16", "--max-model-len", "256"]) == 0
    spec = ModelSpec.from_checkpoint(tiny_llama_dir)
    assert f"kv_bytes_per_token: {kv_bytes_per_token(spec, 2):,}" in capsys.readouterr().out
    assert main(["plan", "--model", str(tiny_llama_dir), "--devices", "4", "--dp", "1", "--tp", "4", "--pp", "1"]) == 2
    assert "num_key_value_heads=2 not divisible by tensor degree 4" in capsys.readouterr().err
