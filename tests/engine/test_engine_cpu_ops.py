"""The engine's C++ CPU kernels (engine/csrc/cpu_ops.cpp) against their torch definitions."""

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_ops
from engine.attention import CommonAttentionMetadata, TorchAttentionBackend

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def test_rms_norm_matches_torch_in_bf16_and_fp32():
    torch.manual_seed(0)
    x = torch.randn(300, 576) * torch.logspace(-3, 3, 300)[:, None]
    weight = torch.randn(576)
    for dtype in (torch.bfloat16, torch.float32):
        xd, wd = x.to(dtype), weight.to(dtype)
        ref = F.rms_norm(xd.float(), (576,), None, 1e-5).to(dtype)
        got = cpu_ops.rms_norm(xd, None, 1e-5)
        got_w = cpu_ops.rms_norm(xd, wd, 1e-5)
        ref_w = wd * ref  # Hugging Face's LlamaRMSNorm: round, then multiply in the model dtype
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
        torch.testing.assert_close(got_w.float(), ref_w.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
        if dtype == torch.bfloat16:
            # the same float32 arithmetic in another summation order: a rare last-place difference at most
            assert (got != ref).float().mean() < 1e-4 and (got_w != ref_w).float().mean() < 1e-4
    # a non-contiguous row stride is read as such
    wide = torch.randn(8, 1000).bfloat16()
    assert torch.equal(cpu_ops.rms_norm(wide[:, :576], None, 1e-6), cpu_ops.rms_norm(wide[:, :576].clone(), None, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rows_do_not_depend_on_the_batch_or_the_address(dtype):
    """A row's norm is the same bits alone, among 256 rows split over the threads, and at any address (batch-invariant
    decoding relies on it: a sum the compiler split by alignment once made rows depend on their batch)."""
    torch.manual_seed(0)
    x = (torch.randn(256, 576) * torch.logspace(-2, 2, 576)).to(dtype)
    weight = torch.randn(576).to(dtype)
    whole = cpu_ops.rms_norm(x, weight, 1e-5)
    for offset in range(1, 16):  # every element offset within a 64-byte line
        moved = torch.empty(x.numel() + offset, dtype=dtype)[offset:].view_as(x)
        moved.copy_(x)
        assert torch.equal(cpu_ops.rms_norm(moved, weight, 1e-5), whole), offset
        assert torch.equal(cpu_ops.rms_norm(moved[offset : offset + 1], weight, 1e-5)[0], whole[offset]), offset


def test_model_fp32_norm_is_one_pass_only_off_intel():
    """fp32 ``engine.model.rms_norm`` runs the C++ kernel where fp32 prefill is on oneDNN anyway (off Intel), else
    Hugging Face's exact ops."""
    from engine.model import fp32_one_pass_norm, rms_norm
    from engine.platform import cpu_vendor

    assert fp32_one_pass_norm() == (cpu_vendor() != "GenuineIntel")
    torch.manual_seed(1)
    x, weight = torch.randn(5, 576), torch.randn(576)
    hf = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    expected = cpu_ops.rms_norm(x, weight, 1e-5) if fp32_one_pass_norm() else hf
    assert torch.equal(rms_norm(x, weight, 1e-5), expected)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), hf, rtol=1e-6, atol=1e-6)


def test_argmax_is_the_first_maximum_as_torch():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in [(64, 49152), (3, 7), (2, 33), (5, 100), (1, 1)]:
            for trial in range(8):
                logits = torch.randint(-3, 3, shape).to(dtype) if trial % 2 else torch.randn(shape).to(dtype)
                if trial == 2:
                    logits[0, -1] = float("nan")
                if trial == 3:
                    logits[:, 0] = float("inf")
                if trial == 4:
                    logits[:] = float("-inf")
                assert torch.equal(cpu_ops.argmax(logits), logits.argmax(dim=-1)), (dtype, shape, trial)


def _paged_case(num_seqs, num_heads, num_kv, head_dim, block_size, lens, dtype, seed=0):
    """A cache with each sequence's blocks scattered, and the reference attention of its last token."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is the padding block
    tables, start = [], 0
    for nb in blocks_per_seq:
        tables.append(perm[start : start + nb].tolist())
        start += nb
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    return cache, block_tables, tables, q


def _reference(cache, tables, q, lens, block_size, window=None):
    num_kv, head_dim = cache.shape[3], cache.shape[4]
    g = q.shape[1] // num_kv
    flat_k, flat_v = cache[0].reshape(-1, num_kv, head_dim).float(), cache[1].reshape(-1, num_kv, head_dim).float()
    outs = []
    for i, n in enumerate(lens):
        slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in tables[i]])[:n]
        if window is not None:
            slots = slots[max(0, n - window) :]
        k, v = flat_k[slots].transpose(0, 1), flat_v[slots].transpose(0, 1)  # [kv, T, hd]
        qi = q[i].float().view(num_kv, g, head_dim)
        p = (qi @ k.transpose(1, 2) * head_dim**-0.5).softmax(-1)
        outs.append((p @ v).reshape(-1))
    return torch.stack(outs)


def _near_tie_logits(rows: int = 12, vocab: int = 3000, hidden: int = 96):
    """bf16 operands whose lm-head products round into ties and swaps near each row's maximum."""
    torch.manual_seed(3)
    h = torch.randn(rows, hidden).bfloat16()
    w = (torch.randn(vocab, hidden) * 0.3).bfloat16()
    w[:40] = w[40:80] + (torch.randn(40, hidden) * 1e-2).bfloat16()  # 40 near-duplicate rows
    exact = h.float() @ w.float().T  # [rows, vocab]: what the GEMM sums before its rounding
    logits = exact.bfloat16()
    return h, w, exact, logits


@pytest.mark.parametrize("native", [True, False])
def test_refine_logits_makes_the_exact_maximum_win_where_bf16_rounding_ties(native):
    h, w, exact, logits = _near_tie_logits()
    for row in range(logits.shape[0]):  # force a tie at the top of each row: the rounded values of two columns equal
        top2 = exact[row].topk(2).indices
        logits[row, top2[1]] = logits[row, top2[0]]
    assert not torch.equal(cpu_ops.argmax(logits), exact.argmax(-1))  # ties go to the first index, not the model
    cpu_ops.use_cpu_kernels(native)
    try:
        full = cpu_ops.refine_logits(logits.clone(), h, w, to_float=True)
        nudged = cpu_ops.refine_logits(logits.clone(), h, w, to_float=False)
    finally:
        cpu_ops.use_cpu_kernels(True)
    assert full.dtype == torch.float32 and nudged.dtype == torch.bfloat16
    assert torch.equal(full.argmax(-1), exact.argmax(-1))
    assert torch.equal(cpu_ops.argmax(nudged), exact.argmax(-1))
    top = full.topk(2, dim=-1).values
    assert (top[:, 0] > top[:, 1]).all()  # no tie where the float32 sums have none
    top1 = logits.float().max(-1, keepdim=True).values
    near = logits.float() >= top1 - 2 * torch.exp2(torch.floor(torch.log2(top1.abs())) - 7)  # two bf16 steps
    assert near.sum(-1).min() >= 2
    torch.testing.assert_close(full[near], exact[near], rtol=1e-5, atol=1e-5)  # the exact sums near the top
    assert torch.equal(full[~near], logits.float()[~near])  # the rest keeps the GEMM's values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(9, 3, 64), (8, 2, 128), (16, 1, 64), (4, 4, 32), (6, 2, 24)])
def test_paged_decode_attention_matches_direct_attention(dtype, num_heads, num_kv, head_dim):
    lens = [1, 5, 16, 17, 40, 100]
    cache, block_tables, tables, q = _paged_case(len(lens), num_heads, num_kv, head_dim, 16, lens, dtype)
    ref = _reference(cache, tables, q, lens, 16)
    got = cpu_ops.paged_decode_attention(q, cache, block_tables, torch.tensor(lens))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    windowed = cpu_ops.paged_decode_attention(q, cache, block_tables, torch.tensor(lens), sliding_window=7)
    torch.testing.assert_close(windowed.float(), _reference(cache, tables, q, lens, 16, window=7), rtol=tol, atol=tol)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 24), (32, 2, 64)])
def test_paged_decode_attention_reads_blocks_shared_by_a_group_once_and_equals_each_alone(
    cache_dtype, num_heads, num_kv, head_dim
):
    """Sequences whose tables start with the same blocks (a group of 7 on 4 blocks, one of them shorter than the
    prefix, a group of 3 on 2 blocks whose third member diverges, two alone; the groups mixed through the batch) are
    attended in chunks that read their common blocks once: each output equals that sequence attended alone and the
    float64 reference, with and without a prior part (cascade from a prefix of the whole batch)."""
    from engine.attention import dequantize_kv, quantize_kv

    bs, gen = 16, torch.Generator().manual_seed(1)
    group_a, group_b = list(range(1, 5)), [5, 6]  # physical blocks of the two common prefixes
    members = ["a", "b", "x", "a", "a", "b", "a", "y", "a", "b2", "a", "a"]
    lens = [70, 40, 33, 64 + 17, 100, 37, 65, 20, 90, 45, 40, 66]  # a's 40 < 4 blocks: the chunk's common part shrinks
    tables, nxt = [], 7
    for who, n in zip(members, lens):
        prefix = {"a": group_a, "b": group_b, "b2": group_b[:1]}.get(who, [])
        own = -(-n // bs) - len(prefix)
        tables.append((prefix + list(range(nxt, nxt + own)))[: -(-n // bs)])
        nxt += max(own, 0)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    values = torch.randn(2, nxt, bs, num_kv, head_dim, generator=gen)
    dtype = torch.bfloat16 if cache_dtype == "bfloat16" else torch.float32
    cache = quantize_kv(values) if cache_dtype == "int8" else values.to(dtype)
    dense = dequantize_kv(cache, torch.float32) if cache_dtype == "int8" else cache
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    got = cpu_ops.paged_decode_attention(q, cache, block_tables, torch.tensor(lens))
    alone = torch.cat(
        [
            cpu_ops.paged_decode_attention(q[i : i + 1], cache, block_tables[i : i + 1], torch.tensor(lens[i : i + 1]))
            for i in range(len(lens))
        ]
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), alone.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.float(), _reference(dense, tables, q, lens, bs), rtol=tol, atol=tol)
    # the same batch behind one more block (nxt) every sequence shares, attended apart and given as the prior
    values = torch.cat([values, torch.randn(2, 1, bs, num_kv, head_dim, generator=gen)], dim=1)
    cache = quantize_kv(values) if cache_dtype == "int8" else values.to(dtype)
    dense = dequantize_kv(cache, torch.float32) if cache_dtype == "int8" else cache
    g = num_heads // num_kv
    k0, v0 = dense[0, nxt].float().transpose(0, 1), dense[1, nxt].float().transpose(0, 1)  # [kv, bs, hd]
    qs = q.float().view(len(lens), num_kv, g, head_dim).transpose(0, 1).reshape(num_kv, -1, head_dim)
    scores = qs @ k0.transpose(1, 2) * head_dim**-0.5  # [kv, D g, bs]
    prior = ((scores.softmax(-1) @ v0).to(dtype), scores.logsumexp(-1))
    lens_after = [n + bs for n in lens]
    got = cpu_ops.paged_decode_attention(q, cache, block_tables, torch.tensor(lens), prior=prior)
    full_tables = [[nxt] + t for t in tables]
    torch.testing.assert_close(got.float(), _reference(dense, full_tables, q, lens_after, bs), rtol=tol, atol=tol)


@pytest.mark.parametrize("cascade", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_backend_with_shared_prefix_equals_the_torch_path(dtype, cascade, shared_prefix_block_table):
    """Cascade decode (shared prefix read once, own blocks in place), and the kernel reading every block
    (the default without AMX), against the gather + flash path."""
    torch.manual_seed(0)
    num_heads, num_kv, head_dim, bs = 9, 3, 64, 16
    lens = [50, 63, 64, 65, 90]
    block_table, nxt = shared_prefix_block_table(lens, bs)  # 48 shared tokens
    cache = torch.randn(2, nxt, bs, num_kv, head_dim).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    seq_lens = torch.tensor(lens)
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        positions=seq_lens - 1,
        query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
        num_decodes=len(lens),
        block_size=bs,
    )
    backend = TorchAttentionBackend(num_heads, num_kv, head_dim)
    backend.cascade_decodes = cascade
    group = backend.build(common).decode
    shared = group.shared_blocks
    assert (shared is not None and len(shared) == 3) if cascade else shared is None
    native = backend._decode_attention(q, cache, group)
    cpu_ops.use_cpu_kernels(False)
    try:
        torch_path = backend._decode_attention(q, cache, group)
    finally:
        cpu_ops.use_cpu_kernels(True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(native.float(), torch_path.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(native.float(), _reference(cache, block_table.tolist(), q, lens, bs), rtol=tol, atol=tol)


def test_bad_arguments_name_the_tensor():
    q = torch.randn(2, 4, 16)
    cache = torch.randn(2, 4, 8, 2, 16)
    with pytest.raises(RuntimeError, match="block_tables"):
        cpu_ops.KERNELS.ops.paged_decode_attention(
            q, cache, torch.zeros(2, 3, dtype=torch.int32), torch.tensor([1, 2]), 0, 0.25, 0, None, None, True
        )
    with pytest.raises(RuntimeError, match="kv_cache must be in q's dtype or int8"):
        cpu_ops.KERNELS.ops.paged_decode_attention(
            q.bfloat16(), cache, torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 2]), 0, 0.25, 0, None, None, True
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_and_cache_is_bit_identical_to_the_torch_ops(rope_and_cache_step, dtype):
    cache = torch.zeros(2, 6, 4, 3, 64, dtype=dtype)
    r = rope_and_cache_step(cache, dtype)
    assert torch.equal(r.q, r.rotated[:, : r.num_heads])
    flat = cache.view(2, -1, r.num_kv, 64)
    stored = r.slots >= 0
    assert torch.equal(flat[0, r.slots[stored]], r.rotated[stored, r.num_heads :])
    assert torch.equal(flat[1, r.slots[stored]], r.v[stored])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[r.slots[stored]] = False
    assert not flat[:, untouched].any()
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    mixed = cpu_ops.rope_and_cache(r.qkv.to(other), r.cos, r.sin, cache, r.slots, r.num_heads, r.num_kv)
    assert mixed is None  # a cache of another dtype: the torch ops


def test_fp32_linear_uses_the_packed_weight_only_for_its_row_range():
    from engine.model import FP32_PACKED_ROWS, Linear, packed_rows

    if packed_rows("cpu", torch.float32) is None:
        return  # no oneDNN: plain F.linear everywhere
    torch.manual_seed(0)
    w, b = torch.randn(96, 40), torch.randn(96)
    layer = Linear(w, b, pack=True, pack_rows=FP32_PACKED_ROWS)
    assert layer.packed is not None and layer.pack_rows == FP32_PACKED_ROWS
    for rows in (1, 3, 4, 17, 64, 65, 200):
        x = torch.randn(rows, 40)
        expected = torch.nn.functional.linear(x, w, b)
        got = layer(x)
        if not FP32_PACKED_ROWS[0] <= rows <= FP32_PACKED_ROWS[1]:
            assert torch.equal(got, expected), rows  # the plain weight, MKL's GEMM: Hugging Face's numbers
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        residual = torch.randn(rows, 96)
        torch.testing.assert_close(layer.add(x, residual), residual + expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_screened_logits_pick_the_float32_heads_argmax(native):
    """A float32 head screened through its bf16 copy picks the float32 argmax: rows with near-duplicate weight rows
    (float32 values 1e-4 apart that bf16 ties or swaps), a row whose float32 maximum is tied (the first index wins,
    as an argmax of the float32 logits), masked entries (-inf) that would win unmasked, and a row masked whole."""
    g = torch.Generator().manual_seed(5)
    rows, vocab, hidden = 16, 4000, 96
    h = torch.randn(rows, hidden, generator=g) * 2
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    w[:50] = w[50:100] + torch.randn(50, hidden, generator=g) * 1e-4  # near-duplicates of the likely winners
    w[100:150] = w[50:100]  # exact duplicates: float32 ties, first index wins
    h[:8] = (w[50:58] * 5).float()  # rows 0..7 aim at the duplicated rows
    exact = h @ w.T
    logits = (h.bfloat16() @ w.bfloat16().T).bfloat16()
    masked_win = exact[8].argmax()
    logits[8, masked_win] = float("-inf")
    exact[8, masked_win] = float("-inf")
    logits[9] = float("-inf")
    norms = w.norm(dim=1)
    assert not torch.equal(cpu_ops.argmax(logits)[:8], exact.argmax(-1)[:8])  # bf16 alone picks other tokens
    cpu_ops.use_cpu_kernels(native)
    try:
        screened = cpu_ops.screen_logits(logits.clone(), h, w, norms)
    finally:
        cpu_ops.use_cpu_kernels(True)
    assert screened.dtype == torch.bfloat16
    picked = cpu_ops.argmax(screened)
    want = exact.argmax(-1)
    assert torch.equal(picked[torch.arange(rows) != 9], want[torch.arange(rows) != 9])
    assert int(picked[8]) != int(masked_win) and torch.isinf(screened[9]).all()


@pytest.mark.parametrize("native", [True, False])
def test_refined_float_logits_hold_the_exact_top_k(native):
    """With ``top_k`` the float copy holds the exact sums of every entry that may be among the k largest, so the
    top-k values and their order are the float32 GEMM's (no rounding ties among them)."""
    h, w, exact, logits = _near_tie_logits()
    cpu_ops.use_cpu_kernels(native)
    try:
        full = cpu_ops.refine_logits(logits.clone(), h, w, to_float=True, top_k=20)
    finally:
        cpu_ops.use_cpu_kernels(True)
    got, want = full.topk(20, dim=-1), exact.topk(20, dim=-1)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-5)
    assert (got.values[:, :-1] > got.values[:, 1:]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_apply_adds_each_slots_delta_to_its_rows_only(dtype):
    """The C++ grouped LoRA kernel against the float64 sum ``y + (x A_s) B_s`` per row, on a block-diagonal
    three-module B (q, k, v of different widths), 37 rows over 3 slots and base rows, a slot with > 16 rows."""
    from engine.lora import LoRABatch, SlotStack

    g = torch.Generator().manual_seed(0)
    widths, rank, slots, n, in_features = [96, 32, 32], 8, 3, 37, 64
    stack = SlotStack(slots, in_features, widths, 3 * rank, dtype, "cpu")
    for s in range(slots):
        stack.A[s] = torch.randn(in_features, 3 * rank, generator=g).to(dtype)
        for j, first in enumerate(stack.out_splits[:-1].tolist()):
            block = torch.randn(rank, widths[j], generator=g).to(dtype)
            stack.B[s, j * rank : (j + 1) * rank, first : first + widths[j]] = block
    row_slots = [(-1 if i % 5 == 4 else (0 if i < 20 else 1 + i % 2)) for i in range(n)]
    x = torch.randn(n + 3, in_features, generator=g).to(dtype)  # rows past n: padding, never read
    y = torch.randn(n, sum(widths), generator=g).to(dtype)
    expected = y.double().clone()
    for i, s in enumerate(row_slots):
        if s >= 0:
            expected[i] += (x[i].double() @ stack.A[s].double()) @ stack.B[s].double()
    batch = LoRABatch(row_slots, {(0, "qkv"): stack}, {(0, "qkv")}, "cpu", dtype)
    assert batch.tasks is not None and max(torch.diff(batch.tasks[1]).tolist()) <= LoRABatch.KERNEL_TASK_ROWS
    got = batch.apply(0, "qkv", x, y.clone())
    cpu_ops.use_cpu_kernels(False)
    try:
        torch_path = batch.apply(0, "qkv", x, y.clone())
    finally:
        cpu_ops.use_cpu_kernels(True)
    if dtype == torch.bfloat16:  # the kernel rounds once (half a bf16 step); the torch path rounds three times
        torch.testing.assert_close(got.double(), expected, atol=1e-3, rtol=2**-8)
        torch.testing.assert_close(torch_path.double(), expected, atol=0.5, rtol=0.02)
    else:
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(torch_path.double(), expected, atol=1e-4, rtol=1e-5)
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_gemv_matches_float32_sums_with_the_packed_linears_roundings(dtype):
    """``float_gemv`` (the C++ kernel where it builds) against float32 sums rounded once, with its residual-add
    and SwiGLU epilogues rounded as oneDNN's post-ops; rows 1 to 4 of one input agree bit for bit, whatever the
    row count of the call, and an odd ``K`` (a tail past the vector loop) and a bias are summed too."""
    if cpu_ops.FLOAT_GEMV_KERNELS.forbidden:
        pytest.skip("--cpu-kernel-path=torch holds the float GEMV off")
    assert cpu_ops.float_gemv_available(), cpu_ops.FLOAT_GEMV_KERNELS.reason
    gen = torch.Generator().manual_seed(4)
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    for k, n, bias in ((576, 3072, False), (1536, 576, False), (101, 70, True)):
        w = torch.randn(n, k, generator=gen).to(dtype) / k**0.5
        b = torch.randn(n, generator=gen) if bias else None
        x4 = torch.randn(4, k, generator=gen).to(dtype)
        full = cpu_ops.float_gemv(x4, w, b)
        for m in (1, 2, 3, 4):
            x = x4[:m]
            sums = x.float() @ w.float().T + (0 if b is None else b)
            got = cpu_ops.float_gemv(x, w, b)
            assert got.dtype == dtype and got.shape == (m, n)
            assert torch.equal(got, full[:m]), (k, m)
            torch.testing.assert_close(got.float(), sums.to(dtype).float(), **tol)
            residual = torch.randn(m, n, generator=gen).to(dtype)
            with_residual = cpu_ops.float_gemv(x, w, b, residual=residual)
            torch.testing.assert_close(with_residual.float(), (sums + residual.float()).to(dtype).float(), **tol)
            gate, up = sums.chunk(2, dim=-1)
            swiglu = (F.silu(gate).to(dtype).float() * up).to(dtype)
            torch.testing.assert_close(cpu_ops.float_gemv(x, w, b, silu_mul=True).float(), swiglu.float(), **tol)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        cpu_ops.float_gemv(torch.randn(5, 8).to(dtype), torch.randn(6, 8).to(dtype))
    with pytest.raises(RuntimeError, match="w must be contiguous"):
        cpu_ops.float_gemv(torch.randn(2, 8).to(dtype), torch.randn(6, 9).to(dtype))


def test_float_gemm_panels_sum_each_output_in_order_with_the_gemvs_epilogues():
    """``float_gemm_panels`` against float64 sums for 1 to 64 rows (full and partial 6-row tiles), a column count
    that is no multiple of 16 and an odd ``K``, a bias, the residual add and SwiGLU (gated panels, whose plain
    output keeps the weight's column order); a row's result is the same bits in any call, alone or in a batch."""
    if cpu_ops.FLOAT_GEMV_KERNELS.forbidden:
        pytest.skip("--cpu-kernel-path=torch holds the float GEMV off")
    assert cpu_ops.float_gemv_available(), cpu_ops.FLOAT_GEMV_KERNELS.reason
    gen = torch.Generator().manual_seed(6)
    for k, n, bias, gated in (
        (576, 960, False, False),
        (101, 70, True, False),
        (576, 3072, True, True),
        (37, 64, False, True),
    ):
        w = torch.randn(n, k, generator=gen) / k**0.5
        b = torch.randn(n, generator=gen) if bias else None
        panels = cpu_ops.pack_float_panels(w, gated)
        assert panels.shape == ((n + 15) // 16, k, 16)
        x64 = torch.randn(64, k, generator=gen)
        full = cpu_ops.float_gemm_panels(x64, panels, n, gated, b)
        for m in (1, 4, 6, 7, 13, 64):
            x = x64[-m:]
            sums = x.double() @ w.double().T + (0 if b is None else b.double())
            got = cpu_ops.float_gemm_panels(x, panels, n, gated, b)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert torch.equal(got, full[-m:]), (k, n, m)  # the same bits whatever the rows around it
            torch.testing.assert_close(got.double(), sums, rtol=1e-5, atol=1e-4)
            residual = torch.randn(m, n, generator=gen)
            with_residual = cpu_ops.float_gemm_panels(x, panels, n, gated, b, residual=residual)
            torch.testing.assert_close(with_residual.double(), sums + residual.double(), rtol=1e-5, atol=1e-4)
            if gated:
                gate, up = sums.chunk(2, dim=-1)
                swiglu = cpu_ops.float_gemm_panels(x, panels, n, True, b, silu_mul=True)
                assert swiglu.shape == (m, n // 2)
                torch.testing.assert_close(swiglu.double(), F.silu(gate) * up, rtol=1e-5, atol=1e-4)
    assert cpu_ops.float_gemm_panels(torch.randn(0, 37), panels, 64, True).shape == (0, 64)
    with pytest.raises(RuntimeError, match="silu_mul needs panels packed with gated"):
        cpu_ops.float_gemm_panels(torch.randn(2, 8), cpu_ops.pack_float_panels(torch.randn(32, 8)), 32, silu_mul=True)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        cpu_ops.pack_float_panels(torch.randn(48, 8), gated=True)
    with pytest.raises(RuntimeError, match="K = x's columns"):
        cpu_ops.float_gemm_panels(torch.randn(2, 9), cpu_ops.pack_float_panels(torch.randn(32, 8)), 32)


def test_linears_on_panels_run_few_rows_on_the_float_gemv_and_the_rest_on_the_panels():
    """``Linear(panels=True)``: 1 to ``gemv_rows`` rows on ``float_gemv``, any other count on the panel GEMM (its
    residual and SwiGLU epilogues too); a gated layer whose halves are no multiple of 16 rows still gives SwiGLU."""
    from engine.model import Linear

    if cpu_ops.FLOAT_GEMV_KERNELS.forbidden:
        pytest.skip("--cpu-kernel-path=torch holds the float GEMV off")
    gen = torch.Generator().manual_seed(7)
    for out_features in (64, 48):
        w = torch.randn(out_features, 32, generator=gen)
        layer = Linear(w, gated=True, panels=True)
        layer.use_float_gemv(3)
        assert layer.panels is not None and layer.panels_gated == (out_features % 32 == 0)
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, 32, generator=gen)
            on_gemv = rows <= 3
            expected = (
                cpu_ops.float_gemv(x, w)
                if on_gemv
                else cpu_ops.float_gemm_panels(x, layer.panels, out_features, layer.panels_gated)
            )
            assert torch.equal(layer(x), expected), rows
            torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
            residual = torch.randn(rows, out_features, generator=gen)
            torch.testing.assert_close(layer.add(x, residual), F.linear(x, w) + residual, rtol=1e-5, atol=1e-5)
            gate, up = F.linear(x, w).chunk(2, dim=-1)
            torch.testing.assert_close(layer.silu_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_linears_run_few_rows_on_the_float_gemv_and_more_on_their_own_path():
    """``Linear.use_float_gemv(rows)``: inputs of 1 to ``rows`` rows take ``cpu_ops.float_gemv`` (its residual and
    SwiGLU epilogues too), larger ones the packed or plain weight; an INT8 layer never does."""
    from engine.model import Linear

    if cpu_ops.FLOAT_GEMV_KERNELS.forbidden:
        pytest.skip("--cpu-kernel-path=torch holds the float GEMV off")
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 32, generator=gen).bfloat16()
    layer = Linear(w, gated=True)
    layer.use_float_gemv(3)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 32, generator=gen).bfloat16()
        on_gemv = rows <= 3
        expected = cpu_ops.float_gemv(x, w) if on_gemv else F.linear(x, w)
        assert torch.equal(layer(x), expected), rows
        gate, up = (x.float() @ w.float().T).chunk(2, dim=-1)
        swiglu = (F.silu(gate).bfloat16().float() * up).bfloat16()
        torch.testing.assert_close(layer.silu_mul(x).float(), swiglu.float(), rtol=2e-2, atol=2e-2)
        if on_gemv:
            assert torch.equal(layer.silu_mul(x), cpu_ops.float_gemv(x, w, silu_mul=True))
    assert layer(torch.randn(0, 32).bfloat16()).shape == (0, 64)  # no rows: the plain path, not the kernel
    held = Linear(None, int8_layer=object(), dtype=torch.bfloat16)
    held.use_float_gemv(3)
    assert held.gemv_rows == 0
