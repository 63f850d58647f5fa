"""INT8 linear layers shared by ``lmforge quantize``, ``lmforge evaluate`` and the engine.

Storage (inside ``model.safetensors``): every quantized linear layer ``X`` stores
``X.weight_int8`` (int8, ``[out_features, in_features]``) and ``X.weight_scale`` (float32,
``[out_features]``) in place of ``X.weight``; its bias (if any) and every other tensor stay in
floating point. Dequantized weight = ``weight_int8 * scale[:, None]``. Weights are symmetric per
output channel: ``scale = max|w_row| / 127``, values rounded and clamped to [-127, 127]. The
file's safetensors metadata ``lmforge_int8_scheme`` names how activations are treated
(``SCHEMES``); files written by the former ``dynamic`` method have no such entry and run as
``w8a8`` (their weights are in the same format; activations now get per-token scales). A ``w8a8``
layer may also store ``X.outlier_channels`` (int64 ``[n]``): input channels whose activations get
a per-token scale of their own (``W8A8Linear``); its weights and scales are stored as above. A ``w8a8``
layer whose stored weight was rotated on its input side stores ``X.input_hadamard`` (int64 ``[1]``,
the block size ``b``): its input is multiplied by ``block_hadamard(x, b)`` at run time before the
activations are quantized (``compress.quantize.rotate``).

Schemes (no pickle and no ``torch.ao.nn.quantized``; the kernels are ATen / oneDNN operators and,
for ``w8a8`` on CPU, one C++ op of our own, ``fused_cpu_kernels``):

* ``weight-only``: activations stay in bf16 / fp32. Up to ``WEIGHT_ONLY_MAX_ROWS`` rows (decode)
  run a C++ kernel of our own (``weight_only_cpu_kernel``; ``torch.ops.aten._weight_int8pack_mm``
  where it can't be built), which reads the int8 weights directly (half the bytes of bf16);
  larger batches (prefill, many sequences) convert the int8 weights to the activation dtype
  and run a float GEMM with the scales applied to its output, slower than a bf16 checkpoint
  there (the conversion is paid at every call): ``gemm_microbench`` says so.
* ``w8a8``: activations quantized per token at run time, ``s_x = max|x_row| / 127`` (the
  dynamic per-token scheme of ZeroQuant, Yao et al. 2022), and an int8 x int8 -> int32 GEMM:
  on CPUs with AMX-INT8 our own tile kernels (``amx_cpu_kernel``, ``csrc/w8a8_amx_cpu.cpp``: the
  weights packed once into the tiles' layout, the engine's residual add and SwiGLU fused into the
  output's store), elsewhere ``torch.ops.onednn.qlinear_pointwise`` on CPU (VNNI where the CPU has it;
  activations passed as uint8 ``q + 128`` with zero point 128, the form VNNI's u8 x s8 product takes),
  ``torch._int_mm`` on CUDA. Output = ``acc * s_x * s_w + b``. On CPU the quantization, the
  GEMM call and the scaling run as one op (``csrc/w8a8_cpu.cpp``, bit-identical to the ATen
  ops, which remain the fallback), and ``add`` / ``silu_mul`` as one op with the residual add or
  SwiGLU applied to the float32 accumulators before the one rounding (``w8a8_linear_epilogue``);
  with AVX-512 its row passes run 16 lanes wide (the fused MLP beats packed bf16 with oneDNN post-ops;
  figures in docs/quantization.md). The AMX kernels give the oneDNN path's outputs bit for bit (same
  integers, products in the same order), about twice as fast.

``gemm_microbench`` times these against fp32 and bf16 on given shapes, so ``lmforge quantize``
and the benchmarks can say which variant is fastest on the CPU at hand instead of assuming
INT8 is.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint.store import read_safetensors_header
from engine.native import CSRC, NativeKernels
from engine.platform import cpu_flags, cpu_int8_flags, exact_int8_gemm_cpu, onednn_bf16_supported, vector_cflags

logger = logging.getLogger(__name__)

INT8_WEIGHT_SUFFIX = ".weight_int8"
INT8_SCALE_SUFFIX = ".weight_scale"
#: int64 ``[n]``: input channels of a ``w8a8`` layer quantized with a per-token scale of their own.
OUTLIER_CHANNELS_SUFFIX = ".outlier_channels"
#: int64 ``[1]``: block size of the Hadamard transform a ``w8a8`` layer applies to its input (``W8A8Linear``).
INPUT_HADAMARD_SUFFIX = ".input_hadamard"
#: ``w8a8`` activations reach oneDNN's int8 GEMM as uint8 ``q + 128`` with this zero point (exactly the int8 sums).
ONEDNN_ACTIVATION_ZERO_POINT = 128
SCHEME_METADATA_KEY = "lmforge_int8_scheme"
SCHEMES = ("weight-only", "w8a8")
#: A file with INT8 tensors but no scheme entry was written by the former ``dynamic`` method.
LEGACY_SCHEME = "w8a8"
#: Row count up to which weight-only layers use the int8 kernel (decode); above it, a float GEMM
#: on the int8 weights converted to the activation dtype (exact: |w8| <= 127), scales applied to
#: the output: the int8 kernel wins at decode's few rows and loses past ~16 (docs/quantization.md).
WEIGHT_ONLY_MAX_ROWS = 8

#: ``w8a8`` inputs of at most this many rows run the weight-only kernel on CPUs without AMX-INT8 (see
#: ``W8A8Linear``): oneDNN's int8 GEMM of one row is slower than the packed bf16 GEMV there.
W8A8_GEMV_MAX_ROWS = 4
#: Activation dtypes of the CPU kernels (the few-row GEMVs, ``block_hadamard``).
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a linear weight symmetrically per output channel.

    Args:
        weight: ``[out_features, in_features]`` floating point.

    Returns:
        ``(weight_int8, scale)``: int8 ``[out, in]`` and float32 ``[out]``.

    Raises:
        ValueError: ``weight`` is not 2-D.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    weight_int8 = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return weight_int8, scale


def dequantize_weight(weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight_int8 * scale[:, None]`` as float32 ``[out, in]``."""
    return weight_int8.float() * scale.float()[:, None]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8 activations: ``x [M, K]`` -> ``(int8 [M, K], float32 scale [M, 1])``.

    ``scale = max(max|x_row|, 1e-8) / 127``, ``q = clamp(round(x / scale), -127, 127)`` (round half
    to even), computed in float32. This is the reference; ``fused_cpu_kernels`` runs the same
    arithmetic in one C++ pass on CPU.
    """
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0  # [M, 1]
    return torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8), scale


#: Source of the fused CPU kernels (``lmforge_int8::quantize_per_token`` and ``w8a8_linear``).
FUSED_KERNEL_SOURCE = CSRC / "w8a8_cpu.cpp"
_FUSED = NativeKernels(
    "lmforge_int8", FUSED_KERNEL_SOURCE, "w8a8_linear", ("-O3", "-march=native", "-ffp-contract=off")
)


#: AMX-INT8 GEMMs of ``w8a8`` (``lmforge_int8_amx``): built only where /proc/cpuinfo reports AMX-INT8;
#: -ffp-contract=off keeps the epilogue's products in the oneDNN path's order and rounding.
AMX_KERNEL_SOURCE = CSRC / "w8a8_amx_cpu.cpp"
_AMX = NativeKernels(
    "lmforge_int8_amx",
    AMX_KERNEL_SOURCE,
    "linear_silu_mul",
    ("-O3", "-march=native", "-mamx-tile", "-mamx-int8", "-ffp-contract=off"),
    requires=("amx_tile", "amx_int8", "avx512bw", "avx512vl"),
)
_amx_tiles_granted: bool | None = None  # None: not asked yet


def amx_cpu_kernel(enable: bool | None = None) -> bool:
    """Whether ``W8A8Linear`` runs its CPU GEMMs on the AMX-INT8 kernels of ``AMX_KERNEL_SOURCE``.

    They quantize the activations per token, multiply on AMX tiles (int8 x int8 -> exact int32) against
    weights packed once into the tiles' layout, and scale the accumulators while storing them, with the
    engine's residual add and SwiGLU fused into that store (``W8A8Linear.add`` / ``silu_mul``). Same
    results as the oneDNN path without those epilogues (bit-identical: same integers, same products in
    the same order). Used where the CPU reports ``amx_int8`` and Linux grants the process the tile state
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); elsewhere, and when the build fails, the oneDNN path runs and
    ``amx_cpu_kernel_reason()`` says why.

    Args:
        enable: ``False`` forces the oneDNN path (comparisons), ``True`` re-enables the kernels; ``None``
            leaves the setting as it is.

    Returns:
        True when the AMX kernels are loaded, enabled and allowed to use the tiles.
    """
    global _amx_tiles_granted
    if not _AMX.enable(enable):
        return False
    if _amx_tiles_granted is None:
        _amx_tiles_granted = bool(_AMX.ops.usable())
        if not _amx_tiles_granted:
            _AMX.reason = "the kernel loaded but Linux did not grant the AMX tile state (arch_prctl)"
            logger.warning("lmforge_int8_amx: %s; running the oneDNN path", _AMX.reason)
    return _amx_tiles_granted


def amx_cpu_kernel_reason() -> str:
    """Why the AMX kernels are not in use ("" when they are, or were not tried yet)."""
    return _AMX.reason


def _use_amx() -> bool:
    if _AMX.state is None or (_AMX.state and _amx_tiles_granted is None):
        return amx_cpu_kernel()  # first use: build or load, ask for the tiles
    return bool(_AMX.state and _amx_tiles_granted)


#: Weight-only INT8 products of 1 to ``WEIGHT_ONLY_MAX_ROWS`` rows (``lmforge_int8_gemv::weight_only_mm``).
GEMV_KERNEL_SOURCE = CSRC / "int8_gemv_cpu.cpp"
_GEMV = NativeKernels("lmforge_int8_gemv", GEMV_KERNEL_SOURCE, "weight_only_mm", cflags=vector_cflags())


def weight_only_cpu_kernel(enable: bool | None = None) -> bool:
    """Whether ``Int8WeightOnlyLinear`` decodes (<= ``WEIGHT_ONLY_MAX_ROWS`` rows, CPU) with its C++ kernel.

    The kernel (``GEMV_KERNEL_SOURCE``) reads each int8 weight row once for all rows of the input and
    widens it to float32 in registers, so a decode step reads half the bytes of bf16 at the memory's
    pace; float32 sums, in another order than ``aten._weight_int8pack_mm`` (the fallback). ``False``
    forces the ATen op, ``True`` re-enables the kernel; built on first use like ``fused_cpu_kernels``.
    """
    return _GEMV.enable(enable)


def fused_cpu_kernels(enable: bool | None = None) -> bool:
    """Whether ``W8A8Linear`` runs its CPU forward as one fused C++ op; builds it on first call.

    The kernels (``FUSED_KERNEL_SOURCE``) quantize each row in one pass and apply the per-token
    scale and bias while converting the GEMM's float32 output to the activation dtype, so a layer
    is one op call instead of about a dozen small ATen kernels; the results are bit-identical to
    the ATen path (built with ``-ffp-contract=off``, so no fused multiply-add changes a rounding).
    ``engine.native.NativeKernels`` builds and caches them; without a compiler, or when
    the build fails, the reason is logged once and the ATen path runs.

    Args:
        enable: ``False`` forces the ATen path (for comparisons), ``True`` re-enables the fused
            kernels; ``None`` leaves the setting as it is.

    Returns:
        True when the fused kernels are loaded and enabled.
    """
    return _FUSED.enable(enable)


@functools.cache
def _int8_gemv_cpu() -> bool:
    """Whether ``w8a8_gemv`` sums its int8 products with vector instructions here, read once: AVX512-VNNI's
    u8 x s8 dot product, or AVX2's ``VPMADDUBSW`` on |w| x sign(w) * q (exact; ``csrc/w8a8_cpu.cpp``)."""
    flags = cpu_flags()
    return "avx512_vnni" in flags or "avx2" in flags


@functools.cache
def _int16_gemm_cpu() -> bool:
    """Whether ``W8A8Linear`` sums its int8 products by ``lmforge_int8::w8a8_gemm_i16`` (``VPMADDWD`` on int16 copies
    of q and w: exact) where oneDNN's int8 GEMM is not exact (``exact_int8_gemm_cpu``): CPUs with AVX2, read once."""
    return "avx2" in cpu_flags() and not exact_int8_gemm_cpu()


def _use_fused() -> bool:
    return _FUSED.available


def cpu_kernel_switches() -> tuple[bool | None, ...]:
    """The state of the weight-only GEMV, the fused ``w8a8`` and the AMX kernels (``None``: not loaded yet; reading it
    loads nothing): a caller that caches a choice made from them (``engine.model.Model.fused_decode_rows``) makes it
    again when one changes."""
    return _GEMV.state, _FUSED.state, _AMX.state, _amx_tiles_granted


def fused_cpu_kernels_reason() -> str:
    """Why the fused kernels are not in use ("" when they are, or were not tried yet)."""
    return _FUSED.reason


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sylvester's Hadamard matrix ``[n, n]``: entries +-1, symmetric, ``H @ H.T == n * I``.

    Raises:
        ValueError: ``n`` is not a power of two >= 1.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, got n={n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))  # [[H, H], [H, -H]]
    return h.to(dtype)


@functools.cache
def _hadamard_on(n: int, device: str) -> torch.Tensor:
    return hadamard_matrix(n).to(device)


def check_hadamard_block(block: int, in_features: int) -> int:
    """``block`` as an int when it is a power of two >= 2 that divides ``in_features``.

    Raises:
        ValueError: otherwise (names both values).
    """
    block = int(block)
    if block < 2 or block & (block - 1) or in_features % block:
        raise ValueError(f"input_hadamard={block}: must be a power of two >= 2 that divides in_features={in_features}")
    return block


def block_hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [..., K]`` with every run of ``block`` consecutive elements times ``hadamard_matrix(block)``.

    Same shape and dtype; computed in float32 and rounded once. On CPU (bf16 / fp32) the butterflies
    of the fast Walsh-Hadamard transform run in the fused C++ op (``lmforge_int8::block_hadamard``,
    ``block * log2(block)`` adds per block); elsewhere, and without the op, a float32 matmul with the
    matrix (the same values up to float32 summation order).
    """
    k = x.shape[-1]
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and _use_fused():
        return torch.ops.lmforge_int8.block_hadamard(x.reshape(-1, k), block).reshape(x.shape)
    h = _hadamard_on(block, str(x.device))  # [block, block]
    return (x.reshape(-1, block).float() @ h).to(x.dtype).reshape(x.shape)


class _Int8Linear(nn.Module):
    """Stored INT8 weights ``[out, in]``, float32 per-channel scales ``[out]`` and an optional bias."""

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight_int8", weight_int8.to(torch.int8).contiguous())  # [out, in]
        self.register_buffer("weight_scale", scale.float().contiguous())  # [out]
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @property
    def in_features(self) -> int:
        return self.weight_int8.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight_int8.shape[0]

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``: ``[N, in]``, ``[N, out]`` in x's dtype -> ``[N, out]``."""
        return residual + self(x)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a ``[gate; up]`` layer (SwiGLU): ``[N, in] -> [N, out / 2]``."""
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up


class Int8WeightOnlyLinear(_Int8Linear):
    """``y = x @ (W8 * s)^T + b`` with float activations (``weight-only`` scheme).

    Input ``[..., in_features]`` in fp32 or bf16; output of the same dtype ``[..., out_features]``.
    """

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight_int8, scale, bias)
        self._scales: dict[torch.dtype, torch.Tensor] = {}

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._scales:
            self._scales[dtype] = self.weight_scale.to(dtype)
        return self._scales[dtype]

    def _kernel_runs(self, x2: torch.Tensor) -> bool:
        """Whether the C++ decode kernel takes ``x2`` (``[M, in]``): CPU, bf16 / fp32, ``M <= WEIGHT_ONLY_MAX_ROWS``."""
        return (
            x2.shape[0] <= WEIGHT_ONLY_MAX_ROWS
            and x2.device.type == "cpu"
            and x2.dtype in (torch.bfloat16, torch.float32)
            and _GEMV.available
        )

    def decode_gemv_args(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """``(weight_int8, None, weight_scale, bias, 0)`` for ``engine.cpu_ops.decode_layers`` where inputs of ``rows``
        rows in ``dtype`` run ``weight_only_mm`` here (``forward``, ``add`` and ``silu_mul`` all do), else ``None``."""
        if rows > WEIGHT_ONLY_MAX_ROWS or self.weight_int8.device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES:
            return None
        return (self.weight_int8, None, self.weight_scale, self.bias, 0) if _GEMV.available else None

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` (``[N, in]``, ``[N, out]`` in x's dtype); in the decode kernel's epilogue where it
        runs (the same two roundings)."""
        x2 = x.reshape(-1, x.shape[-1])
        if residual.dtype == x.dtype and residual.shape == (x2.shape[0], self.out_features) and self._kernel_runs(x2):
            return _GEMV.ops.weight_only_mm(x2, self.weight_int8, self.weight_scale, self.bias, residual)
        return residual + self(x)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a ``[gate; up]`` layer (``[N, in] -> [N, out / 2]``); in the decode kernel's
        epilogue where it runs (the roundings of the torch ops; its SiLU's exp may differ from ATen's in the
        last float bit, which rarely moves a bf16 result), so the engine's op-by-op forward and
        ``engine.cpu_ops.decode_layers`` compute the same numbers."""
        x2 = x.reshape(-1, x.shape[-1])
        if self.out_features % 2 == 0 and self._kernel_runs(x2):
            return _GEMV.ops.weight_only_mm(x2, self.weight_int8, self.weight_scale, self.bias, None, True)
        return super().silu_mul(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [M, in]
        cpu_decode = x2.shape[0] <= WEIGHT_ONLY_MAX_ROWS and x2.device.type == "cpu"
        if self._kernel_runs(x2):
            y = _GEMV.ops.weight_only_mm(x2, self.weight_int8, self.weight_scale, self.bias)  # [M, out], bias added
            return y.reshape(*x.shape[:-1], self.out_features)
        if cpu_decode:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight_int8, self._scale(x.dtype))  # [M, out]
        else:
            y = F.linear(x2, self.weight_int8.to(x.dtype)) * self._scale(x.dtype)  # [M, out]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


class W8A8Linear(_Int8Linear):
    """INT8 weights and per-token dynamic INT8 activations (``w8a8`` scheme).

    Input ``[..., in_features]`` (fp32 / bf16); output of the same dtype. CPU with AMX-INT8: the
    kernels of ``amx_cpu_kernel()`` on the weight packed once into the tiles' layout, with ``add``
    (residual) and ``silu_mul`` (SwiGLU, ``[gate; up]`` layers, each half packed alone) fused into
    the store of the output. Other CPUs: oneDNN ``qlinear_pointwise`` on the prepacked weight
    (activation scale 1, so the int32 accumulators come back as float and the per-token and
    per-channel scales are applied after), as one fused op ``lmforge_int8::w8a8_linear`` (and
    ``w8a8_linear_epilogue`` for ``add`` / ``silu_mul``) where ``fused_cpu_kernels()`` built it,
    else as ATen ops (same results; the epilogues there round the GEMM output first); CUDA:
    ``torch._int_mm``. On CPUs without AMX-INT8, inputs of at most ``W8A8_GEMV_MAX_ROWS`` rows (one
    sequence decoding, a short verification) run a GEMV on the plain int8 weight instead: oneDNN's int8
    GEMM of one row is slower than packed bf16 there. With AVX512-VNNI and the fused kernels (and no
    outlier split) that is ``lmforge_int8::w8a8_gemv``, the same quantized activations and int32 sums
    as the oneDNN path, bit for bit, at ~19 GB/s of weights; else the weight-only kernel
    (``weight_only_mm``: the same int8 weights and scales, float activations, so no activation rounding),
    which widens each weight to float and reads ~13 GB/s (a step's 120 layer GEMVs of SmolLM2-135M at one
    row, 2-core AMD EPYC: 5.5 vs 8.8 ms). With AVX2 and no VNNI, whose oneDNN int8 GEMM saturates, wider inputs
    run ``lmforge_int8::w8a8_gemm_i16`` (the same exact int32 sums, by ``VPMADDWD`` on an int16 copy of the
    weight, with the same epilogues; ``_int16_input``).

    ``outlier_channels`` (int64 ``[n]``, optional): input channels whose activations are quantized
    with a per-token scale of their own, ``s2 = max|x_row[outliers]| / 127``, while the other
    channels get ``s1`` over the rest of the row; ``y = (acc1 * s1 + acc2 * s2) * s_w + b``. A few
    channels of large magnitude (the final norm's output feeding the LM head: max |x| 50 against a
    median channel's 3.8) otherwise set every token's scale and round the small channels coarsely.
    The split follows LLM.int8()'s outlier decomposition (Dettmers et al. 2022), but both parts stay
    INT8: on AMX the outlier part is one more 64-wide K block of the same tiles. The weights and
    their per-channel scales are the same as without a split (stored as usual).

    ``input_hadamard`` (block size ``b``, optional): every public call first computes
    ``x' = block_hadamard(x, b)`` (runs of ``b`` input channels times the +-1 Hadamard matrix) and
    runs every path above on ``x'``; the stored weight is the rotated one (``W D H / b``,
    ``compress.quantize.rotate``), so ``x' @ W'^T == x @ W^T``. The transform spreads a channel's
    outlier over its block, so one per-token scale rounds the block's other channels far less
    (QuaRot's online Hadamard before ``down_proj``, Ashkboos et al. 2024).
    """

    def __init__(
        self,
        weight_int8: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        outlier_channels: torch.Tensor | None = None,
        input_hadamard: int | None = None,
    ):
        super().__init__(weight_int8, scale, bias)
        if outlier_channels is not None:
            outlier_channels = check_outlier_channels(outlier_channels, weight_int8.shape[1])
        self.register_buffer("outlier_channels", outlier_channels)
        self.input_hadamard = (
            None if input_hadamard is None else check_hadamard_block(input_hadamard, weight_int8.shape[1])
        )
        self._packed = None  # oneDNN's layout
        self._amx_packed = None  # int8 [ceil(out / 16), ceil(in / 64), 16, 64] (lmforge_int8_amx.pack_weight)
        self._amx_gated = None  # the gate and up halves, each packed alone, concatenated
        self._zero_points = torch.zeros(weight_int8.shape[0], dtype=torch.long)
        self._split = None  # (rest channels [in - n], outlier channels [n]) when outlier_channels is set
        self._parts = None  # the two halves as W8A8Linear layers, for the paths without AMX
        self._weight_float = None  # float32 copy of weight_int8 on CPUs without exact int8 GEMMs or AVX2
        self._packed_i16 = None  # int16 [ceil(out / 16), ceil(in / 2), 16, 2] (lmforge_int8.pack_weight_i16)
        self._weight_sum = None  # int32 [out]: each weight row's sum, for w8a8_gemv's zero point (``_gemv``)
        self._gemv_args = None  # plain references to the buffers ``_gemv`` reads (``_gemv_weights``)

    def _channels(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._split is None:
            keep = torch.ones(self.in_features, dtype=torch.bool)
            keep[self.outlier_channels] = False
            self._split = (keep.nonzero().flatten(), self.outlier_channels)
        return self._split

    def _amx_input(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` as ``[M, in]`` when the AMX kernels take it, else None."""
        if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or not _use_amx():
            return None
        return x.reshape(-1, x.shape[-1])

    def _fused_input(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` as ``[M, in]`` when the fused oneDNN-path ops of ``fused_cpu_kernels()`` take it, else None.

        They need a CPU input in bf16 / fp32, a CPU with exact int8 GEMMs (``exact_int8_gemm_cpu``) and no
        outlier split; the weight is prepacked for oneDNN on first use.
        """
        if (
            x.device.type != "cpu"
            or x.dtype not in (torch.bfloat16, torch.float32)
            or self.outlier_channels is not None
            or not exact_int8_gemm_cpu()
            or not _use_fused()
        ):
            return None
        if self._packed is None:
            self._packed = torch.ops.onednn.qlinear_prepack(self.weight_int8, None)
        return x.reshape(-1, x.shape[-1])

    def _int16_input(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` as ``[M, in]`` when ``lmforge_int8::w8a8_gemm_i16`` takes it (CPU input in bf16 / fp32, the fused
        kernels built, no outlier split, an AVX2 CPU whose oneDNN int8 GEMM is not exact), else None; the weight
        is packed for it on first use (int16, 2x the int8 bytes)."""
        if (
            x.device.type != "cpu"
            or x.dtype not in CPU_KERNEL_DTYPES
            or self.outlier_channels is not None
            or not _int16_gemm_cpu()
            or not _use_fused()
        ):
            return None
        if self._packed_i16 is None:
            self._packed_i16 = torch.ops.lmforge_int8.pack_weight_i16(self.weight_int8)
        return x.reshape(-1, x.shape[-1])

    def _pack(self, weight_int8: torch.Tensor, gated: bool) -> torch.Tensor:
        if not gated:
            return _AMX.ops.pack_weight(weight_int8)
        gate, up = weight_int8.chunk(2)
        return torch.cat((_AMX.ops.pack_weight(gate), _AMX.ops.pack_weight(up)))

    def _amx_weights(self, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed weights: of all channels, or of the rest and of the outlier channels (each packed alone)."""
        cached = self._amx_gated if gated else self._amx_packed
        if cached is None:
            if self.outlier_channels is None:
                cached = (self._pack(self.weight_int8, gated), None)
            else:
                rest, outliers = self._channels()
                cached = (
                    self._pack(self.weight_int8[:, rest].contiguous(), gated),
                    self._pack(self.weight_int8[:, outliers].contiguous(), gated),
                )
            if gated:
                self._amx_gated = cached
            else:
                self._amx_packed = cached
        return cached

    def _amx_args(self, x2: torch.Tensor, gated: bool = False) -> tuple:
        """``(x or its rest channels, packed, outlier channels' x or None, their packed weights or None)``."""
        packed, packed_outlier = self._amx_weights(gated)
        if packed_outlier is None:
            return x2, packed, None, None
        rest, outliers = self._channels()
        return x2.index_select(1, rest), packed, x2.index_select(1, outliers), packed_outlier

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input as its stored weight expects it (``block_hadamard`` where ``input_hadamard`` is set)."""
        return x if self.input_hadamard is None else block_hadamard(x, self.input_hadamard)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` rounded once to x's dtype (AMX, or the fused oneDNN-path op):
        ``[N, in]``, ``[N, out]`` -> ``[N, out]``."""
        x = self._rotate(x)
        if (xg := self._gemv_input(x)) is not None:
            if residual.dtype == x.dtype and residual.shape == (xg.shape[0], self._buffers["weight_int8"].shape[0]):
                return self._gemv(xg, residual=residual)  # the kernel's residual epilogue
            return residual + self._gemv(xg).reshape(residual.shape)
        x2 = self._amx_input(x)
        if x2 is None and residual.dtype == x.dtype and (xi := self._int16_input(x)) is not None:
            residual2 = residual.reshape(-1, self.out_features)
            y = torch.ops.lmforge_int8.w8a8_gemm_i16(xi, self._packed_i16, self.weight_scale, self.bias, residual2)
            return y.reshape(residual.shape)
        if x2 is None and residual.dtype == x.dtype and (xf := self._fused_input(x)) is not None:
            residual2 = residual.reshape(-1, self.out_features)
            y = torch.ops.lmforge_int8.w8a8_linear_epilogue(
                xf, self._packed, self.weight_scale, self._zero_points, self.bias, residual2, False
            )
            return y.reshape(residual.shape)
        if x2 is None or residual.dtype != x.dtype:
            return residual + self._linear(x)
        residual2 = residual.reshape(-1, self.out_features)
        xm, packed, xo, packed_outlier = self._amx_args(x2)
        y = _AMX.ops.linear(xm, packed, self.weight_scale, self.bias, self.out_features, residual2, xo, packed_outlier)
        return y.reshape(residual.shape)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a ``[gate; up]`` layer, in float32 before one rounding (AMX, fused op):
        ``[N, in] -> [N, out / 2]``.

        Raises:
            ValueError: ``out_features`` is odd (not a ``[gate; up]`` layer).
        """
        out_features = self._buffers["weight_int8"].shape[0]
        if out_features % 2:
            raise ValueError(f"silu_mul needs a [gate; up] layer with even out_features, got {out_features}")
        x = self._rotate(x)
        if (xg := self._gemv_input(x)) is not None:
            y = self._gemv(xg, silu_mul=True)  # the kernel's SwiGLU epilogue
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], out_features // 2)
        x2 = self._amx_input(x)
        if x2 is None and (xi := self._int16_input(x)) is not None:
            y = torch.ops.lmforge_int8.w8a8_gemm_i16(xi, self._packed_i16, self.weight_scale, self.bias, None, True)
            return y.reshape(*x.shape[:-1], self.out_features // 2)
        if x2 is None:
            xf = self._fused_input(x)
            if xf is None:
                gate, up = self._linear(x).chunk(2, dim=-1)
                return F.silu(gate) * up
            y = torch.ops.lmforge_int8.w8a8_linear_epilogue(
                xf, self._packed, self.weight_scale, self._zero_points, self.bias, None, True
            )
            return y.reshape(*x.shape[:-1], self.out_features // 2)
        half = self.out_features // 2
        xm, packed, xo, packed_outlier = self._amx_args(x2, gated=True)
        y = _AMX.ops.linear_silu_mul(xm, packed, self.weight_scale, self.bias, half, xo, packed_outlier)
        return y.reshape(*x.shape[:-1], half)

    def decode_gemv_args(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """``(weight_int8, row sums, weight_scale, bias, input Hadamard block or 0)`` for
        ``engine.cpu_ops.decode_layers`` where inputs of ``rows`` rows in ``dtype`` run ``w8a8_gemv`` here (after the
        C++ ``block_hadamard``), else ``None``: the conditions of ``_gemv_input``, ``_gemv`` and ``block_hadamard``."""
        if (
            rows > W8A8_GEMV_MAX_ROWS
            or self.weight_int8.device.type != "cpu"
            or dtype not in CPU_KERNEL_DTYPES
            or _use_amx()
            or not _GEMV.available
            or not (_use_fused() and _int8_gemv_cpu())
        ):
            return None
        weight, weight_sum, scale, bias = self._gemv_weights()
        if weight_sum is None:  # outlier channels: the weight-only kernel runs instead
            return None
        return weight, weight_sum, scale, bias, self.input_hadamard or 0

    def _gemv_input(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` as ``[M, in]`` when it runs the weight-only kernel (few rows, CPU without AMX), else None."""
        if (
            x.device.type != "cpu"
            or x.dtype not in (torch.bfloat16, torch.float32)
            or x.numel() > W8A8_GEMV_MAX_ROWS * x.shape[-1]
            or _use_amx()
            or not _GEMV.available
        ):
            return None
        return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])

    def _gemv_weights(self) -> tuple:
        """``(weight_int8, its row sums or None, weight_scale, bias)`` as plain references, made again
        when the buffers were replaced: a decode step calls ``_gemv`` 120 times, and each buffer read through
        ``nn.Module.__getattr__`` cost ~0.7 us of a ~7 us kernel call (SmolLM2-135M's o projection)."""
        buffers = self._buffers
        weight, scale, bias = buffers["weight_int8"], buffers["weight_scale"], buffers["bias"]
        args = self._gemv_args
        if args is None or args[0] is not weight or args[2] is not scale or args[3] is not bias:
            self._weight_sum = None if buffers["outlier_channels"] is not None else weight.sum(1, dtype=torch.int32)
            args = (weight, self._weight_sum, scale, bias)
            self._gemv_args = args
        return args

    def _gemv(self, x2: torch.Tensor, residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
        """``[M, in] -> [M, out]`` (``[M, out / 2]`` with ``silu_mul``; ``residual [M, out]`` added) on the plain int8
        weight: ``w8a8_gemv`` (the oneDNN path's numbers) where it runs (no outlier channels, VNNI), else the
        weight-only kernel (float activations; its epilogues round ``y`` first, as the separate torch ops do)."""
        weight, weight_sum, scale, bias = self._gemv_weights()
        if weight_sum is not None and _use_fused() and _int8_gemv_cpu():
            return _FUSED.ops.w8a8_gemv(x2, weight, weight_sum, scale, bias, residual, silu_mul)
        return _GEMV.ops.weight_only_mm(x2, weight, scale, bias, residual, silu_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(self._rotate(x))

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` of an input already rotated (``_rotate``): ``[..., in] -> [..., out]`` in x's dtype."""
        if (xg := self._gemv_input(x)) is not None:
            y = self._gemv(xg)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
        x2 = self._amx_input(x)
        if x2 is not None:
            xm, packed, xo, packed_outlier = self._amx_args(x2)
            y = _AMX.ops.linear(xm, packed, self.weight_scale, self.bias, self.out_features, None, xo, packed_outlier)
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.outlier_channels is not None:
            return self._split_forward(x)
        if (x2 := self._int16_input(x)) is not None:
            y = torch.ops.lmforge_int8.w8a8_gemm_i16(x2, self._packed_i16, self.weight_scale, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        if (x2 := self._fused_input(x)) is not None:
            y = torch.ops.lmforge_int8.w8a8_linear(x2, self._packed, self.weight_scale, self._zero_points, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        x2 = x.reshape(-1, x.shape[-1])  # [M, in]
        if x2.device.type == "cpu" and not exact_int8_gemm_cpu():
            return self._float_gemm_forward(x2).reshape(*x.shape[:-1], self.out_features)
        if x2.device.type == "cpu" and self._packed is None:
            self._packed = torch.ops.onednn.qlinear_prepack(self.weight_int8, None)
        xq, x_scale = quantize_per_token(x2)  # int8 [M, in], [M, 1]
        if x2.device.type == "cpu":
            # uint8 xq + 128 with zero point 128: the same sums; oneDNN 3.12 runs int8 activations on its
            # reference kernel on an AVX-512 VNNI CPU without AMX (~4000x slower; VNNI multiplies u8 x s8)
            acc = torch.ops.onednn.qlinear_pointwise(
                (xq.to(torch.int16) + ONEDNN_ACTIVATION_ZERO_POINT).to(torch.uint8),
                1.0,
                ONEDNN_ACTIVATION_ZERO_POINT,
                self._packed,
                self.weight_scale,
                self._zero_points,
                None,
                1.0,
                0,
                torch.float32,
                "none",
                [],
                "",
            )  # [M, out] = sum_k xq * w8 * s_w
            y = acc * x_scale
        else:
            rows = x2.shape[0]
            pad = max(0, 17 - rows)  # torch._int_mm on CUDA needs more than 16 rows
            acc = torch._int_mm(F.pad(xq, (0, 0, 0, pad)), self.weight_int8.t())[:rows]  # int32 [M, out]
            y = acc.float() * x_scale * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _float_gemm_forward(self, x2: torch.Tensor) -> torch.Tensor:
        """The ``w8a8`` arithmetic with the int8 x int8 products summed by an fp32 GEMM (CPUs without
        VNNI or AMX, ``exact_int8_gemm_cpu``): ``[M, in] -> [M, out]`` in x's dtype.

        Each product is exact in float32 and so is every partial sum below 2^24 (``in`` x 127 x 127 is
        9.3e6 at ``in = 576``); past that a sum rounds like any fp32 accumulation. The weight is kept
        once as float32 (4x the int8 bytes): it runs at the fp32 GEMM's speed, no faster.
        """
        if self._weight_float is None:
            self._weight_float = self.weight_int8.float()  # [out, in]
        xq, x_scale = quantize_per_token(x2)  # int8 [M, in], [M, 1]
        # acc * s_w, then * s_x: the order of the oneDNN path and of w8a8_gemv, so a decode step agrees bit for bit
        y = F.linear(xq.float(), self._weight_float) * self.weight_scale * x_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x2.dtype)

    def _split_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The outlier split without AMX: the two parts as plain ``W8A8Linear`` layers in float32, summed."""
        rest, outliers = self._channels()
        if self._parts is None or self._parts[0].weight_int8.device != x.device:
            device = x.device
            self._parts = (
                W8A8Linear(self.weight_int8[:, rest], self.weight_scale, self.bias).to(device),
                W8A8Linear(self.weight_int8[:, outliers], self.weight_scale).to(device),
            )
        xf = x.float()
        y = self._parts[0](xf.index_select(-1, rest.to(x.device))) + self._parts[1](
            xf.index_select(-1, outliers.to(x.device))
        )
        return y.to(x.dtype)


def check_outlier_channels(channels: torch.Tensor, in_features: int) -> torch.Tensor:
    """``channels`` as a sorted int64 ``[n]`` vector of distinct input channels, 0 < n < in_features.

    Raises:
        ValueError: not 1-D integers, repeated, out of range, empty, or every channel.
    """
    if channels.dim() != 1 or channels.is_floating_point() or channels.dtype == torch.bool:
        raise ValueError(f"outlier_channels must be a 1-D integer tensor, got {channels.dtype} {tuple(channels.shape)}")
    channels = channels.to(torch.long).sort().values
    n = channels.numel()
    if not 0 < n < in_features or int(channels[0]) < 0 or int(channels[-1]) >= in_features:
        raise ValueError(
            f"outlier_channels must hold 1 to {in_features - 1} input channels in [0, {in_features}), got {n} "
            f"in [{int(channels[0]) if n else '-'}, {int(channels[-1]) if n else '-'}]"
        )
    if bool((channels[1:] == channels[:-1]).any()):
        raise ValueError("outlier_channels holds a channel twice")
    return channels


#: scheme -> runtime layer class.
LAYERS: dict[str, type[nn.Module]] = {"weight-only": Int8WeightOnlyLinear, "w8a8": W8A8Linear}


def int8_linear(
    scheme: str,
    weight_int8: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    outlier_channels: torch.Tensor | None = None,
    input_hadamard: torch.Tensor | int | None = None,
) -> nn.Module:
    """The runtime layer of ``scheme`` from stored INT8 weights (no re-quantization).

    Args:
        scheme: one of ``SCHEMES``.
        weight_int8: int8 ``[out_features, in_features]``; scale: float ``[out_features]``;
            bias: optional float ``[out_features]``.
        outlier_channels: int64 ``[n]`` input channels with an activation scale of their own
            (``W8A8Linear``; ``w8a8`` only).
        input_hadamard: block size of the input's Hadamard transform, or its stored int64 ``[1]``
            tensor (``W8A8Linear``; ``w8a8`` only).

    Raises:
        ValueError: unknown scheme, outlier channels or an input rotation on a scheme without
            activation quantization, or bad values (``check_outlier_channels``, ``check_hadamard_block``).
    """
    if scheme not in LAYERS:
        raise ValueError(f"INT8 scheme {scheme!r} is not supported; use one of {list(SCHEMES)}")
    if isinstance(input_hadamard, torch.Tensor):
        if input_hadamard.numel() != 1 or input_hadamard.is_floating_point():
            raise ValueError(f"input_hadamard must be one integer (the block size), got {input_hadamard.tolist()}")
        input_hadamard = int(input_hadamard.item())
    if outlier_channels is not None or input_hadamard is not None:
        if scheme != "w8a8":
            raise ValueError(f"outlier channels and input rotations apply to the w8a8 scheme only, not {scheme!r}")
        return W8A8Linear(weight_int8, scale, bias, outlier_channels, input_hadamard)
    return LAYERS[scheme](weight_int8, scale, bias)


def read_scheme(files: Iterable[str | Path]) -> str | None:
    """The INT8 scheme of a checkpoint's safetensors files (metadata ``lmforge_int8_scheme``).

    Returns ``None`` when no file holds INT8 tensors, ``LEGACY_SCHEME`` for a former ``dynamic``
    checkpoint (INT8 tensors, no metadata).

    Raises:
        ValueError: a scheme outside ``SCHEMES`` (names the file and the fix).
    """
    scheme, has_int8 = None, False
    for file in files:
        header = read_safetensors_header(file)
        has_int8 = has_int8 or any(name.endswith(INT8_WEIGHT_SUFFIX) for name in header)
        found = (header.get("__metadata__") or {}).get(SCHEME_METADATA_KEY)
        if found is not None:
            if found not in SCHEMES:
                raise ValueError(
                    f"{file}: {SCHEME_METADATA_KEY}={found!r} is not one of {list(SCHEMES)}; re-create it with "
                    "`lmforge quantize`"
                )
            scheme = found
    if not has_int8:
        return None
    return scheme or LEGACY_SCHEME


def scheme_metadata(scheme: str) -> dict[str, str]:
    """Safetensors metadata recording ``scheme`` (``save_file(..., metadata=...)``)."""
    if scheme not in SCHEMES:
        raise ValueError(f"INT8 scheme {scheme!r} is not supported; use one of {list(SCHEMES)}")
    return {SCHEME_METADATA_KEY: scheme}


# --------------------------------------------------------------------------------------------
# Which variant is fastest here
# --------------------------------------------------------------------------------------------


def _best_us(fn, repeats: int, number: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def gemm_microbench(
    shapes: Iterable[tuple[int, int]],
    *,
    rows: Iterable[int] = (1, 64),
    threads: int | None = None,
    repeats: int = 5,
    number: int = 5,
    torchao: bool = False,
) -> dict[str, dict[str, float]]:
    """Time one forward of every linear shape per variant, random weights, on the CPU.

    Args:
        shapes: ``(out_features, in_features, count)`` of the layers of one model (e.g. a
            decoder layer's fused qkv, o, gate_up, down times the number of layers, and the LM
            head once); each figure is weighted by ``count``.
        rows: activation rows ``M`` (1 = one decoding sequence, 64 = a batch).
            ``bf16`` is the engine's CPU path (weights packed for oneDNN), ``w8a8`` the fused
            kernels where they build (``format_microbench`` says which ran).
        threads: ``torch.set_num_threads`` for the measurement (restored after).
        repeats / number: each figure is the best of ``repeats`` means over ``number`` calls
            (the least disturbed by other processes).
        torchao: also time torchao's ``Int8WeightOnlyConfig`` and
            ``Int8DynamicActivationInt8WeightConfig`` (eager) on the same layers.

    Returns:
        ``{"M=1": {"fp32": us, "bf16": us, "int8-weight-only": us, "w8a8": us, ...}, ...}``:
        microseconds for all shapes together.
    """
    shapes = list(shapes)
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    try:
        layers = []
        for out_features, in_features, count in shapes:
            w = torch.randn(out_features, in_features, generator=generator) * 0.05
            w8, s = quantize_weight_per_channel(w)
            variants = {
                "fp32": (lambda x, w=w: F.linear(x, w), torch.float32),
                "bf16": (_bf16_linear(w), torch.bfloat16),
                "int8-weight-only": (Int8WeightOnlyLinear(w8, s), torch.bfloat16),
                "int8-weight-only-fp32": (Int8WeightOnlyLinear(w8, s), torch.float32),
                "w8a8": (W8A8Linear(w8, s), torch.bfloat16),
            }
            if torchao:
                variants.update(_torchao_variants(w))
            layers.append((in_features, count, variants))
        with torch.no_grad():
            for m in rows:
                totals: dict[str, float] = {}
                for in_features, count, variants in layers:
                    for name, (fn, dtype) in variants.items():
                        x = torch.randn(m, in_features, generator=generator).to(dtype)
                        totals[name] = totals.get(name, 0.0) + count * _best_us(lambda: fn(x), repeats, number)
                results[f"M={m}"] = {k: round(v, 1) for k, v in totals.items()}
    finally:
        torch.set_num_threads(previous)
    return results


def _bf16_linear(w: torch.Tensor):
    """The bf16 linear as the engine runs it on CPU: the weight packed once into oneDNN's blocked
    layout (AMX where the CPU has it), else (no oneDNN bf16 on this CPU) ``F.linear`` on the plain bf16 weight."""
    wb = w.bfloat16()
    if not onednn_bf16_supported():
        return lambda x: F.linear(x, wb)
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, 64)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _torchao_variants(w: torch.Tensor) -> dict:
    # here, not at the top: every command loads this module and torchao takes seconds to import
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    out = {}
    for name, config, dtype in (
        ("torchao-weight-only", Int8WeightOnlyConfig(), torch.bfloat16),
        ("torchao-w8a8", Int8DynamicActivationInt8WeightConfig(), torch.float32),
    ):
        layer = nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
        layer.weight.data = w.to(dtype)
        quantize_(layer, config)
        out[name] = (layer, dtype)
    return out


def format_microbench(results: dict[str, dict[str, float]]) -> str:
    """One line per row count: microseconds per variant and the fastest, plus the CPU flags."""
    flags = cpu_int8_flags()
    if _AMX.state and _amx_tiles_granted:
        kernel = "AMX-INT8 kernels"
    elif _FUSED.state:
        kernel = f"fused C++ op over oneDNN (AMX kernels: {amx_cpu_kernel_reason() or 'not tried'})"
    else:
        kernel = f"ATen ops ({fused_cpu_kernels_reason() or 'fused kernels not tried'})"
    flag_text = ", ".join(flags) or "no VNNI / AMX / AVX-512 BF16"
    lines = [f"GEMM microbench (CPU flags: {flag_text}; w8a8 on CPU: {kernel}):"]
    for rows, times in results.items():
        fastest = min(times, key=times.get)
        cells = "  ".join(f"{k} {v / 1000:.2f} ms" for k, v in times.items())
        lines.append(f"  {rows:<5} {cells}  -> fastest: {fastest} ({times['bf16'] / times[fastest]:.2f}x bf16)")
    return "\n".join(lines)


def model_linear_shapes(config_path: str | Path) -> list[tuple[int, int, int]]:
    """``(out, in, count)`` of the fused linear layers of a Llama-style model (as the engine
    runs them) and its LM head, from ``config.json``."""
    c = json.loads(Path(config_path).read_text())
    hidden, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    n = c["num_hidden_layers"]
    return [
        ((heads + 2 * kv_heads) * head_dim, hidden, n),
        (hidden, heads * head_dim, n),
        (2 * inter, hidden, n),
        (hidden, inter, n),
        (c["vocab_size"], hidden, 1),
    ]
