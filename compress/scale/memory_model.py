"""Memory of a decoder-only transformer (Llama family) per device, for training and inference.

Every number here is a closed form in the model sizes; ``compress.scale.plan`` combines them over
parallel splits. Sources:

* Model states (parameters, gradients, optimizer states) and their partitioning by ZeRO stage:
  Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", Sec. 3 and 5: mixed precision AdamW keeps 2 bytes of parameters, 2 bytes of gradients
  and K = 12 bytes of optimizer state (fp32 master weights, momentum, variance) per parameter;
  stage 1 partitions the optimizer states over the data-parallel degree N_d, stage 2 also the
  gradients, stage 3 also the parameters (FSDP ``FULL_SHARD`` is stage 3, ``SHARD_GRAD_OP`` stage 2).
* Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Sec. 4: count the tensors each block saves for the backward pass. Their closed form
  ``s*b*h*(34 + 5*a*s/h)`` is for GPT blocks (LayerNorm, GeLU MLP of 4h, dropout, materialised
  attention scores); we apply the same counting to a Llama block as PyTorch runs it (RMSNorm with
  an fp32 upcast, SwiGLU, grouped-query attention through fused scaled-dot-product attention,
  which keeps the output and a log-sum-exp instead of the score matrix). With full activation
  recomputation (gradient checkpointing) a layer keeps only its input, and the backward pass
  holds one recomputed layer at a time (Sec. 4.3).
* KV cache: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V, the
  paged layout of vLLM (Kwon et al. 2023) that our engine uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from engine.checkpoint.model_spec import ModelSpec, check_positive


class Precision(str, Enum):
    """Training precision: ``fp32``, or ``bf16`` / ``fp16`` mixed precision with fp32 master weights."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def param_bytes(self) -> int:
        """Bytes of one parameter (and one gradient) as the forward/backward pass uses it."""
        return 4 if self is Precision.FP32 else 2

    @property
    def optimizer_bytes(self) -> int:
        """AdamW state bytes per parameter: momentum + variance (fp32), plus an fp32 master copy in mixed precision
        (ZeRO's K)."""
        return 8 if self is Precision.FP32 else 12

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element in the compute dtype."""
        return 4 if self is Precision.FP32 else 2


#: Bytes of torch.optim.AdamW's per-tensor ``step`` counter (a float32 scalar tensor).
ADAM_STEP_BYTES = 4
FP32_BYTES = 4
INT64_BYTES = 8


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCount:
    """Parameter elements and parameter tensors held by one device."""

    elements: float  # may be fractional under ZeRO-3 averaging; callers round up bytes
    tensors: int


def layer_params(model: ModelSpec, tensor_parallel: int = 1) -> ParamCount:
    """Parameters of one decoder layer on one tensor-parallel rank.

    Attention and MLP matrices are split over ``tensor_parallel`` ranks (Megatron column/row
    parallel linears); the two RMSNorm weights are replicated. ``gated_mlp=False`` (GPT shapes,
    used to compare with published GPT runs) has two MLP matrices; its biases and LayerNorm
    biases (``O(h)`` per layer) are not counted.
    """
    h, q, kv, inter = model.hidden_size, model.q_size, model.kv_size, model.intermediate_size
    matrices = h * q + 2 * h * kv + q * h + (3 if model.gated_mlp else 2) * h * inter
    biases = (q + 2 * kv) if model.qkv_bias else 0
    tensors = (9 if model.gated_mlp else 8) + (3 if model.qkv_bias else 0)
    return ParamCount((matrices + biases) / tensor_parallel + 2 * h, tensors)


def stage_params(model: ModelSpec, stage: int, pipeline_parallel: int = 1, tensor_parallel: int = 1) -> ParamCount:
    """Parameters held by one device of pipeline stage ``stage`` (0-based).

    The first stage holds the embedding, the last the final norm and the LM head (vocabulary split
    over tensor ranks). With tied embeddings and one stage the matrix is counted once; with several
    stages the last stage keeps its own copy (as Megatron-LM does).
    """
    layers = model.num_hidden_layers // pipeline_parallel
    per_layer = layer_params(model, tensor_parallel)
    embed = model.vocab_size * model.hidden_size / tensor_parallel
    elements, tensors = layers * per_layer.elements, layers * per_layer.tensors
    first, last = stage == 0, stage == pipeline_parallel - 1
    if first:
        elements, tensors = elements + embed, tensors + 1
    if last:
        elements, tensors = elements + model.hidden_size, tensors + 1  # final norm
        if not (model.tie_word_embeddings and first):
            elements, tensors = elements + embed, tensors + 1
    return ParamCount(elements, tensors)


def total_params(model: ModelSpec) -> int:
    """Parameter count of the whole model (tied embeddings counted once), as ``sum(p.numel())``."""
    return int(stage_params(model, 0, 1, 1).elements)


# ---------------------------------------------------------------------------------------------
# Model states under ZeRO
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateMemory:
    """Bytes of parameters, gradients and optimizer states on one device."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def state_memory(params: ParamCount, precision: Precision, zero_stage: int, data_parallel: int) -> StateMemory:
    """Parameter, gradient and AdamW memory of one device (Rajbhandari et al. 2020, Fig. 1).

    Stage 0: ``(2 + 2 + K) * Psi`` (fp32: ``(4 + 4 + 8) * Psi``); stage 1 divides the optimizer term
    by ``data_parallel``, stage 2 also the gradients, stage 3 also the parameters. The optimizer
    term includes AdamW's float32 ``step`` counter per parameter tensor.

    Raises:
        ValueError: ``zero_stage`` not in 0..3 or ``data_parallel`` not positive.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: must be 0, 1, 2 or 3")
    check_positive("data_parallel", data_parallel)
    n = params.elements
    p = n * precision.param_bytes
    g = n * precision.param_bytes
    o = n * precision.optimizer_bytes + params.tensors * ADAM_STEP_BYTES
    if zero_stage >= 1:
        o /= data_parallel
    if zero_stage >= 2:
        g /= data_parallel
    if zero_stage >= 3:
        p /= data_parallel
    return StateMemory(math.ceil(p), math.ceil(g), math.ceil(o))


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def rmsnorm_activation_bytes(tokens: int, hidden: int, precision: Precision) -> int:
    """Bytes one RMSNorm saves for backward: fp32 input and ``rsqrt`` (the upcast), normalised and output in the
    compute dtype."""
    return tokens * (hidden * FP32_BYTES + FP32_BYTES + 2 * hidden * precision.activation_bytes)


def layer_activation_bytes(
    model: ModelSpec,
    batch: int,
    seq_len: int,
    precision: Precision,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    fused_attention: bool = True,
) -> int:
    """Bytes one decoder layer saves for backward for a micro-batch of ``batch`` sequences of ``seq_len``.

    Per token, in the compute dtype ``a``: 2 RMSNorms (see ``rmsnorm_activation_bytes``);
    attention keeps the rotated query (q), key and value, the attention output (q) and an fp32
    log-sum-exp per head; the SwiGLU MLP keeps gate, SiLU(gate), up and their product
    (4 x intermediate). ``fused_attention``: causal attention without a mask tensor, K and V at
    KV-head width (flash attention, SDPA with ``is_causal``); otherwise (SDPA with an explicit
    mask, what transformers runs with ``use_cache=False``, e.g. under gradient checkpointing) K and
    V are repeated to the query heads and each layer also keeps a ``[b, 1, s, s]`` mask. Tensor
    parallelism splits attention and MLP terms; the norms are split only with sequence
    parallelism (Korthikanti et al. 2022, Sec. 4.2.2).
    """
    a = precision.activation_bytes
    t = tensor_parallel
    tokens = batch * seq_len
    kv_width = model.kv_size if fused_attention else model.q_size
    mlp = (4 if model.gated_mlp else 2) * model.intermediate_size  # GeLU MLP: up output and GeLU output
    split = (2 * model.q_size + 2 * kv_width + mlp) * a + model.num_attention_heads * FP32_BYTES
    norms = 2 * rmsnorm_activation_bytes(tokens, model.hidden_size, precision)
    mask = 0 if fused_attention else batch * seq_len * seq_len * a
    return math.ceil(tokens * split / t + (norms / t if sequence_parallel else norms)) + mask


def input_activation_bytes(batch: int, seq_len: int) -> int:
    """Bytes saved by the embedding lookup: the int64 token ids."""
    return batch * seq_len * INT64_BYTES


def rotary_activation_bytes(model: ModelSpec, seq_len: int, precision: Precision) -> int:
    """Bytes of the rotary cos/sin tables ``[1, s, head_dim]`` that every layer's RoPE saves (shared)."""
    return 2 * seq_len * model.dim_head * precision.activation_bytes


def output_activation_bytes(model: ModelSpec, tokens: int, precision: Precision, tensor_parallel: int = 1) -> int:
    """Bytes saved by the output side: final RMSNorm, fp32 log-softmax over the (vocab-parallel) logits, int64 labels,
    the loss."""
    return (
        rmsnorm_activation_bytes(tokens, model.hidden_size, precision)
        + math.ceil(tokens * model.vocab_size * FP32_BYTES / tensor_parallel)
        + tokens * INT64_BYTES
        + FP32_BYTES
    )


def stage_activation_bytes(
    model: ModelSpec,
    *,
    micro_batch: int,
    seq_len: int,
    precision: Precision,
    stage: int = 0,
    pipeline_parallel: int = 1,
    in_flight: int = 1,
    tensor_parallel: int = 1,
    checkpointing: bool = False,
    sequence_parallel: bool = False,
    fused_attention: bool = True,
) -> int:
    """Peak activation bytes on one device of pipeline stage ``stage`` (0-based).

    ``in_flight`` micro-batches have run their forward and wait for their backward (1F1B: stage
    ``i`` of ``p`` holds ``min(m, p - i)``, Narayanan et al. 2021). Without checkpointing each
    keeps every layer's saved tensors; the peak is at the end of the forward. With full
    recomputation each keeps only each layer's input ``[tokens, hidden]``; the peak is the larger
    of the end of the forward (with the output layer's log-softmax) and the backward, which holds
    one recomputed layer at a time, whose input is the kept checkpoint (not counted twice).
    Activation memory here is the bytes of distinct tensors referenced by saved-for-backward slots;
    checked against that measurement in fp32 and bf16 in tests/compress/test_plan.py.
    """
    tokens = micro_batch * seq_len
    layers = model.num_hidden_layers // pipeline_parallel
    first, last = stage == 0, stage == pipeline_parallel - 1
    full_layer = layer_activation_bytes(
        model, micro_batch, seq_len, precision, tensor_parallel, sequence_parallel, fused_attention
    )
    rotary = rotary_activation_bytes(model, seq_len, precision)
    hidden_buffer = tokens * model.hidden_size * precision.activation_bytes
    if sequence_parallel:
        hidden_buffer = math.ceil(hidden_buffer / tensor_parallel)
    ids = input_activation_bytes(micro_batch, seq_len) if first else 0
    output = output_activation_bytes(model, tokens, precision, tensor_parallel) if last else 0
    if not checkpointing:
        return in_flight * (layers * full_layer + ids + rotary) + output
    kept = in_flight * (layers * hidden_buffer + ids)
    # the recomputed layer's input is its kept checkpoint, already counted in ``kept``
    return max(kept + output, kept + full_layer - hidden_buffer + rotary)


# ---------------------------------------------------------------------------------------------
# KV cache (inference)
# ---------------------------------------------------------------------------------------------


def kv_bytes_per_token(model: ModelSpec, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """KV cache bytes one token occupies on one device: ``2 (K and V) x layers x kv_heads/t x head_dim x dtype``.

    Raises:
        ValueError: ``num_key_value_heads`` not divisible by ``tensor_parallel``.
    """
    check_positive("dtype_bytes", dtype_bytes)
    if model.num_key_value_heads % tensor_parallel:
        raise ValueError(
            f"num_key_value_heads={model.num_key_value_heads} is not divisible by tensor_parallel={tensor_parallel}"
        )
    return 2 * model.num_hidden_layers * (model.num_key_value_heads // tensor_parallel) * model.dim_head * dtype_bytes


@dataclass(frozen=True)
class KVCapacity:
    """How many KV blocks and concurrent sequences fit a memory budget."""

    kv_bytes_per_token: int
    block_bytes: int  # one block across all layers, K and V
    num_blocks: int
    blocks_per_sequence: int
    max_concurrent_sequences: int
    max_tokens: int


def kv_capacity(
    model: ModelSpec,
    *,
    budget_bytes: int,
    block_size: int,
    max_model_len: int,
    dtype_bytes: int,
    tensor_parallel: int = 1,
    max_num_seqs: int | None = None,
) -> KVCapacity:
    """Blocks of ``block_size`` tokens that fit ``budget_bytes`` and full-length sequences they hold.

    ``num_blocks = budget // (block_size x kv_bytes_per_token)``, as a paged engine sizes its cache;
    each sequence of ``max_model_len`` tokens needs ``ceil(max_model_len / block_size)`` blocks.
    With ``max_num_seqs`` the pool is capped at what that many full-length sequences use (our
    engine does not allocate blocks its scheduler can never fill).

    Raises:
        ValueError: non-positive sizes.
    """
    check_positive("block_size", block_size)
    check_positive("max_model_len", max_model_len)
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes}: the weights alone exceed the memory; add devices or memory")
    per_token = kv_bytes_per_token(model, dtype_bytes, tensor_parallel)
    block_bytes = block_size * per_token
    num_blocks = budget_bytes // block_bytes
    per_seq = -(-max_model_len // block_size)
    if max_num_seqs is not None:
        num_blocks = min(num_blocks, check_positive("max_num_seqs", max_num_seqs) * per_seq)
    return KVCapacity(per_token, block_bytes, num_blocks, per_seq, num_blocks // per_seq, num_blocks * block_size)
