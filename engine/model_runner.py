"""Llama-family transformer over a paged KV cache, one flattened token batch per step.

Architectures: Llama (incl. SmolLM2), Mistral (sliding window), Qwen2 (q/k/v bias); RMSNorm
(Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021, RoFormer) with the
checkpoint's ``rope_theta`` and ``linear`` / ``llama3`` scaling, grouped-query attention
(Ainslie et al. 2023) and SwiGLU MLP (Shazeer 2020).

Every step runs all scheduled tokens of all requests as one batch of ``N`` tokens: linear layers
see ``[N, hidden]``. Attention writes the new K/V into the cache by ``slot_mapping`` and reads
each request's context through its block table: decodes (one query token each) form one
group whose blocks shared by every request are read once (cascade attention), prefill chunks
(padded to the longest chunk) another, one ``scaled_dot_product_attention`` call per layer with
a causal mask. No Python loop over requests runs inside the layer loop.

INT8 checkpoints (``compress.int8``: ``weight-only`` or ``w8a8``, named in the safetensors
metadata) run their linear layers, the LM head included when it was quantized, with the INT8
kernels of ``compress.int8`` on CPU; on CUDA their weights are dequantized to ``dtype``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from compress.checkpoints import CheckpointError
from compress.int8 import (
    INT8_SCALE_SUFFIX,
    INT8_WEIGHT_SUFFIX,
    dequantize_weight,
    int8_linear,
    read_scheme,
)
from engine.scheduler import SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------------------------ architecture


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape and options of a Llama-family checkpoint, read from its ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    qkv_bias: bool
    sliding_window: int | None
    max_position_embeddings: int
    tie_word_embeddings: bool


def _llama_bias(cfg) -> bool:
    return bool(getattr(cfg, "attention_bias", False))


def _qwen2_window(cfg) -> int | None:
    if getattr(cfg, "use_sliding_window", False):
        raise CheckpointError("qwen2 with use_sliding_window=True is not supported by the engine; set it to false")
    return None


#: model_type -> (has q/k/v bias, sliding window) readers. Add an architecture here.
ARCHITECTURES: dict[str, tuple[Callable, Callable]] = {
    "llama": (_llama_bias, lambda cfg: None),
    "mistral": (lambda cfg: False, lambda cfg: getattr(cfg, "sliding_window", None)),
    "qwen2": (lambda cfg: True, _qwen2_window),
}


def read_model_spec(path: Path) -> ModelSpec:
    """Read ``config.json`` of a checkpoint directory.

    Raises:
        CheckpointError: an architecture outside ``ARCHITECTURES`` (the supported ones are listed).
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    if cfg.model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: model_type {cfg.model_type!r} is not supported by the engine; supported: {sorted(ARCHITECTURES)}"
        )
    bias_fn, window_fn = ARCHITECTURES[cfg.model_type]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelSpec(
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=float(getattr(cfg, "rope_theta", 10000.0)),
        rope_scaling=getattr(cfg, "rope_scaling", None),
        qkv_bias=bias_fn(cfg),
        sliding_window=window_fn(cfg),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )


# ------------------------------------------------------------------------------------ rotary


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with ``linear`` or ``llama3`` scaling.

    llama3 scaling (Meta, Llama 3.1): long wavelengths divided by ``factor``, short kept, a
    smooth blend in between.

    Raises:
        CheckpointError: an unsupported ``rope_scaling`` type.
    """
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise CheckpointError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., d] -> [..., d]``: ``cat(-x[d/2:], x[:d/2])`` (the Hugging Face Llama convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ------------------------------------------------------------------------------------ weights


class Linear:
    """``y = x @ W^T + b`` from float weights, or a CPU INT8 layer of ``compress.int8`` (same dtype in and out)."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, int8_layer=None, dtype=None):
        self.weight, self.bias, self.int8_layer, self.dtype = weight, bias, int8_layer, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_layer is not None:
            return self.int8_layer(x)
        return F.linear(x, self.weight, self.bias)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint's ``*.safetensors`` files.

    Raises:
        CheckpointError: no weight file, or a corrupt one (its path is named).
    """
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights; the engine loads safetensors checkpoints")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises several error types for corrupt files
            raise CheckpointError(f"{file}: cannot read safetensors ({exc}); re-create the checkpoint") from exc
    return tensors


class WeightLoader:
    """Builds fused linear layers from a state dict, float or INT8 (``X.weight_int8`` + ``X.weight_scale``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype, device: str):
        self.tensors, self.path, self.dtype, self.device = tensors, path, dtype, device
        try:
            self.int8_scheme = read_scheme(sorted(path.glob("*.safetensors")))  # None for a float checkpoint
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc

    def has(self, name: str) -> bool:
        return name in self.tensors or name.removesuffix(".weight") + INT8_WEIGHT_SUFFIX in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: weight {name!r} is missing; the checkpoint is incomplete")
        return self.tensors[name].to(device=self.device, dtype=self.dtype)

    def is_int8(self, prefix: str) -> bool:
        return prefix + INT8_WEIGHT_SUFFIX in self.tensors

    def linear(self, prefixes: list[str], bias: bool = False) -> Linear:
        """One linear layer whose output concatenates those of ``prefixes`` (e.g. q, k, v)."""
        biases = torch.cat([self.tensor(p + ".bias") for p in prefixes]) if bias else None
        if all(self.is_int8(p) for p in prefixes) and self.device == "cpu":
            w8 = torch.cat([self.tensors[p + INT8_WEIGHT_SUFFIX] for p in prefixes])  # [sum(out), in]
            scale = torch.cat([self.tensors[p + INT8_SCALE_SUFFIX] for p in prefixes])
            return Linear(None, int8_layer=int8_linear(self.int8_scheme, w8, scale, None if biases is None else biases.float()), dtype=self.dtype)
        weights = [self._float_weight(p) for p in prefixes]
        return Linear(torch.cat(weights).contiguous(), biases)

    def _float_weight(self, prefix: str) -> torch.Tensor:
        if self.is_int8(prefix):
            w = dequantize_weight(self.tensors[prefix + INT8_WEIGHT_SUFFIX], self.tensors[prefix + INT8_SCALE_SUFFIX])
            return w.to(device=self.device, dtype=self.dtype)
        return self.tensor(prefix + ".weight")


@dataclasses.dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim
    o: Linear  # num_heads * head_dim -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


def load_layers(loader: WeightLoader, spec: ModelSpec) -> list[LayerWeights]:
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                input_norm=loader.tensor(p + "input_layernorm.weight"),
                qkv=loader.linear([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"], bias=spec.qkv_bias),
                o=loader.linear([p + "self_attn.o_proj"]),
                post_norm=loader.tensor(p + "post_attention_layernorm.weight"),
                gate_up=loader.linear([p + "mlp.gate_proj", p + "mlp.up_proj"]),
                down=loader.linear([p + "mlp.down_proj"]),
            )
        )
    return layers


# ------------------------------------------------------------------------------------ attention metadata


@dataclasses.dataclass
class AttentionGroup:
    """Requests of one attention call: their queries, block tables and mask.

    Attributes:
        block_tables: ``[B, max_blocks]`` physical block ids (padded with block 0).
        mask: ``[B, 1, Q, T]`` bool, True where query may attend key (T = max_blocks * block_size).
        query_index: ``[B, Q]`` rows of the group's flat queries (padding repeats row 0 of the
            request), ``None`` for decodes (Q = 1, rows in order).
        output_index: ``[n]`` rows of the flattened ``[B * Q]`` output that are real tokens,
            ``None`` for decodes.
        shared_blocks: ``[C]`` leading blocks common to every request of a decode group (a shared
            prompt prefix); read once for all, ``block_tables`` and ``mask`` then start at block C.
    """

    block_tables: torch.Tensor
    mask: torch.Tensor
    query_index: torch.Tensor | None = None
    output_index: torch.Tensor | None = None
    shared_blocks: torch.Tensor | None = None


@dataclasses.dataclass
class StepInputs:
    """Tensors of one step, shared by every layer.

    Attributes:
        input_ids: ``[N]`` token ids, decodes first then prefill chunks.
        positions: ``[N]`` positions in their sequences.
        slot_mapping: ``[N]`` physical slot ``block * block_size + offset`` receiving each token's K/V.
        num_decodes: the first ``num_decodes`` tokens are single-token decodes.
        decode: attention group of the decodes (or ``None``).
        prefill: attention group of the prefill chunks (or ``None``).
        logits_index: ``[S]`` rows whose logits are sampled (last token of finished chunks).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    logits_index: torch.Tensor


# ------------------------------------------------------------------------------------ runner


class ModelRunner:
    """Owns the weights and the KV cache; ``execute`` runs one scheduled step.

    Args:
        path: a resolved checkpoint directory.
        dtype: ``float32`` / ``bfloat16`` / ``float16`` (activations and float weights).
        device: ``cpu`` or ``cuda``.
        block_size: tokens per KV block.
        max_model_len: longest sequence (sizes the rotary tables).

    Raises:
        CheckpointError: unsupported architecture, missing or corrupt weights.
    """

    def __init__(self, path: Path, dtype: str, device: str, block_size: int, max_model_len: int):
        self.spec = spec = read_model_spec(path)
        self.dtype = DTYPES[dtype]
        self.device = device
        self.block_size = block_size
        tensors = load_state_dict(path)
        loader = WeightLoader(tensors, path, self.dtype, device)
        self.embed = loader.tensor("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = load_layers(loader, spec)
        self.norm = loader.tensor("model.norm.weight")
        if loader.is_int8("lm_head") or (loader.has("lm_head.weight") and not spec.tie_word_embeddings):
            self.lm_head = loader.linear(["lm_head"])
        else:
            self.lm_head = Linear(self.embed)
        self.is_int8 = any(k.endswith(INT8_WEIGHT_SUFFIX) for k in tensors)
        del tensors
        inv_freq = rope_inv_freq(spec)
        t = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_model_len, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_model_len, head_dim]
        self.rope_cos = emb.cos().to(device=device, dtype=self.dtype)
        self.rope_sin = emb.sin().to(device=device, dtype=self.dtype)
        self.kv_cache: torch.Tensor | None = None

    # ------------------------------------------------------------ KV cache

    def kv_bytes_per_block(self) -> int:
        """Bytes of K and V of all layers for one block."""
        s = self.spec
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * self.embed.element_size()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Zero-filled cache ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``."""
        s = self.spec
        self.kv_cache = torch.zeros(
            s.num_layers, 2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim, dtype=self.dtype, device=self.device
        )

    # ------------------------------------------------------------ inputs

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flatten the step's tokens and build slot mapping, block tables and masks."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_index: list[int] = []
        decodes, prefills = [], []
        for item in out.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            table = seq.block_table
            for p in range(start, start + n):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            if item.samples:
                logits_index.append(len(ids) - 1)
            (decodes if n == 1 and not prefills else prefills).append(item)
        device = self.device
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        positions_t = as_long(positions)
        decode = self._decode_group(decodes) if decodes else None
        prefill = self._prefill_group(prefills, positions_t[len(decodes):]) if prefills else None
        return StepInputs(as_long(ids), positions_t, as_long(slots), len(decodes), decode, prefill, as_long(logits_index))

    def _block_tables(self, items, num_blocks: int, first: int = 0) -> torch.Tensor:
        """``[B, num_blocks - first]`` block ids of columns ``first..num_blocks`` (padded with block 0)."""
        width = num_blocks - first
        rows = []
        for it in items:
            row = it.seq.block_table[first:num_blocks]
            rows.append(row + [0] * (width - len(row)))
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _key_mask(self, query_pos: torch.Tensor, num_keys: int, first_key: int = 0) -> torch.Tensor:
        """``query_pos [B, Q] -> [B, 1, Q, T]``: causal (and sliding-window) mask over key positions ``first_key..num_keys``."""
        keys = torch.arange(first_key, num_keys, device=self.device)
        mask = keys[None, None, :] <= query_pos[:, :, None]
        window = self.spec.sliding_window
        if window is not None:
            mask &= keys[None, None, :] > query_pos[:, :, None] - window
        return mask[:, None]

    def _decode_group(self, items) -> AttentionGroup:
        bs = self.block_size
        ctx = [it.seq.num_computed_tokens + 1 for it in items]
        num_blocks = -(-max(ctx) // bs)
        shared = 0
        if len(items) > 1 and self.spec.sliding_window is None:
            shared = common_prefix_blocks([it.seq.block_table for it in items], min(ctx) // bs)
        query_pos = torch.tensor([c - 1 for c in ctx], dtype=torch.long, device=self.device)[:, None]  # [D, 1]
        tables = self._block_tables(items, num_blocks, first=shared)
        mask = self._key_mask(query_pos, num_blocks * bs, first_key=shared * bs)
        shared_blocks = torch.tensor(items[0].seq.block_table[:shared], dtype=torch.long, device=self.device) if shared else None
        return AttentionGroup(tables, mask, shared_blocks=shared_blocks)

    def _prefill_group(self, items, positions: torch.Tensor) -> AttentionGroup:
        lengths = [it.num_new_tokens for it in items]
        max_q = max(lengths)
        ends = [it.seq.num_computed_tokens + it.num_new_tokens for it in items]
        num_blocks = -(-max(ends) // self.block_size)
        starts = torch.tensor([0] + lengths[:-1], device=self.device).cumsum(0)  # [P] first row of each chunk
        offsets = torch.arange(max_q, device=self.device)
        lens = torch.tensor(lengths, device=self.device)
        valid = offsets[None, :] < lens[:, None]  # [P, max_q]
        query_index = torch.where(valid, starts[:, None] + offsets[None, :], starts[:, None])  # [P, max_q]
        query_pos = positions[query_index]  # [P, max_q]
        output_index = valid.reshape(-1).nonzero().squeeze(1)  # [n_prefill]
        mask = self._key_mask(query_pos, num_blocks * self.block_size)
        return AttentionGroup(self._block_tables(items, num_blocks), mask, query_index, output_index)

    # ------------------------------------------------------------ forward

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; return float32 logits ``[S, vocab]`` of the sampled rows (in ``out.scheduled`` order)."""
        inputs = self.prepare(out)
        hidden = self.forward(inputs)  # [N, hidden]
        hidden = rms_norm(hidden[inputs.logits_index], self.norm, self.spec.rms_norm_eps)  # [S, hidden]
        return self.lm_head(hidden).float()  # [S, vocab]

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """``[N]`` token ids -> ``[N, hidden]`` last hidden states (before the final norm)."""
        s = self.spec
        eps = s.rms_norm_eps
        n = inputs.input_ids.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        cos = self.rope_cos[inputs.positions][:, None, :]  # [N, 1, head_dim]
        sin = self.rope_sin[inputs.positions][:, None, :]
        h = self.embed[inputs.input_ids]  # [N, hidden]
        for layer_idx, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, eps)
            qkv = layer.qkv(x)  # [N, q_size + 2 * kv_size]
            q = qkv[:, :q_size].view(n, s.num_heads, s.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(n, s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size:].view(n, s.num_kv_heads, s.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attn = self.attention(q, k, v, self.kv_cache[layer_idx], inputs)  # [N, q_size]
            h = h + layer.o(attn)
            x = rms_norm(h, layer.post_norm, eps)
            gate_up = layer.gate_up(x)  # [N, 2 * intermediate]
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return h

    def attention(self, q, k, v, cache: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """Paged attention of one layer.

        Args:
            q: ``[N, num_heads, head_dim]`` (rotated); k, v: ``[N, num_kv_heads, head_dim]``.
            cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K, V) of this layer.

        Returns:
            ``[N, num_heads * head_dim]``.
        """
        s = self.spec
        k_cache, v_cache = cache[0], cache[1]
        flat_k = k_cache.view(-1, s.num_kv_heads, s.head_dim)  # [num_blocks * block_size, kv_heads, head_dim]
        flat_v = v_cache.view(-1, s.num_kv_heads, s.head_dim)
        flat_k.index_copy_(0, inputs.slot_mapping, k)
        flat_v.index_copy_(0, inputs.slot_mapping, v)
        outputs = []
        d = inputs.num_decodes
        if inputs.decode is not None:
            outputs.append(self._decode_attention(q[:d], k_cache, v_cache, inputs.decode))
        if inputs.prefill is not None:
            outputs.append(self._prefill_attention(q[d:], k_cache, v_cache, inputs.prefill))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _gather(self, cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, bs, kv, hd]`` by ``[B, nb]`` -> ``[B, kv, nb * bs, hd]``."""
        b, nb = block_tables.shape
        s = self.spec
        rows = cache.view(cache.shape[0], -1).index_select(0, block_tables.view(-1))  # [B * nb, bs * kv * hd]
        return rows.view(b, nb * self.block_size, s.num_kv_heads, s.head_dim).transpose(1, 2)

    def _decode_attention(self, q, k_cache, v_cache, group: AttentionGroup) -> torch.Tensor:
        """Single-token queries against their paged context.

        The heads of one KV group act as the query rows (``[D, kv_heads, g, head_dim]``), so K/V
        are never repeated. Blocks shared by the whole batch (``group.shared_blocks``) are read
        once and scored for all queries in one matrix product, as in cascade attention
        (FlashInfer, Ye et al. 2024); the per-request rest is gathered through the block tables.
        Softmax runs over the concatenated scores.
        """
        s = self.spec
        d, kv, hd = q.shape[0], s.num_kv_heads, s.head_dim
        g = s.num_heads // kv
        qg = q.view(d, kv, g, hd) * (hd ** -0.5)  # [D, kv, g, hd]
        keys = self._gather(k_cache, group.block_tables)  # [D, kv, Tu, hd]
        scores = torch.matmul(qg, keys.transpose(-1, -2))  # [D, kv, g, Tu]
        scores = scores.masked_fill(~group.mask, float("-inf"))
        num_shared = 0
        if group.shared_blocks is not None:
            shared_k = k_cache.index_select(0, group.shared_blocks).view(-1, kv, hd).transpose(0, 1)  # [kv, Ts, hd]
            qs = qg.transpose(0, 1).reshape(kv, d * g, hd)  # [kv, D*g, hd]
            shared_scores = torch.matmul(qs, shared_k.transpose(-1, -2))  # [kv, D*g, Ts]
            num_shared = shared_scores.shape[-1]
            shared_scores = shared_scores.view(kv, d, g, num_shared).transpose(0, 1)  # [D, kv, g, Ts]
            scores = torch.cat((shared_scores, scores), dim=-1)  # [D, kv, g, Ts + Tu]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        values = self._gather(v_cache, group.block_tables)  # [D, kv, Tu, hd]
        out = torch.matmul(probs[..., num_shared:], values)  # [D, kv, g, hd]
        if num_shared:
            shared_v = v_cache.index_select(0, group.shared_blocks).view(-1, kv, hd).transpose(0, 1)  # [kv, Ts, hd]
            shared_p = probs[..., :num_shared].transpose(0, 1).reshape(kv, d * g, num_shared)  # [kv, D*g, Ts]
            out = out + torch.matmul(shared_p, shared_v).view(kv, d, g, hd).transpose(0, 1)
        return out.reshape(d, s.num_heads * hd)

    def _prefill_attention(self, q, k_cache, v_cache, group: AttentionGroup) -> torch.Tensor:
        s = self.spec
        p, max_q = group.query_index.shape
        qp = q[group.query_index].transpose(1, 2)  # [P, num_heads, max_q, head_dim]
        keys = self._gather(k_cache, group.block_tables)  # [P, kv_heads, T, head_dim]
        values = self._gather(v_cache, group.block_tables)
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=group.mask, enable_gqa=True)  # [P, H, max_q, hd]
        out = out.transpose(1, 2).reshape(p * max_q, s.num_heads * s.head_dim)
        return out[group.output_index]


def common_prefix_blocks(tables: list[list[int]], limit: int) -> int:
    """Number of leading block ids (at most ``limit``) equal in every table."""
    first = tables[0]
    n = min(limit, len(first))
    for table in tables[1:]:
        while n and table[:n] != first[:n]:
            n -= 1
        if not n:
            break
    return n


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as Hugging Face Llama does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
