"""The KV cache dtype (``EngineConfig.kv_cache_dtype``): int8 rows with per-token, per-head float16 scales.

The torch definitions (``engine.attention.quantize_kv`` / ``dequantize_kv``) are the reference: the C++
``rope_and_cache`` writes the same bytes, the C++ decode kernel and the torch paths read them to within the
rounding of their dtype, the block budget holds about twice the bf16 blocks, prefix-cache hits reuse int8
blocks, and a bad name is refused naming the field.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, cpu_ops
from engine.attention import (
    KV_SCALE_BYTES,
    CommonAttentionMetadata,
    TorchAttentionBackend,
    dequantize_kv,
    kv_bytes_per_token,
    quantize_kv,
)
from engine.errors import UsageError
from engine.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("cpu_kernels")


def test_quantize_kv_rows_scales_and_error_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 40.0])[:, None]  # 3 magnitudes per token
    x[2, 1] = 0.0  # an all-zero row
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (6, 3, 64 + KV_SCALE_BYTES)
    values, scale = rows[..., :64], rows[..., 64:].contiguous().view(torch.float16).float()[..., 0]
    assert values.abs().max() <= 127 and (values == -128).sum() == 0
    torch.testing.assert_close(scale, (x.abs().amax(-1) / 127).half().float(), rtol=0, atol=0)
    assert torch.equal(rows[2, 1], torch.zeros(64 + KV_SCALE_BYTES, dtype=torch.int8))
    back = dequantize_kv(rows, torch.float32)
    # round-to-nearest: at most half a step (scale / 2) off, plus the float16 rounding of the scale (the largest
    # value may clamp at 127: 127 * scale is within 2**-11 relative of absmax)
    bound = scale[..., None] * 0.5 + x.abs().amax(-1, keepdim=True) * 2.0**-11
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_and_cache_writes_the_bytes_of_quantize_kv(rope_and_cache_step, dtype):
    cache = torch.zeros(2, 6, 4, 3, 64 + KV_SCALE_BYTES, dtype=torch.int8)
    r = rope_and_cache_step(cache, dtype)
    assert torch.equal(r.q, r.rotated[:, : r.num_heads])  # the torch path's roundings
    flat = cache.view(2, -1, r.num_kv, 64 + KV_SCALE_BYTES)
    stored = r.slots >= 0
    assert torch.equal(flat[0, r.slots[stored]], quantize_kv(r.rotated[stored, r.num_heads :]))
    assert torch.equal(flat[1, r.slots[stored]], quantize_kv(r.v[stored]))
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[r.slots[stored]] = False
    assert not flat[:, untouched].any()


def _scattered_case(lens, num_heads, num_kv, head_dim, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 3
    cache = quantize_kv(torch.randn(2, num_blocks, block_size, num_kv, head_dim, generator=gen) * 3)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, start = [], 0
    for nb in blocks:
        tables.append(perm[start : start + nb])
        start += nb
    width = max(blocks)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return cache, block_tables, tables, gen


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(9, 3, 64), (8, 2, 128), (16, 1, 64), (6, 2, 24)])
def test_decode_kernel_on_int8_rows_equals_attention_over_the_dequantized_cache(
    dtype, tol, num_heads, num_kv, head_dim
):
    """The C++ kernel's ``scale * (q . k_int8)`` and ``(p * scale) v_int8`` against float32 attention over
    ``dequantize_kv`` of the same cache (fp32 within 1e-5: only the order of the products differs; bf16 within
    its output rounding)."""
    lens = [1, 5, 16, 17, 40, 100]
    cache, block_tables, tables, gen = _scattered_case(lens, num_heads, num_kv, head_dim)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    got = cpu_ops.paged_decode_attention(q, cache, block_tables, torch.tensor(lens))
    assert got is not None
    dense = dequantize_kv(cache, torch.float32)  # [2, blocks, bs, kv, hd]
    g = num_heads // num_kv
    for i, n in enumerate(lens):
        k = dense[0][tables[i]].reshape(-1, num_kv, head_dim)[:n].transpose(0, 1)  # [kv, n, hd]
        v = dense[1][tables[i]].reshape(-1, num_kv, head_dim)[:n].transpose(0, 1)
        p = (q[i].float().view(num_kv, g, head_dim) @ k.transpose(1, 2) * head_dim**-0.5).softmax(-1)
        torch.testing.assert_close(got[i].float(), (p @ v).reshape(-1), rtol=tol, atol=tol)


@pytest.mark.parametrize("cascade", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_paths_on_an_int8_cache_agree(dtype, cascade, shared_prefix_block_table):
    """A step of decodes behind a shared prefix and of prefill chunks, on an int8 cache: the C++ kernels
    (cascade decode or the kernel over every block, prefill rows) equal the torch paths (dequantized
    gather + flash) within the dtype's rounding, and the torch store writes ``quantize_kv``'s bytes."""
    torch.manual_seed(0)
    num_heads, num_kv, hd, bs = 9, 3, 64, 16
    decode_lens, chunks = [50, 63, 65], [(48, 5), (49, 12)]  # (computed, new) of the prefill chunks
    lens = decode_lens + [c + n for c, n in chunks]
    block_table, nxt = shared_prefix_block_table(lens, bs)
    qlens = [1] * len(decode_lens) + [n for _, n in chunks]
    computed = [n - 1 for n in decode_lens] + [c for c, _ in chunks]
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(computed, qlens)])
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(qlens))
    slot_mapping = block_table[req, positions // bs] * bs + positions % bs
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist()),
        seq_lens=torch.tensor(lens),
        block_table=block_table,
        slot_mapping=slot_mapping,
        positions=positions,
        query_lens_cpu=qlens,
        seq_lens_cpu=lens,
        num_decodes=len(decode_lens),
        block_size=bs,
    )
    backend = TorchAttentionBackend(num_heads, num_kv, hd)
    backend.cascade_decodes = cascade
    meta = backend.build(common)
    assert (meta.decode.shared_blocks is not None) == cascade and meta.short_prefill is not None
    n = sum(qlens)
    q = torch.randn(n, num_heads, hd).to(dtype)
    k, v = torch.randn(n, num_kv, hd).to(dtype), torch.randn(n, num_kv, hd).to(dtype)
    base = quantize_kv(torch.randn(2, nxt, bs, num_kv, hd))
    native_cache = base.clone()
    native = backend.forward(q, k, v, native_cache, meta)
    flat = native_cache.view(2, -1, num_kv, hd + KV_SCALE_BYTES)
    assert torch.equal(flat[0, slot_mapping], quantize_kv(k)) and torch.equal(flat[1, slot_mapping], quantize_kv(v))
    cpu_ops.use_cpu_kernels(False)
    try:
        torch_cache = base.clone()
        torch_path = backend.forward(q, k, v, torch_cache, backend.build(common))
    finally:
        cpu_ops.use_cpu_kernels(True)
    assert torch.equal(native_cache, torch_cache)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the torch path rounds the dequantized K/V to bf16
    torch.testing.assert_close(native.float(), torch_path.float(), rtol=tol, atol=tol)


def test_int8_blocks_per_gib_are_about_twice_bf16s(tiny_llama_dir):
    """Same ``kv_cache_memory_bytes``: an int8 row is head_dim + 2 bytes against 2 * head_dim for bf16."""
    runners = {
        name: ModelRunner(tiny_llama_dir, "bfloat16", "cpu", 16, 128, kv_cache_dtype=name)
        for name in ("bfloat16", "int8", "float32")
    }
    hd = runners["int8"].spec.head_dim
    per_block = {name: r.kv_bytes_per_block() for name, r in runners.items()}
    assert per_block["bfloat16"] * (hd + KV_SCALE_BYTES) == per_block["int8"] * 2 * hd
    assert per_block["float32"] == 2 * per_block["bfloat16"]
    budget = 1 << 23  # 8 MiB: below the max_num_seqs * max_model_len cap of either dtype
    blocks = {}
    for name in ("bfloat16", "int8"):
        llm = LLM(
            tiny_llama_dir,
            dtype="bfloat16",
            kv_cache_dtype=name,
            kv_cache_memory_bytes=budget,
            max_num_seqs=4096,
            max_model_len=128,
        )
        blocks[name] = llm.engine.config.num_kv_blocks
        runner = llm.engine.runner
        assert runner.kv_cache.dtype == getattr(torch, name)
        assert runner.kv_cache.numel() * runner.kv_cache.itemsize <= budget
        assert blocks[name] == budget // per_block[name]
    assert blocks["int8"] / blocks["bfloat16"] == pytest.approx(2 * hd / (hd + KV_SCALE_BYTES), rel=1e-3)
    # SmolLM2-135M (30 layers, 3 KV heads of 64): 128 / 66 = 1.94x the blocks of bf16 per GiB
    smollm2 = {name: kv_bytes_per_token(30, 3, 64, getattr(torch, name)) for name in ("bfloat16", "int8")}
    assert (1 << 30) // smollm2["int8"] / ((1 << 30) // smollm2["bfloat16"]) > 1.93


def test_prefix_cache_hits_reuse_int8_blocks(tiny_llama_dir):
    """Requests behind one cached prefix read its int8 blocks (hits counted) and generate what they generate
    with prefix caching off (the same quantized K/V recomputed)."""
    shared = list(range(100, 160))  # 60 tokens: 3 full blocks of 16 shared
    prompts = [shared + [7, 8, 9], shared + [11, 12], shared + [5]]
    outputs = {}
    for caching in (True, False):
        llm = LLM(
            tiny_llama_dir,
            dtype="bfloat16",
            kv_cache_dtype="int8",
            enable_prefix_caching=caching,
            num_kv_blocks=64,
            max_model_len=128,
        )
        first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY)
        outputs[caching] = [list(o.outputs[0].token_ids) for o in first + rest]
        stats = llm.engine.get_stats()
        if caching:
            assert stats.prefix_cache_hits_tokens_total >= 2 * 48
            assert all(o.metrics.num_cached_tokens >= 48 for o in rest)
        llm.engine.check_invariants()
    assert outputs[True] == outputs[False]


def test_bad_kv_cache_dtype_is_refused_naming_the_field():
    with pytest.raises(UsageError, match=r"kv_cache_dtype='fp8'.*'int8'"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
