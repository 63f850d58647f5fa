"""``lmforge plan``: memory, parallelism and step-time planner for training and inference at scale.

Training: for every (data, tensor, pipeline) split of the devices, micro-batch count, ZeRO stage
and checkpointing choice, the per-device memory (parameters, gradients, optimizer states,
activations; formulas and sources in ``compress.scale.memory_model``) and the step time by cause:
compute at an achieved (not peak) FLOP rate, tensor-parallel all-reduces, pipeline sends,
data-parallel / ZeRO collectives not hidden behind the backward, the 1F1B bubble
(``compress.scale.pipeline_schedule``) and the optimizer update (``compress.scale.comm_model``, on a
``Cluster``: peak, memory bandwidth, devices per node, intra- and inter-node link rates). The
feasible configurations are ranked by tokens per second; the others list the constraint they break.

MFU is model FLOPs (``6 N + 12 L s q`` per token, no recomputation) per second over the peak of
all devices (Chowdhery et al. 2022, App. B); ``mfu_6n`` counts ``6 N`` only (Kaplan et al. 2020).

Inference: KV cache bytes per token and the concurrent full-length sequences that fit the memory
left after the weights, in blocks of ``block_size`` tokens (how a paged engine sizes its cache),
and for each tensor-parallel size the inter-token latency of a decode step with its all-reduces.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field

from compress.scale.comm_model import (
    CLUSTER_PRESETS,
    Cluster,
    DecodeTime,
    ParallelConfig,
    StepTime,
    decode_step_time,
    model_flops_per_token,
    training_step_time,
)
from compress.scale.memory_model import (
    KVCapacity,
    ModelSpec,
    Precision,
    StateMemory,
    kv_capacity,
    stage_activation_bytes,
    stage_params,
    state_memory,
    total_params,
)
from compress.scale.pipeline_schedule import bubble_fraction, simulate_1f1b
from engine.checkpoint.outputs import check_output_file, write_output_file
from engine.checkpoint.store import resolve_checkpoint
from engine.errors import LmforgeError, UsageError

GIB = 2**30


@dataclass(frozen=True)
class TrainingSetup:
    """What the user trains with; sizes in sequences, tokens and bytes.

    Raises:
        ValueError: a non-positive size, or an unknown zero stage (names the field).
    """

    seq_len: int
    global_batch: int  # sequences per optimizer step
    num_devices: int
    device_memory_bytes: int
    precision: Precision = Precision.BF16
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    checkpointing: tuple[bool, ...] = (False, True)
    cluster: Cluster = CLUSTER_PRESETS["a100-80gb-sxm"]  # peak FLOP/s, memory and network of the devices
    sequence_parallel: bool = False
    fused_attention: bool = True  # flash / SDPA is_causal; False: SDPA with a materialised mask
    overlap_grad_reduce: bool = True  # gradient reduction overlaps the backward (compress.scale.comm_model)

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch", "num_devices", "device_memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        bad = [z for z in self.zero_stages if z not in (0, 1, 2, 3)]
        if bad or not self.zero_stages:
            raise ValueError(f"zero_stages={self.zero_stages!r}: choose from 0, 1, 2, 3")


@dataclass(frozen=True)
class Split:
    """Degrees of data, tensor and pipeline parallelism; their product is the device count."""

    data: int
    tensor: int
    pipeline: int


@dataclass
class PlanEntry:
    """One configuration: split, micro-batching, ZeRO, checkpointing, and what it costs."""

    split: Split
    micro_batches: int
    micro_batch_size: int
    zero_stage: int
    checkpointing: bool
    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    bubble_fraction: float = 0.0
    time: StepTime | None = None  # the step by cause
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0  # model FLOPs (6 N + 12 L s q per token) per second / peak of all devices
    mfu_6n: float = 0.0  # the same with 6 N per token only (Kaplan et al. 2020), no attention term
    infeasible: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes

    def describe(self) -> str:
        """``dp=.. tp=.. pp=.. m=.. mbs=.. ZeRO-.. ckpt ..``"""
        s = self.split
        return (
            f"dp={s.data} tp={s.tensor} pp={s.pipeline} m={self.micro_batches} mbs={self.micro_batch_size} "
            f"ZeRO-{self.zero_stage} ckpt {'on' if self.checkpointing else 'off'}"
        )


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [k for k in range(1, n + 1) if n % k == 0]


def split_constraints(model: ModelSpec, split: Split, global_batch: int) -> list[str]:
    """Why ``split`` cannot run this model and batch; empty when it can."""
    t, p, d = split.tensor, split.pipeline, split.data
    checks = [
        ("tensor", t, "num_attention_heads", model.num_attention_heads),
        ("tensor", t, "num_key_value_heads", model.num_key_value_heads),
        ("tensor", t, "intermediate_size", model.intermediate_size),
        ("pipeline", p, "num_hidden_layers", model.num_hidden_layers),
        ("data", d, "global_batch", global_batch),
    ]
    problems = [
        f"{kind} degree: {field}={value} not divisible by {kind} degree {degree}"
        for kind, degree, field, value in checks
        if value % degree
    ]
    return problems


def check_split(model: ModelSpec, split: Split, setup: TrainingSetup) -> None:
    """Raise ``ValueError`` naming every constraint a user-chosen split breaks."""
    product = split.data * split.tensor * split.pipeline
    problems = split_constraints(model, split, setup.global_batch)
    if product != setup.num_devices:
        problems.append(f"device count: data x tensor x pipeline = {product} != num_devices={setup.num_devices}")
    if problems:
        raise ValueError("; ".join(problems))


def enumerate_splits(num_devices: int) -> list[Split]:
    """Every (data, tensor, pipeline) with ``d * t * p == num_devices``."""
    return [Split(num_devices // (t * p), t, p) for t in divisors(num_devices) for p in divisors(num_devices // t)]


def evaluate_entry(model: ModelSpec, setup: TrainingSetup, entry: PlanEntry) -> PlanEntry:
    """Fill memory (the most loaded pipeline stage), bubble, step time and feasibility of ``entry``."""
    s = entry.split
    if entry.zero_stage >= 2 and s.pipeline > 1:
        entry.infeasible.append(
            f"ZeRO with pipeline: stage {entry.zero_stage} with pipeline degree {s.pipeline} (gradient "
            "partitioning conflicts "
            "with pipeline micro-batch accumulation; DeepSpeed allows ZeRO-1 with pipelines)"
        )
    worst: tuple[int, StateMemory, int] | None = None
    for stage in range(s.pipeline):
        states = state_memory(
            stage_params(model, stage, s.pipeline, s.tensor), setup.precision, entry.zero_stage, s.data
        )
        acts = stage_activation_bytes(
            model,
            micro_batch=entry.micro_batch_size,
            seq_len=setup.seq_len,
            precision=setup.precision,
            stage=stage,
            pipeline_parallel=s.pipeline,
            in_flight=min(entry.micro_batches, s.pipeline - stage),
            tensor_parallel=s.tensor,
            checkpointing=entry.checkpointing,
            sequence_parallel=setup.sequence_parallel,
            fused_attention=setup.fused_attention,
        )
        if worst is None or states.total_bytes + acts > worst[0]:
            worst = (states.total_bytes + acts, states, acts)
    _, states, acts = worst
    entry.params_bytes, entry.grads_bytes, entry.optimizer_bytes = (
        states.params_bytes,
        states.grads_bytes,
        states.optimizer_bytes,
    )
    entry.activations_bytes = acts
    if entry.total_bytes > setup.device_memory_bytes:
        entry.infeasible.append(
            f"memory: needs {entry.total_bytes / GIB:.1f} GiB per device > {setup.device_memory_bytes / GIB:.1f} GiB "
            f"(states {states.total_bytes / GIB:.1f}, activations {acts / GIB:.1f})"
        )
    entry.bubble_fraction = bubble_fraction(s.pipeline, entry.micro_batches)
    config = ParallelConfig(
        s.data,
        s.tensor,
        s.pipeline,
        entry.micro_batches,
        entry.micro_batch_size,
        entry.zero_stage,
        entry.checkpointing,
        setup.sequence_parallel,
    )
    shard = max(stage_params(model, stage, s.pipeline, s.tensor).elements for stage in range(s.pipeline))
    entry.time = training_step_time(
        model,
        config,
        setup.cluster,
        seq_len=setup.seq_len,
        stage_param_elements=shard,
        dtype_bytes=setup.precision.param_bytes,
        fused_attention=setup.fused_attention,
        overlap_grad_reduce=setup.overlap_grad_reduce,
    )
    tokens = setup.global_batch * setup.seq_len
    entry.step_time_s = entry.time.step_s
    entry.tokens_per_s = tokens / entry.step_time_s
    model_flops = model_flops_per_token(model, total_params(model), setup.seq_len) * entry.tokens_per_s
    entry.mfu = model_flops / (setup.num_devices * setup.cluster.peak_flops)
    entry.mfu_6n = 6 * total_params(model) * entry.tokens_per_s / (setup.num_devices * setup.cluster.peak_flops)
    return entry


def rank_key(entry: PlanEntry) -> tuple:
    """Sort key: feasible first, then most tokens per second (shortest step), then least memory."""
    if entry.infeasible:
        return (1, 0.0, 0)
    return (0, round(entry.step_time_s, 12), entry.total_bytes)


def plan_training(model: ModelSpec, setup: TrainingSetup, splits: list[Split] | None = None) -> list[PlanEntry]:
    """Evaluate every configuration; feasible ones first, most tokens per second first (then least memory).

    Args:
        splits: restrict to these splits (each is checked with ``check_split``); default all.

    Raises:
        ValueError: a given split breaks a constraint (the message names it).
    """
    if splits is None:
        splits = enumerate_splits(setup.num_devices)
    else:
        for split in splits:
            check_split(model, split, setup)
    entries = []
    for split in splits:
        problems = split_constraints(model, split, setup.global_batch)
        if problems:
            entries.append(PlanEntry(split, 0, 0, 0, False, infeasible=problems))
            continue
        per_replica = setup.global_batch // split.data
        for m in divisors(per_replica):
            for zero in setup.zero_stages:
                for ckpt in setup.checkpointing:
                    entries.append(evaluate_entry(model, setup, PlanEntry(split, m, per_replica // m, zero, ckpt)))
    entries.sort(key=rank_key)
    return entries


@dataclass(frozen=True)
class ServingSetup:
    """What a model is served with: device memory and the share the engine may use, the KV cache's
    ``block_size``, ``max_model_len`` and ``max_num_seqs`` (None: no cap), bytes per weight and per KV value."""

    device_memory_bytes: int
    memory_utilization: float
    block_size: int
    max_model_len: int
    weight_bytes: int
    kv_dtype_bytes: int
    max_num_seqs: int | None = None

    def weights_per_device(self, model: ModelSpec, tensor_parallel: int) -> int:
        return math.ceil(total_params(model) * self.weight_bytes / tensor_parallel)


def inference_capacity(model: ModelSpec, setup: ServingSetup, tensor_parallel: int = 1) -> KVCapacity:
    """KV capacity of one device after the weights: budget = memory x utilization - weights / t.

    Raises:
        ValueError: utilization outside (0, 1], non-positive sizes, KV heads not divisible by t, or
            weights larger than the budget.
    """
    if not 0 < setup.memory_utilization <= 1:
        raise ValueError(f"memory_utilization={setup.memory_utilization}: must be in (0, 1]")
    budget = int(setup.device_memory_bytes * setup.memory_utilization) - setup.weights_per_device(
        model, tensor_parallel
    )
    return kv_capacity(
        model,
        budget_bytes=budget,
        block_size=setup.block_size,
        max_model_len=setup.max_model_len,
        dtype_bytes=setup.kv_dtype_bytes,
        tensor_parallel=tensor_parallel,
        max_num_seqs=setup.max_num_seqs,
    )


TIME_TERMS = {
    "compute_s": "compute",
    "tp_comm_s": "tensor-parallel all-reduce",
    "pp_comm_s": "pipeline sends",
    "dp_comm_s": "exposed data-parallel communication",
    "bubble_s": "pipeline bubble",
    "optimizer_s": "optimizer update",
}


def runner_up(feasible: list[PlanEntry]) -> PlanEntry | None:
    """The fastest feasible configuration with another split than the winner's (else the second)."""
    if len(feasible) < 2:
        return None
    return next((e for e in feasible[1:] if e.split != feasible[0].split), feasible[1])


def explain_winner(best: PlanEntry, other: PlanEntry) -> str:
    """One line: why ``best`` beats ``other``, from the largest differences of their step terms and memory."""
    deltas = {name: getattr(other.time, name) - getattr(best.time, name) for name in TIME_TERMS}
    loses = max(deltas, key=deltas.get)
    gains = min(deltas, key=deltas.get)
    gap = other.step_time_s - best.step_time_s
    line = (
        f"winner {best.describe()} vs runner-up {other.describe()}: {gap:.3f} s per step "
        f"({gap / other.step_time_s:.1%}) faster; the runner-up spends {deltas[loses]:.3f} s more on "
        f"{TIME_TERMS[loses]}"
    )
    if deltas[gains] < 0:
        line += f" and saves {-deltas[gains]:.3f} s of {TIME_TERMS[gains]}"
    memory = best.total_bytes - other.total_bytes
    line += f"; it needs {abs(memory) / GIB:.1f} GiB {'less' if memory > 0 else 'more'} per device"
    return line


@dataclass(frozen=True)
class ServingOption:
    """One tensor-parallel size for serving: memory per device, KV capacity and decode latency."""

    tensor_parallel: int
    weights_bytes: int  # per device
    capacity: KVCapacity | None  # None: the weights do not fit
    itl_batch1: DecodeTime | None  # one sequence at max_model_len
    itl_full: DecodeTime | None  # every sequence that fits, at max_model_len
    full_batch: int


def serving_options(model: ModelSpec, cluster: Cluster, setup: ServingSetup) -> list[ServingOption]:
    """For each tensor-parallel size inside one node that divides the KV heads: what fits and the ITL.

    ITL is ``compress.scale.comm_model.decode_step_time`` at ``max_model_len`` tokens of context, for one
    sequence and for as many full-length sequences as the KV cache holds (capped by ``max_num_seqs``).
    """
    options = []
    for t in divisors(cluster.devices_per_node):
        if model.num_key_value_heads % t or model.num_attention_heads % t:
            continue
        weights = setup.weights_per_device(model, t)
        try:
            cap = inference_capacity(model, setup, t)
        except ValueError:
            cap = None
        if cap is None or cap.max_concurrent_sequences < 1:
            options.append(ServingOption(t, weights, cap, None, None, 0))
            continue
        one, full = (
            decode_step_time(
                model,
                cluster,
                batch=batch,
                context_len=setup.max_model_len,
                tensor_parallel=t,
                weight_bytes=setup.weight_bytes,
                kv_dtype_bytes=setup.kv_dtype_bytes,
            )
            for batch in (1, cap.max_concurrent_sequences)
        )
        options.append(ServingOption(t, weights, cap, one, full, cap.max_concurrent_sequences))
    return options


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (a checkpoint, or explicit sizes)")
    model.add_argument("--model", help="checkpoint: name, .gguf or HF directory (reads config.json)")
    model.add_argument("--num-layers", type=int, help="num_hidden_layers")
    model.add_argument("--hidden-size", type=int)
    model.add_argument("--num-heads", type=int, help="num_attention_heads")
    model.add_argument("--num-kv-heads", type=int, help="num_key_value_heads (default: num-heads)")
    model.add_argument("--vocab-size", type=int)
    model.add_argument("--intermediate-size", type=int)
    model.add_argument("--head-dim", type=int, help="default hidden-size / num-heads")
    model.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--mode", choices=("train", "inference"), default="train")
    parser.add_argument("--devices", type=int, default=8, help="number of devices (train)")
    parser.add_argument("--device-memory-gib", type=float, default=80.0, help="memory per device, GiB")
    train = parser.add_argument_group("training")
    train.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    train.add_argument("--global-batch", type=int, default=64, help="sequences per optimizer step")
    train.add_argument(
        "--precision",
        choices=[p.value for p in Precision],
        default="bf16",
        help="fp32, or bf16/fp16 mixed precision with fp32 master weights",
    )
    train.add_argument(
        "--zero-stage",
        type=int,
        action="append",
        choices=(0, 1, 2, 3),
        help="ZeRO stage(s) to consider (repeat; default all)",
    )
    train.add_argument(
        "--checkpointing",
        choices=("off", "on", "both"),
        default="both",
        help="gradient checkpointing (full recomputation)",
    )
    train.add_argument(
        "--sequence-parallel", action="store_true", help="Megatron sequence parallelism with tensor parallelism"
    )
    train.add_argument(
        "--attention",
        choices=("fused", "masked"),
        default="fused",
        help="fused: flash attention / SDPA is_causal; masked: SDPA with a [b,1,s,s] mask, K/V repeated",
    )
    hw = parser.add_argument_group("devices and network (a preset, or explicit values that override it)")
    hw.add_argument(
        "--cluster",
        choices=tuple(CLUSTER_PRESETS),
        default="a100-80gb-sxm",
        help="; ".join(f"{k}: {v.name}" for k, v in CLUSTER_PRESETS.items()),
    )
    hw.add_argument(
        "--device-tflops", type=float, help="peak dense 16-bit TFLOP/s per device (achieved rate is modelled)"
    )
    hw.add_argument("--hbm-gbs", type=float, help="device memory bandwidth, GB/s")
    hw.add_argument("--devices-per-node", type=int, help="devices sharing the NVLink-class network")
    hw.add_argument("--intra-node-gbps", type=float, help="NVLink class, Gb/s per device per direction")
    hw.add_argument("--inter-node-gbps", type=float, help="InfiniBand / Ethernet class, Gb/s per device per direction")
    train.add_argument(
        "--no-overlap-grad-reduce",
        action="store_true",
        help="gradient reduction after the backward (default: overlapped with it, as DDP/FSDP do)",
    )
    train.add_argument("--dp", type=int, help="fix the data degree (with --tp and --pp)")
    train.add_argument("--tp", type=int, help="fix the tensor degree (train) / tensor parallel size (inference)")
    train.add_argument("--pp", type=int, help="fix the pipeline degree")
    train.add_argument("--top", type=int, default=10, help="feasible configurations to print")
    infer = parser.add_argument_group("inference")
    infer.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    infer.add_argument("--max-model-len", type=int, default=2048, help="tokens per sequence (prompt + output)")
    infer.add_argument("--kv-dtype", choices=tuple(DTYPE_BYTES), default="bf16")
    infer.add_argument("--weight-dtype", choices=tuple(DTYPE_BYTES), default="bf16")
    infer.add_argument(
        "--max-num-seqs", type=int, help="cap the pool at this many full-length sequences (engine field)"
    )
    infer.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="fraction of device memory for weights + KV"
    )
    parser.add_argument("--json", dest="json_out", help="also write the full plan to this JSON file")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The model from ``--model`` or from the explicit sizes (which override the checkpoint's)."""
    explicit = {
        "num_hidden_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "vocab_size": args.vocab_size,
        "intermediate_size": args.intermediate_size,
        "head_dim": args.head_dim,
    }
    if args.model:
        base = asdict(ModelSpec.from_checkpoint(resolve_checkpoint(args.model)))
    else:
        missing = [
            k
            for k in ("num_layers", "hidden_size", "num_heads", "vocab_size", "intermediate_size")
            if getattr(args, k) is None
        ]
        if missing:
            raise ValueError(f"pass --model or all of: {', '.join('--' + m.replace('_', '-') for m in missing)}")
        base = {"tie_word_embeddings": args.tie_word_embeddings}
        explicit["num_key_value_heads"] = args.num_kv_heads or args.num_heads
    base.update({k: v for k, v in explicit.items() if v is not None})
    return ModelSpec(**base)


def _s(x: float) -> str:
    return f"{x:7.3f}"


def format_training(model: ModelSpec, setup: TrainingSetup, entries: list[PlanEntry], top: int) -> str:
    feasible = [e for e in entries if not e.infeasible]
    c = setup.cluster
    lines = [
        f"model: {total_params(model):,} parameters, {model.num_hidden_layers} layers, hidden {model.hidden_size}, "
        f"heads {model.num_attention_heads}/{model.num_key_value_heads} KV, vocab {model.vocab_size}",
        f"setup: {setup.num_devices} devices x {setup.device_memory_bytes / GIB:.0f} GiB, {setup.precision.value}, "
        f"seq_len {setup.seq_len}, global batch {setup.global_batch} sequences",
        f"devices: {c.peak_tflops:g} TFLOP/s peak, {c.hbm_gbs:g} GB/s memory, {c.devices_per_node} per node, "
        f"{c.intra_node_gbps:g} Gb/s intra-node, {c.inter_node_gbps:g} Gb/s inter-node per device; gradient reduction "
        f"{'overlapped with' if setup.overlap_grad_reduce else 'after'} the backward",
        f"{len(feasible)} feasible of {len(entries)} configurations (times in s per step, memory in GiB per device)",
        "",
        "rank  dp  tp  pp  micro  mbs  zero  ckpt   states  activ.   total  compute  tp_comm  pp_comm  dp_comm"
        "   bubble    optim   step_s     tok/s    MFU",
    ]
    for rank, e in enumerate(feasible[:top], 1):
        s, t = e.split, e.time
        lines.append(
            f"{rank:4d} {s.data:3d} {s.tensor:3d} {s.pipeline:3d} {e.micro_batches:6d} {e.micro_batch_size:4d} "
            f"{e.zero_stage:5d} {'on' if e.checkpointing else 'off':>5} "
            f"{(e.total_bytes - e.activations_bytes) / GIB:8.2f}"
            f"{e.activations_bytes / GIB:8.2f}{e.total_bytes / GIB:8.2f}  {_s(t.compute_s)}  {_s(t.tp_comm_s)}  "
            f"{_s(t.pp_comm_s)}  {_s(t.dp_comm_s)}  {_s(t.bubble_s)}  {_s(t.optimizer_s)}  {_s(e.step_time_s)} "
            f"{e.tokens_per_s:9.0f} {e.mfu:6.1%}"
        )
    if feasible:
        best = feasible[0]
        lines.append(
            f"\nbest: {best.describe()}: {best.tokens_per_s:,.0f} tok/s, MFU {best.mfu:.1%} (6N only: "
            f"{best.mfu_6n:.1%}), step {best.step_time_s:.3f} s "
            f"(bubble {best.bubble_fraction:.1%}), {(setup.device_memory_bytes - best.total_bytes) / GIB:.1f} "
            "GiB headroom"
        )
        other = runner_up(feasible)
        if other is not None:
            lines.append(explain_winner(best, other))
        simulated = simulate_1f1b(best.split.pipeline, best.micro_batches)
        lines.append(
            f"1F1B schedule simulation for pp={best.split.pipeline}, m={best.micro_batches}: bubble "
            f"{simulated.bubble_fraction:.4f} (closed form (p-1)/(m+p-1) = {best.bubble_fraction:.4f}), "
            f"micro-batches held per stage {simulated.max_in_flight}"
        )
    reasons: dict[str, list[tuple[PlanEntry, str]]] = {}
    for e in entries:
        for reason in e.infeasible:
            reasons.setdefault(reason.split(":")[0], []).append((e, reason))
    if reasons:
        lines.append("\ninfeasible (count, constraint, first example):")
        for group in sorted(reasons.values(), key=len, reverse=True):
            e, reason = group[0]
            where = f"dp={e.split.data} tp={e.split.tensor} pp={e.split.pipeline}"
            if e.micro_batches:
                where += f" micro={e.micro_batches} zero={e.zero_stage} ckpt={'on' if e.checkpointing else 'off'}"
            lines.append(f"  {len(group):5d}  {reason}  [{where}]")
    return "\n".join(lines)


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The ``--cluster`` preset with any explicit device and network values replacing its own."""
    preset = CLUSTER_PRESETS[args.cluster]
    overrides = {
        "peak_tflops": args.device_tflops,
        "hbm_gbs": args.hbm_gbs,
        "devices_per_node": args.devices_per_node,
        "intra_node_gbps": args.intra_node_gbps,
        "inter_node_gbps": args.inter_node_gbps,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return preset
    return Cluster(**{**asdict(preset), **overrides, "name": f"{args.cluster} with {', '.join(sorted(overrides))} set"})


def run_training(args: argparse.Namespace, model: ModelSpec) -> dict:
    setup = TrainingSetup(
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        num_devices=args.devices,
        device_memory_bytes=int(args.device_memory_gib * GIB),
        precision=Precision(args.precision),
        zero_stages=tuple(args.zero_stage or (0, 1, 2, 3)),
        checkpointing={"off": (False,), "on": (True,), "both": (False, True)}[args.checkpointing],
        cluster=cluster_from_args(args),
        sequence_parallel=args.sequence_parallel,
        fused_attention=args.attention == "fused",
        overlap_grad_reduce=not args.no_overlap_grad_reduce,
    )
    fixed = (args.dp, args.tp, args.pp)
    splits = None
    if any(v is not None for v in fixed):
        if any(v is None for v in fixed):
            raise ValueError("--dp, --tp and --pp fix a split together; pass all three (or none to search)")
        for flag, value in zip(("--dp", "--tp", "--pp"), fixed):
            if value < 1:
                raise ValueError(f"{flag} {value}: a parallel degree must be >= 1")
        splits = [Split(args.dp, args.tp, args.pp)]
    entries = plan_training(model, setup, splits)
    print(format_training(model, setup, entries, args.top))
    return {
        "model": asdict(model),
        "setup": {**asdict(setup), "precision": setup.precision.value},
        "entries": [{**asdict(e), "total_bytes": e.total_bytes} for e in entries],
    }


def run_inference(args: argparse.Namespace, model: ModelSpec) -> dict:
    for flag, value in (("--tp", args.tp), ("--max-num-seqs", args.max_num_seqs)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1 (or left out)")
    cluster = cluster_from_args(args)
    setup = ServingSetup(  # both the chosen size and every option are sized with it
        device_memory_bytes=int(args.device_memory_gib * GIB),
        memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        weight_bytes=DTYPE_BYTES[args.weight_dtype],
        kv_dtype_bytes=DTYPE_BYTES[args.kv_dtype],
        max_num_seqs=args.max_num_seqs,
    )
    cap = inference_capacity(model, setup, args.tp) if args.tp else None
    options = serving_options(model, cluster, setup)
    if cap is None:
        fitting = [o for o in options if o.capacity is not None and o.full_batch >= 1]
        if not fitting:
            raise ValueError(
                f"weights and one sequence of max_model_len={args.max_model_len} fit no tensor-parallel size up "
                f"to {cluster.devices_per_node} devices of {args.device_memory_gib:g} GiB; add memory, "
                "quantize the weights (--weight-dtype int8) or lower --max-model-len"
            )
        cap = fitting[0].capacity
        args.tp = fitting[0].tensor_parallel
    t = args.tp
    print(
        f"model: {total_params(model):,} parameters; KV cache {args.kv_dtype}, block_size {args.block_size}, "
        f"tensor parallel {t}"
    )
    print(
        f"kv_bytes_per_token: {cap.kv_bytes_per_token:,} "
        f"(2 x {model.num_hidden_layers} layers x {model.num_key_value_heads // t} KV heads x "
        f"{model.dim_head} head_dim x {DTYPE_BYTES[args.kv_dtype]} bytes)"
    )
    print(f"num_blocks: {cap.num_blocks:,} ({cap.block_bytes:,} bytes each) = {cap.max_tokens:,} tokens")
    print(
        f"max concurrent sequences of max_model_len {args.max_model_len}: {cap.max_concurrent_sequences:,} "
        f"({cap.blocks_per_sequence} blocks each)"
    )
    print(
        f"\ntensor-parallel sizes on {cluster.peak_tflops:g} TFLOP/s, {cluster.hbm_gbs:g} GB/s devices, "
        f"{cluster.intra_node_gbps:g} Gb/s NVLink-class (ITL at {args.max_model_len} tokens of context):"
    )
    print("  tp  weights_GiB  max_seqs  itl_1seq_ms  allreduce_ms  itl_full_ms  allreduce_ms   tok/s_full")
    for o in options:
        if o.itl_batch1 is None:
            print(f"{o.tensor_parallel:4d} {o.weights_bytes / GIB:12.2f}  does not fit (weights + one sequence)")
            continue
        print(
            f"{o.tensor_parallel:4d} {o.weights_bytes / GIB:12.2f} {o.full_batch:9d} {o.itl_batch1.itl_s * 1e3:12.2f} "
            f"{o.itl_batch1.tp_comm_s * 1e3:13.2f} {o.itl_full.itl_s * 1e3:12.2f} {o.itl_full.tp_comm_s * 1e3:13.2f} "
            f"{o.full_batch / o.itl_full.itl_s:12.0f}"
        )
    usable = [o for o in options if o.itl_batch1 is not None]
    if usable and usable[0].tensor_parallel > 1:
        print(
            f"needs tp >= {usable[0].tensor_parallel}: the weights "
            f"({total_params(model) * DTYPE_BYTES[args.weight_dtype] / GIB:.1f} GiB) "
            "and one sequence do not fit one device; the all-reduces cost "
            f"{usable[0].itl_batch1.tp_comm_s * 1e3:.2f} ms "
            f"of {usable[0].itl_batch1.itl_s * 1e3:.2f} ms ITL at batch 1"
        )
    elif len(usable) > 1:
        one, two = usable[0], usable[1]
        print(
            f"fits on one device; tp={two.tensor_parallel} changes ITL at batch 1 from "
            f"{one.itl_batch1.itl_s * 1e3:.2f} to "
            f"{two.itl_batch1.itl_s * 1e3:.2f} ms ({two.itl_batch1.tp_comm_s * 1e3:.2f} ms of all-reduce) and holds "
            f"{two.full_batch} instead of {one.full_batch} full-length sequences per replica"
        )
    return {
        "model": asdict(model),
        "capacity": asdict(cap),
        "tensor_parallel": t,
        "serving_options": [asdict(o) for o in options],
    }


def run(args: argparse.Namespace) -> int:
    if args.json_out:
        check_output_file(args.json_out, flag="--json")
    try:
        model = model_from_args(args)
        result = run_training(args, model) if args.mode == "train" else run_inference(args, model)
    except ValueError as error:  # a flag or model shape the plan cannot use (CheckpointError too)
        raise error if isinstance(error, LmforgeError) else UsageError(str(error)) from error
    if args.json_out:
        write_output_file(args.json_out, json.dumps(result, indent=1), flag="--json")
    return 0
