"""The engine's C++ CPU kernels (``csrc/cpu_ops.cpp``) with their pure-torch equivalents.

``torch.ops.lmforge_engine`` holds five operators that replace several small ATen kernels each
in a bf16 / fp32 step on CPU:

* ``rms_norm``: RMSNorm of ``[N, H]`` rows in one pass (float32 sum of squares, one rounding);
* ``argmax``: the greedy token of ``[S, V]`` logits read once in their own dtype (``torch.max``
  over bf16 logits takes about 2.3 ms for 64 x 49,152 on one thread of this machine);
* ``paged_decode_attention``: one query token per sequence against its keys read in place
  through its block table, merged with a prior partial result (a shared prefix) by its
  log-sum-exp, so no ``index_select`` copy of the cache and no padded keys;
* ``rope_and_cache`` (bf16, float32): rotary embedding of q and k in float32 (one rounding to the dtype) and the
  store of k and v at their ``slot_mapping`` slots in one pass, bit for bit the torch ops it replaces
  (quantized to int8 rows for an int8 KV cache);
* ``apply_token_bitmask_``: structured output's grammar mask on the logits, in place, writing only the
  disallowed entries (the torch path unpacks the bitmask to one byte per token and ``masked_fill_``s
  every entry).

``torch.ops.lmforge_float_gemv.mm`` (``csrc/float_gemv_cpu.cpp``, ``float_gemv``) multiplies 1 to 4 rows by a
plain fp32 or bf16 weight, reading each weight row once for all of them, with the residual-add and SwiGLU
epilogues of the packed linears.

``torch.ops.lmforge_decode.decode_layers`` (``csrc/int8_decode_cpu.cpp``) runs every decoder layer of a decode step
of a few tokens in one call, through those operators and the few-row GEMVs of each linear (float, weight-only INT8,
``w8a8``): such a step is otherwise as much Python and op dispatch as reading the weights. The engine's steps
(``engine.model.Model.fused_decode_rows``) and an INT8 draft's forwards (``engine.spec_decode``) use it.

They are built on first use (``engine.native.NativeKernels``, 15-25 s once, cached);
where they cannot be built every function here runs its torch equivalent, and
``use_cpu_kernels(False)`` forces that path (tests compare the two).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.native import CSRC, NativeKernels
from engine.platform import vector_cflags
from engine.quant.int8 import cpu_kernel_switches, weight_only_cpu_kernel

#: The C++ source of ``torch.ops.lmforge_engine``.
KERNEL_SOURCE = CSRC / "cpu_ops.cpp"
KERNELS = NativeKernels("lmforge_engine", KERNEL_SOURCE, "rope_and_cache", cflags=vector_cflags())
#: ``torch.ops.lmforge_decode``: the decoder layers of a decode step of a few tokens in one call (``decode_layers``).
DECODE_KERNEL_SOURCE = CSRC / "int8_decode_cpu.cpp"
DECODE_KERNELS = NativeKernels("lmforge_decode", DECODE_KERNEL_SOURCE, "decode_layers", cflags=vector_cflags())
_DTYPES = (torch.bfloat16, torch.float32)
#: ``torch.ops.lmforge_float_gemv``: few-row float linears on the plain weight (``float_gemv``). Default flags (no
#: reassociation): a row's sums are added in one fixed order whatever the row count.
FLOAT_GEMV_SOURCE = CSRC / "float_gemv_cpu.cpp"
FLOAT_GEMV_KERNELS = NativeKernels("lmforge_float_gemv", FLOAT_GEMV_SOURCE, "mm")
#: Most rows ``float_gemv`` takes.
FLOAT_GEMV_MAX_ROWS = 4


def use_cpu_kernels(enable: bool | None = None) -> bool:
    """Whether the C++ kernels run (built on the first call); ``False`` forces the torch path, ``True``
    re-enables them."""
    return KERNELS.enable(enable)


def _native(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and KERNELS.available


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [N, H]`` (Zhang & Sennrich 2019) as Hugging Face's LlamaRMSNorm.

    The normalization runs in float32 and is rounded to ``x.dtype``; ``weight [H]`` (``x.dtype``;
    ``None``: only normalize) then multiplies it in ``x.dtype``. Bit-identical to the torch path
    (``F.rms_norm`` on the float32 copy) in bf16; in fp32 the sum of squares may differ in its
    last bit (another summation order), so fp32 callers that must equal Hugging Face keep torch.
    """
    if x.dim() == 2 and x.stride(1) == 1 and _native(x):
        return KERNELS.ops.rms_norm(x, weight, eps)
    out = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return out if weight is None else weight * out


def float_gemv_available() -> bool:
    """Whether ``float_gemv`` runs its C++ kernel (built on the first call)."""
    return FLOAT_GEMV_KERNELS.available


def float_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias)`` for ``M <= FLOAT_GEMV_MAX_ROWS``, summed in float32, rounded once
    to ``x.dtype`` (fp32 or bf16, ``weight``'s too).

    ``residual [M, N]`` gives ``round(residual + y)``; ``silu_mul`` (``weight`` is ``[gate; up]``, ``[2 I, K]``)
    gives ``[M, I]`` ``round(round(silu(gate)) * up)``: the roundings of oneDNN's post-ops on the packed weight.
    Each row's sums are added in the same order whatever ``M`` is. Without the C++ kernel, the same in torch ops.

    Raises:
        RuntimeError: more than ``FLOAT_GEMV_MAX_ROWS`` rows, or mismatched shapes or dtypes (from the kernel).
    """
    if FLOAT_GEMV_KERNELS.available:
        return FLOAT_GEMV_KERNELS.ops.mm(x, weight, bias, residual, silu_mul)
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        return (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)
    return (y if residual is None else y + residual.float()).to(x.dtype)


def pack_float_panels(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """fp32 ``weight [N, K]`` packed for ``float_gemm_panels``: ``[ceil(N / 16), K, 16]``, 16 output columns a panel
    (``gated``: ``[gate; up]`` halves of a multiple of 16 rows, their panels alternating).

    Raises:
        RuntimeError: not fp32 ``[N, K]``, a gated weight of other halves, or the kernel is not built.
    """
    if not FLOAT_GEMV_KERNELS.available:
        raise RuntimeError(f"the float GEMV kernels are not built here: {FLOAT_GEMV_KERNELS.reason}")
    return FLOAT_GEMV_KERNELS.ops.pack_panels(weight, gated)


def float_gemm_panels(
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    gated: bool = False,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """fp32 ``x [M, K] @ weight^T (+ bias)`` on ``pack_float_panels(weight, gated)``, ``weight [out_features, K]``:
    ``[M, out_features]`` in the weight's column order, or with ``silu_mul`` (gated panels) ``[M, out_features / 2]``
    ``silu(gate) * up``; ``residual [M, out_features]`` gives ``residual + y``. Each output is one float32 sum over
    ``K`` in order, so a row's result does not depend on the other rows of the call (register tiles of 6 rows x 16
    columns; ``csrc/float_gemv_cpu.cpp``).

    Raises:
        RuntimeError: mismatched shapes or dtypes, ``silu_mul`` without gated panels (from the kernel).
    """
    return FLOAT_GEMV_KERNELS.ops.gemm_panels(x, panels, out_features, gated, bias, residual, silu_mul)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``[S, V] -> [S]`` int64: index of the first maximum of each row (a NaN counts as the maximum)."""
    if logits.dim() == 2 and logits.stride(1) == 1 and _native(logits):
        return KERNELS.ops.argmax(logits)
    return logits.max(dim=-1).indices  # the first maximum too, and on CPU ~4x faster than argmax


#: bf16's unit roundoff (8 significant bits, round to nearest).
BF16_UNIT_ROUNDOFF = 2.0**-8
#: An absolute term added to ``screen_logits``' bound (covers values flushed to zero by bf16 units).
SCREEN_BOUND_FLOOR = 1e-6


def screen_bound_coefficients(hidden_size: int) -> tuple[float, float]:
    """``(rel, out)`` of ``screen_logits``' bound ``|exact_v - a_v| <= rel * |x| |w_v| + out * |a_v|``.

    ``a_v`` sums the products of ``x`` and ``w_v`` rounded to bf16 (each product off by at most ``2u + u^2`` of
    ``|x_i w_vi|``, ``u`` bf16's unit roundoff) in float32 and rounds the sum to bf16 (``u`` of it, ``2u`` for an
    output truncated instead of rounded); the float32 reference sums ``x_i w_vi`` in another order. Each float32
    sum of ``H`` terms is off by at most ``gamma_H = H 2^-24 / (1 - H 2^-24)`` of ``sum |x_i w_vi|``, which is at
    most ``|x| |w_v|`` (Cauchy-Schwarz); counted twice for each, with a 5% margin on the whole."""
    u = BF16_UNIT_ROUNDOFF
    gamma = hidden_size * 2.0**-24 / (1 - hidden_size * 2.0**-24)
    return 1.05 * (2 * u + u * u + 4 * gamma * (1 + 2 * u)), 1.05 * 2 * u


def screen_logits(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, weight_norms: torch.Tensor
) -> torch.Tensor:
    """The greedy pick of a float32 lm head, read from the same head run on bf16 copies of its operands.

    A float32 lm head reads 4 bytes a weight (113 MB for SmolLM2's 49,152 x 576) and runs at float32 speed; its
    bf16 copy reads half and runs on the CPU's bf16 units. Every screened entry lies within a bound of its
    float32 value (``screen_bound_coefficients``), so only the entries whose upper bound reaches the largest lower
    bound of their row can be the float32 argmax: those are recomputed in float32 and the first of the largest is
    made the row's unique maximum, in place. Greedy rows read nothing else; sampling and logprobs take the float32
    head.

    Args:
        logits: ``[S, V]`` bf16, the head's output for ``hidden`` and ``weight`` rounded to bf16 (no bias);
            ``-inf`` entries (masked tokens) are never picked.
        hidden: ``[S, H]`` float32 head input.
        weight: ``[V, H]`` float32 head weight.
        weight_norms: ``[V]`` float32 Euclidean norms of ``weight``'s rows.

    Returns:
        ``logits``, whose argmax per row is the float32 head's (the first of its maxima).
    """
    hidden, weight = hidden.contiguous(), weight.contiguous()
    rel, out = screen_bound_coefficients(hidden.shape[1])
    if logits.stride(1) == 1 and _native(logits):
        return KERNELS.ops.screen_logits(logits, hidden, weight, weight_norms, rel, out, SCREEN_BOUND_FLOOR)
    a = logits.float()
    bound = rel * hidden.norm(dim=1, keepdim=True) * weight_norms[None, :] + out * a.abs() + SCREEN_BOUND_FLOOR
    finite = torch.isfinite(a)
    floor = torch.where(finite, a - bound, float("-inf")).amax(dim=1, keepdim=True)
    rows, cols = (finite & (a + bound >= floor)).nonzero(as_tuple=True)
    exact = torch.einsum("nh,nh->n", hidden[rows], weight[cols])
    return _lift_exact_winners(logits, rows, cols, exact)


def _lift_exact_winners(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, exact: torch.Tensor):
    """Raise, in place, each row's first largest ``exact`` value among its candidates ``(rows, cols)`` to the next
    bf16 value above the row's maximum (unless an argmax of the row already picks it); returns ``logits``."""
    if rows.numel() == 0:
        return logits
    best = torch.full((logits.shape[0],), float("-inf")).scatter_reduce(0, rows, exact, "amax")
    is_best = exact == best[rows]
    winner = {}
    for r, c in zip(rows[is_best].tolist(), cols[is_best].tolist()):
        winner.setdefault(r, c)  # the lowest index among exact ties, as the kernel keeps
    for r, c in winner.items():
        top = logits[r].float().max()
        if bool(torch.isfinite(top)) and int(logits[r].max(dim=-1).indices) != c:  # the kernels skip inf / NaN rows
            step = torch.exp2(torch.floor(torch.log2(top.abs().clamp_min(torch.finfo(torch.float32).tiny))) - 7)
            logits[r, c] = (top + step).to(logits.dtype)  # a bf16 value above the row's maximum
    return logits


def refine_logits(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, to_float: bool, top_k: int = 0
) -> torch.Tensor:
    """Exact top of bf16 logits: entries within two bf16 steps of a row's maximum recomputed in float32.

    A bf16 GEMM rounds its float32 accumulators to 8 significant bits (0.125 apart near 20), so close
    candidates tie or swap and greedy decoding follows the tie order. The entries that can hold a row's
    true maximum are recomputed as float32 dot products of the same bf16 operands.

    Args:
        logits: ``[S, V]`` bf16, the lm head's output for ``hidden`` (no bias).
        hidden: ``[S, H]`` bf16, its input.
        weight: ``[V, H]`` bf16, its weight.
        to_float: return a float32 ``[S, V]`` copy holding the exact values near each maximum; otherwise
            raise each row's exact winner in place to the next bf16 value above the row's maximum, so an
            argmax picks it (for greedy rows, which read nothing else).
        top_k: with ``to_float``, also recompute every entry that may be among the ``top_k`` largest exact
            values of its row (those within two bf16 steps below a value ``top_k`` entries reach), so the top
            logprobs a request reads hold no rounding ties.

    Returns:
        The float32 copy, or ``logits`` itself.
    """
    hidden, weight = hidden.contiguous(), weight.contiguous()
    if logits.stride(1) == 1 and _native(logits):
        return KERNELS.ops.refine_logits(logits, hidden, weight, to_float, top_k)
    out = logits.float()
    top = out.max(dim=-1, keepdim=True).values

    def bf16_step(x: torch.Tensor) -> torch.Tensor:
        return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(torch.float32).tiny))) - 7)

    step = bf16_step(top)
    threshold = top - 2 * step
    if to_float and top_k > 1:  # the k-th largest rounded value bounds the true top k (the kernel's doubling search
        kth = out.topk(min(top_k, out.shape[-1]), dim=-1).values[:, -1:]  # finds a lower one: a superset)
        threshold = torch.minimum(threshold, kth - 2 * bf16_step(torch.maximum(top.abs(), kth.abs())))
    rows, cols = (out >= threshold).nonzero(as_tuple=True)
    exact = torch.einsum("nh,nh->n", hidden[rows].float(), weight[cols].float())
    if to_float:
        out[rows, cols] = exact
        return out
    return _lift_exact_winners(logits, rows, cols, exact)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[i, t]`` to -inf where bit ``t`` of ``bitmask[i]`` is 0, in place (a set bit allows its token).

    Args:
        logits: ``[R, vocab]`` rows (bf16, fp16 or fp32; any device for the torch path).
        bitmask: ``[R, ceil(vocab / 32)]`` int32 on the CPU, token ``t`` at bit ``t % 32`` of word ``t // 32``
            (llguidance's and xgrammar's layout; a little-endian host).
    """
    if (
        logits.device.type == "cpu"
        and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and logits.dim() == 2
        and logits.stride(1) == 1
        and bitmask.stride(1) == 1
        and KERNELS.available
    ):
        KERNELS.ops.apply_token_bitmask_(logits, bitmask)
        return
    vocab = logits.shape[1]
    # bytes of the inverted words, little-endian, unpacked little bit first: token t is entry t
    words = bitmask.contiguous().numpy().view(np.uint8)
    disallowed = np.unpackbits(np.invert(words), axis=1, bitorder="little")  # [R, W * 32]
    mask = torch.from_numpy(disallowed.view(np.bool_)[:, :vocab])  # [R, vocab]
    logits.masked_fill_(mask.to(logits.device), float("-inf"))


def decode_kernel_built() -> bool:
    """Whether the C++ kernels are built and enabled (builds them on the first call)."""
    return KERNELS.available


def decode_kernel_runs(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention`` runs the C++ kernel for these queries and this cache."""
    return _native(q) and kv_cache.dtype in (q.dtype, torch.int8) and q.shape[-1] <= 256


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    first_block: int = 0,
    sliding_window: int | None = None,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
    group_shared: bool = True,
) -> torch.Tensor | None:
    """Decode attention read in place from the paged cache, or ``None`` where the C++ kernel can't run.

    Args:
        q: ``[D, num_heads, head_dim]``, one query per sequence at position ``seq_lens - 1``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` this layer's K and V in q's dtype, or
            int8 ``[..., head_dim + 2]``: each row's int8 values and float16 scale (``engine.attention.quantize_kv``),
            dequantized as they are read (a score is ``scale * (q . k_int8)``).
        block_tables: ``[D, max_blocks]`` int64 physical blocks of each sequence (from its first block).
        seq_lens: ``[D]`` int64 context lengths (the query's key included).
        first_block: keys before ``first_block * block_size`` are skipped (covered by ``prior``).
        sliding_window: attend to at most this many latest keys.
        prior: ``(out [num_kv_heads, D * g, head_dim] in q's dtype, lse [num_kv_heads, D * g] float32)``
            of the same queries over the skipped keys (``g = num_heads // num_kv_heads``; row ``i * g + j``
            of KV head ``h`` is query head ``h * g + j`` of sequence ``i``: one attention call over a shared
            prefix returns this layout); merged exactly by log-sum-exp (cascade attention).
        group_shared: attend the blocks that several sequences' tables start with once for all of them (up to
            16 query heads a chunk: a prefix of one LoRA adapter's requests, a prefill chunk's rows). A row's
            result then depends on which other rows share its blocks, in the last bits: batch-invariant
            decoding turns it off.

    Returns:
        ``[D, num_heads * head_dim]`` in q's dtype, scaled by ``head_dim ** -0.5``; softmax in float32.
    """
    if not decode_kernel_runs(q, kv_cache):
        return None
    prior_out, prior_lse = prior if prior is not None else (None, None)
    return KERNELS.ops.paged_decode_attention(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        first_block,
        q.shape[-1] ** -0.5,
        sliding_window or 0,
        prior_out,
        prior_lse,
        group_shared,
    )


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor | None:
    """Rotate q and k and store k, v in the cache; ``None`` where the C++ kernel can't run (not bf16 or float32 on
    CPU, or a cache of another dtype).

    Args:
        qkv: ``[N, (num_heads + 2 * num_kv_heads) * head_dim]`` the fused projection's output, bf16 or float32.
        cos, signed_sin: ``[N, head_dim]`` float32 rotary tables at each token's position (``engine.model``:
            ``x * cos + swap_halves(x) * signed_sin`` is Hugging Face's rotary embedding), applied to float32
            copies of q and k and rounded once to ``qkv``'s dtype (``engine.model.rotate``; float32: the same
            three roundings as the torch ops).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` this layer's cache in ``qkv``'s dtype
            (written), or an int8 one (``[..., head_dim + 2]``): the rotated k and the v rows are then quantized as
            ``engine.attention.quantize_kv`` does (the same bytes).
        slot_mapping: ``[N]`` int64 slot ``block * block_size + offset`` of each token (negative: not stored).

    Returns:
        The rotated queries ``[N, num_heads, head_dim]``, bit-identical to ``engine.model.rotate``.
    """
    if kv_cache.dtype not in (qkv.dtype, torch.int8) or not _native(qkv):  # _native: bf16 or float32 on CPU
        return None
    return KERNELS.ops.rope_and_cache(qkv, cos, signed_sin, kv_cache, slot_mapping, num_heads, num_kv_heads)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    task_bounds: torch.Tensor,
    task_slots: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    out_splits: torch.Tensor,
) -> bool:
    """Add the LoRA deltas of one fused layer to ``y`` in place; ``False`` (nothing done) where the C++ kernel
    can't run (not CPU, the dtypes differ, or the kernels are off).

    Args:
        y: ``[N, out]`` the layer's output (changed on the rows listed).
        x: ``[>= N, in]`` its input, in ``y``'s dtype.
        rows: ``[M]`` int64 row indices, grouped by task.
        task_bounds: ``[T + 1]`` int64: task ``t`` holds ``rows[task_bounds[t]:task_bounds[t + 1]]`` (1 to 16 rows,
            all of one slot).
        task_slots: ``[T]`` int64 slot of each task.
        A: ``[S, in, K]`` the slots' stacked ``A^T`` (``engine.lora.SlotStack``), ``B``: ``[S, K, out]`` their
            block-diagonal ``(s B)^T``; module ``j`` of ``n`` owns rank rows ``[j K/n, (j+1) K/n)`` and output
            columns ``out_splits[j]:out_splits[j + 1]``.

    ``x A`` and the delta are float32 and ``y`` is rounded once (the torch path rounds ``x A`` and the delta to
    ``y``'s dtype as well).
    """
    if not (_native(x) and y.dtype == x.dtype == A.dtype == B.dtype):
        return False
    KERNELS.ops.lora_apply(y, x, rows, task_bounds, task_slots, A, B, out_splits)
    return True


def int8_decode_available() -> bool:
    """Whether an INT8 draft's ``decode_layers`` runs: the engine's kernels, the INT8 GEMV and this op are built and
    enabled (``use_cpu_kernels(False)`` or ``engine.quant.int8.weight_only_cpu_kernel(False)`` turn it off too)."""
    return KERNELS.available and weight_only_cpu_kernel() and DECODE_KERNELS.available


def kernel_switches() -> tuple[bool | None, ...]:
    """The state of each of the engine's C++ kernel sets (``use_cpu_kernels`` and the INT8 layers' switches; ``None``:
    not loaded yet), read without loading any."""
    return (KERNELS.state, DECODE_KERNELS.state, FLOAT_GEMV_KERNELS.state, *cpu_kernel_switches())


def decode_layers_available() -> bool:
    """Whether ``decode_layers`` can run: the engine's kernels and this op are built and enabled (each linear's own
    kernel is checked by the caller, ``engine.model.Model.fused_decode_rows``)."""
    return KERNELS.available and DECODE_KERNELS.available


def decode_layers(
    h: torch.Tensor,
    weights: list[torch.Tensor],
    weight_sums: list[torch.Tensor | None],
    scales: list[torch.Tensor | None],
    biases: list[torch.Tensor | None],
    hadamard_blocks: list[int],
    norms: list[torch.Tensor | None],
    kv_cache: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    float_aten: bool = False,
) -> torch.Tensor:
    """Every decoder layer of a decode step of a few tokens in one C++ call.

    The ops, arguments and order of ``engine.model.Model.forward`` for such a step (RMSNorm, each linear on the
    kernel it runs at that row count with its residual-add or SwiGLU epilogue, ``rope_and_cache``,
    ``paged_decode_attention``), so the same bits; the Python and op dispatch between them are what it saves.

    Args:
        h: ``[N, hidden]`` embeddings in the model dtype (bf16 or float32), ``1 <= N <= 8``.
        weights, weight_sums, scales, biases, hadamard_blocks: per layer ``qkv, o, [gate; up], down``
            (``4 * num_layers`` each): a ``w8a8`` linear has its int8 ``[out, in]`` weight, int32 row sums,
            float32 scales, bias and input Hadamard block (0: none; ``lmforge_int8::w8a8_gemv``); a weight-only
            INT8 one its weight, ``None``, scales, bias, 0 (``weight_only_mm``); a float one its plain weight,
            ``None``, ``None``, bias, 0 (``float_gemv``; with ``float_aten`` ``F.linear`` and the add or SwiGLU as
            torch ops: the unpacked path of an INT8 draft's float-kept layers).
        norms: per layer the input and post-attention RMSNorm weights (``[hidden]`` or ``None``).
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` in h's dtype, or int8 ``[...,
            head_dim + 2]`` (written).
        cos, signed_sin: ``[N, head_dim]`` float32 rotary tables at the tokens' positions.
        slot_mapping: ``[N]`` int64 cache slot of each token.
        block_tables: ``[N, max_blocks]`` int64 block table of each token's sequence.
        seq_lens: ``[N]`` int64 each token's position + 1.

    Returns:
        ``[N, hidden]`` hidden states after the last layer (before the final norm), in h's dtype.
    """
    return DECODE_KERNELS.ops.decode_layers(
        h,
        weights,
        weight_sums,
        scales,
        biases,
        hadamard_blocks,
        norms,
        kv_cache,
        cos,
        signed_sin,
        slot_mapping,
        block_tables,
        seq_lens,
        num_heads,
        num_kv_heads,
        eps,
        float_aten,
    )
