"""Time of a parallel training step or a serving decode step: compute, communication, bubble.

``compress.scale.memory_model`` says what fits; this module says how long it takes, so that
``compress.scale.plan`` can rank data / tensor / pipeline splits by tokens per second. Every term is a
closed form in the model sizes, the split and the machine (``Cluster``); the sources:

* Collectives (ring algorithms; Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective
  Communication Operations in MPICH"; the bus-bandwidth convention of NCCL's ``nccl-tests``):
  an all-reduce of ``B`` bytes over ``n`` ranks moves ``2 (n-1)/n x B`` bytes through each rank's
  link, an all-gather or reduce-scatter (``B`` = the full, gathered size) ``(n-1)/n x B``; each of
  the ``2 (n-1)`` (resp. ``n-1``) ring steps also pays a hop latency.
* Data parallelism: one gradient all-reduce per optimizer step (gradient accumulation reduces once,
  DDP ``no_sync``; Li et al. 2020, "PyTorch Distributed", VLDB). ZeRO (Rajbhandari et al. 2020,
  Sec. 7): stages 1-2 reduce-scatter the gradients and all-gather the updated parameters (the same
  ``2 Psi`` volume as an all-reduce); stage 2 keeps only a gradient shard, so it reduce-scatters
  after every micro-batch; stage 3 also all-gathers the parameters before the forward and again
  before the backward of every micro-batch (``3 Psi`` per micro-batch; FSDP ``FULL_SHARD``).
* Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, Sec. 3; Narayanan et al. 2021, Sec. 3.2):
  two all-reduces of the ``[b, s, h]`` activations per transformer layer in the forward pass
  (after attention, after the MLP) and two in the backward pass; full recomputation repeats the
  forward two. Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) replaces each all-reduce
  by an all-gather plus a reduce-scatter: the same bytes on the wire. These sit on the critical
  path (not overlapped).
* Pipeline parallelism (Narayanan et al. 2021, Sec. 2.2 and 4.1): per micro-batch each stage
  boundary sends the ``[b, s, h]`` activations forward and their gradients backward; with tensor
  parallelism each tensor rank sends ``1/t`` of it (their scatter/gather optimisation, or sequence
  parallelism). The 1F1B bubble is ``p - 1`` micro-batch slots of the slowest stage.
* Overlap, an explicit assumption (``overlap_grad_reduce``): when on, gradient reduction runs in
  buckets during the backward pass (PyTorch DDP, FSDP, Megatron-LM ``--overlap-grad-reduce``), so
  only what exceeds the backward of the last micro-batch shows (ZeRO-2: of each micro-batch);
  ZeRO-3's parameter gathers are prefetched during the compute of the micro-batch, except the
  first layer's (nothing runs before it): ``1/layers`` of the traffic always shows. When off
  (Megatron-LM as of 2021, which reduced gradients after the pipeline flush) all of it shows.
  The final parameter all-gather of ZeRO-1/2 after the optimizer step is never overlapped.
* Placement (Megatron-LM's default rank order ``tp-dp-pp``, Narayanan et al. 2021 Takeaway 1):
  tensor ranks are adjacent (inside a node when ``t`` divides ``devices_per_node``), then data,
  then pipeline ranks. A group whose members all sit in one node uses the NVLink-class rate,
  a group across nodes leaves each node through the NICs of its members there (one per GPU on
  the preset machines), ``min(intra, members per node x inter)`` (``group_link``).

Achieved FLOP/s (instead of one peak): every GEMM of the layer takes
``max(2 m n k / (GEMM_EFFICIENCY x peak), bytes / (HBM_EFFICIENCY x hbm))`` (a roofline: small or
thin GEMMs, e.g. at decode or over a thin tensor shard, are bound by reading their operands);
fused causal attention runs at ``FLASH_ATTENTION_EFFICIENCY`` of peak on half of the score matrix;
unfused attention is two batched GEMMs plus a softmax that reads and writes the ``[b, a, s, s]``
scores; norms, activations, residual adds and rotary embedding are memory-bound element-wise
traffic. The backward pass costs twice the forward (Narayanan et al. 2021, Sec. 5.1), fused
attention's 2.5 times (Dao et al. 2022).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from compress.scale.memory_model import ModelSpec, Precision, kv_bytes_per_token, layer_activation_bytes

#: Fraction of tensor-core peak a large bf16/fp16 GEMM sustains once its tiles fill every SM:
#: large cuBLAS GEMMs reach 75-85 % of the datasheet peak on A100 and 65-75 % on H100 (whose
#: clocks drop under sustained tensor-core load); one value, 0.7, for every model and device.
GEMM_EFFICIENCY = 0.7
#: Output tiles of large 16-bit GEMM kernels (rows x columns); a GEMM runs in waves of one tile
#: per SM, and a partial last wave idles the rest (wave quantization; NVIDIA, "Matrix
#: Multiplication Background User's Guide", Sec. "Tile Quantization" and "Wave Quantization").
#: The library's heuristic picks a kernel per shape; we take the tile that wastes least.
GEMM_TILES = ((256, 128), (128, 256), (128, 128))
#: Fraction of peak reached by fused causal attention forward + backward: FlashAttention-2 runs
#: at 50-70 % of A100 peak for head_dim 64-128 (Dao 2023, "FlashAttention-2", Sec. 4.1).
FLASH_ATTENTION_EFFICIENCY = 0.55
#: Backward / forward time of fused attention: the backward recomputes the scores and runs five
#: matrix products to the forward's two (Dao et al. 2022, "FlashAttention", Sec. 3.1 and App. B).
FLASH_BACKWARD_RATIO = 2.5
#: Fraction of the datasheet memory bandwidth that streaming kernels reach (STREAM-like copies
#: reach 80-90 % of HBM peak on A100/H100).
HBM_EFFICIENCY = 0.8
#: Fraction of the per-direction link rate a large NCCL collective reaches as bus bandwidth
#: (``nccl-tests`` on NVLink and InfiniBand systems report about 80 %).
LINK_EFFICIENCY = 0.8
#: Latency of one ring step inside a node (NVLink) and between nodes (InfiniBand), seconds.
INTRA_NODE_HOP_S = 1e-6
INTER_NODE_HOP_S = 5e-6
#: Forward element-wise traffic per byte saved for backward: each saved tensor is written by the
#: op that makes it and read by the op that consumes it (the backward, twice the forward, then
#: reads it and writes and reads its gradient).
ELEMENTWISE_PASSES = 2
#: Bytes AdamW reads and writes per parameter in an optimizer step, mixed precision: fp32 master,
#: momentum and variance read and written (24), the 16-bit gradient read and parameter written (4).
ADAM_BYTES_PER_PARAM = 28

GBIT_BYTES = 1e9 / 8  # bytes per second in one Gb/s


@dataclass(frozen=True)
class Cluster:
    """The machines: per-device peak and memory bandwidth, and the two levels of network.

    Link rates are per device and per direction, in Gb/s (an NVLink 3 A100 with "600 GB/s" total
    bidirectional bandwidth has 300 GB/s = 2400 Gb/s each way).

    Raises:
        ValueError: a non-positive rate or node size (names the field).
    """

    peak_tflops: float  # dense 16-bit tensor-core peak per device, TFLOP/s
    hbm_gbs: float  # device memory bandwidth, GB/s
    devices_per_node: int = 8
    intra_node_gbps: float = 2400.0  # NVLink class, Gb/s per device per direction
    inter_node_gbps: float = 200.0  # InfiniBand / Ethernet class, Gb/s per device per direction
    name: str = "custom"
    sm_count: int = 108  # streaming multiprocessors (A100: 108, H100 SXM: 132), for wave quantization

    def __post_init__(self) -> None:
        if not isinstance(self.sm_count, int) or self.sm_count <= 0:
            raise ValueError(f"sm_count={self.sm_count!r}: must be a positive integer")
        for field_name in ("peak_tflops", "hbm_gbs", "intra_node_gbps", "inter_node_gbps"):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"{field_name}={getattr(self, field_name)!r}: must be > 0")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node <= 0:
            raise ValueError(f"devices_per_node={self.devices_per_node!r}: must be a positive integer")

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbs * 1e9


#: Common machines. Sources: NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: BF16 312 TFLOPS
#: dense, 2,039 GB/s HBM2e, NVLink 600 GB/s); NVIDIA DGX A100 datasheet (8 GPUs, 8 single-port
#: ConnectX-6 200 Gb/s HDR InfiniBand for the compute fabric: one per GPU); NVIDIA H100 Tensor
#: Core GPU datasheet (SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, 3.35 TB/s HBM3, NVLink
#: 900 GB/s); NVIDIA DGX H100 datasheet (8 GPUs, 8 ConnectX-7 400 Gb/s NDR: one per GPU). SM
#: counts from the A100 (108) and H100 SXM5 (132) architecture whitepapers.
CLUSTER_PRESETS: dict[str, Cluster] = {
    "a100-80gb-sxm": Cluster(
        312.0, 2039.0, 8, 300 * 8, 200.0, "8x A100 80GB SXM (NVLink 600 GB/s) + 200 Gb/s HDR per GPU"
    ),
    "h100-sxm": Cluster(989.0, 3350.0, 8, 450 * 8, 400.0, "8x H100 SXM (NVLink 900 GB/s) + 400 Gb/s NDR per GPU", 132),
}


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """What one rank of a process group sees: bytes per second and latency per ring step."""

    bytes_per_s: float
    hop_s: float
    inter_node: bool


def group_link(cluster: Cluster, stride: int, size: int) -> Link:
    """The link one rank of a group of ``size`` ranks ``r, r + stride, ...`` sees under ``cluster``.

    Inside one node (``stride * size`` divides ``devices_per_node``): the NVLink-class rate.
    Across nodes, the rings leave each node through the NICs of the group's ``g`` members in that
    node (one NIC per GPU on the preset machines; NCCL runs one ring per NIC), so a rank sees
    ``min(intra, g x inter)``: ``g = 1`` when the group has one member per node (then the
    per-device inter-node rate), ``g = 8`` for a data-parallel group over whole 8-GPU nodes.
    """
    node = cluster.devices_per_node
    intra = cluster.intra_node_gbps * GBIT_BYTES * LINK_EFFICIENCY
    if size > 1 and stride * size <= node and node % (stride * size) == 0:
        return Link(intra, INTRA_NODE_HOP_S, False)
    members_per_node = min(size, node // stride) if stride < node else 1
    inter = cluster.inter_node_gbps * GBIT_BYTES * LINK_EFFICIENCY * max(1, members_per_node)
    return Link(min(intra, inter), INTER_NODE_HOP_S, True)


def all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` over ``ranks``: ``2 (n-1)/n x B / bw + 2 (n-1) x hop``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / link.bytes_per_s + 2 * (ranks - 1) * link.hop_s


def all_gather_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a tensor of ``nbytes`` in full: ``(n-1)/n x B / bw + (n-1) x hop``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / link.bytes_per_s + (ranks - 1) * link.hop_s


reduce_scatter_s = all_gather_s


def p2p_s(nbytes: float, link: Link) -> float:
    """One point-to-point send of ``nbytes``."""
    return nbytes / link.bytes_per_s + link.hop_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class DataParallelBytes:
    """Bytes handed to each collective in one optimizer step by one rank (what ``torch.distributed`` is called with).

    ``all_reduce``: gradients (DDP / ZeRO-0). ``reduce_scatter``: the full gradient tensors
    (input size). ``all_gather``: the full parameter tensors (output size).
    """

    all_reduce: float = 0.0
    reduce_scatter: float = 0.0
    all_gather: float = 0.0


def data_parallel_bytes(
    param_elements: float, zero_stage: int, micro_batches: int, param_bytes: int, grad_bytes: int
) -> DataParallelBytes:
    """Collective bytes of one step for ``param_elements`` parameters on a device (the replicated model shard).

    Stage 0: one all-reduce of the gradients. Stage 1: one reduce-scatter of the gradients and
    one all-gather of the updated parameters. Stage 2: a reduce-scatter per micro-batch, one
    all-gather. Stage 3 (FSDP ``FULL_SHARD``): per micro-batch an all-gather of the parameters
    for the forward and one for the backward, and a reduce-scatter of the gradients
    (Rajbhandari et al. 2020, Sec. 7.2).

    Raises:
        ValueError: an unknown ZeRO stage.
    """
    p, g, m = param_elements * param_bytes, param_elements * grad_bytes, micro_batches
    if zero_stage == 0:
        return DataParallelBytes(all_reduce=g)
    if zero_stage == 1:
        return DataParallelBytes(reduce_scatter=g, all_gather=p)
    if zero_stage == 2:
        return DataParallelBytes(reduce_scatter=m * g, all_gather=p)
    if zero_stage == 3:
        return DataParallelBytes(reduce_scatter=m * g, all_gather=2 * m * p)
    raise ValueError(f"zero_stage={zero_stage!r}: must be 0, 1, 2 or 3")


# ---------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------


def wave_efficiency(m: float, n: float, cluster: Cluster) -> float:
    """Fraction of the SMs' work slots a ``[m, n]`` output fills, best over ``GEMM_TILES``:
    ``(m n / tile area) / (waves x SMs)`` with ``waves = ceil(tiles / sm_count)`` (a partial edge
    tile counts as a whole one). Skinny outputs (decode) use tiles of as few rows as they need,
    down to the 16 rows of a tensor-core MMA instruction."""
    best = 0.0
    for rows, cols in GEMM_TILES:
        rows = min(rows, 16 * math.ceil(m / 16))
        tiles = math.ceil(m / rows) * math.ceil(n / cols)
        best = max(best, m * n / (rows * cols) / (math.ceil(tiles / cluster.sm_count) * cluster.sm_count))
    return best


def gemm_s(m: float, n: float, k: float, cluster: Cluster, dtype_bytes: int = 2, batch: float = 1) -> float:
    """Time of ``batch`` GEMMs ``[m, k] x [k, n]``: the larger of math at ``GEMM_EFFICIENCY`` of
    peak times the wave efficiency (of all ``batch`` outputs together) and reading both operands
    and writing the output at ``HBM_EFFICIENCY`` of bandwidth (a roofline)."""
    waves = wave_efficiency(m * batch, n, cluster)
    math_s = 2 * m * n * k / (GEMM_EFFICIENCY * waves * cluster.peak_flops)
    memory_s = (m * k + k * n + m * n) * dtype_bytes / (HBM_EFFICIENCY * cluster.hbm_bytes_per_s)
    return batch * max(math_s, memory_s)


def memory_s(nbytes: float, cluster: Cluster) -> float:
    """Time to stream ``nbytes`` through device memory."""
    return nbytes / (HBM_EFFICIENCY * cluster.hbm_bytes_per_s)


def layer_times(
    model: ModelSpec,
    batch: int,
    seq_len: int,
    cluster: Cluster,
    *,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    fused_attention: bool = True,
    dtype_bytes: int = 2,
) -> tuple[float, float]:
    """Forward and backward time of one decoder layer on one tensor rank for ``batch`` sequences of ``seq_len``.

    GEMMs (per rank, ``M = batch x seq_len``): QKV ``[M, h] x [h, (q + 2 kv)/t]``, output
    ``[M, q/t] x [q/t, h]``, MLP up (gated: gate and up, ``2 i/t``; plain: ``i/t``) and down.
    Causal attention: fused at ``FLASH_ATTENTION_EFFICIENCY`` on half the ``4 b s^2 d a/t`` FLOPs,
    its backward ``FLASH_BACKWARD_RATIO`` x the forward; unfused, ``QK^T`` and ``AV`` as batched
    GEMMs plus a softmax that writes and reads the scores once each in the forward. The rest of the
    backward is twice the forward (two GEMMs per forward GEMM). Element-wise work (norms, activation function, rotary,
    residual adds) is memory
    traffic: ``ELEMENTWISE_PASSES`` x the bytes the layer saves for backward
    (``compress.scale.memory_model.layer_activation_bytes``, checked against real tensors), split over
    ``t`` as that count is (norms only with sequence parallelism).
    """
    t, a = tensor_parallel, dtype_bytes
    h, q, kv, inter = model.hidden_size, model.q_size, model.kv_size, model.intermediate_size
    tokens = batch * seq_len
    up = (2 if model.gated_mlp else 1) * inter
    gemms = (
        gemm_s(tokens, (q + 2 * kv) / t, h, cluster, a)
        + gemm_s(tokens, h, q / t, cluster, a)
        + gemm_s(tokens, up / t, h, cluster, a)
        + gemm_s(tokens, h, inter / t, cluster, a)
    )
    heads = model.num_attention_heads / t
    if fused_attention:
        attn_flops = 4 * batch * seq_len * seq_len * model.dim_head * heads
        attn_bytes = batch * seq_len * (2 * q + 2 * kv) / t * a  # read q, k, v, write the output
        attention = max(
            attn_flops / 2 / (FLASH_ATTENTION_EFFICIENCY * cluster.peak_flops), memory_s(attn_bytes, cluster)
        )
        attention_backward = FLASH_BACKWARD_RATIO * attention
    else:
        scores = batch * heads * seq_len * seq_len * a
        attention = (
            gemm_s(seq_len, seq_len, model.dim_head, cluster, a, batch * heads)
            + gemm_s(seq_len, model.dim_head, seq_len, cluster, a, batch * heads)
            + memory_s(2 * scores, cluster)
        )
        attention_backward = 2 * attention
    precision = Precision.FP32 if dtype_bytes == 4 else Precision.BF16
    saved = layer_activation_bytes(model, batch, seq_len, precision, t, sequence_parallel, fused_attention)
    rest = gemms + memory_s(ELEMENTWISE_PASSES * saved, cluster)
    return rest + attention, 2 * rest + attention_backward


def head_forward_s(
    model: ModelSpec, tokens: int, cluster: Cluster, tensor_parallel: int = 1, dtype_bytes: int = 2
) -> float:
    """Forward time of the LM head and the loss on the last stage: ``[M, h] x [h, V/t]`` plus an
    fp32 log-softmax that writes and reads the ``[M, V/t]`` logits."""
    vocab = model.vocab_size / tensor_parallel
    return gemm_s(tokens, vocab, model.hidden_size, cluster, dtype_bytes) + memory_s(tokens * vocab * 4 * 2, cluster)


# ---------------------------------------------------------------------------------------------
# Training step
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest pipeline stage, by cause; they add up to ``step_s``."""

    compute_s: float  # m micro-batches of forward + backward (+ recompute)
    tp_comm_s: float  # tensor-parallel all-reduces (critical path)
    pp_comm_s: float  # pipeline sends of activations and gradients
    dp_comm_s: float  # data-parallel / ZeRO collectives not hidden behind the backward
    bubble_s: float  # 1F1B fill and drain: (p - 1) micro-batch slots
    optimizer_s: float  # AdamW update of this device's optimizer shard

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.bubble_s + self.optimizer_s


@dataclass(frozen=True)
class ParallelConfig:
    """One configuration to time: degrees, micro-batching, ZeRO stage and recomputation."""

    data: int
    tensor: int
    pipeline: int
    micro_batches: int
    micro_batch_size: int
    zero_stage: int = 0
    checkpointing: bool = False
    sequence_parallel: bool = False


def training_step_time(
    model: ModelSpec,
    config: ParallelConfig,
    cluster: Cluster,
    *,
    seq_len: int,
    stage_param_elements: float,
    dtype_bytes: int = 2,
    fused_attention: bool = True,
    overlap_grad_reduce: bool = True,
) -> StepTime:
    """Time one optimizer step of ``config`` (see the module docstring for each term).

    Args:
        stage_param_elements: parameters one device holds before ZeRO partitioning (the most
            loaded stage's tensor shard; ``compress.scale.memory_model.stage_params``).
        dtype_bytes: bytes of a 16-bit (2) or fp32 (4) activation, parameter and gradient (fp32
            GEMMs are still timed at the 16-bit peak: fp32 training is not modelled).
        overlap_grad_reduce: the overlap assumption (module docstring).

    Raises:
        ValueError: degrees or micro-batching below 1.
    """
    c = config
    for name in ("data", "tensor", "pipeline", "micro_batches", "micro_batch_size"):
        if getattr(c, name) < 1:
            raise ValueError(f"{name}={getattr(c, name)}: must be >= 1")
    t, p, d, m, b = c.tensor, c.pipeline, c.data, c.micro_batches, c.micro_batch_size
    tokens = b * seq_len
    layers = model.num_hidden_layers / p
    layer_fwd, layer_bwd = layer_times(
        model,
        b,
        seq_len,
        cluster,
        tensor_parallel=t,
        sequence_parallel=c.sequence_parallel,
        fused_attention=fused_attention,
        dtype_bytes=dtype_bytes,
    )
    head = head_forward_s(model, tokens, cluster, t, dtype_bytes)  # backward: twice; never recomputed
    forward_part = layers * layer_fwd + head
    backward_part = layers * (layer_bwd + (layer_fwd if c.checkpointing else 0.0)) + 2 * head
    micro_compute = forward_part + backward_part  # the last stage (it holds the head) is the slowest

    tp_link = group_link(cluster, 1, t)
    activation_bytes = tokens * model.hidden_size * dtype_bytes
    micro_tp = layers * (4 + (2 if c.checkpointing else 0)) * all_reduce_s(activation_bytes, t, tp_link)
    pp_link = group_link(cluster, t * d, p)
    micro_pp = 2 * p2p_s(activation_bytes / t, pp_link) if p > 1 else 0.0

    dp_link = group_link(cluster, t, d)
    traffic = data_parallel_bytes(stage_param_elements, c.zero_stage, m, dtype_bytes, dtype_bytes)
    reduce_s = all_reduce_s(traffic.all_reduce, d, dp_link) + reduce_scatter_s(traffic.reduce_scatter, d, dp_link)
    gather_s = all_gather_s(traffic.all_gather, d, dp_link)
    backward_window = backward_part
    if not overlap_grad_reduce or d == 1:
        dp_exposed = reduce_s + gather_s
    elif c.zero_stage == 3:  # gathers prefetched and gradient shards reduced during each micro-batch,
        # except the first layer's gathers (forward, backward) and the last reduce-scatter: 1/layers of it
        per_micro = (reduce_s + gather_s) / m
        dp_exposed = m * max(per_micro / layers, per_micro - micro_compute)
    elif c.zero_stage == 2:
        dp_exposed = m * max(0.0, reduce_s / m - backward_window) + gather_s
    else:
        dp_exposed = max(0.0, reduce_s - backward_window) + gather_s

    shard = stage_param_elements / (d if c.zero_stage >= 1 else 1)
    optimizer = memory_s(shard * ADAM_BYTES_PER_PARAM, cluster)
    slot = micro_compute + micro_tp + micro_pp
    return StepTime(m * micro_compute, m * micro_tp, m * micro_pp, dp_exposed, (p - 1) * slot, optimizer)


# ---------------------------------------------------------------------------------------------
# Serving (decode)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeTime:
    """One decode step (one new token for each of ``batch`` sequences) on one tensor rank, seconds."""

    weights_s: float  # GEMMs: at small batch, reading this rank's weight shard
    attention_s: float  # reading the KV cache of every sequence
    tp_comm_s: float  # 2 all-reduces of [batch, h] per layer

    @property
    def itl_s(self) -> float:
        return self.weights_s + self.attention_s + self.tp_comm_s


def decode_step_time(
    model: ModelSpec,
    cluster: Cluster,
    *,
    batch: int,
    context_len: int,
    tensor_parallel: int = 1,
    weight_bytes: int = 2,
    kv_dtype_bytes: int = 2,
) -> DecodeTime:
    """Inter-token latency of a decode step with ``batch`` sequences of ``context_len`` tokens.

    GEMMs with ``M = batch`` through ``gemm_s`` (weight-bandwidth bound at small batch; weight
    bytes per element ``weight_bytes``); attention reads ``batch x context_len`` tokens of KV cache
    (``kv_bytes_per_token`` on this rank); tensor parallelism all-reduces the ``[batch, h]``
    activations twice per layer (Megatron-LM), where latency dominates at small batch.

    Raises:
        ValueError: non-positive batch or context, KV heads not divisible by ``tensor_parallel``.
    """
    if batch < 1 or context_len < 1:
        raise ValueError(f"batch={batch}, context_len={context_len}: both must be >= 1")
    t = tensor_parallel
    h, q, kv, inter = model.hidden_size, model.q_size, model.kv_size, model.intermediate_size
    up = (2 if model.gated_mlp else 1) * inter
    w = weight_bytes
    layer = (
        gemm_s(batch, (q + 2 * kv) / t, h, cluster, w)
        + gemm_s(batch, h, q / t, cluster, w)
        + gemm_s(batch, up / t, h, cluster, w)
        + gemm_s(batch, h, inter / t, cluster, w)
    )
    weights = model.num_hidden_layers * layer + gemm_s(batch, model.vocab_size / t, h, cluster, w)
    attention = memory_s(batch * context_len * kv_bytes_per_token(model, kv_dtype_bytes, t), cluster)
    comm = model.num_hidden_layers * 2 * all_reduce_s(batch * h * 2, t, group_link(cluster, 1, t))
    return DecodeTime(weights, attention, comm)


def megatron_flops_per_iteration(model: ModelSpec, batch: int, seq_len: int) -> float:
    """FLOPs Narayanan et al. 2021 (Eq. 3) count per iteration, with activation recomputation:
    ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))``; the figure their TFLOP/s per GPU divide."""
    layers, h, v = model.num_hidden_layers, model.hidden_size, model.vocab_size
    return 96 * batch * seq_len * layers * h * h * (1 + seq_len / (6 * h) + v / (16 * layers * h))


def model_flops_per_token(model: ModelSpec, param_count: int, seq_len: int) -> float:
    """Model FLOPs per trained token for MFU: ``6 N + 12 L s q`` (Chowdhery et al. 2022, App. B;
    no recomputation counted)."""
    return 6 * param_count + 12 * model.num_hidden_layers * seq_len * model.q_size
