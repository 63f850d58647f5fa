"""The Triton paged-attention kernels against a plain PyTorch reference.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``
is set before ``engine.attention_triton`` is imported), so shapes stay tiny. Cases: block sizes
1, 4, 16 and 32, GQA ratios 1, 2 and 4, ragged lengths, block tables that share physical
prefix blocks, chunks with cached context, sliding window, and padding rows of a CUDA-graph batch.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'lmforge[gpu]')")

from engine.attention import CommonAttentionMetadata, TorchAttentionBackend  # noqa: E402
from engine.attention_triton import TritonAttentionBackend, paged_decode, paged_prefill, store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_attention(q, keys, values, positions, window=None):
    """``q [Q, H, D]`` at ``positions [Q]`` over contiguous ``keys, values [T, KV, D]`` -> ``[Q, H * D]``."""
    h, kv = q.shape[1], keys.shape[1]
    k = keys.float().repeat_interleave(h // kv, dim=1)  # [T, H, D]
    v = values.float().repeat_interleave(h // kv, dim=1)
    scores = torch.einsum("qhd,thd->hqt", q.float(), k) * q.shape[-1] ** -0.5
    t = torch.arange(keys.shape[0])
    allowed = t[None, :] <= positions[:, None]
    if window is not None:
        allowed &= t[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    out = torch.einsum("hqt,thd->qhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], -1)


class PagedCase:
    """Random requests laid out in a paged cache; request 0's first ``shared`` blocks are reused by all."""

    def __init__(
        self, seq_lens, block_size, num_heads, num_kv_heads, head_dim=16, shared_blocks=0, seed=0, dtype=torch.float32
    ):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens, self.bs = seq_lens, block_size
        nb = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(nb) + 2
        perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
        self.tables, used = [], 0
        for i, n in enumerate(nb):
            own = perm[used : used + n]
            used += n
            if i > 0 and shared_blocks:
                own[:shared_blocks] = self.tables[0][:shared_blocks]
            self.tables.append(own)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=g).to(dtype)
        self.v_cache = torch.randn(shape, generator=g).to(dtype)
        width = max(nb)
        self.block_table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        self.num_heads, self.head_dim, self.g = num_heads, head_dim, g

    def contiguous_kv(self, i):
        """Request ``i``'s ``[seq_len, KV, D]`` keys and values, read through its block table."""
        idx = torch.tensor(self.tables[i])
        n = self.seq_lens[i]
        k = self.k_cache[idx].reshape(-1, *self.k_cache.shape[2:])[:n]
        v = self.v_cache[idx].reshape(-1, *self.v_cache.shape[2:])[:n]
        return k, v

    def on(self, *tensors):
        return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads", [(1, 2, 2), (4, 4, 2), (16, 8, 2), (32, 4, 1)])
def test_paged_decode_matches_reference(block_size, num_heads, num_kv_heads):
    case = PagedCase(
        [max(1, block_size), 7 + block_size, 33, 18 + block_size], block_size, num_heads, num_kv_heads, shared_blocks=1
    )
    q = torch.randn(4, num_heads, case.head_dim, generator=case.g)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    out = paged_decode(*case.on(q, case.k_cache, case.v_cache, case.block_table, seq_lens)).cpu()
    for i, n in enumerate(case.seq_lens):
        k, v = case.contiguous_kv(i)
        ref = reference_attention(q[i : i + 1], k, v, torch.tensor([n - 1]))
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


def test_paged_decode_sliding_window_and_padding_rows():
    case = PagedCase([40, 9, 1], 4, 4, 2)
    q = torch.randn(3, 4, 16, generator=case.g)
    seq_lens = torch.tensor([40, 9, 0], dtype=torch.int32)  # row 2: a padding row of a graph bucket
    out = paged_decode(*case.on(q, case.k_cache, case.v_cache, case.block_table, seq_lens), sliding_window=6).cpu()
    for i in range(2):
        k, v = case.contiguous_kv(i)
        ref = reference_attention(q[i : i + 1], k, v, torch.tensor([case.seq_lens[i] - 1]), window=6)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros(4 * 16))


@pytest.mark.parametrize(
    "block_size, num_heads, num_kv_heads, window", [(4, 4, 2, None), (16, 4, 4, None), (8, 8, 2, 5), (1, 2, 1, None)]
)
def test_paged_prefill_matches_reference(block_size, num_heads, num_kv_heads, window):
    # chunk lengths with cached context before them: (context, chunk)
    chunks = [(0, 5), (block_size, 19), (3, 1), (0, 37)]
    seq_lens = [c + n for c, n in chunks]
    case = PagedCase(seq_lens, block_size, num_heads, num_kv_heads, shared_blocks=1 if block_size <= 4 else 0)
    lens = [n for _, n in chunks]
    q = torch.randn(sum(lens), num_heads, case.head_dim, generator=case.g)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = paged_prefill(
        *case.on(q, case.k_cache, case.v_cache, case.block_table, torch.tensor(seq_lens, dtype=torch.int32), qsl),
        max(lens),
        sliding_window=window,
    ).cpu()
    for i, (c, n) in enumerate(chunks):
        k, v = case.contiguous_kv(i)
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        ref = reference_attention(q[rows], k, v, torch.arange(c, c + n), window=window)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)


def test_paged_prefill_bfloat16_within_tolerance():
    case = PagedCase([21, 12], 8, 4, 2, dtype=torch.bfloat16)
    q = torch.randn(33, 4, 16, generator=case.g).to(torch.bfloat16)
    qsl = torch.tensor([0, 21, 33], dtype=torch.int32)
    out = paged_prefill(
        *case.on(q, case.k_cache, case.v_cache, case.block_table, torch.tensor([21, 12], dtype=torch.int32), qsl), 21
    ).cpu()
    for i in range(2):
        k, v = case.contiguous_kv(i)
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        ref = reference_attention(q[rows], k, v, torch.arange(case.seq_lens[i]))
        torch.testing.assert_close(out[rows].float(), ref, atol=2e-2, rtol=2e-2)


def test_store_kv_writes_slots_and_skips_negative():
    k_cache = torch.zeros(3, 4, 2, 16)
    v_cache = torch.zeros(3, 4, 2, 16)
    kv = torch.randn(3, 2, 48)  # k and v as strided views of one projection, as the model makes them
    k, v = kv[..., :16], kv[..., 16:32]
    slots = torch.tensor([5, -1, 11])
    k_d, v_d = case_on(k_cache, v_cache)
    store_kv(*case_on(k, v), k_d, v_d, slots.to(DEVICE))
    expected = torch.zeros(12, 2, 16)
    expected[5], expected[11] = k[0], k[2]
    assert torch.equal(k_d.cpu().view(12, 2, 16), expected)
    expected[5], expected[11] = v[0], v[2]
    assert torch.equal(v_d.cpu().view(12, 2, 16), expected)


def case_on(*tensors):
    return [t.to(DEVICE) for t in tensors]


def mixed_step(bs: int) -> tuple[CommonAttentionMetadata, CommonAttentionMetadata]:
    """One step's metadata (on CPU, and on ``DEVICE``): two decodes sharing blocks 0-1 (a prefix), a chunk of 6
    after 5 cached tokens, a fresh prompt of 3."""
    tables = [[0, 1, 2], [0, 1, 3, 4], [5, 6, 7], [8]]
    computed, qlens = [10, 13, 5, 0], [1, 1, 6, 3]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, qlens)])
    req = torch.repeat_interleave(torch.arange(4), torch.tensor(qlens))
    slot_mapping = block_table[req, positions // bs] * bs + positions % bs
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist())
    seq_lens = [c + n for c, n in zip(computed, qlens)]
    tensors = (qsl, torch.tensor(seq_lens), block_table, slot_mapping, positions)
    return (
        CommonAttentionMetadata(*tensors, qlens, seq_lens, 2, bs),
        CommonAttentionMetadata(*case_on(*tensors), qlens, seq_lens, 2, bs),
    )


def test_backend_equals_torch_backend_on_a_mixed_step():
    """Decodes then prefill chunks in one step: the Triton backend's output equals the torch backend's."""
    bs, h, kv, hd = 4, 4, 2, 16
    torch_backend, triton_backend = TorchAttentionBackend(h, kv, hd), TritonAttentionBackend(h, kv, hd)
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 24, bs, kv, hd, generator=g)
    common, dev = mixed_step(bs)
    n = sum(common.query_lens_cpu)
    q, k, v = (
        torch.randn(n, h, hd, generator=g),
        torch.randn(n, kv, hd, generator=g),
        torch.randn(n, kv, hd, generator=g),
    )
    expected = torch_backend.forward(q, k, v, cache.clone(), torch_backend.build(common))
    cache_d = cache.clone().to(DEVICE)
    got = triton_backend.forward(*case_on(q, k, v), cache_d, triton_backend.build(dev)).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    cache_t = cache.clone()
    torch_backend.forward(q, k, v, cache_t, torch_backend.build(common))
    assert torch.equal(cache_d.cpu(), cache_t)


def test_int8_cache_store_and_attention_match_the_torch_backend():
    """An int8 KV cache: ``store_kv`` writes ``quantize_kv``'s bytes (scales included), and both kernels equal the
    torch backend over the same bytes (fp32, within 1e-5: the scales are applied to the scores and the weights
    instead of to the values)."""
    from engine.attention import KV_SCALE_BYTES, quantize_kv

    bs, h, kv, hd = 4, 4, 2, 16
    torch_backend, triton_backend = TorchAttentionBackend(h, kv, hd), TritonAttentionBackend(h, kv, hd)
    g = torch.Generator().manual_seed(5)
    cache = quantize_kv(torch.randn(2, 24, bs, kv, hd, generator=g) * 2)
    assert cache.shape[-1] == hd + KV_SCALE_BYTES
    common, dev = mixed_step(bs)
    n = sum(common.query_lens_cpu)
    q = torch.randn(n, h, hd, generator=g)
    kv_new = torch.randn(n, kv, 3 * hd, generator=g)  # k and v as strided views of one projection
    k, v = kv_new[..., :hd], kv_new[..., hd : 2 * hd]
    cache_t = cache.clone()
    expected = torch_backend.forward(q, k, v, cache_t, torch_backend.build(common))
    cache_d = cache.clone().to(DEVICE)
    got = triton_backend.forward(*case_on(q, k, v), cache_d, triton_backend.build(dev)).cpu()
    assert torch.equal(cache_d.cpu(), cache_t)  # same int8 values and float16 scales
    flat = cache_t.view(2, -1, kv, hd + KV_SCALE_BYTES)
    slots = common.slot_mapping
    assert torch.equal(flat[0, slots], quantize_kv(k)) and torch.equal(flat[1, slots], quantize_kv(v))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
