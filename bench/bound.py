"""Compute bound of a generation workload and the summary statistics the benchmarks print.

The bound is a roofline-style ceiling (Williams et al. 2009, "Roofline: an insightful visual
performance model"; the FLOP count follows Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", Table 1: 2 FLOPs per weight per token plus attention over the context): total useful
FLOPs of the workload divided by the peak matmul rate measured on this machine. It ignores
memory bandwidth, so the true ceiling can be lower; it is the figure an ideal engine would hit if
every FLOP ran at matmul peak.

Useful FLOPs, with a shared prefix computed once per distinct system prompt:

* every prompt token that is not part of an already computed shared prefix goes through every
  transformer layer once (projections, MLP, attention over its context);
* every output token but the last of each request is fed back through the layers (decode);
* the LM head runs once per output token (at the last prompt position and at each decode step).
"""

from __future__ import annotations

import time
import warnings

import torch

from engine.checkpoint.model_spec import ModelSpec


def _span_flops(shape: ModelSpec, start: int, stop: int) -> int:
    """Body FLOPs of the tokens at positions ``start .. stop-1`` (closed form of the sum)."""
    n = stop - start
    if n <= 0:
        return 0
    q_dim = shape.num_attention_heads * shape.head_dim
    linear = 2 * shape.layer_matmul_params * n
    context_sum = (start + 1 + stop) * n // 2  # sum of (position + 1) over the span
    return shape.num_hidden_layers * (linear + 4 * q_dim * context_sum)


def workload_flops(
    shape: ModelSpec, prompt_lens: list[int], max_tokens: int, shared_prefix_lens: list[int], system_of: list[int]
) -> int:
    """Useful FLOPs of a greedy generation workload with each shared prefix computed once.

    Args:
        shape: the model dimensions.
        prompt_lens: prompt length of each request (tokens).
        max_tokens: output tokens per request (all requests run to ``max_tokens``).
        shared_prefix_lens: per system prompt, the tokens shared by all its requests.
        system_of: per request, the index into ``shared_prefix_lens``.

    Raises:
        ValueError: lengths disagree or a shared prefix is longer than a prompt.
    """
    if len(prompt_lens) != len(system_of):
        raise ValueError(f"prompt_lens has {len(prompt_lens)} entries but system_of has {len(system_of)}")
    total = sum(_span_flops(shape, 0, n) for n in shared_prefix_lens)
    for prompt_len, system in zip(prompt_lens, system_of):
        shared = shared_prefix_lens[system]
        if shared > prompt_len:
            raise ValueError(f"shared prefix {shared} is longer than a prompt of {prompt_len} tokens")
        total += _span_flops(shape, shared, prompt_len)  # distinct prompt suffix
        total += _span_flops(shape, prompt_len, prompt_len + max_tokens - 1)  # decode feeds
        total += max_tokens * shape.lm_head_flops
    return total


#: Matmul dtypes whose peak is measured, as configurations name them.
MATMUL_DTYPES = ("fp32", "bf16", "int8")


def _matmul_kernels(dtype: str, size: int) -> list:
    """Zero-argument callables, each one ``size x size @ size x size`` product in ``dtype``.

    * ``fp32`` / ``bf16``: ``torch.matmul`` (oneDNN; AMX or AVX-512 BF16 for bf16 where present).
    * ``int8``: ``torch._int_mm`` (int8 x int8 -> int32) and ``quantized::linear_dynamic`` on
      the default quantized engine (the kernel behind ``torch.ao`` dynamic INT8 linears, which
      also quantizes its fp32 input); the peak is the faster of the two.

    Raises:
        ValueError: ``dtype`` is not one of :data:`MATMUL_DTYPES`.
    """
    if dtype == "fp32" or dtype == "bf16":
        torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
        a, b = torch.randn(size, size, dtype=torch_dtype), torch.randn(size, size, dtype=torch_dtype)
        out = torch.empty(size, size, dtype=torch_dtype)
        return [lambda: torch.matmul(a, b, out=out)]
    if dtype == "int8":
        a8 = torch.randint(-128, 128, (size, size), dtype=torch.int8)
        b8 = torch.randint(-128, 128, (size, size), dtype=torch.int8)
        x = torch.randn(size, size)
        with warnings.catch_warnings():  # quantized tensors are deprecated, but still the kernel torch.ao runs
            warnings.simplefilter("ignore")
            weight = torch.quantize_per_tensor(torch.randn(size, size), 0.05, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(weight, None)
        return [lambda: torch._int_mm(a8, b8), lambda: torch.ops.quantized.linear_dynamic(x, packed)]
    raise ValueError(f"dtype={dtype!r}; choose one of {', '.join(MATMUL_DTYPES)}")


def measure_matmul_gflops(size: int = 1024, min_time_s: float = 1.0, repeats: int = 5, dtype: str = "fp32") -> float:
    """Peak ``dtype`` matmul rate of this machine, GFLOP/s (best of ``repeats`` timings).

    Each timing runs ``size x size @ size x size`` products (see :func:`_matmul_kernels`) for at
    least ``min_time_s`` seconds with the current ``torch.get_num_threads()``; the best timing
    is reported, because other processes on the machine can only slow a timing down.

    Raises:
        ValueError: unknown ``dtype``.
    """
    flops = 2.0 * size**3
    best = 0.0
    for kernel in _matmul_kernels(dtype, size):
        for _ in range(3):
            kernel()  # warm-up
        for _ in range(repeats):
            count, start = 0, time.perf_counter()
            while True:
                kernel()
                count += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_time_s or count >= 10_000:
                    break
            best = max(best, flops * count / elapsed / 1e9)
    return best


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def target_result(value: float | None, target: str) -> str:
    """``met`` / ``MISSED`` of a measured figure against a target such as ``">= 1.5"``; ``n/a`` without one."""
    if value is None:
        return "n/a"
    op, limit = target.split()
    return "met" if (value >= float(limit) if op == ">=" else value <= float(limit)) else "MISSED"
