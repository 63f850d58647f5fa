"""What this machine can run: CPU feature flags (``/proc/cpuinfo``), oneDNN's bf16 support, compiler flags.

Every choice of a kernel path (AMX, AVX-512 VNNI, oneDNN, plain torch) and of the default dtype reads
these functions, so the detection lives in one place.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """Feature flags of the first CPU in ``cpuinfo`` (empty where the file does not exist)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``vendor_id`` of the first CPU in ``cpuinfo`` ("GenuineIntel", "AuthenticAMD", ...; "" where unknown)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8")
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def mkl_gemv_fast() -> bool:
    """Whether one row of an fp32 ``F.linear`` (MKL's GEMV) streams the weight faster than oneDNN's packed GEMM:
    on Intel CPUs, where MKL runs its own fastest kernels (one request decoding alone: 27.1 vs 20.3 tok/s on a
    Xeon with AMX); on AMD EPYC it took twice as long (docs/engine.md)."""
    return cpu_vendor() == "GenuineIntel"


def float_gemv_fast() -> bool:
    """Whether the engine's float GEMV (``engine.cpu_ops.float_gemv``) streams a decode step's weights faster than
    oneDNN's packed GEMM: on AMD CPUs with AVX-512, where a step's linears at one row took 15.4 vs 19.4 ms in fp32 and
    7.6 vs 16.3 in bf16 (2-core AMD EPYC, ``engine.model.FLOAT_GEMV_ROWS``), and with AVX2 + FMA only, where one fp32
    request alone decoded at 30.9 against 61.9 ms a token (2-core AVX2-only AMD EPYC, alternated in one process);
    Intel CPUs keep oneDNN (and MKL's fp32 GEMV), not yet measured against it."""
    flags = cpu_flags()
    return cpu_vendor() == "AuthenticAMD" and ("avx512f" in flags or {"avx2", "fma"} <= flags)


def float_panels_fast() -> bool:
    """Whether fp32 linears of 4 or more rows run the engine's panel GEMM (``engine.cpu_ops.float_gemm_panels``)
    instead of oneDNN's packed GEMM: on AMD CPUs with AVX2 + FMA and no AVX-512, where a decode step's SmolLM2-135M
    layer linears took 38 / 39 / 56 / 164 against 70 / 71 / 80 / 192 ms at 4 / 8 / 16 / 64 rows and the same at 160
    and 512 (2-core AVX2-only AMD EPYC, 2 threads; docs/engine.md). oneDNN's AVX-512 kernels are not measured
    against it."""
    flags = cpu_flags()
    return cpu_vendor() == "AuthenticAMD" and {"avx2", "fma"} <= flags and "avx512f" not in flags


def onednn_bf16_supported() -> bool:
    """Whether this CPU runs oneDNN's bf16 kernels (packed weights, ``mkldnn._linear_pointwise``).

    oneDNN refuses bf16 without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (``_reorder_linear_weight``
    raises "bf16 path needs the cpu support ..."); there bf16 linears run ``F.linear`` on the plain
    weight.
    """
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_dot_products() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX-BF16) and oneDNN runs its bf16 kernels:
    a bf16 GEMM there runs at several times float32's speed, where elsewhere it is emulated in float32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and onednn_bf16_supported()


def vector_cflags() -> tuple[str, ...]:
    """Flags for kernels whose float sums may be reassociated (not bit-identical to ATen).

    ``-ffp-contract=fast`` lets ``a * b + c`` be one fused multiply-add (ISO C++ mode turns that off),
    and the reassociation flags let float sums and maxima run as vector reductions (IEEE special
    values still behave: no ``-ffinite-math-only``); with AVX-512, 16-float vectors fill one zmm.
    """
    flags = (
        "-O3",
        "-march=native",
        "-ffp-contract=fast",
        "-fassociative-math",
        "-fno-signed-zeros",
        "-fno-trapping-math",
        "-fno-math-errno",
    )
    return flags + (("-mprefer-vector-width=512",) if "avx512f" in cpu_flags() else ())


#: CPU flags of int8 dot-product instructions that sum int8 x int8 products without saturating.
EXACT_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache  # asked on every W8A8Linear forward: read /proc/cpuinfo once
def exact_int8_gemm_cpu() -> bool:
    """Whether oneDNN's int8 GEMM (``onednn::qlinear_pointwise``) is exact on this CPU: it has VNNI or AMX-INT8.

    Without them oneDNN multiplies with ``vpmaddubsw`` (u8 x s8 pairs summed into saturating int16):
    measured on an AVX2-only AMD EPYC, s8 activations of [-127, 127] against a [1536, 576] int8 weight
    gave int32 sums off by up to 1.4e5 (of sums up to ~1e6). There ``W8A8Linear`` sums the same
    products with an fp32 GEMM (``W8A8Linear._float_gemm_forward``).
    """
    flags = cpu_flags()
    return any(f in flags for f in EXACT_INT8_FLAGS)


def cpu_int8_flags() -> list[str]:
    """The int8 / bf16 matrix instruction sets this CPU reports in /proc/cpuinfo (Linux)."""
    flags = cpu_flags()
    return [f for f in ("avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in flags]


#: glibc ``mallopt`` parameters (``<malloc.h>``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Allocations below this many bytes come from malloc's heap instead of a fresh ``mmap`` each (glibc's largest
#: allowed threshold on 64-bit: half its 64 MiB per-thread heap).
HEAP_ALLOCATION_MAX_BYTES = 32 << 20
#: Free memory at the top of malloc's heap goes back to the kernel only past this many bytes.
HEAP_TRIM_THRESHOLD_BYTES = 256 << 20
#: Environment variables that tune glibc's malloc: when one is set, the user's choice stands.
GLIBC_MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def reuse_freed_tensor_memory() -> bool:
    """Keep freed CPU tensor memory in malloc's heap for the next engine step instead of unmapping it.

    A step allocates and frees float32 tensors of several MB (an LM head's output at 64 rows is 12.6 MB);
    glibc's malloc serves some of them with a fresh ``mmap`` and gives memory back on free, so the next step
    faults the same pages in again, zero-filled by the kernel one 4 KiB page at a time: ten calls of an INT8 LM
    head of 64 rows took 61,000-153,000 page faults, and none with the heap kept (``mallopt(3)``; the same
    reason CPU serving stacks preload tcmalloc or jemalloc). Sets ``M_MMAP_THRESHOLD`` to
    ``HEAP_ALLOCATION_MAX_BYTES`` and ``M_TRIM_THRESHOLD`` to ``HEAP_TRIM_THRESHOLD_BYTES``, once per process: the
    peak resident memory is unchanged, and up to the trim threshold of freed memory stays mapped between steps.

    Returns:
        Whether both were set: False off Linux, without glibc, or where the user tunes malloc
        (``GLIBC_MALLOC_ENV``).
    """
    import ctypes
    import os
    import sys

    if not sys.platform.startswith("linux") or any(os.environ.get(name) for name in GLIBC_MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl or another libc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_ALLOCATION_MAX_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD_BYTES)
    )
