"""The Llama-family model: its spec (``config.json``), weights (safetensors, float or INT8) and forward.

Architectures: Llama (incl. SmolLM2), Mistral (sliding window), Qwen2 (q/k/v bias); RMSNorm
(Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021, RoFormer) with the
checkpoint's ``rope_theta`` and ``linear`` / ``llama3`` scaling, grouped-query attention
(Ainslie et al. 2023) and SwiGLU MLP (Shazeer 2020).

``Model.forward`` runs all scheduled tokens of a step as one flat batch of ``N`` tokens: linear
layers see ``[N, hidden]``; attention is delegated to an ``engine.attention.AttentionBackend``
with the step's metadata. With an ``engine.lora.LoRABatch`` the rows of LoRA requests get their
adapters' deltas on top of the base layers' outputs (``Model.forward``'s ``lora``).
INT8 checkpoints (``engine.quant.int8``: ``weight-only`` or
``w8a8``, named in the safetensors metadata) run their linear layers, the LM head included when it
was quantized, with the INT8 kernels of ``engine.quant.int8`` on CPU; on CUDA their weights are
dequantized to ``dtype``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import cpu_ops
from engine.attention import TorchAttentionMetadata
from engine.checkpoint.model_spec import ModelSpec
from engine.checkpoint.store import CheckpointError
from engine.config import SUPPORTED_DTYPES
from engine.errors import UsageError
from engine.platform import (
    bf16_dot_products,
    float_gemv_fast,
    float_panels_fast,
    mkl_gemv_fast,
    onednn_bf16_supported,
)
from engine.quant.int8 import (
    INPUT_HADAMARD_SUFFIX,
    INT8_SCALE_SUFFIX,
    INT8_WEIGHT_SUFFIX,
    OUTLIER_CHANNELS_SUFFIX,
    Int8WeightOnlyLinear,
    block_hadamard,
    dequantize_weight,
    int8_linear,
    read_scheme,
)

#: ``EngineConfig.dtype`` names -> torch dtypes (``"auto"`` is resolved to one of them first).
DTYPES = {name: getattr(torch, name) for name in SUPPORTED_DTYPES if name != "auto"}


# ------------------------------------------------------------------------------------ architecture


def read_model_spec(path: Path) -> ModelSpec:
    """Read ``config.json`` of a checkpoint directory (``engine.checkpoint.model_spec``).

    Raises:
        CheckpointError: an architecture outside ``ARCHITECTURES`` (the supported ones are listed).
    """
    # optional or heavy dependency: imported only on the path that needs it
    from transformers import AutoConfig

    return ModelSpec.from_config(AutoConfig.from_pretrained(path).to_dict(), check_architecture=True, where=path)


# ------------------------------------------------------------------------------------ rotary


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with ``linear`` or ``llama3`` scaling.

    llama3 scaling (Meta, Llama 3.1): long wavelengths divided by ``factor``, short kept, a
    smooth blend in between.

    Raises:
        CheckpointError: an unsupported ``rope_scaling`` type.
    """
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise CheckpointError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [..., head_dim]`` (any float dtype) with float32 ``cos`` / ``signed_sin`` tables
    broadcast to it: ``x * cos + swap_halves(x) * signed_sin`` in float32, rounded once to ``x.dtype``.

    Hugging Face's bf16 Llama rounds the tables, both products and the sum to bf16 (four roundings of
    q and k before every attention score); measured on SmolLM2-135M (docs/engine.md), one rounding
    lowers the bf16 engine's mean KL to fp32 by 8% at no cost (the C++ ``rope_and_cache`` computes
    in float32 either way).
    """
    xf = x.float()
    out = xf * cos + swap_halves(xf) * signed_sin
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``[..., d] -> [..., d]``: ``cat(x[d/2:], x[:d/2])``.

    With ``sin`` whose first half is negated this is the Hugging Face Llama ``rotate_half``:
    ``rotate_half(x) * sin == swap_halves(x) * signed_sin`` exactly (only signs move).
    """
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


# ------------------------------------------------------------------------------------ weights


#: Batch size (rows) oneDNN picks its packed weight layout for: a full decode batch.
PACK_BATCH_HINT = 64


def can_pack_weights(device: str, dtype: torch.dtype) -> bool:
    """Whether float weights are pre-packed for oneDNN: bf16 on a CPU whose oneDNN has bf16 kernels
    (``onednn_bf16_supported``). Packed at every size, fp32 ran at half the speed of ``F.linear``
    (161 vs 313 tok/s, docs/engine.md), so fp32 packs only ``FP32_PACKED_ROWS``.
    """
    return device == "cpu" and dtype == torch.bfloat16 and onednn_bf16_supported()


#: Rows (tokens) of an fp32 CPU linear that run on a oneDNN-packed copy of the weight on Intel CPUs: 2 to 64 (decode,
#: speculative verification); prefill keeps MKL's ``F.linear`` on the plain weight, which re-packs the weight on every
#: call past 3 rows (the LM head: 26.8 ms vs 14.1 packed at 5 rows; docs/engine.md), and so does one row (one request
#: decoding alone), where MKL's GEMV streams the weight faster (``fp32_packed_rows``).
FP32_PACKED_ROWS = (2, 64)


def fp32_packed_rows() -> tuple[int, int]:
    """Rows of an fp32 linear that run on the oneDNN-packed weight on this CPU: ``FP32_PACKED_ROWS`` where MKL runs
    its own fastest kernels (``engine.platform.mkl_gemv_fast``: Intel); elsewhere every row count, prefill included:
    on a 2-core AMD EPYC MKL was the slower path at every size measured (a step's 120 layer linears at 160 / 512 rows
    192 / 609 ms vs 159 / 513 packed; docs/engine.md)."""
    return FP32_PACKED_ROWS if mkl_gemv_fast() else (1, sys.maxsize)


#: Fewest rows a step runs its oneDNN-packed float linears with: a decode of 1 to 3 tokens is padded with zero rows
#: to 4, where oneDNN picks faster kernels (a step's bf16 layer linears: 15.7 ms at 1 row, 13.2 at 4; docs/engine.md).
PACKED_MIN_ROWS = 4


#: Rows per oneDNN call of a float linear in batch-invariant mode (``EngineConfig.batch_invariant``): a row's
#: result must not depend on how many rows share the call. oneDNN's packed bf16 GEMM (AMX, 2 threads) computes
#: every row of a call of 1 to 32 rows bit-identically, and picks other kernels above that whose roundings differ
#: in some rows (e.g. the ``[576, 1536]`` down projection at 37-568 rows, the LM head at 33-352 rows); fp32 packed
#: calls of 2 or more rows agree at every size measured (up to 1,192), one row differs. So batch-invariant linears
#: run on the packed weight in calls of at most this many rows, each padded to ``PACKED_MIN_ROWS``.
BATCH_INVARIANT_TILE_ROWS = 32


#: Most tokens of a decode step that ``cpu_ops.decode_layers`` runs (its limit; each linear's few-row kernel may take
#: fewer: ``Model.fused_decode_rows``).
FUSED_DECODE_MAX_ROWS = 8

#: Most rows of a float linear that run on the engine's GEMV (``cpu_ops.float_gemv``) where it is the faster path
#: (``float_gemv_fast``). Medians of 5, ms for a step's 120 layer linears of SmolLM2-135M streamed from memory on a
#: 2-core AMD EPYC (docs/engine.md), GEMV at 1 / 2 / 3 / 4 rows against oneDNN's packed GEMM at 4 rows: fp32 15.4 /
#: 15.1 / 16.9 / 24.2 vs 19.4; bf16 7.6 / 8.6 / 10.2 / 10.6 vs 16.3.
FLOAT_GEMV_ROWS = {torch.float32: 3, torch.bfloat16: 4}


def float_gemv_rows(device: str, dtype: torch.dtype) -> int:
    """Rows up to which a float linear runs ``cpu_ops.float_gemv`` on its plain weight (``FLOAT_GEMV_ROWS``), or 0
    where oneDNN stays the faster path (``float_gemv_fast``) or the kernel cannot be built. Builds it on first use."""
    if device != "cpu" or dtype not in FLOAT_GEMV_ROWS or not float_gemv_fast():
        return 0
    return FLOAT_GEMV_ROWS[dtype] if cpu_ops.float_gemv_available() else 0


def float_panels(device: str, dtype: torch.dtype, batch_invariant: bool = False) -> bool:
    """Whether fp32 linears keep their weight packed for the engine's panel GEMM (``cpu_ops.float_gemm_panels``) in
    place of oneDNN's packed copy, for every row count past ``float_gemv_rows``: where it is the faster path
    (``float_panels_fast``) and its kernel builds; batch-invariant mode keeps oneDNN's tiles."""
    return (
        device == "cpu"
        and dtype == torch.float32
        and not batch_invariant
        and float_panels_fast()
        and cpu_ops.float_gemv_available()
    )


def packed_rows(device: str, dtype: torch.dtype, batch_invariant: bool = False) -> tuple[int, int] | None:
    """``(min, max)`` rows of a float linear that use the oneDNN-packed weight, or ``None`` (never packed).

    bf16 on CPU: every row count (``can_pack_weights``); fp32 on CPU: ``fp32_packed_rows()`` (the plain
    weight serves the others), or every row count in batch-invariant mode (no MKL call, whose rows
    depend on the row count); elsewhere ``None``.
    """
    if can_pack_weights(device, dtype):
        return (1, sys.maxsize)
    if device == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return (1, sys.maxsize) if batch_invariant else fp32_packed_rows()
    return None


class Linear:
    """``y = x @ W^T + b`` from float weights, or a CPU INT8 layer of ``engine.quant.int8`` (same dtype in and
    out).

    With ``pack=True`` (CPU) the float weight ``[out, in]`` is reordered once into oneDNN's
    blocked layout (``mkldnn._reorder_linear_weight``, as inductor's CPU weight-prepack pass
    does) and every call runs ``mkldnn._linear_pointwise`` on it, so no call re-packs the
    weight; in bf16 that uses AMX tiles where the CPU has them. ``weight`` keeps the plain
    tensor (shared with the embedding when the lm head is tied).

    ``add`` (residual) and ``silu_mul`` (SwiGLU) run the element-wise work after the GEMM as
    oneDNN post-ops on packed weights (computed on the float accumulator before the one rounding
    to ``dtype``), in the INT8 layer's own ``add`` / ``silu_mul`` (fused for ``w8a8`` on CPU),
    and as separate ops otherwise. A layer made with ``gated=True`` holds
    ``[gate; up]`` (``[2 * intermediate, in]``) and is packed as its two halves for ``silu_mul``.

    ``pack_rows=(lo, hi)`` (with ``pack``; default every row count) runs inputs of ``lo`` to ``hi``
    rows on the packed weight and the others with ``F.linear`` on the plain one (fp32:
    ``fp32_packed_rows()``, where MKL is the faster path for the others). After
    ``use_float_gemv(rows)``, inputs of at most ``rows`` rows run the engine's GEMV on the plain weight
    (``cpu_ops.float_gemv``, with the same epilogues) before any of that. With ``panels=True`` (fp32, in place of
    ``pack``) the weight is also held packed for ``cpu_ops.float_gemm_panels``, which runs every other row count
    (a gated layer's halves in alternating panels where they are multiples of 16 rows, so ``silu_mul`` is one call).
    """

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None = None,
        int8_layer=None,
        dtype=None,
        pack: bool = False,
        gated: bool = False,
        pack_rows: tuple[int, int] | None = None,
        panels: bool = False,
    ):
        self.weight, self.bias, self.int8_layer, self.dtype = weight, bias, int8_layer, dtype
        self.pack_rows = pack_rows or (1, sys.maxsize)
        self.tile_rows: int | None = None  # batch-invariant mode: rows per call (``invariant_tiles``)
        self.min_rows = 1
        self.gemv_rows = 0  # inputs of at most this many rows run cpu_ops.float_gemv (``use_float_gemv``)
        self.packed = None
        self.packed_halves = None  # (gate, up, gate bias, up bias) of a packed gated layer
        self.panels = None  # [ceil(out / 16), in, 16] fp32 for cpu_ops.float_gemm_panels
        self.panels_gated = False
        if panels and weight is not None:
            self.panels_gated = gated and weight.shape[0] % 32 == 0
            self.panels = cpu_ops.pack_float_panels(weight, self.panels_gated)
        elif pack and weight is not None:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            if gated:
                gate, up = weight.chunk(2)
                biases = (None, None) if bias is None else bias.chunk(2)
                self.packed_halves = (
                    reorder(gate.contiguous(), PACK_BATCH_HINT),
                    reorder(up.contiguous(), PACK_BATCH_HINT),
                ) + tuple(None if b is None else b.contiguous() for b in biases)
            else:
                self.packed = reorder(weight, PACK_BATCH_HINT)

    def _on_packed(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (``[N, in]``) runs on the packed weight: one is held and ``N`` is in ``pack_rows``."""
        lo, hi = self.pack_rows
        return lo <= x.shape[0] <= hi or self.weight is None

    def use_float_gemv(self, rows: int) -> None:
        """Run inputs of 1 to ``rows`` rows (0: none) on ``cpu_ops.float_gemv`` over the plain float weight (an INT8
        layer, or one held only packed, keeps its own path; an input of no rows takes the usual one)."""
        self.gemv_rows = rows if self.weight is not None and self.int8_layer is None else 0

    def decode_gemv_args(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """``(weight, row sums, scale, bias, input Hadamard block)`` of this linear for ``cpu_ops.decode_layers``
        where inputs of ``rows`` rows run a kernel that op calls (the INT8 layer's own answer; a float layer's
        ``float_gemv``), else ``None``."""
        if self.tile_rows is not None:
            return None
        if self.int8_layer is not None:
            fn = getattr(self.int8_layer, "decode_gemv_args", None)
            return None if fn is None else fn(rows, dtype)
        if rows > self.gemv_rows or self.weight is None or self.weight.dtype != dtype:
            return None
        return (self.weight, None, None, self.bias, 0) if cpu_ops.float_gemv_available() else None

    def invariant_tiles(self, tile_rows: int, min_rows: int) -> None:
        """Batch-invariant mode: every call runs in calls of at most ``tile_rows`` rows, each padded with zero
        rows to ``min_rows`` (see ``BATCH_INVARIANT_TILE_ROWS``)."""
        self.tile_rows, self.min_rows = tile_rows, min_rows

    def _tiled(self, fn, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``fn(x)`` (or ``fn(x, residual)``) over ``tile_rows``-row slices of ``x`` ``[N, in]``, concatenated."""
        n = x.shape[0]
        tile = self.tile_rows
        if tile is None or self.min_rows <= n <= tile:
            return fn(x) if residual is None else fn(x, residual)
        outputs = []
        for start in range(0, n, tile):
            xs = pad_rows(x[start : start + tile], self.min_rows)
            m = min(tile, n - start)
            if residual is None:
                outputs.append(fn(xs)[:m])
            else:
                outputs.append(fn(xs, pad_rows(residual[start : start + tile], self.min_rows))[:m])
        return torch.cat(outputs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows is not None:
            return self._tiled(self._call, x)
        return self._call(x)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_layer is not None:
            return self.int8_layer.forward(x)  # no hooks on it: skips nn.Module.__call__ (~2 us of a decode GEMV)
        if 0 < x.shape[0] <= self.gemv_rows:
            return cpu_ops.float_gemv(x, self.weight, self.bias)
        if self.panels is not None:
            return cpu_ops.float_gemm_panels(x, self.panels, self.weight.shape[0], self.panels_gated, self.bias)
        if self.packed is not None and self._on_packed(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.packed_halves is not None and self._on_packed(x):
            gate, up, gate_bias, up_bias = self.packed_halves
            linear = torch.ops.mkldnn._linear_pointwise
            return torch.cat((linear(x, gate, gate_bias, "none", [], ""), linear(x, up, up_bias, "none", [], "")), -1)
        return F.linear(x, self.weight, self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``; ``residual`` is ``[N, out]`` in the output dtype."""
        if self.tile_rows is not None:
            return self._tiled(self._add, x, residual)
        return self._add(x, residual)

    def _add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.int8_layer is not None:
            return self.int8_layer.add(x, residual)
        if 0 < x.shape[0] <= self.gemv_rows:
            return cpu_ops.float_gemv(x, self.weight, self.bias, residual=residual)
        if self.panels is not None:
            return cpu_ops.float_gemm_panels(
                x, self.panels, self.weight.shape[0], self.panels_gated, self.bias, residual=residual
            )
        if self.packed is not None and self._on_packed(x):
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        return residual + self._call(x)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a ``[gate; up]`` layer: ``[N, in] -> [N, intermediate]``."""
        if self.tile_rows is not None:
            return self._tiled(self._silu_mul, x)
        return self._silu_mul(x)

    def _silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_layer is not None:
            return self.int8_layer.silu_mul(x)
        if 0 < x.shape[0] <= self.gemv_rows:
            return cpu_ops.float_gemv(x, self.weight, self.bias, silu_mul=True)
        if self.panels_gated:
            return cpu_ops.float_gemm_panels(x, self.panels, self.weight.shape[0], True, self.bias, silu_mul=True)
        if self.packed_halves is not None and self._on_packed(x):
            gate, up, gate_bias, up_bias = self.packed_halves
            linear = torch.ops.mkldnn._linear_pointwise
            return linear.binary(x, linear(x, gate, gate_bias, "swish", [], ""), up, up_bias, "mul")
        gate, up = self._call(x).chunk(2, dim=-1)
        return F.silu(gate) * up


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint's ``*.safetensors`` files.

    Raises:
        CheckpointError: no weight file, or a corrupt one (its path is named).
    """
    # optional or heavy dependency: imported only on the path that needs it
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights; the engine loads safetensors checkpoints")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises several error types for corrupt files
            raise CheckpointError(f"{file}: cannot read safetensors ({exc}); re-create the checkpoint") from exc
    return tensors


class WeightLoader:
    """Builds fused linear layers from a state dict, float or INT8 (``X.weight_int8`` + ``X.weight_scale``)."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype, device: str, batch_invariant=False
    ):
        self.tensors, self.path, self.dtype, self.device = tensors, path, dtype, device
        try:
            self.int8_scheme = read_scheme(sorted(path.glob("*.safetensors")))  # None for a float checkpoint
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
        self.pack = can_pack_weights(device, dtype)  # every row count; RMSNorm weights folded in
        self.panels = float_panels(device, dtype, batch_invariant)  # fp32 on the engine's panel GEMM, not oneDNN
        # bf16: every row count; fp32: fp32_packed_rows(), or never beside the panels
        self.pack_rows = None if self.panels else packed_rows(device, dtype, batch_invariant)

    def has(self, name: str) -> bool:
        return name in self.tensors or name.removesuffix(".weight") + INT8_WEIGHT_SUFFIX in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: weight {name!r} is missing; the checkpoint is incomplete")
        return self.tensors[name].to(device=self.device, dtype=self.dtype)

    def is_int8(self, prefix: str) -> bool:
        return prefix + INT8_WEIGHT_SUFFIX in self.tensors

    def linear(self, prefixes: list[str], bias: bool = False, gated: bool = False) -> Linear:
        """One linear layer whose output concatenates those of ``prefixes`` (e.g. q, k, v).

        Args:
            gated: the layer is ``[gate; up]`` of a SwiGLU MLP (``Linear.silu_mul``).

        The RMSNorm weight that feeds a layer stays apart (``rms_norm`` multiplies by it and rounds, as
        Hugging Face does): folded into bf16 weights (``W * g`` rounded once) the bf16 engine's greedy
        tokens left fp32's sooner (27 against 31 of 64 requests identical, docs/engine.md) at no gain
        in speed.
        """
        biases = torch.cat([self.tensor(p + ".bias") for p in prefixes]) if bias else None
        if all(self.is_int8(p) for p in prefixes) and self.device == "cpu":
            w8 = torch.cat([self.tensors[p + INT8_WEIGHT_SUFFIX] for p in prefixes])  # [sum(out), in]
            scale = torch.cat([self.tensors[p + INT8_SCALE_SUFFIX] for p in prefixes])
            outliers = self._shared(prefixes, OUTLIER_CHANNELS_SUFFIX, "outlier channels")
            rotation = self._shared(prefixes, INPUT_HADAMARD_SUFFIX, "input rotation")
            try:
                layer = int8_linear(
                    self.int8_scheme, w8, scale, None if biases is None else biases.float(), outliers, rotation
                )
            except ValueError as exc:
                raise CheckpointError(f"{self.path}: {prefixes[0]}: {exc}") from exc
            return Linear(None, int8_layer=layer, dtype=self.dtype)
        weights = [self._float_weight(p) for p in prefixes]
        layer = Linear(
            torch.cat(weights).contiguous(),
            biases,
            pack=self.pack_rows is not None,
            gated=gated,
            pack_rows=self.pack_rows,
            panels=self.panels,
        )
        return layer

    def _shared(self, prefixes: list[str], suffix: str, what: str) -> torch.Tensor | None:
        """The ``suffix`` tensor that the INT8 layers ``prefixes`` (one fused input) all hold, or ``None``.

        Raises:
            CheckpointError: some of them hold it and others not, or different values.
        """
        found = [self.tensors.get(p + suffix) for p in prefixes]
        if any(t is None for t in found) != all(t is None for t in found) or any(
            t is not None and not torch.equal(t, found[0]) for t in found
        ):
            raise CheckpointError(
                f"{self.path}: {', '.join(prefixes)} share their input but not their {what}; "
                "re-create the checkpoint with `lmforge quantize`"
            )
        return found[0]

    def _float_weight(self, prefix: str) -> torch.Tensor:
        """The ``[out, in]`` float weight of ``prefix`` (an INT8 one dequantized) in the model's dtype.

        A weight stored for a Hadamard-rotated input (``X.input_hadamard``: ``W' = W D H / b``) comes back
        as ``W' H = W D``, the weight of the unrotated input (Sylvester's ``H`` is symmetric, ``H H = b I``).
        """
        if self.is_int8(prefix):
            w = dequantize_weight(self.tensors[prefix + INT8_WEIGHT_SUFFIX], self.tensors[prefix + INT8_SCALE_SUFFIX])
            block = self.tensors.get(prefix + INPUT_HADAMARD_SUFFIX)
            if block is not None:
                w = block_hadamard(w.float(), int(block.item()))  # each row's blocks times H
            return w.to(device=self.device, dtype=self.dtype)
        return self.tensor(prefix + ".weight")


@dataclasses.dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim
    o: Linear  # num_heads * head_dim -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate ([gate; up])
    down: Linear  # intermediate -> hidden


def load_layers(loader: WeightLoader, spec: ModelSpec) -> list[LayerWeights]:
    layers = []
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                input_norm=loader.tensor(p + "input_layernorm.weight"),
                qkv=loader.linear(
                    [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"], bias=spec.qkv_bias
                ),
                o=loader.linear([p + "self_attn.o_proj"]),
                post_norm=loader.tensor(p + "post_attention_layernorm.weight"),
                gate_up=loader.linear([p + "mlp.gate_proj", p + "mlp.up_proj"], gated=True),
                down=loader.linear([p + "mlp.down_proj"]),
            )
        )
    return layers


# ------------------------------------------------------------------------------------ model


class Model:
    """Weights and rotary tables of a checkpoint; ``forward`` runs one flat token batch.

    Args:
        path: a resolved checkpoint directory.
        dtype: activations and float weights (a ``torch.dtype``).
        device: ``cpu`` or ``cuda``.
        max_model_len: longest sequence (sizes the rotary tables).
        batch_invariant: every linear layer runs its rows in calls of ``BATCH_INVARIANT_TILE_ROWS`` on the packed
            weight, so a token's result does not depend on the other tokens of its step
            (``EngineConfig.batch_invariant``).

    Raises:
        CheckpointError: unsupported architecture, missing or corrupt weights.
        UsageError: ``batch_invariant`` with an INT8 checkpoint, or where float weights are not packed.
    """

    def __init__(self, path: Path, dtype: torch.dtype, device: str, max_model_len: int, batch_invariant: bool = False):
        self.spec = spec = read_model_spec(path)
        self.dtype, self.device = dtype, device
        tensors = load_state_dict(path)
        loader = WeightLoader(tensors, path, dtype, device, batch_invariant)
        self.embed = loader.tensor("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = load_layers(loader, spec)
        self.norm = loader.tensor("model.norm.weight")
        if loader.is_int8("lm_head") or (loader.has("lm_head.weight") and not spec.tie_word_embeddings):
            self.lm_head = loader.linear(["lm_head"])
        else:
            self.lm_head = Linear(
                self.embed, pack=loader.pack_rows is not None, pack_rows=loader.pack_rows, panels=loader.panels
            )
        self.is_int8 = any(k.endswith(INT8_WEIGHT_SUFFIX) for k in tensors)
        # the linears of a packed float model run at least this many rows (INT8 decode kernels read the weights
        # once per call for any row count, so an INT8 model is never padded; on Intel an fp32 row alone takes
        # MKL's GEMV)
        gemv_row = dtype == torch.float32 and not batch_invariant and mkl_gemv_fast()
        padded = loader.pack_rows is not None and not self.is_int8 and not gemv_row
        self.min_rows = PACKED_MIN_ROWS if padded else 1
        # steps of at most this many tokens run every float linear on the engine's GEMV, unpadded
        self.gemv_rows = 0 if batch_invariant else float_gemv_rows(device, dtype)
        for linear in [lin for lw in self.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [self.lm_head]:
            linear.use_float_gemv(self.gemv_rows)
        self.head_screen = head_screen(self.lm_head, dtype, device, batch_invariant)
        del tensors
        if batch_invariant:
            if self.is_int8 or loader.pack_rows is None:
                raise UsageError(
                    f"batch_invariant=True needs a float checkpoint in bfloat16 or float32 on CPU with oneDNN; {path} "
                    f"is {'INT8' if self.is_int8 else str(dtype)} on {device}",
                    fix="turn batch_invariant off or serve the float checkpoint",
                )
            for lw in self.layers:
                for linear in (lw.qkv, lw.o, lw.gate_up, lw.down):
                    linear.invariant_tiles(BATCH_INVARIANT_TILE_ROWS, self.min_rows)
            self.lm_head.invariant_tiles(BATCH_INVARIANT_TILE_ROWS, self.min_rows)
        inv_freq = rope_inv_freq(spec)
        t = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_model_len, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_model_len, head_dim]
        # float32 tables in every dtype: q and k are rotated in float32 and rounded once (``rotate``)
        self.rope_cos = emb.cos().to(device=device)
        half = spec.head_dim // 2
        sin = emb.sin()
        self.rope_signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device)
        self._int8_decode: tuple | bool | None = None  # int8_decode_weights(), collected on first use
        # (rows, decode_layers' weight lists, the kernel switches they were chosen under), by fused_decode_rows()
        self._decode_args: tuple | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn, attn_metadata, lora=None
    ) -> torch.Tensor:
        """``[N]`` token ids at ``[N]`` positions -> ``[N, hidden]`` last hidden states (before the final norm).

        Args:
            kv_cache: ``[num_layers, ...]`` the per-layer caches in ``attn``'s layout.
            attn: the ``AttentionBackend``; ``attn_metadata`` what its ``build`` returned for this step.
            lora: an ``engine.lora.LoRABatch`` when rows of this step run with LoRA adapters, else ``None``.
                Each adapted layer adds its delta to the base output: qkv before rotary and the cache store,
                o and down after their residual-add epilogue (the delta is linear, so adding it after the
                fused add is exact), and gate/up before SwiGLU, where the fused ``silu_mul`` then gives way to
                the plain GEMM + ``silu * up`` in the layers an adapter of the step changes. A base-only step
                (``None``) runs the fused path unchanged.
        """
        s = self.spec
        eps = s.rms_norm_eps
        n = input_ids.shape[0]
        fused = self._fused_decode(n, kv_cache, attn, attn_metadata, lora)
        if fused is not None:
            layer_args, block_tables, seq_lens = fused
            return cpu_ops.decode_layers(
                self.embed[input_ids],
                *layer_args,
                kv_cache,
                self.rope_cos[positions],
                self.rope_signed_sin[positions],
                attn_metadata.slot_mapping,
                block_tables,
                seq_lens,
                s.num_attention_heads,
                s.num_key_value_heads,
                eps,
            )
        q_size, kv_size = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        num_heads, num_kv_heads = s.num_attention_heads, s.num_key_value_heads
        cos2, sin2 = self.rope_cos[positions], self.rope_signed_sin[positions]  # [N, head_dim]
        cos, sin = cos2[:, None, :], sin2[:, None, :]  # [N, 1, head_dim]
        slot_mapping = getattr(attn_metadata, "slot_mapping", None)
        pad_to = self.pad_target(n)
        h = pad_rows(self.embed[input_ids], pad_to)  # [R, hidden], R = max(N, pad_to); rows past N are 0
        for layer_idx, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, eps)
            qkv = layer.qkv(x)[:n]  # [N, q_size + 2 * kv_size]
            if lora is not None:
                qkv = lora.apply(layer_idx, "qkv", x, qkv)
            q = None
            if slot_mapping is not None and attn.stores_kv_separately:
                # bf16 or fp32 on CPU: rotary on q and k and the k, v store in one C++ pass (else None)
                q = cpu_ops.rope_and_cache(qkv, cos2, sin2, kv_cache[layer_idx], slot_mapping, num_heads, num_kv_heads)
            if q is not None:
                k = v = None  # already in the cache
            else:
                qk = rotate(qkv[:, : q_size + kv_size].view(n, num_heads + num_kv_heads, s.head_dim), cos, sin)
                q, k = qk[:, :num_heads], qk[:, num_heads:]
                v = qkv[:, q_size + kv_size :].view(n, num_kv_heads, s.head_dim)
            out = attn.forward(q, k, v, kv_cache[layer_idx], attn_metadata)  # [N, q_size]
            h = layer.o.add(pad_rows(out, pad_to), h)  # [R, hidden]
            if lora is not None:
                h = lora.apply(layer_idx, "o", out, h)
            x = rms_norm(h, layer.post_norm, eps)
            if lora is not None and lora.has(layer_idx, "gate_up"):
                gate_up = layer.gate_up(x)  # [R, 2 * intermediate]
                gate_up = lora.apply(layer_idx, "gate_up", x, gate_up)
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            else:
                act = layer.gate_up.silu_mul(x)  # [R, intermediate]
            h = layer.down.add(act, h)  # [R, hidden]
            if lora is not None:
                h = lora.apply(layer_idx, "down", act, h)
        return h[:n]

    def _fused_decode(self, n: int, kv_cache: torch.Tensor, attn, attn_metadata, lora) -> tuple | None:
        """``(the layers' weight lists, block_tables [n, blocks], seq_lens [n])`` when this step runs every layer in
        one ``cpu_ops.decode_layers`` call, else ``None``: ``n`` single-token decodes, no LoRA, each attending every
        key of its own table (no shared-prefix split), and every op of the layer on the C++ kernel ``forward``
        would call for ``n`` rows (so the same bits; ``fused_decode_rows``)."""
        if lora is not None or n > self.fused_decode_rows() or not isinstance(attn_metadata, TorchAttentionMetadata):
            return None
        group = attn_metadata.decode
        if (
            group is None
            or attn_metadata.prefill is not None
            or attn_metadata.rows is not None
            or attn_metadata.num_decode_tokens != n
            or group.shared_blocks is not None
            or attn.sliding_window is not None
            or kv_cache.dtype not in (self.dtype, torch.int8)
            or not attn.stores_kv_separately
        ):
            return None
        return self._decode_args[1], group.block_tables, group.seq_lens

    def fused_decode_rows(self) -> int:
        """Most tokens a decode step may have to run in one ``cpu_ops.decode_layers`` call (0: never): where every
        linear's few-row kernel, the C++ RMSNorm, rotary and attention run, and the rows need no padding. Chosen
        again when a kernel switch changes (``cpu_ops.use_cpu_kernels(False)`` turns it off)."""
        if self._decode_args is None or self._decode_args[2] != cpu_ops.kernel_switches():
            rows_and_args = (0, None)
            dtype = self.dtype
            norm_kernel = dtype == torch.bfloat16 or (dtype == torch.float32 and fp32_one_pass_norm())
            if self.device == "cpu" and norm_kernel and self.spec.head_dim <= 256:
                linears = [lin for lw in self.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)]
                for rows in range(FUSED_DECODE_MAX_ROWS, 0, -1):
                    args = [lin.decode_gemv_args(rows, dtype) for lin in linears]
                    # the op itself is built only once every linear has a few-row kernel here
                    if all(a is not None for a in args) and self.pad_target(rows) == 1:
                        if cpu_ops.decode_layers_available():
                            norms = [norm for lw in self.layers for norm in (lw.input_norm, lw.post_norm)]
                            rows_and_args = (rows, [list(column) for column in zip(*args)] + [norms])
                        break
            # the switches as the look above left them (it may have loaded kernels)
            self._decode_args = (*rows_and_args, cpu_ops.kernel_switches())
        return self._decode_args[0]

    def pad_target(self, n: int) -> int:
        """Rows a step of ``n`` tokens runs its linears with: ``n`` where the GEMV takes it (``gemv_rows``), else at
        least ``min_rows`` (zero rows added)."""
        return 1 if 0 < n <= self.gemv_rows else self.min_rows

    def int8_decode_weights(self) -> tuple[list, ...] | None:
        """``(weights, row sums, scales, biases, Hadamard blocks, norms)`` of every layer for an INT8 draft's
        ``cpu_ops.decode_layers`` (with ``float_aten``: a float-kept layer on ``F.linear``), or ``None`` where it cannot
        run this model: not bf16 on CPU, no weight-only INT8 linear or a ``w8a8`` one, a sliding window, or the C++
        kernels (the engine's, the INT8 GEMV, the op itself) not built or disabled."""
        if self._int8_decode is None:
            self._int8_decode = self._collect_int8_decode() or False
        if not self._int8_decode or not cpu_ops.int8_decode_available():
            return None
        return self._int8_decode

    def _collect_int8_decode(self) -> tuple[list, ...] | None:
        if self.device != "cpu" or self.dtype != torch.bfloat16 or self.spec.sliding_window is not None:
            return None
        layers = [(lw.qkv, lw.o, lw.gate_up, lw.down) for lw in self.layers]
        kinds = [type(lin.int8_layer) for group in layers for lin in group]
        if Int8WeightOnlyLinear not in kinds or any(k not in (Int8WeightOnlyLinear, type(None)) for k in kinds):
            return None
        if any(lin.int8_layer is None and lin.weight is None for group in layers for lin in group):
            return None  # a float layer held only in oneDNN's packed layout
        weights, scales, biases, norms = [], [], [], []
        for lw, group in zip(self.layers, layers):
            for lin in group:
                int8 = lin.int8_layer
                if int8 is None:  # a layer the quantizer kept in float (its sensitivity): at::linear, bf16 bias
                    weights.append(lin.weight)
                    scales.append(None)
                    biases.append(lin.bias)
                else:
                    weights.append(int8.weight_int8)
                    scales.append(int8.weight_scale)
                    biases.append(int8.bias)
            norms += [lw.input_norm, lw.post_norm]
        n = len(weights)
        return weights, [None] * n, scales, biases, [0] * n, norms

    def compute_logits(
        self, hidden: torch.Tensor, float_logits: bool = True, mask: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """``[S, hidden]`` last hidden states -> logits ``[S, vocab]`` (final norm, lm head), float32
        unless ``float_logits=False`` (then for an argmax: in the model dtype, or bf16 from ``head_screen``).
        ``mask`` (e.g. structured output's grammar masks) sets disallowed entries of the lm head's output to
        -inf, in place, before the refinement below, so the exact winner it finds is an allowed token.

        In bf16 the entries near each row's maximum are recomputed in float32 (``cpu_ops.refine_logits``):
        the GEMM's rounding to bf16 would otherwise tie or swap close candidates, and greedy output would
        follow the tie order instead of the model. Float logits also hold the exact values of every entry that
        may be among the ``EXACT_TOP_LOGITS`` largest (the top logprobs a request reads, the candidates a
        sampler keeps). With ``float_logits=False`` the exact winner is made the row's unique maximum.

        A float32 head with a ``head_screen`` runs, for ``float_logits=False``, on its bf16 copy, and the entries
        that can hold the float32 maximum are recomputed in float32 (``cpu_ops.screen_logits``): the same argmax.
        """
        s = hidden.shape[0]
        hidden = rms_norm(pad_rows(hidden, self.pad_target(s)), self.norm, self.spec.rms_norm_eps)
        head = self.lm_head
        if not float_logits and self.head_screen is not None:
            screen, weight_norms = self.head_screen
            logits = screen(hidden.to(torch.bfloat16))[:s]
            if mask is not None:
                mask(logits)
            return cpu_ops.screen_logits(logits, hidden[:s], head.weight, weight_norms)
        logits = self.lm_head(hidden)[:s]
        if mask is not None:
            mask(logits)
        if logits.dtype == torch.bfloat16 and head.int8_layer is None and head.bias is None and head.weight is not None:
            return cpu_ops.refine_logits(logits, hidden[:s], head.weight, to_float=float_logits, top_k=EXACT_TOP_LOGITS)
        return logits.float() if float_logits else logits


def head_screen(head: Linear, dtype: torch.dtype, device: str, batch_invariant: bool):
    """``(bf16 copy of the lm head, [V] float32 norms of its weight rows)`` for ``cpu_ops.screen_logits``, or ``None``.

    A greedy step of a float32 model needs only each row's argmax; reading the head's weight in bf16 reads half
    the bytes (56 of SmolLM2's 113 MB) and runs on the CPU's bf16 units (the head and its pick at 1 / 64 rows in
    1.3 / 7.2 ms against 2.4 / 10.6 in float32 on a 2-core AMD EPYC Zen 5), and the float32 recomputation of the few
    entries that can win keeps the pick the float32 head's. Built for a float32 CPU model whose head is a plain float
    weight without bias, where the CPU multiplies bf16 in hardware (``bf16_dot_products``) and the C++ kernels
    build; not in batch-invariant mode. Costs a bf16 copy of the head (and oneDNN's packed copy of it).
    """
    if (
        dtype != torch.float32
        or device != "cpu"
        or batch_invariant
        or head.weight is None
        or head.bias is not None
        or head.int8_layer is not None
        or not bf16_dot_products()
        or not cpu_ops.decode_kernel_built()
    ):
        return None
    return build_head_screen(head.weight, device)


def build_head_screen(weight: torch.Tensor, device: str = "cpu") -> tuple[Linear, torch.Tensor]:
    """``head_screen``'s pair for a float32 head weight ``[V, H]``, whatever the CPU (tests build it anywhere)."""
    screen = Linear(weight.to(torch.bfloat16), pack=onednn_bf16_supported())
    screen.use_float_gemv(float_gemv_rows(device, torch.bfloat16))
    return screen, weight.float().norm(dim=1).contiguous()


#: bf16 float logits hold exact float32 sums for (at least) this many largest entries of each row (``compute_logits``):
#: more than the 20 top logprobs the OpenAI API returns.
EXACT_TOP_LOGITS = 32


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``[N, d] -> [max(N, rows), d]``: ``x`` followed by zero rows (``x`` itself when it has enough rows)."""
    n = x.shape[0]
    return x if n >= rows else torch.cat((x, x.new_zeros(rows - n, x.shape[1])))


@functools.cache
def fp32_one_pass_norm() -> bool:
    """Whether a float32 RMSNorm runs the one-pass C++ kernel: off Intel, where fp32 prefill already runs on
    oneDNN's packed weights (``fp32_packed_rows``) and its numbers differ from Hugging Face's in the last bits
    anyway. Its sum of squares adds in another order than torch's ``mean``; on Intel, where fp32 prefill keeps
    MKL's (Hugging Face's) GEMM, the norm keeps Hugging Face's exact ops too."""
    return not mkl_gemv_fast()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as Hugging Face Llama does.

    ``weight=None`` (folded into the next layer) only normalizes. Below float32 (bf16 on CPU) the
    C++ kernel ``engine.cpu_ops.rms_norm`` runs it in one pass (the same float32 arithmetic and
    roundings; its sum of squares adds in another order, which moves about 3 in a million bf16
    results by one unit in the last place); float32 does too where ``fp32_one_pass_norm`` (2-core AMD
    EPYC, 64 fp32 requests: 355-365 -> 357-394 tok/s), else it keeps Hugging Face's exact ops.
    """
    if x.dtype != torch.float32 or fp32_one_pass_norm():
        return cpu_ops.rms_norm(x, weight, eps)
    if weight is None:
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf
