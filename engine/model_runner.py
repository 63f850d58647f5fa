"""``ModelRunner``: one scheduled step -> flat model inputs -> logits of the sampled rows.

Owns the model (``engine.model``), the attention backend (``engine.attention``) and the KV cache.
``prepare`` flattens the step's tokens (decodes first, then prefill chunks) and builds the
``CommonAttentionMetadata`` (positions, slot mapping, block table) with tensor ops over the
block table, not per token; ``execute`` runs the forward pass and the lm head on the rows
that are sampled. With LoRA enabled (``enable_lora``) it also owns the ``engine.lora.LoRAManager``,
and ``prepare`` maps each row to its adapter's slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from engine.attention import CommonAttentionMetadata, kv_bytes_per_token
from engine.attention_backends import get_attention_backend
from engine.lora import LoRABatch, LoRAManager
from engine.model import DTYPES, Model
from engine.scheduler import SchedulerOutput

#: ``kv_cache_dtype`` names -> the cache tensor's dtype (int8 rows carry their scales: ``engine.attention``).
KV_DTYPES = {**DTYPES, "int8": torch.int8}


@dataclasses.dataclass
class StepInputs:
    """Tensors of one step, shared by every layer.

    Attributes:
        input_ids: ``[N]`` token ids, decodes first then prefill chunks.
        positions: ``[N]`` positions in their sequences.
        attn_metadata: the attention backend's metadata of this step.
        logits_index: ``[S + P]`` rows whose logits are computed: the ``S`` sampled ones (last token of
            finished chunks, in ``out.scheduled`` order), then the ``P`` prompt positions that score
            the next prompt token (``ScheduledSequence.prompt_logprob_positions``, same order).
        lora: the rows' LoRA slots (``None``: every row runs the base).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: object
    logits_index: torch.Tensor
    lora: LoRABatch | None = None


class ModelRunner:
    """Owns the model and the KV cache; ``execute`` runs one scheduled step.

    Args:
        path: a resolved checkpoint directory.
        dtype: ``float32`` / ``bfloat16`` / ``float16`` (activations and float weights).
        device: ``cpu`` or ``cuda``.
        block_size: tokens per KV block.
        max_model_len: longest sequence (sizes the rotary tables).
        attention_backend: ``engine.attention.ATTENTION_BACKENDS`` name; ``None`` picks by device.
        kv_cache_dtype: ``EngineConfig.kv_cache_dtype`` resolved (``float32`` / ``bfloat16`` / ``float16`` /
            ``int8``); ``None`` stores K and V in ``dtype``.
        batch_invariant: ``EngineConfig.batch_invariant`` (the model's linears and the attention).

    Raises:
        CheckpointError: unsupported architecture, missing or corrupt weights.
    """

    def __init__(
        self,
        path: Path,
        dtype: str,
        device: str,
        block_size: int,
        max_model_len: int,
        attention_backend: str | None = None,
        kv_cache_dtype: str | None = None,
        batch_invariant: bool = False,
    ):
        self.dtype = DTYPES[dtype]
        self.kv_cache_dtype = self.dtype if kv_cache_dtype in (None, "auto") else KV_DTYPES[kv_cache_dtype]
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model = Model(path, self.dtype, device, max_model_len, batch_invariant)
        self.spec = s = self.model.spec
        self.attn = get_attention_backend(
            device,
            s.num_attention_heads,
            s.num_key_value_heads,
            s.head_dim,
            s.sliding_window,
            attention_backend,
            batch_invariant,
        )
        self.kv_cache: torch.Tensor | None = None
        self.lora_manager: LoRAManager | None = None

    def enable_lora(self, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> LoRAManager:
        """Create the model's ``LoRAManager`` (``EngineConfig`` limits); returns it."""
        self.lora_manager = LoRAManager(self.spec, self.dtype, self.device, max_loras, max_lora_rank, max_cpu_loras)
        return self.lora_manager

    @property
    def layers(self):
        return self.model.layers

    @property
    def is_int8(self) -> bool:
        return self.model.is_int8

    # ------------------------------------------------------------ KV cache

    def kv_bytes_per_block(self) -> int:
        """Bytes of K and V of all layers for one block, in ``kv_cache_dtype`` (an int8 row is ``head_dim``
        values and a 2-byte scale: 66 bytes where bf16 takes 128 at head_dim 64)."""
        s = self.spec
        per_token = kv_bytes_per_token(s.num_hidden_layers, s.num_key_value_heads, s.head_dim, self.kv_cache_dtype)
        return self.block_size * per_token

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Zero-filled cache in the backend's layout
        (``[num_layers, 2, num_blocks, block_size, kv_heads, W]``, ``W = head_dim`` or ``head_dim + 2`` for int8)."""
        shape = self.attn.kv_cache_shape(self.spec.num_hidden_layers, num_blocks, self.block_size, self.kv_cache_dtype)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    def copy_kv_slots(self, copies: list[tuple[int, int, int]]) -> None:
        """For each ``(src, dst, n)``: the K/V of slots ``0..n-1`` of block ``src`` into block ``dst``,
        every layer (``SchedulerOutput.kv_copies``). Sources are gathered before any write."""
        if not copies:
            return
        bs, device = self.block_size, self.device
        src = torch.cat([torch.arange(b * bs, b * bs + n, device=device) for b, _, n in copies])  # [T]
        dst = torch.cat([torch.arange(b * bs, b * bs + n, device=device) for _, b, n in copies])  # [T]
        layers, two, num_blocks = self.kv_cache.shape[:3]
        flat = self.kv_cache.view(layers, two, num_blocks * bs, -1)  # [L, 2, slots, kv_heads * head_dim]
        flat[:, :, dst] = flat[:, :, src]

    # ------------------------------------------------------------ inputs

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flatten the step's tokens and build positions, slot mapping and the block table."""
        bs, device = self.block_size, self.device
        ids: list[int] = []
        query_lens: list[int] = []
        computed: list[int] = []
        tables: list[list[int]] = []
        logits_index: list[int] = []
        row_slots: list[int] = []  # LoRA slot of each row (-1: the base)
        lora = self.lora_manager
        prompt_rows: list[int] = []
        num_decodes = 0
        for item in out.scheduled:
            seq, n = item.seq, item.num_new_tokens
            if lora is not None:
                row_slots += [-1 if seq.lora_request is None else lora.slot_of(seq.lora_request)] * n
            start = seq.num_computed_tokens
            prompt_rows.extend(len(ids) + p - start for p in item.prompt_logprob_positions)
            ids.extend(seq.token_ids[start : start + n] + item.spec_token_ids)  # proposals follow the last token
            query_lens.append(n)
            computed.append(start)
            tables.append(seq.block_table)
            logits_index.extend(range(len(ids) - item.num_sampled_rows, len(ids)))  # 1 + m rows when verifying
            if n == 1 and num_decodes == len(query_lens) - 1:
                num_decodes += 1
        width = max(len(t) for t in tables)
        block_table = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device
        )  # [B, width]
        qlens = torch.tensor(query_lens, dtype=torch.long, device=device)  # [B]
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.long, device=device)
        torch.cumsum(qlens, 0, out=query_start_loc[1:])
        num_tokens = len(ids)
        req_of_token = torch.repeat_interleave(
            torch.arange(len(query_lens), device=device), qlens, output_size=num_tokens
        )  # [N]
        first_pos = torch.tensor(computed, dtype=torch.long, device=device) - query_start_loc[:-1]  # [B]
        positions = torch.arange(num_tokens, device=device) + first_pos[req_of_token]  # [N]
        slot_mapping = block_table[req_of_token, positions // bs] * bs + positions % bs  # [N]
        seq_lens_cpu = [c + n for c, n in zip(computed, query_lens)]
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.long, device=device),
            block_table=block_table,
            slot_mapping=slot_mapping,
            positions=positions,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens_cpu,
            num_decodes=num_decodes,
            block_size=bs,
        )
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        lora_batch = None if lora is None else lora.batch(row_slots)
        return StepInputs(
            as_long(ids), positions, self.attn.build(common), as_long(logits_index + prompt_rows), lora_batch
        )

    # ------------------------------------------------------------ forward

    @torch.inference_mode()
    def teacher_forced_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` of every position of one sequence, in one prefill (teacher forcing).

        The sequence's K and V are written into ``block_table`` (blocks the caller holds, at least
        ``ceil(T / block_size)``) and read back by attention as in any prefill, so the logits carry the
        ``kv_cache_dtype``'s rounding (how ``lmforge evaluate --kv-cache-dtype`` judges a KV dtype).

        Raises:
            ValueError: ``block_table`` holds fewer blocks than the tokens need.
        """
        n, bs, device = len(token_ids), self.block_size, self.device
        if len(block_table) * bs < n:
            raise ValueError(f"{n} tokens need {-(-n // bs)} blocks of {bs}; block_table holds {len(block_table)}")
        positions = torch.arange(n, device=device)
        table = torch.tensor([block_table], dtype=torch.long, device=device)  # [1, blocks]
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, n], device=device),
            seq_lens=torch.tensor([n], device=device),
            block_table=table,
            slot_mapping=table[0, positions // bs] * bs + positions % bs,
            positions=positions,
            query_lens_cpu=[n],
            seq_lens_cpu=[n],
            num_decodes=0,
            block_size=bs,
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        hidden = self.model.forward(ids, positions, self.kv_cache, self.attn, self.attn.build(common))  # [T, hidden]
        return self.model.compute_logits(hidden)  # [T, vocab]

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, float_logits: bool = True, mask: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Run one step; return logits ``[S + P, vocab]``: the sampled rows (in ``out.scheduled`` order), then the
        prompt-logprob rows (``StepInputs.logits_index``); float32 unless ``float_logits=False`` (the model dtype:
        enough for greedy picks, and no copy of the whole row). ``mask`` edits the raw logits in place first
        (``Model.compute_logits``)."""
        self.copy_kv_slots(out.kv_copies)
        inputs = self.prepare(out)
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_cache, self.attn, inputs.attn_metadata, inputs.lora
        )  # [N, hidden]
        return self.model.compute_logits(hidden[inputs.logits_index], float_logits, mask)  # [S + P, vocab]
