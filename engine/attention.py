"""Paged attention: the per-step metadata every backend gets, and the backends that compute it.

The KV cache of one layer is ``[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``.
A request's ``block_table`` maps its logical blocks to physical ones, and ``slot_mapping`` gives
each new token's physical slot ``block * block_size + offset``.

``ModelRunner`` builds a ``CommonAttentionMetadata`` per step (what any paged-attention kernel
needs: query start offsets, context lengths, the padded block table, slot mapping); a backend's
``build`` turns it into its own metadata once per step, and its ``forward`` runs one layer. An
``AttentionBackend`` is all a new device kernel (e.g. a CUDA paged kernel) has to implement;
``engine.attention_backends.get_attention_backend`` picks one by name.

``TorchAttentionBackend`` (CPU, and any device torch runs on): decodes (one query token each,
they come first in the batch) form one group whose blocks shared by every request are read once
(cascade attention), prefill chunks (padded to the longest chunk) another, causal: when the
chunks continue one cached prefix (a shared system prompt) that prefix is read once for all
their queries as well, and only each chunk's own blocks are gathered. No Python loop over
requests runs inside the layer loop.

KV cache dtypes (``EngineConfig.kv_cache_dtype``): K and V are stored in the model's dtype, in another
float dtype (converted on store and read), or as int8 rows: each (token, KV head) row of ``head_dim``
values is followed by its float16 scale in ``KV_SCALE_BYTES`` bytes (``quantize_kv``), so the last dim of
an int8 cache is ``head_dim + KV_SCALE_BYTES``. Every reader dequantizes (``dequantize_kv``; the C++ and
Triton kernels on the fly).
"""

from __future__ import annotations

import abc
import dataclasses

import torch
import torch.nn.functional as F

from engine.cpu_ops import decode_kernel_built, decode_kernel_runs, paged_decode_attention
from engine.errors import UsageError
from engine.platform import cpu_flags

#: Bytes after each ``head_dim`` int8 values of a K or V row in an int8 cache: the row's float16 scale.
KV_SCALE_BYTES = 2

#: Largest magnitude of a symmetric int8 value (-128 is never used, so negation stays in range).
INT8_MAX = 127


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim]`` float K or V rows -> ``[..., head_dim + KV_SCALE_BYTES]`` int8 cache rows.

    Symmetric per-row quantization (one scale per token and KV head, as in KIVI, Liu et al. 2024, and
    OpenVINO's per-token u8 cache): ``scale = float16(absmax / 127)``, ``q = clamp(round(x / scale), -127,
    127)`` (round half to even; an all-zero row stores scale 0 and zeros), the scale's two bytes after the
    values. The C++ ``rope_and_cache`` and the Triton ``store_kv`` compute the same bytes.
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).to(torch.float16)  # [..., 1]
    sf = scale.float()
    q = torch.where(sf > 0, xf / sf, 0.0).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat((q, scale.view(torch.int8)), dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim + KV_SCALE_BYTES]`` int8 cache rows -> ``[..., head_dim]`` in ``dtype``: ``q * scale``
    (exact in float32: 8 by 11 significant bits), then rounded to ``dtype``."""
    hd = rows.shape[-1] - KV_SCALE_BYTES
    if rows.stride(-1) != 1 or any(st % KV_SCALE_BYTES for st in rows.stride()[:-1]):
        rows = rows.contiguous()
    scale = rows[..., hd:].view(torch.float16).float()  # [..., 1]
    return (rows[..., :hd].float() * scale).to(dtype)


def kv_as(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as ``dtype`` values for an attention call: int8 rows dequantized, other dtypes converted
    (the cache itself when it is in ``dtype``)."""
    if rows.dtype == torch.int8:
        return dequantize_kv(rows, dtype)
    return rows if rows.dtype == dtype else rows.to(dtype)


def kv_row_width(head_dim: int, kv_cache_dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of the cache: ``head_dim``, plus the scale's bytes when int8."""
    return head_dim + KV_SCALE_BYTES if kv_cache_dtype == torch.int8 else head_dim


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: torch.dtype) -> int:
    """Bytes of K and V of every layer for one token (int8: ``head_dim + KV_SCALE_BYTES`` bytes a row)."""
    return 2 * num_layers * num_kv_heads * kv_row_width(head_dim, kv_cache_dtype) * kv_cache_dtype.itemsize


def store_kv_rows(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``k, v [N, num_kv_heads, head_dim]`` at ``slot_mapping`` into ``kv_cache [2, num_blocks,
    block_size, num_kv_heads, W]`` (quantized by ``quantize_kv`` for an int8 cache, else converted)."""
    heads, width = kv_cache.shape[-2], kv_cache.shape[-1]
    flat_k = kv_cache[0].view(-1, heads, width)  # [num_blocks * block_size, kv_heads, W]
    flat_v = kv_cache[1].view(-1, heads, width)
    if kv_cache.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    flat_k.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


@dataclasses.dataclass
class CommonAttentionMetadata:
    """Backend-independent facts of one step; tensors on the model's device.

    Requests are in batch order, decodes (one new token each) first; request ``i``'s new tokens
    are rows ``query_start_loc[i]:query_start_loc[i + 1]`` of the flat ``[N]`` batch.

    Attributes:
        query_start_loc: ``[B + 1]`` int64 offsets of each request's first new token.
        seq_lens: ``[B]`` int64 context lengths after this step (computed + new tokens).
        block_table: ``[B, max_blocks]`` int64 physical block ids (padded with block 0).
        slot_mapping: ``[N]`` int64 physical slot receiving each new token's K/V.
        positions: ``[N]`` int64 position of each new token in its sequence.
        query_lens_cpu: ``B`` host ints, new tokens per request.
        seq_lens_cpu: ``B`` host ints, ``seq_lens`` (for decisions that must not read the device).
        num_decodes: the first ``num_decodes`` requests (and tokens) are single-token queries.
        block_size: tokens per KV block.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int
    block_size: int


class AttentionBackend(abc.ABC):
    """Paged attention for one model shape (``num_heads`` query heads over ``num_kv_heads``).

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention when fewer than ``num_heads``).
        head_dim: features per head.
        sliding_window: attend to at most this many latest keys (``None``: all).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window

    #: ``forward`` accepts ``k = v = None`` (the caller stored them by ``metadata.slot_mapping``).
    stores_kv_separately = False

    def kv_cache_shape(
        self, num_layers: int, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype | None = None
    ) -> tuple[int, ...]:
        """Shape of the whole cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, W]`` with ``W =
        head_dim`` (``head_dim + KV_SCALE_BYTES`` for an int8 cache: ``kv_row_width``)."""
        width = self.head_dim if kv_cache_dtype is None else kv_row_width(self.head_dim, kv_cache_dtype)
        return (num_layers, 2, num_blocks, block_size, self.num_kv_heads, width)

    @abc.abstractmethod
    def build(self, common: CommonAttentionMetadata):
        """This backend's metadata for one step (called once per step, shared by all layers)."""

    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata
    ) -> torch.Tensor:
        """Write the new K/V into the cache and attend.

        Args:
            q: ``[N, num_heads, head_dim]`` (rotated); k, v: ``[N, num_kv_heads, head_dim]``, or both
                ``None`` when the caller already stored them at ``slot_mapping`` (only where
                ``stores_kv_separately``: the cache layout of this base class, written by slot).
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, W]`` this layer's K and V, in any
                ``EngineConfig.kv_cache_dtype`` (``W``: ``kv_row_width``).
            metadata: what ``build`` returned for this step.

        Returns:
            ``[N, num_heads * head_dim]``.
        """


# ------------------------------------------------------------------------------------ torch backend


@dataclasses.dataclass
class AttentionGroup:
    """Requests of one attention call: their queries, block tables and mask.

    Attributes:
        block_tables: ``[B, max_blocks]`` physical block ids (padded with block 0).
        mask: ``[B, 1, Q, T]`` bool, True where query may attend key (T = max_blocks * block_size);
            with ``shared_blocks`` in a prefill group ``[B, 1, Q * g, T]``, one row per query head
            of a KV group (row ``t * g + j``: head ``j`` of query ``t``).
        query_index: ``[B, Q]`` rows of the group's flat queries (padding repeats row 0 of the
            request), ``None`` for decodes (Q = 1, rows in order).
        output_index: ``[n]`` rows of the flattened ``[B * Q]`` output that are real tokens,
            ``None`` for decodes.
        shared_blocks: ``[C]`` leading blocks common to every request of the group (a shared
            prompt prefix); read once for all, ``block_tables`` and ``mask`` then start at block C.
            Every request keeps at least its newest key outside them (a prefill group shares
            only blocks computed before the step).
        shared_range: ``(first, last + 1)`` when ``shared_blocks`` are consecutive ids (read as a view).
        seq_lens: ``[B]`` int64 keys of each request in ``block_tables`` (its context length less the
            shared blocks' tokens), for the C++ decode kernel.
    """

    block_tables: torch.Tensor
    mask: torch.Tensor
    query_index: torch.Tensor | None = None
    output_index: torch.Tensor | None = None
    shared_blocks: torch.Tensor | None = None
    shared_range: tuple[int, int] | None = None
    seq_lens: torch.Tensor | None = None
    _additive: dict = dataclasses.field(default_factory=dict, repr=False)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask`` as 0 / -inf in ``dtype`` (built once per step, shared by the layers)."""
        if dtype not in self._additive:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._additive[dtype] = zeros.masked_fill_(~self.mask, float("-inf"))
        return self._additive[dtype]


@dataclasses.dataclass
class TorchAttentionMetadata:
    """``TorchAttentionBackend``'s step metadata.

    Attributes:
        slot_mapping: ``[N]`` physical slot of each new token.
        num_decode_tokens: the first rows of the batch that are single-token decodes.
        decode: attention group of the decodes (or ``None``).
        prefill: attention group of the prefill chunks (or ``None``).
        block_size: tokens per KV block.
        short_prefill: when every chunk has at most ``SHORT_QUERY_TOKENS`` tokens (speculative
            verification, a chunked prompt's tail) or attends at most the backend's
            ``row_kernel_max_own_keys`` (``None``: any number) keys past the prefill group's shared
            blocks, each of their tokens as a decode row for the C++ kernel: ``(block_tables [n, own
            blocks] of the row's request from its first block after the shared ones, seq_lens [n] =
            position + 1 - shared tokens)``.
        rows: batch-invariant mode: every token of the step as a row of the C++ kernel over all its keys,
            ``(block_tables [N, max_blocks], seq_lens [N] = position + 1)``; ``decode`` and ``prefill`` are
            then ``None``.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    block_size: int
    short_prefill: tuple[torch.Tensor, torch.Tensor] | None = None
    rows: tuple[torch.Tensor, torch.Tensor] | None = None


#: Prefill chunks up to this many tokens run as rows of the decode kernel: a query token attends its
#: context read in place, causal by its own length, instead of a gathered, padded flash call.
SHORT_QUERY_TOKENS = 16

#: Longer chunks run as decode-kernel rows too when each attends at most this many keys past the
#: blocks the whole batch shares: those shared blocks go through one flash call for every row (its
#: output and log-sum-exp start the kernel's softmax) and each row then reads only its own few
#: keys in place. This is the suffix prefill of many requests behind one cached system prompt,
#: where a padded flash call over gathered keys spent most of its time on padding. On CPUs where
#: the flash call does not pay (``TorchAttentionBackend.cascade_decodes`` off) every chunk runs as rows.
ROW_KERNEL_MAX_OWN_KEYS = 64


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain torch ops and the C++ CPU kernels; see the module docstring.

    Args:
        batch_invariant: every query token is a row of the C++ decode kernel over all its keys, read in
            one fixed order (no shared-prefix split, no padded flash call whose blocking follows the
            batch), so its output is the same bits whatever else the step holds and however its prompt
            was chunked (``EngineConfig.batch_invariant``).

    Attributes:
        cascade_decodes: decodes attend the blocks the whole batch shares in one flash call before the
            C++ kernel reads each request's own (see ``_decode_attention``). Without it the kernel reads
            every block in place, walking blocks that several requests' tables start with once for up to
            16 query heads. The flash call pays where it runs on AMX (``amx_bf16``: the default there, and
            wherever the C++ kernel is not built) and on CPUs without AVX-512, where the kernel's 16-float
            vectors take two registers each and a group's accumulators spill (a 2-core AVX2-only AMD EPYC,
            64 requests behind one system prompt, alternated in one process: fp32 1.17-1.23x, ``w8a8``
            1.05-1.15x tok/s); with AVX-512 and no AMX the kernel alone is faster (an AVX-512 BF16 AMD EPYC,
            same load: bf16 1.07x, fp32 1.04x tok/s).
        row_kernel_max_own_keys: prefill chunks attending at most this many keys past the blocks all
            chunks share run as rows of the C++ kernel (``ROW_KERNEL_MAX_OWN_KEYS``), the rest as a padded
            flash call; ``None`` (where ``cascade_decodes`` is off): every chunk. With AVX-512 and no AMX the flash call
            runs its bf16 products in float32 and, padded, does more of them: on the AMD EPYC above, bf16,
            rows took 0.82-0.89x the step time of a flash call for 1 to 8 prompts of 100 to 1,400 tokens
            (fp32 about even) and 0.87x for the prefill steps of 64 chat requests behind one system prompt.
            On CPUs without AVX-512 the limit holds too: on a 2-core AVX2-only AMD EPYC a 160-token fp32
            prompt alone prefilled in 437 ms with the flash call against 541 ms as rows (``w8a8``: 541 vs
            647 ms; medians of 6, alternated in one process, same greedy tokens).

    Raises:
        UsageError: ``batch_invariant`` where the C++ kernel cannot run (not built, or head_dim > 256).
    """

    stores_kv_separately = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        batch_invariant: bool = False,
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, sliding_window)
        self.batch_invariant = batch_invariant
        flags = cpu_flags()
        self.cascade_decodes = not decode_kernel_built() or "amx_bf16" in flags or "avx512f" not in flags
        # rows for every prefill chunk only where that was measured to pay: AVX-512 without AMX
        rows_pay = not self.cascade_decodes
        self.row_kernel_max_own_keys = None if rows_pay else ROW_KERNEL_MAX_OWN_KEYS
        if batch_invariant and not (decode_kernel_built() and head_dim <= 256):
            raise UsageError(
                "batch_invariant=True runs attention in the engine's C++ CPU kernel, which is not available here "
                f"(head_dim={head_dim}; the kernel takes up to 256 and must build)",
                fix="turn batch_invariant off",
            )

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        if self.batch_invariant:
            lens = torch.tensor(common.query_lens_cpu, device=common.positions.device)
            request_of_row = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)  # [N]
            rows = (common.block_table[request_of_row], common.positions + 1)
            return TorchAttentionMetadata(common.slot_mapping, 0, None, None, common.block_size, rows=rows)
        d = common.num_decodes
        decode = self._decode_group(common) if d else None
        prefill = self._prefill_group(common) if d < len(common.query_lens_cpu) else None
        short = None
        if prefill is not None:
            bs = common.block_size
            shared = 0 if prefill.shared_blocks is None else prefill.shared_blocks.numel()
            own_keys = max(common.seq_lens_cpu[d:]) - shared * bs
            limit = self.row_kernel_max_own_keys
            if max(common.query_lens_cpu[d:]) <= SHORT_QUERY_TOKENS or limit is None or own_keys <= limit:
                first_row = common.query_start_loc[d]
                lens = torch.tensor(common.query_lens_cpu[d:], device=common.positions.device)
                request_of_row = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)  # [n]
                num_blocks = prefill.block_tables.shape[1] + shared
                tables = common.block_table[d:, shared:num_blocks][request_of_row]  # [n, own blocks]
                short = (tables, common.positions[first_row:] + 1 - shared * bs)
        return TorchAttentionMetadata(common.slot_mapping, d, decode, prefill, common.block_size, short)

    def _key_mask(self, query_pos: torch.Tensor, num_keys: int, first_key: int = 0) -> torch.Tensor:
        """``query_pos [B, Q] -> [B, 1, Q, T]``: causal (and sliding-window) mask over key positions
        ``first_key..num_keys``."""
        keys = torch.arange(first_key, num_keys, device=query_pos.device)
        mask = keys[None, None, :] <= query_pos[:, :, None]
        if self.sliding_window is not None:
            mask &= keys[None, None, :] > query_pos[:, :, None] - self.sliding_window
        return mask[:, None]

    def _decode_group(self, common: CommonAttentionMetadata) -> AttentionGroup:
        bs, d = common.block_size, common.num_decodes
        ctx = common.seq_lens_cpu[:d]
        num_blocks = -(-max(ctx) // bs)
        tables = common.block_table[:d, :num_blocks]  # [D, nb]
        shared = 0
        cascade = self.cascade_decodes or tables.device.type != "cpu"
        if d > 1 and self.sliding_window is None and cascade:
            shared = common_prefix_blocks(tables, (min(ctx) - 1) // bs)  # each query keeps its own key
        query_pos = common.positions[:d, None]  # [D, 1]
        mask = self._key_mask(query_pos, num_blocks * bs, first_key=shared * bs)
        own_lens = common.seq_lens[:d] - shared * bs  # [D] keys past the shared blocks
        if not shared:
            return AttentionGroup(tables, mask, seq_lens=own_lens)
        shared_blocks = tables[0, :shared]
        first, last = int(shared_blocks[0]), int(shared_blocks[-1])
        consecutive = last - first == shared - 1 and bool((shared_blocks.diff() == 1).all())
        return AttentionGroup(
            tables[:, shared:],
            mask,
            shared_blocks=shared_blocks,
            shared_range=(first, last + 1) if consecutive else None,
            seq_lens=own_lens,
        )

    def _prefill_group(self, common: CommonAttentionMetadata) -> AttentionGroup:
        d = common.num_decodes
        device = common.positions.device
        bs = common.block_size
        lengths = common.query_lens_cpu[d:]
        max_q = max(lengths)
        num_blocks = -(-max(common.seq_lens_cpu[d:]) // bs)
        first_row = common.query_start_loc[d]
        starts = common.query_start_loc[d:-1] - first_row  # [P] first row of each chunk
        positions = common.positions[first_row:]
        offsets = torch.arange(max_q, device=device)
        lens = torch.tensor(lengths, device=device)
        valid = offsets[None, :] < lens[:, None]  # [P, max_q]
        query_index = torch.where(valid, starts[:, None] + offsets[None, :], starts[:, None])  # [P, max_q]
        query_pos = positions[query_index]  # [P, max_q]
        output_index = valid.reshape(-1).nonzero().squeeze(1)  # [n_prefill]
        tables = common.block_table[d:, :num_blocks]
        shared = 0
        if len(lengths) > 1 and self.sliding_window is None:
            computed = [c - q for c, q in zip(common.seq_lens_cpu[d:], lengths)]
            shared = common_prefix_blocks(tables, min(computed) // bs)  # blocks every chunk attends in full
        mask = self._key_mask(query_pos, num_blocks * bs, first_key=shared * bs)  # [P, 1, max_q, T]
        if not shared:
            return AttentionGroup(tables, mask, query_index, output_index)
        shared_blocks = tables[0, :shared]
        first, last = int(shared_blocks[0]), int(shared_blocks[-1])
        consecutive = last - first == shared - 1 and bool((shared_blocks.diff() == 1).all())
        g = self.num_heads // self.num_kv_heads
        return AttentionGroup(
            tables[:, shared:],
            mask.repeat_interleave(g, dim=2),  # [P, 1, max_q * g, T]: row t * g + j is head j of query t
            query_index,
            output_index,
            shared_blocks=shared_blocks,
            shared_range=(first, last + 1) if consecutive else None,
        )

    # ------------------------------------------------------------ kernels

    def forward(self, q, k, v, kv_cache: torch.Tensor, metadata: TorchAttentionMetadata) -> torch.Tensor:
        if k is not None:
            store_kv_rows(kv_cache, k, v, metadata.slot_mapping)
        if metadata.rows is not None:
            return paged_decode_attention(
                q, kv_cache, *metadata.rows, sliding_window=self.sliding_window, group_shared=False
            )
        outputs = []
        d = metadata.num_decode_tokens
        if metadata.decode is not None:
            outputs.append(self._decode_attention(q[:d], kv_cache, metadata.decode))
        if metadata.prefill is not None:
            out = None
            if metadata.short_prefill is not None:
                out = self._row_attention(q[d:], kv_cache, metadata.prefill, *metadata.short_prefill)
            outputs.append(self._prefill_attention(q[d:], kv_cache, metadata.prefill) if out is None else out)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _row_attention(
        self, q, kv_cache, group: AttentionGroup, tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor | None:
        """Prefill tokens ``q [n, num_heads, head_dim]`` as rows of the C++ decode kernel, or ``None``
        without it. Blocks shared by every chunk (``group.shared_blocks``) are attended by all rows in
        one flash call first, as in ``_decode_attention``; ``tables [n, own blocks]`` and ``seq_lens
        [n]`` (keys past the shared blocks, the row's own included) then give each row its causal rest.
        """
        if not decode_kernel_runs(q, kv_cache):
            return None
        prior = None if group.shared_blocks is None else self._attend_shared(q, kv_cache, group)
        return paged_decode_attention(q, kv_cache, tables, seq_lens, sliding_window=self.sliding_window, prior=prior)

    def _gather(
        self, kv_cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[2, num_blocks, bs, kv, W]`` by ``[B, nb]`` -> keys and values ``[B, kv, nb * bs, hd]`` in ``dtype``
        (one copy; int8 rows dequantized)."""
        b, nb = block_tables.shape
        block_size = kv_cache.shape[2]
        rows = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, block_tables.reshape(-1))  # [2, B * nb, ...]
        rows = kv_as(rows.view(2, b, nb * block_size, self.num_kv_heads, kv_cache.shape[-1]), dtype)
        kv = rows.transpose(2, 3)
        return kv[0], kv[1]

    def _decode_attention(self, q, kv_cache, group: AttentionGroup) -> torch.Tensor:
        """Single-token queries against their paged context.

        Blocks shared by the whole batch (``group.shared_blocks``) are read once and attended by all
        queries in one call, as in cascade attention (FlashInfer, Ye et al. 2024): the heads of each
        KV group act as that call's query rows (``[1, kv_heads, D * g, head_dim]``), so K/V are never
        repeated. Each request's own blocks are then read in place by the C++ kernel
        (``engine.cpu_ops.paged_decode_attention``), which starts its online softmax from the shared
        part's output and log-sum-exp; without it they are gathered through the block tables into one
        padded flash call and the two results merged by their log-sum-exp (the shared part's weight is
        ``sigmoid(lse_shared - lse_own)``).
        """
        d, kv, hd = q.shape[0], self.num_kv_heads, self.head_dim
        g = self.num_heads // kv
        prior = None if group.shared_blocks is None else self._attend_shared(q, kv_cache, group)
        out = paged_decode_attention(
            q, kv_cache, group.block_tables, group.seq_lens, sliding_window=self.sliding_window, prior=prior
        )
        if out is not None:
            return out
        qg = q.view(d, kv, g, hd)  # [D, kv, g, hd]
        keys, values = self._gather(kv_cache, group.block_tables, q.dtype)  # [D, kv, Tu, hd]
        out, lse = attend(qg, keys, values, group.additive_mask(q.dtype))  # [D, kv, g, hd], [D, kv, g]
        if prior is not None:
            out_s = prior[0].view(kv, d, g, hd).transpose(0, 1)
            weight = torch.sigmoid(prior[1].view(kv, d, g).transpose(0, 1) - lse)  # [D, kv, g]
            out = torch.lerp(out, out_s, weight[..., None].to(out.dtype))
        return out.reshape(d, self.num_heads * hd)

    def _shared(
        self, kv_cache: torch.Tensor, group: AttentionGroup, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the shared prefix blocks, ``[1, kv, Ts, hd]`` each in ``dtype`` (views of the cache
        if its blocks are consecutive and in ``dtype``; int8 rows dequantized)."""
        if group.shared_range is not None:
            blocks = kv_cache[:, group.shared_range[0] : group.shared_range[1]]
        else:
            blocks = kv_cache.index_select(1, group.shared_blocks)
        kv = kv_as(blocks.view(2, 1, -1, self.num_kv_heads, kv_cache.shape[-1]), dtype).transpose(2, 3)
        return kv[0], kv[1]

    def _attend_shared(self, q, kv_cache, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query of ``q [n, num_heads, hd]`` over the shared prefix blocks in one call: the heads
        of each KV group act as its query rows, so K/V are never repeated. Returns ``out [kv, n * g, hd]``
        and ``lse [kv, n * g]`` (row ``i * g + j`` of KV head ``h``: query head ``h * g + j`` of row ``i``)."""
        n, kv, hd = q.shape[0], self.num_kv_heads, self.head_dim
        g = self.num_heads // kv
        qs = q.view(n, kv, g, hd).transpose(0, 1).reshape(1, kv, n * g, hd)
        out, lse = attend(qs, *self._shared(kv_cache, group, q.dtype), None)  # [1, kv, n*g, hd], [1, kv, n*g]
        return out[0], lse[0]

    def _prefill_attention(self, q, kv_cache, group: AttentionGroup) -> torch.Tensor:
        """Prefill chunks (padded to the longest) against their paged context, causal.

        With ``group.shared_blocks`` (the chunks continue one cached prefix) the prefix is read
        once and attended by every real query in one call, and only each chunk's own blocks are
        gathered; the two parts are merged by their log-sum-exp as in ``_decode_attention``.
        """
        p, max_q = group.query_index.shape
        keys, values = self._gather(kv_cache, group.block_tables, q.dtype)  # [P, kv_heads, T, head_dim]
        if group.shared_blocks is None:
            qp = q[group.query_index].transpose(1, 2)  # [P, num_heads, max_q, head_dim]
            out = F.scaled_dot_product_attention(
                qp, keys, values, attn_mask=group.mask, enable_gqa=True
            )  # [P, H, max_q, hd]
            out = out.transpose(1, 2).reshape(p * max_q, self.num_heads * self.head_dim)
            return out[group.output_index]
        n, kv, hd = q.shape[0], self.num_kv_heads, self.head_dim
        g = self.num_heads // kv
        qp = q[group.query_index].view(p, max_q, kv, g, hd).transpose(1, 2).reshape(p, kv, max_q * g, hd)
        out, lse = attend(qp, keys, values, group.additive_mask(q.dtype))  # [P, kv, max_q*g, hd], [P, kv, max_q*g]
        out = out.view(p, kv, max_q, g, hd).transpose(1, 2).reshape(p * max_q, kv, g, hd)[group.output_index]
        lse = lse.view(p, kv, max_q, g).transpose(1, 2).reshape(p * max_q, kv, g)[group.output_index]
        out_s, lse_s = self._attend_shared(q, kv_cache, group)
        out_s = out_s.view(kv, n, g, hd).transpose(0, 1)  # [n, kv, g, hd]
        weight = torch.sigmoid(lse_s.view(kv, n, g).transpose(0, 1) - lse)  # [n, kv, g]
        return torch.lerp(out, out_s, weight[..., None].to(out.dtype)).reshape(n, self.num_heads * hd)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of the scores (to merge partial results).

    Args:
        q: ``[B, H, L, hd]``; k, v: ``[B, H, S, hd]`` (any strides with a contiguous last dim).
        mask: additive ``[B, 1, 1, S]`` (0 / -inf, q's dtype) or ``None``; no row may be fully masked.

    Returns:
        ``[B, H, L, hd]`` in q's dtype and the float32 log-sum-exp ``[B, H, L]`` of the scaled scores.
        On CPU one fused flash-attention kernel (fp32 accumulation) computes both.
    """
    scale = q.shape[-1] ** -0.5
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, L, S]
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


def common_prefix_blocks(tables: torch.Tensor, limit: int) -> int:
    """Number of leading columns (at most ``limit``) of ``tables [B, nb]`` equal in every row."""
    if limit <= 0:
        return 0
    head = tables[:, :limit]
    same = (head == head[:1]).all(dim=0)  # [limit]
    return int(same.long().cumprod(0).sum())
