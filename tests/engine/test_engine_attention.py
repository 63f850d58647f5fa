"""The CPU paged-attention backend on prefill chunks that continue a shared cached prefix.

Such chunks take the cascade path (the prefix read once for every query, merged by log-sum-exp
with each chunk's own blocks), as a padded flash call or as rows of the C++ decode kernel; both
must equal attention computed directly over each request's contiguous keys.
"""

from __future__ import annotations

import pytest
import torch

from engine import attention
from engine.attention import CommonAttentionMetadata, TorchAttentionBackend


def _prefill_step(tables: list[list[int]], computed: list[int], lens: list[int], bs: int) -> CommonAttentionMetadata:
    """A step of prefill chunks only: chunk i has ``lens[i]`` new tokens after ``computed[i]`` cached ones,
    its blocks ``tables[i]`` (K/V already in the cache, so no slots are written)."""
    width = max(map(len, tables))
    seq_lens = [c + n for c, n in zip(computed, lens)]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()),
        seq_lens=torch.tensor(seq_lens),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.zeros(sum(lens), dtype=torch.long),
        positions=torch.cat([torch.arange(c, c + n) for c, n in zip(computed, lens)]),
        query_lens_cpu=lens,
        seq_lens_cpu=seq_lens,
        num_decodes=0,
        block_size=bs,
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "lens, rows",
    [
        ([5, 1, 9, 3], True),  # every chunk <= SHORT_QUERY_TOKENS
        ([21, 1, 30, 17], True),  # longer chunks, but at most ROW_KERNEL_MAX_OWN_KEYS keys past the shared blocks
        ([70, 1, 9, 3], False),  # one chunk attends more own keys than that: padded flash call only
    ],
)
def test_prefill_after_shared_prefix_matches_direct_attention(dtype, tol, lens, rows):
    g = torch.Generator().manual_seed(0)
    bs, num_heads, num_kv_heads, hd, shared = 4, 6, 2, 16, 3
    computed = [12, 14, 12, 13]  # cached tokens before each chunk; the first 3 blocks are common
    backend = TorchAttentionBackend(num_heads, num_kv_heads, hd)
    backend.row_kernel_max_own_keys = attention.ROW_KERNEL_MAX_OWN_KEYS  # both paths on every CPU
    k_cache = torch.randn(80, bs, num_kv_heads, hd, generator=g).to(dtype)
    v_cache = torch.randn(80, bs, num_kv_heads, hd, generator=g).to(dtype)
    tables, next_block = [], 20
    for c, n in zip(computed, lens):
        own = -(-(c + n) // bs) - shared
        tables.append([7, 8, 9] + list(range(next_block, next_block + own)))
        next_block += own + 1
    metadata = backend.build(_prefill_step(tables, computed, lens, bs))
    assert metadata.prefill.shared_blocks.tolist() == [7, 8, 9]
    q = torch.randn(sum(lens), num_heads, hd, generator=g).to(dtype)
    kv_cache = torch.stack((k_cache, v_cache))
    out = backend._prefill_attention(q, kv_cache, metadata.prefill)  # [N, H * hd]
    # chunks this short (or with few keys past the shared blocks) also run as rows of the C++ decode
    # kernel, which starts from the shared blocks' flash output (k, v already in the cache)
    assert (metadata.short_prefill is not None) == rows
    short = backend.forward(q, None, None, kv_cache, metadata)
    row = 0
    for table, c, n in zip(tables, computed, lens):
        keys = k_cache[table].reshape(-1, num_kv_heads, hd)[: c + n].float().repeat_interleave(3, dim=1)
        values = v_cache[table].reshape(-1, num_kv_heads, hd)[: c + n].float().repeat_interleave(3, dim=1)
        scores = torch.einsum("qhd,thd->hqt", q[row : row + n].float(), keys) * hd**-0.5
        causal = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
        ref = torch.einsum("hqt,thd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), values)
        torch.testing.assert_close(out[row : row + n].float(), ref.reshape(n, -1), atol=tol, rtol=tol)
        torch.testing.assert_close(short[row : row + n].float(), ref.reshape(n, -1), atol=tol, rtol=tol)
        row += n


@pytest.mark.parametrize(
    "flags, native, cascade, all_rows",
    [
        ({"amx_bf16", "avx512f"}, True, True, False),
        ({"avx512f"}, True, False, True),
        ({"avx2"}, True, True, False),
        (set(), False, True, False),
    ],
)
def test_decodes_cascade_where_the_flash_call_pays(monkeypatch, flags, native, cascade, all_rows):
    """The shared-prefix flash call for decodes is the default on AMX, without AVX-512 and wherever the C++
    kernel is off; with AVX-512 and no AMX the kernel reads every block itself."""
    monkeypatch.setattr(attention, "cpu_flags", lambda: flags)
    monkeypatch.setattr(attention, "decode_kernel_built", lambda: native)
    backend = TorchAttentionBackend(6, 2, 16)
    assert backend.cascade_decodes == cascade
    # prefill chunks of any length run as rows of the kernel with AVX-512 and no AMX (measured to pay there);
    # elsewhere those with many keys of their own take the flash call
    assert backend.row_kernel_max_own_keys == (None if all_rows else attention.ROW_KERNEL_MAX_OWN_KEYS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefill_chunks_as_kernel_rows_match_the_flash_call(dtype):
    """With no limit on own keys (CPUs without AMX) a step of long fresh prompts runs as kernel rows, and
    equals the padded flash call."""
    g = torch.Generator().manual_seed(1)
    bs, num_heads, num_kv_heads, hd = 4, 6, 2, 16
    lens = [90, 1, 37]
    backend = TorchAttentionBackend(num_heads, num_kv_heads, hd)
    backend.row_kernel_max_own_keys = None
    kv_cache = torch.randn(2, 64, bs, num_kv_heads, hd, generator=g).to(dtype)
    tables, first = [], 1
    for n in lens:
        tables.append(list(range(first, first + -(-n // bs))))
        first += len(tables[-1])
    metadata = backend.build(_prefill_step(tables, [0] * len(lens), lens, bs))
    q = torch.randn(sum(lens), num_heads, hd, generator=g).to(dtype)
    flash = backend._prefill_attention(q, kv_cache, metadata.prefill)
    rows = backend.forward(q, None, None, kv_cache, metadata)
    assert metadata.short_prefill is not None and metadata.prefill.shared_blocks is None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rows.float(), flash.float(), atol=tol, rtol=tol)
