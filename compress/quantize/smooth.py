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
from collections.abc import Iterable

import torch


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
    hooks = []
    for name in layer_names:

        def hook(module, inputs, output, name=name):
            x = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0).float()  # [in]
            stats[name] = torch.maximum(stats[name], x) if name in stats else x

        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        for ids in batches:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for h in hooks:
            h.remove()
    return stats


@torch.no_grad()
def smooth_model(model, batches: Iterable[torch.Tensor], *, alpha: float = 0.5) -> int:
    """Apply SmoothQuant in place to a Llama-style causal LM (fp32).

    Args:
        model: ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``.
        batches: calibration token ids, each ``[1, T]``.
        alpha: migration strength in [0, 1] (0.5 in the paper).

    Returns:
        Number of linear layers whose inputs were smoothed.

    Raises:
        ValueError: alpha out of range, or no calibration batch.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant_alpha={alpha}: must be in [0, 1] (0.5 in the SmoothQuant paper)")
    groups = smooth_groups(model)
    names = {n for g in groups for n in g.layers}
    batches = list(batches)
    if not batches:
        raise ValueError("calibration data is empty; SmoothQuant needs at least one record")
    stats = activation_absmax(model, batches, names)
    config = model.config
    heads, kv_heads = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for group in groups:
        linears = [model.get_submodule(n) for n in group.layers]
        x_max = stats[group.layers[0]].clamp(min=1e-5)  # [in]
        w_max = torch.stack([linear.weight.abs().amax(dim=0) for linear in linears]).amax(dim=0).clamp(min=1e-5)  # [in]
        scale = (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)  # [in]
        if group.kind == "gqa_rows":
            per_group = scale.view(kv_heads, heads // kv_heads, head_dim).amax(dim=1)  # [kv_heads, head_dim]
            scale = per_group.repeat_interleave(heads // kv_heads, dim=0).reshape(-1)  # [heads * head_dim]
            producer_scale = per_group.reshape(-1)  # [kv_heads * head_dim]
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
