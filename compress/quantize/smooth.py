"""SmoothQuant: move activation outliers into the weights before INT8 quantization.

Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models". A few input channels of some linear layers (SmolLM2's ``down_proj`` reaches
|x| ~ 100 while most channels stay below 5) ruin per-tensor INT8 activation scales. For each
channel ``j`` of a linear input, ``s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)``; the input is
divided by ``s`` (folded into the preceding operation, so nothing is added at run time) and the
weight columns multiplied by ``s``. The fp32 model computes the same function (up to rounding);
only the quantization error changes.

Folding points in a Llama/Mistral/Qwen2 decoder layer:

* ``q/k/v_proj`` input = ``input_layernorm`` output -> divide the norm weight;
* ``gate/up_proj`` input = ``post_attention_layernorm`` output -> divide the norm weight;
* ``down_proj`` input = ``act(gate) * up`` -> divide ``up_proj``'s output rows (and bias);
* ``o_proj`` input = attention output -> divide ``v_proj``'s output rows; with grouped-query
  attention one value channel feeds ``num_heads / num_kv_heads`` query heads, so the factor is
  shared by the group (the maximum over the group's channels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch

from engine.quant.int8 import dequantize_weight, quantize_per_token, quantize_weight_per_channel


@dataclasses.dataclass(frozen=True)
class SmoothGroup:
    """Linear layers that read one input, and how to fold ``1/s`` into that input's producer."""

    layers: tuple[str, ...]  # qualified names of the consuming linear layers
    producer: str  # qualified name of the norm or linear layer whose output is the input
    kind: str  # "norm" (divide weight), "rows" (divide output rows), "gqa_rows" (v_proj -> o_proj)


def smooth_groups(model) -> list[SmoothGroup]:
    """The SmoothQuant groups of every decoder layer of a Llama-style ``model``."""
    groups = []
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        groups += [
            SmoothGroup(
                (f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj"),
                f"{p}.input_layernorm",
                "norm",
            ),
            SmoothGroup((f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"), f"{p}.post_attention_layernorm", "norm"),
            SmoothGroup((f"{p}.mlp.down_proj",), f"{p}.mlp.up_proj", "rows"),
            SmoothGroup((f"{p}.self_attn.o_proj",), f"{p}.self_attn.v_proj", "gqa_rows"),
        ]
    return groups


@torch.no_grad()
def activation_absmax(model, batches: Iterable[torch.Tensor], layer_names: set[str]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of the named linear layers over calibration batches.

    Args:
        batches: token id tensors ``[1, T]``.

    Returns:
        ``{name: [in_features]}`` float32.
    """
    stats: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        x = x.abs().amax(dim=0).float()  # [in]
        stats[name] = torch.maximum(stats[name], x) if name in stats else x

    _run_with_input_hooks(model, batches, layer_names, record)
    return stats


def _run_with_input_hooks(
    model, batches: Iterable[torch.Tensor], layer_names: set[str], record: Callable[[str, torch.Tensor], None]
) -> None:
    """Run ``model`` on each batch with ``record(name, x [tokens, in_features])`` called on the input of every
    named layer; the hooks are removed afterwards, also when a forward pass raises."""
    hooks = []
    for name in layer_names:

        def hook(module, inputs, output, name=name):
            record(name, inputs[0].detach().reshape(-1, inputs[0].shape[-1]))

        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        for ids in batches:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for h in hooks:
            h.remove()


def _smoothing_scale(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)`` per input channel ``[in]``."""
    return (x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)


def _gqa_scale(scale: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``o_proj``'s factors shared per grouped-query group: ``(o_proj [heads * hd], v_proj [kv_heads * hd])``."""
    per_group = scale.view(kv_heads, heads // kv_heads, head_dim).amax(dim=1)  # [kv_heads, head_dim]
    return per_group.repeat_interleave(heads // kv_heads, dim=0).reshape(-1), per_group.reshape(-1)


def _head_shape(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


@torch.no_grad()
def input_samples(
    model, batches: Iterable[torch.Tensor], layer_names: set[str], *, max_rows: int = 256
) -> dict[str, torch.Tensor]:
    """Up to ``max_rows`` input rows of each named linear layer, evenly spaced over the batches' tokens.

    Returns:
        ``{name: [rows, in_features]}`` float32.
    """
    batches = list(batches)
    per_batch = max(1, -(-max_rows // max(len(batches), 1)))
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in layer_names}

    def record(name: str, x: torch.Tensor) -> None:
        pick = torch.linspace(0, x.shape[0] - 1, min(per_batch, x.shape[0])).round().long()
        rows[name].append(x[pick].float())

    _run_with_input_hooks(model, batches, layer_names, record)
    return {name: torch.cat(r)[:max_rows] for name, r in rows.items()}


def w8a8_output_error(x: torch.Tensor, weights: list[torch.Tensor], scale: torch.Tensor) -> float:
    """Squared error of the W8A8 outputs of ``weights`` on ``x`` smoothed by ``scale``, relative to fp32.

    Args:
        x: ``[rows, in]`` inputs; weights: each ``[out, in]``; scale: ``[in]`` SmoothQuant factors.

    Returns:
        ``sum_W ||Q(x / s) Q(W s)^T - x W^T||^2 / ||x W^T||^2`` with per-token activation and
        per-channel weight INT8 (``engine.quant.int8``).
    """
    xq, x_scale = quantize_per_token(x / scale)
    x_deq = xq.float() * x_scale  # [rows, in]
    error = 0.0
    for w in weights:
        y = x @ w.t()  # [rows, out]
        y_q = x_deq @ dequantize_weight(*quantize_weight_per_channel(w * scale)).t()
        error += float((y_q - y).pow(2).sum() / y.pow(2).sum().clamp(min=1e-12))
    return error


@torch.no_grad()
def calibrate_alpha(
    model, batches: Iterable[torch.Tensor], grid: Sequence[float], *, max_rows: int = 256
) -> dict[str, float]:
    """Per SmoothQuant group, the alpha of ``grid`` with the least W8A8 output error on calibration inputs.

    Each group's inputs (``input_samples``) are smoothed with every alpha of the grid, the
    group's linear layers are run in W8A8 and compared with fp32 (``w8a8_output_error``); the
    alpha with the least error wins. Groups are independent: smoothing one group leaves the fp32
    function, and so every other group's inputs, unchanged. (The per-layer search of the
    SmoothQuant authors' later work and of Intel Neural Compressor's ``auto`` alpha follows the
    same idea with other error measures.)

    Args:
        model: Llama-style causal LM (fp32, not yet smoothed).
        grid: candidate alphas, each in [0, 1].

    Returns:
        ``{first linear of the group: alpha}`` for every group of ``smooth_groups`` (the
        ``alpha`` argument of ``smooth_model``).

    Raises:
        ValueError: an alpha out of [0, 1], an empty grid, or no calibration batch.
    """
    grid = list(grid)
    if not grid or any(not 0.0 <= a <= 1.0 for a in grid):
        raise ValueError(f"smoothquant alpha grid {grid}: needs values in [0, 1]")
    batches = list(batches)
    if not batches:
        raise ValueError("calibration data is empty; SmoothQuant needs at least one record")
    groups = smooth_groups(model)
    names = {g.layers[0] for g in groups}
    stats = activation_absmax(model, batches, names)
    samples = input_samples(model, batches, names, max_rows=max_rows)
    heads, kv_heads, head_dim = _head_shape(model.config)
    chosen = {}
    for group in groups:
        weights = [model.get_submodule(n).weight.float() for n in group.layers]
        w_max = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)  # [in]
        errors = {}
        for alpha in grid:
            scale = _smoothing_scale(stats[group.layers[0]], w_max, alpha)
            if group.kind == "gqa_rows":
                scale = _gqa_scale(scale, heads, kv_heads, head_dim)[0]
            errors[alpha] = w8a8_output_error(samples[group.layers[0]], weights, scale)
        chosen[group.layers[0]] = min(errors, key=errors.get)
    return chosen


@torch.no_grad()
def smooth_model(model, batches: Iterable[torch.Tensor], *, alpha: float | dict[str, float] = 0.5) -> int:
    """Apply SmoothQuant in place to a Llama-style causal LM (fp32).

    Args:
        model: ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``.
        batches: calibration token ids, each ``[1, T]``.
        alpha: migration strength in [0, 1] (0.5 in the paper), one for every group, or per
            group ``{first linear of the group: alpha}`` (``calibrate_alpha``).

    Returns:
        Number of linear layers whose inputs were smoothed.

    Raises:
        ValueError: alpha out of range, a group without an alpha, or no calibration batch.
    """
    groups = smooth_groups(model)
    alphas = alpha if isinstance(alpha, dict) else {g.layers[0]: alpha for g in groups}
    for group in groups:
        a = alphas.get(group.layers[0])
        if a is None or not 0.0 <= a <= 1.0:
            raise ValueError(
                f"smoothquant_alpha={a} for {group.layers[0]}: must be in [0, 1] (0.5 in the SmoothQuant paper)"
            )
    names = {n for g in groups for n in g.layers}
    batches = list(batches)
    if not batches:
        raise ValueError("calibration data is empty; SmoothQuant needs at least one record")
    stats = activation_absmax(model, batches, names)
    heads, kv_heads, head_dim = _head_shape(model.config)
    for group in groups:
        linears = [model.get_submodule(n) for n in group.layers]
        w_max = torch.stack([linear.weight.abs().amax(dim=0) for linear in linears]).amax(dim=0)  # [in]
        scale = _smoothing_scale(stats[group.layers[0]], w_max, alphas[group.layers[0]])  # [in]
        if group.kind == "gqa_rows":
            scale, producer_scale = _gqa_scale(scale, heads, kv_heads, head_dim)
        else:
            producer_scale = scale
        producer = model.get_submodule(group.producer)
        if group.kind == "norm":
            producer.weight.div_(producer_scale)
        else:
            producer.weight.div_(producer_scale[:, None])
            if getattr(producer, "bias", None) is not None:
                producer.bias.div_(producer_scale)
        for linear in linears:
            linear.weight.mul_(scale[None, :])
    return len(names)
