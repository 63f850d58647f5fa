"""Calibration passes of the INT8 methods: calibration records, the SmoothQuant / rotated fp32 model,
the fused groups kept float by the KL they add, and the input channels given their own scale.

``compress.quantize.methods`` runs these before it quantizes; each reads the calibration records
(``calibration_data``, default: the training split of the default data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.data.records import default_split_records
from compress.quantize.rotate import rotate_down_proj_inputs, rotate_residual_stream, rotated_inputs
from compress.quantize.sensitivity import quantization_units, unit_sensitivity
from compress.quantize.smooth import activation_absmax, calibrate_alpha, smooth_model
from engine.errors import UsageError
from engine.quant.int8 import int8_linear, quantize_weight_per_channel
from engine.records import encode_record, read_records


def calibration_batches(tokenizer, *, data: str | None, num_records: int, max_length: int = 256):
    """Token id tensors ``[1, T]`` of the first ``num_records`` calibration records.

    Raises:
        DataError: a bad calibration file (names file:line).
    """
    records = read_records(data) if data else default_split_records("train")[0]
    return [torch.tensor([encode_record(tokenizer, r, max_length=max_length)[0]]) for r in records[:num_records]]


def load_smoothed_model(
    source_dir: Path,
    *,
    alpha: float | None,
    data: str | None,
    num_records: int,
    alpha_grid: tuple[float, ...] | None = None,
    rotation_block: int | None = None,
):
    """The fp32 causal LM of ``source_dir``, with SmoothQuant applied when ``alpha`` or ``alpha_grid`` is set.

    With ``alpha_grid``, every group's alpha is calibrated (``calibrate_alpha``) on the same records.
    With ``rotation_block``, the residual stream is rotated before SmoothQuant and the ``down_proj``
    inputs after it (``compress.quantize.rotate``); those layers become ``RotatedInputLinear``.

    Raises:
        UsageError: a rotation of a model that is not a Llama-style decoder, or a block that does not
            divide its intermediate size.
    """
    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    try:
        if rotation_block is not None:
            rotate_residual_stream(model)
        if alpha is not None or alpha_grid:
            tokenizer = AutoTokenizer.from_pretrained(source_dir)
            batches = calibration_batches(tokenizer, data=data, num_records=num_records)
            smooth_model(model, batches, alpha=calibrate_alpha(model, batches, alpha_grid) if alpha_grid else alpha)
        if rotation_block is not None:
            rotate_down_proj_inputs(model, rotation_block)
    except ValueError as exc:
        if rotation_block is None:
            raise
        raise UsageError(f"--rotation hadamard: {exc}") from exc
    return model


def most_sensitive_units(model, tokenizer, config: Any) -> list[str]:
    """Module names of the ``config.float_units`` fused groups (``config``: an ``Int8WeightOnlyConfig`` or
    ``W8A8Config`` of ``compress.quantize.methods``) whose INT8 (``config.scheme``) adds the most KL
    per weight (kept float): float weights cost bytes, so a group is ranked by the KL it adds divided
    by its parameter count."""

    def quantized(linear):
        weight_int8, scale = quantize_weight_per_channel(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        rotation = getattr(linear, "input_hadamard", None)  # a RotatedInputLinear's block
        return int8_linear(config.scheme, weight_int8, scale, bias, input_hadamard=rotation)

    units = [u for u in quantization_units(model) if not any(is_skipped(n, config.skip_modules) for n in u)]
    batches = calibration_batches(
        tokenizer, data=config.calibration_data, num_records=config.sensitivity_records, max_length=128
    )
    sensitivity = unit_sensitivity(model, batches, quantized, units)

    def kl_per_weight(unit: tuple[str, ...]) -> float:
        # per weight kept float: the LM head (21% of SmolLM2's weights) must add 20x a layer's KL to be chosen
        return sensitivity[unit] / sum(model.get_submodule(name).weight.numel() for name in unit)

    ranked = sorted(units, key=kl_per_weight, reverse=True)[: config.float_units]
    return [name for unit in ranked for name in unit]


def outlier_input_channels(model, tokenizer, config: Any, float_modules=()) -> dict[str, torch.Tensor]:
    """``{module name: int64 [config.outlier_channels]}`` (``config``: a ``W8A8Config``): for every INT8
    linear layer matching ``config.outlier_modules``, the input channels with the largest max |x| over the first
    ``calibration_records`` calibration records (sorted ascending).

    Raises:
        UsageError: ``outlier_modules`` names no INT8 linear layer, or a layer has no more input
            channels than ``outlier_channels``.
    """
    names = {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and is_skipped(name, config.outlier_modules)
        and not is_skipped(name, config.skip_modules)
        and name not in float_modules
    }
    if not names:
        raise UsageError(
            f"outlier_modules={config.outlier_modules!r} names no INT8 linear layer",
            fix="name a quantized layer (e.g. lm_head), or pass --outlier-channels 0",
        )
    both = sorted(names & set(rotated_inputs(model)))
    if both:
        raise UsageError(
            f"outlier_modules={config.outlier_modules!r} includes {both[0]}, whose input is rotated (--rotation "
            "hadamard spreads its outliers already)",
            fix="leave down_proj out of --outlier-modules, or pass --rotation none",
        )
    batches = calibration_batches(tokenizer, data=config.calibration_data, num_records=config.calibration_records)
    absmax = activation_absmax(model, batches, names)
    out = {}
    for name, x_max in absmax.items():
        if x_max.numel() <= config.outlier_channels:
            raise UsageError(
                f"outlier_channels={config.outlier_channels}: {name} has only {x_max.numel()} input channels",
                fix="pass a smaller --outlier-channels",
            )
        out[name] = x_max.topk(config.outlier_channels).indices.sort().values
    return out


def is_skipped(name: str, skip_modules: tuple[str, ...]) -> bool:
    """Whether module ``name`` matches an entry of ``skip_modules`` (whole name or dotted suffix)."""
    return any(name == s or name.endswith("." + s) for s in skip_modules)
