"""Which linear layers to keep in floating point: the KL each one adds when it alone is INT8.

Mixed precision in the manner of LLM.int8() and of most quantization recipes that leave a few
outlier-heavy layers in 16/32-bit: each *unit* (the linear layers the engine fuses into one GEMM:
``q/k/v_proj``, ``o_proj``, ``gate/up_proj``, ``down_proj`` of every decoder layer, and the LM
head) is quantized alone, the model runs the calibration records, and the mean
``KL(P_float || P_unit_int8)`` of the next-token distributions over their tokens is that unit's
sensitivity. The most sensitive units stay float (``W8A8Config.float_units``); a unit is the
engine's fusion group, so the engine and ``lmforge evaluate`` run the same layers in INT8.

Cost: one forward pass of the calibration records per unit (121 for SmolLM2-135M).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

#: Linear layers of one decoder layer that the engine runs as one GEMM (``engine/model.py``).
FUSED_UNITS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def quantization_units(model) -> list[tuple[str, ...]]:
    """The fused linear groups of a Llama-style causal LM (``FUSED_UNITS`` per layer, then ``lm_head``)."""
    layers = range(len(model.model.layers))
    units = [tuple(f"model.layers.{i}.{name}" for name in unit) for i in layers for unit in FUSED_UNITS]
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        units.append(("lm_head",))
    return units


@torch.no_grad()
def unit_sensitivity(
    model,
    batches: Iterable[torch.Tensor],
    quantize_linear: Callable[[nn.Linear], nn.Module],
    units: list[tuple[str, ...]] | None = None,
) -> dict[tuple[str, ...], float]:
    """Mean KL (nats per token) that INT8 of each unit alone adds, on calibration batches.

    Args:
        model: the float causal LM (after SmoothQuant, when the checkpoint will use it).
        batches: token ids ``[1, T]``.
        quantize_linear: ``nn.Linear`` -> its INT8 runtime layer (e.g. ``W8A8Linear`` of the
            per-channel weights).
        units: groups of module names; default ``quantization_units(model)``.

    Returns:
        ``{unit: KL}`` in the order of ``units``.

    Raises:
        ValueError: no calibration batch.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("calibration data is empty; the sensitivity needs at least one record")
    units = quantization_units(model) if units is None else units

    def logprobs() -> list[torch.Tensor]:
        return [
            F.log_softmax(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float(), dim=-1)
            for ids in batches
        ]  # each [T, vocab]

    reference = logprobs()
    tokens = sum(r.shape[0] for r in reference)
    result = {}
    for unit in units:
        originals = [model.get_submodule(name) for name in unit]
        for name, linear in zip(unit, originals):
            model.set_submodule(name, quantize_linear(linear))
        try:
            kl = sum(
                float((ref.exp() * (ref - got)).sum()) for ref, got in zip(reference, logprobs())
            )  # summed over tokens
        finally:
            for name, linear in zip(unit, originals):
                model.set_submodule(name, linear)
        # KL >= 0; a unit whose INT8 copy leaves the logits all but unchanged can sum to -1e-9 in float32
        result[unit] = max(kl / tokens, 0.0)
    return result
