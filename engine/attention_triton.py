"""Paged attention in Triton kernels: the CUDA backend of ``engine.attention``.

The kernels read K and V straight from the paged cache ``[num_blocks, block_size, num_kv_heads,
head_dim]`` through each request's block table; nothing is gathered into a contiguous copy.
Three launches per layer and step, of two kernels (``paged_decode`` and ``paged_prefill`` run one
attention kernel, whose tile rows are either the query heads of a KV head or a head's query tokens):

- ``store_kv``: writes each new token's K/V at ``slot_mapping`` (a negative slot is skipped:
  padding rows of a CUDA-graph batch).
- ``paged_decode``: one program per (request, KV head); the ``g = num_heads / num_kv_heads``
  query heads of the KV group are the rows of one tile (grouped-query attention without
  repeating K/V), keys are visited ``BLOCK_N`` at a time with an online softmax (Milakov &
  Gimelshein 2018; the FlashAttention formulation, Dao et al. 2022). A request with
  ``seq_len == 0`` (a padding row) writes zeros.
- ``paged_prefill``: one program per (prefill chunk, query head, ``BLOCK_M`` query tile);
  causal over the chunk's context (the ``seq_len - query_len`` tokens already cached plus the
  chunk), sliding window when the model has one.

An int8 cache (``EngineConfig.kv_cache_dtype="int8"``; rows of ``head_dim`` int8 values and a float16
scale, ``engine.attention.quantize_kv``) is written by ``store_kv_int8`` and read by both attention
kernels through a float16 view of the scale bytes: int8 values convert exactly to the query's dtype,
a score is ``scale_k * (q . k)`` and a value row enters the accumulator as ``(p * scale_v) v``.

Both attention kernels accumulate in float32; ``float32`` models use IEEE (not TF32) products
so greedy tokens match a float32 reference. Under the interpreter 16-bit tiles are upcast
before ``tl.dot`` (``_dot_fp32``); loads and stores keep the cache's dtype. On CPU the same kernels run under Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported); that is how the
tests check them without a GPU.

Raises ``ImportError`` at import when ``triton`` is not installed (``pip install
lmforge[gpu]``).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from engine.attention import KV_SCALE_BYTES, AttentionBackend, CommonAttentionMetadata

#: Keys visited per inner-loop iteration of both kernels (a power of two >= 16 for ``tl.dot``).
BLOCK_N = 64
#: Query tokens per program of the prefill kernel.
BLOCK_M = 64


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v, ROW: tl.constexpr, BLOCK_ROW: tl.constexpr
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        offs = tl.arange(0, BLOCK_ROW)
        m = offs < ROW
        k = tl.load(k_ptr + token * stride_k + offs, mask=m)
        v = tl.load(v_ptr + token * stride_v + offs, mask=m)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=m)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=m)


@triton.jit
def _round_half_even(x):
    """``x`` rounded to the nearest integer, ties to even (``torch.round``), in float32."""
    r = tl.floor(x + 0.5)
    half_up_odd = ((r - x) == 0.5) & (tl.floor(r * 0.5) != r * 0.5)
    return tl.where(half_up_odd, r - 1.0, r)


@triton.jit
def _quantize_rows(x, values_ptr, scale_ptr, mask, row_mask):
    """Store ``x [H, D]`` float32 rows as int8 ``values_ptr`` with float16 ``scale_ptr [H]`` (absmax / 127)."""
    scale = (tl.max(tl.abs(x), 1) / 127.0).to(tl.float16)  # [H]
    sf = scale.to(tl.float32)
    safe = tl.where(sf > 0, sf, 1.0)
    q = tl.where(sf[:, None] > 0, _round_half_even(x / safe[:, None]), 0.0)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(values_ptr, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr, scale, mask=row_mask)


@triton.jit
def _store_kv_int8_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_k,
    stride_v,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    SCALE_ROW: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        hm = h < NUM_KV_HEADS
        m = hm[:, None] & (d < HEAD_DIM)[None, :]
        rows = slot.to(tl.int64) * NUM_KV_HEADS + h  # [H] cache rows of this token
        src = h[:, None] * HEAD_DIM + d[None, :]
        dst = rows[:, None] * ROW + d[None, :]
        k = tl.load(k_ptr + token * stride_k + src, mask=m, other=0.0).to(tl.float32)
        _quantize_rows(k, k_cache_ptr + dst, k_scale_ptr + rows * SCALE_ROW, m, hm)
        v = tl.load(v_ptr + token * stride_v + src, mask=m, other=0.0).to(tl.float32)
        _quantize_rows(v, v_cache_ptr + dst, v_scale_ptr + rows * SCALE_ROW, m, hm)


@triton.jit
def _attend_keys(
    q,
    acc,
    m_i,
    l_i,
    row,
    tm,
    allowed,
    d,
    dm,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    ROW: tl.constexpr,
    SCALE_ROW: tl.constexpr,
    QUANT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step of ``q [R, D]`` over the ``BLOCK_N`` keys at cache rows ``row [N]``.

    ``tm [N]`` marks keys that exist, ``allowed [R, N]`` the scores kept. Returns the updated running
    output ``acc [R, D]``, max ``m_i [R]`` and normalizer ``l_i [R]`` (all float32).
    """
    kv_mask = tm[:, None] & dm[None, :]
    k = tl.load(k_cache_ptr + row[:, None] * ROW + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # [N, D]
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [R, N] float32
    if QUANT:
        s = s * tl.load(k_scale_ptr + row * SCALE_ROW, mask=tm, other=0.0).to(tl.float32)[None, :]
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    v = tl.load(v_cache_ptr + row[:, None] * ROW + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # [N, D]
    pv = p
    if QUANT:
        pv = p * tl.load(v_scale_ptr + row * SCALE_ROW, mask=tm, other=0.0).to(tl.float32)[None, :]
    acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    SCALE_ROW: tl.constexpr,
    QUANT: tl.constexpr,
    PAGE: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A tile of ``BLOCK_M`` query rows of request ``program_id(0)`` against its paged keys.

    ``DECODE`` (grid ``(requests, kv_heads)``): the rows are the ``GROUP`` query heads of KV head
    ``program_id(1)``, all at the request's last position (``query_start_ptr`` is not read). Prefill
    (grid ``(chunks, heads, query tiles)``): the rows are query tile ``program_id(2)`` of the chunk, head
    ``program_id(1)``; a tile past the chunk's end does nothing.
    """
    req = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + req)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    if DECODE:
        kvh = tl.program_id(1)
        heads = kvh * GROUP + r
        rm = r < GROUP
        q_offs = req * stride_q_tok + heads * stride_q_head  # [M]
        o_offs = req * stride_o_tok + heads * HEAD_DIM
        first = seq_len - 1  # position of the tile's first query
        q_pos = tl.zeros([BLOCK_M], tl.int32) + first  # [M] positions of the tile's queries
        hi = seq_len  # past the tile's last query
    else:
        head = tl.program_id(1)
        kvh = head // GROUP
        q_start = tl.load(query_start_ptr + req)
        q_len = tl.load(query_start_ptr + req + 1) - q_start
        context = seq_len - q_len  # tokens cached before this chunk
        m = tl.program_id(2) * BLOCK_M + r
        rm = m < q_len
        q_offs = (q_start + m) * stride_q_tok + head * stride_q_head
        o_offs = (q_start + m) * stride_o_tok + head * HEAD_DIM
        first = context + tl.program_id(2) * BLOCK_M  # at seq_len or past it: a tile past the chunk's end
        q_pos = context + m
        hi = tl.minimum(seq_len, first + BLOCK_M)
    if first < seq_len:
        q = tl.load(q_ptr + q_offs[:, None] + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)  # [M, D]
        if DOT_FP32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(first - WINDOW + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            toks = start + tl.arange(0, BLOCK_N)
            tm = toks < seq_len
            blk = tl.load(block_table_ptr + req * stride_bt + toks // PAGE, mask=tm, other=0)
            row = (blk.to(tl.int64) * PAGE + toks % PAGE) * NUM_KV_HEADS + kvh  # [N] row of [slots * kv_heads, D]
            allowed = tm[None, :] & (toks[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                allowed = allowed & (toks[None, :] > q_pos[:, None] - WINDOW)
            acc, m_i, l_i = _attend_keys(
                q, acc, m_i, l_i, row, tm, allowed, d, dm, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, scale,
                ROW, SCALE_ROW, QUANT, PRECISION,
            )  # fmt: skip
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + o_offs[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :]
        )


# ------------------------------------------------------------------------------------ launchers


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k, v [N, kv_heads, head_dim]`` into ``k_cache, v_cache [num_blocks, block_size, kv_heads, W]``.

    Row ``i`` goes to physical slot ``slot_mapping[i]`` (``block * block_size + offset``);
    rows whose slot is negative are skipped. An int8 cache (``W = head_dim + KV_SCALE_BYTES``) gets each
    (token, KV head) row quantized as ``engine.attention.quantize_kv`` does; a float cache of another
    dtype gets the values converted.
    """
    n, kv, hd = k.shape
    if n == 0:
        return
    k, v = _rows(k), _rows(v)
    if k_cache.dtype == torch.int8:
        _store_kv_int8_kernel[(n,)](
            k,
            v,
            k_cache,
            v_cache,
            _scales(k_cache),
            _scales(v_cache),
            slot_mapping,
            k.stride(0),
            v.stride(0),
            NUM_KV_HEADS=kv,
            HEAD_DIM=hd,
            ROW=k_cache.shape[-1],
            SCALE_ROW=k_cache.shape[-1] // KV_SCALE_BYTES,
            BLOCK_H=triton.next_power_of_2(kv),
            BLOCK_D=triton.next_power_of_2(hd),
        )
        return
    row = kv * hd
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, BLOCK_ROW=triton.next_power_of_2(row)
    )


def _scales(cache: torch.Tensor) -> torch.Tensor:
    """The float16 scales of an int8 cache ``[num_blocks, block_size, kv_heads, head_dim + 2]`` as a view
    ``[num_blocks, block_size, kv_heads, 1]`` (row ``r``'s scale at element ``r * (head_dim + 2) / 2``); a
    float cache itself (the kernels then read no scale)."""
    if cache.dtype != torch.int8:
        return cache
    return cache[..., cache.shape[-1] - KV_SCALE_BYTES :].view(torch.float16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each token's ``[heads, head_dim]`` contiguous (rows may be strided)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_fp32(dtype: torch.dtype) -> bool:
    """Upcast 16-bit tiles before ``tl.dot`` under the interpreter, whose 16-bit ``dot`` is wrong
    (checked with triton 3.9.0); compiled kernels multiply bf16/fp16 tiles on tensor cores."""
    return dtype != torch.float32 and _interpreting()


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    max_query_len: int,
    sliding_window: int | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``paged_prefill``, or ``paged_decode`` when ``query_start_loc`` is ``None`` (``max_query_len`` unused)."""
    n, h, hd = q.shape
    kv = k_cache.shape[2]
    if out is None:
        out = torch.empty(n, h * hd, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    decode = query_start_loc is None
    if decode:  # a tile: the query heads of one KV head
        grid, block_m = (n, kv), _pow2_at_least_16(h // kv)
    else:
        grid, block_m = (block_table.shape[0], h, triton.cdiv(max_query_len, BLOCK_M)), BLOCK_M
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        _scales(k_cache),
        _scales(v_cache),
        block_table,
        seq_lens,
        seq_lens if decode else query_start_loc,  # not read by a decode
        hd**-0.5,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        block_table.stride(0),
        NUM_KV_HEADS=kv,
        GROUP=h // kv,
        HEAD_DIM=hd,
        ROW=k_cache.shape[-1],
        SCALE_ROW=k_cache.shape[-1] // KV_SCALE_BYTES,
        QUANT=k_cache.dtype == torch.int8,
        PAGE=k_cache.shape[1],
        WINDOW=sliding_window or 0,
        PRECISION=_precision(q.dtype),
        DOT_FP32=_dot_fp32(q.dtype),
        DECODE=decode,
        BLOCK_M=block_m,
        BLOCK_D=_pow2_at_least_16(hd),
        BLOCK_N=BLOCK_N,
    )
    return out


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request against its paged context.

    Args:
        q: ``[B, num_heads, head_dim]`` (request ``i``'s token is at position ``seq_lens[i] - 1``).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, W]`` (contiguous; int8 rows with their scales,
            ``W = head_dim + 2``, or float rows, ``W = head_dim``).
        block_table: ``[B, max_blocks]`` int physical block ids.
        seq_lens: ``[B]`` int context lengths including the new token; 0 writes zeros.
        sliding_window: attend to the last this many keys (``None``: all).
        out: ``[B, num_heads * head_dim]`` to write into (allocated when ``None``).

    Returns:
        ``[B, num_heads * head_dim]`` in ``q``'s dtype.
    """
    return _paged_attention(q, k_cache, v_cache, block_table, seq_lens, None, 1, sliding_window, out)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ragged prefill chunks against their paged context (their own K/V already stored).

    Args:
        q: ``[N, num_heads, head_dim]``, chunk ``i`` at rows ``query_start_loc[i]:query_start_loc[i + 1]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, W]`` (as ``paged_decode``).
        block_table: ``[P, max_blocks]``; seq_lens: ``[P]`` context length after the chunk.
        query_start_loc: ``[P + 1]`` offsets (the first is 0).
        max_query_len: longest chunk (sizes the launch grid; a host int).
        sliding_window: attend to the last this many keys (``None``: all).

    Returns:
        ``[N, num_heads * head_dim]``.
    """
    return _paged_attention(
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, sliding_window, out
    )


# ------------------------------------------------------------------------------------ backend


@dataclasses.dataclass
class TritonAttentionMetadata:
    """``TritonAttentionBackend``'s step metadata (device tensors, fixed addresses under a CUDA graph).

    Attributes:
        slot_mapping: ``[N]`` physical slot of each new token (negative: not stored).
        num_decode_tokens: the first rows of the batch that are single-token decodes.
        decode_block_table / decode_seq_lens: ``[D, max_blocks]`` / ``[D]`` of the decodes.
        prefill_block_table / prefill_seq_lens: ``[P, max_blocks]`` / ``[P]`` of the prefill chunks.
        prefill_query_start_loc: ``[P + 1]`` chunk offsets relative to the first prefill row.
        max_prefill_query_len: longest chunk (0 without prefills).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_table: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    prefill_block_table: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_query_start_loc: torch.Tensor | None = None
    max_prefill_query_len: int = 0


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels of this module (selected for ``device='cuda'``)."""

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        d = common.num_decodes
        # int32 tables and lengths, as the CUDA-graph buffers hold them: one compiled variant per kernel
        block_table, seq_lens = common.block_table.to(torch.int32), common.seq_lens.to(torch.int32)
        meta = TritonAttentionMetadata(
            common.slot_mapping, d, block_table[:d] if d else None, seq_lens[:d] if d else None
        )
        if d < len(common.query_lens_cpu):
            meta.prefill_block_table = block_table[d:]
            meta.prefill_seq_lens = seq_lens[d:]
            meta.prefill_query_start_loc = common.query_start_loc[d:] - common.query_start_loc[d]
            meta.max_prefill_query_len = max(common.query_lens_cpu[d:])
        return meta

    def decode_metadata(
        self, slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
    ) -> TritonAttentionMetadata:
        """Metadata of a batch of decodes only (the CUDA-graph path: static tensors, padding rows
        with slot ``-1`` and ``seq_len`` 0)."""
        return TritonAttentionMetadata(slot_mapping, slot_mapping.shape[0], block_table, seq_lens)

    def forward(self, q, k, v, kv_cache: torch.Tensor, metadata: TritonAttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        n = q.shape[0]
        out = torch.empty(n, self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        d = metadata.num_decode_tokens
        if d:
            paged_decode(
                q[:d],
                k_cache,
                v_cache,
                metadata.decode_block_table,
                metadata.decode_seq_lens,
                self.sliding_window,
                out=out[:d],
            )
        if d < n:
            paged_prefill(
                q[d:],
                k_cache,
                v_cache,
                metadata.prefill_block_table,
                metadata.prefill_seq_lens,
                metadata.prefill_query_start_loc,
                metadata.max_prefill_query_len,
                self.sliding_window,
                out=out[d:],
            )
        return out
