"""Rotations that make a model's activations easy to quantize per token, at no change to its function.

An orthogonal ``Q`` can be applied to a linear layer's input and folded into its weight:
``x W^T == (x Q)(W Q)^T``. A random Hadamard ``Q`` spreads every outlier channel of ``x`` over all
channels, so one per-token INT8 scale rounds the others far less (QuaRot, Ashkboos et al. 2024;
SpinQuant, Liu et al. 2024; the random signs follow QuIP#'s randomized Hadamard transform, Tseng et
al. 2024). ``w8a8`` (``compress.quantize.methods.W8A8Config.rotation``) applies two of them to a
Llama-style decoder before SmoothQuant and INT8 quantization:

* **The residual stream** (``rotate_residual``, offline only): every RMSNorm weight is first folded
  into the linear layers it feeds (``fold_norms``: ``q/k/v`` and ``gate/up`` columns, and an untied
  ``lm_head``), so the norms only normalize, which commutes with ``Q``. Then the embedding rows and
  the inputs of ``q/k/v``, ``gate/up`` and the head are rotated by ``Q`` (``W <- W Q``) and the
  outputs of ``o_proj`` and ``down_proj`` by ``Q^T`` (``W <- Q^T W``), so the residual stream holds
  ``h Q`` everywhere. Nothing runs at inference time; the checkpoint's norm weights are ones and its
  head is stored untied (``tie_word_embeddings`` false).
* **The input of ``down_proj``** (``rotate_down_proj_inputs``, online): ``act(gate) * up`` has no
  linear producer to fold a rotation into, so each run of ``block`` channels is multiplied at run
  time by the +-1 Sylvester Hadamard matrix (``engine.quant.int8.block_hadamard``, stored as
  ``X.input_hadamard``); random signs ``D`` are folded into ``up_proj``'s output rows and
  ``D H / block`` into ``down_proj``'s weight.

``load_smoothed_model`` (``compress.quantize.calibration``) rotates the residual stream, applies
SmoothQuant in that basis (the ``down_proj`` group's factors fold into ``up_proj`` as before), then
rotates the ``down_proj`` inputs, so calibration passes always run a model of the same function.

Both rotations are on by default because together they cut the W8A8 KL divergence against the fp32
model by more than half on SmolLM2-135M, where the residual rotation alone does not help; ``block`` is
64, the cheapest size that does as well as larger ones (figures: docs/quantization.md).
"""

from __future__ import annotations

import contextlib
import io

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.int8 import block_hadamard, hadamard_matrix

#: Seed of the rotations' random signs (a checkpoint is reproducible from its config).
ROTATION_SEED = 0


def orthogonal_rotation(n: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """A random orthogonal ``[n, n]`` float64 matrix for the residual stream: ``diag(signs) H / sqrt(n)``.

    ``H`` is a Hadamard matrix of size ``n`` from ``torchao.prototype.spinquant`` (sizes ``K * 2^m`` for
    the ``K`` it ships: 576 = 36 * 16, 960 = 60 * 16, 2048, ...); for other sizes, ``Q`` of the QR
    decomposition of a Gaussian matrix (a random rotation, a little worse at spreading outliers).
    """
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a note on a GPU kernel it lacks
            from torchao.prototype.spinquant.hadamard_utils import random_hadamard_matrix

            return random_hadamard_matrix(n, "cpu", seed=seed).to(torch.float64)
    except (AssertionError, ImportError):  # no Hadamard matrix of that size there
        gen = torch.Generator().manual_seed(seed)
        q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))[None, :]


def _decoder_layers(model) -> list:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "mlp") and hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(
            f"rotation needs a Llama-style decoder (model.layers[i].self_attn / .mlp), got {type(model).__name__}; "
            "quantize without it (--rotation none)"
        )
    return list(layers)


@torch.no_grad()
def fold_norms(model) -> None:
    """Fold every RMSNorm weight into the linear layers it feeds; the norms keep weight 1.

    ``input_layernorm`` into ``q/k/v_proj``'s columns, ``post_attention_layernorm`` into ``gate/up_proj``'s,
    the final ``model.norm`` into ``lm_head``, which is untied from the embedding first
    (``config.tie_word_embeddings`` becomes false). The model computes the same function.
    """
    for layer in _decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        for norm, linears in (
            (layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
            (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj)),
        ):
            for linear in linears:
                linear.weight.mul_(norm.weight[None, :].to(linear.weight.dtype))
            norm.weight.fill_(1.0)
    head = model.lm_head
    head.weight = nn.Parameter(head.weight * model.model.norm.weight[None, :].to(head.weight.dtype))  # [vocab, hidden]
    model.model.norm.weight.fill_(1.0)
    model.config.tie_word_embeddings = False


def rotate_residual_stream(model, seed: int = ROTATION_SEED) -> None:
    """``fold_norms``, then ``rotate_residual`` by ``orthogonal_rotation(hidden_size, seed)``.

    Raises:
        ValueError: not a Llama-style decoder.
    """
    fold_norms(model)  # raises first for a model that is not a Llama-style decoder
    rotate_residual(model, orthogonal_rotation(model.config.hidden_size, seed))


@torch.no_grad()
def rotate_residual(model, q: torch.Tensor) -> None:
    """Rotate the residual stream by the orthogonal ``q [hidden, hidden]`` (after ``fold_norms``).

    Embedding rows and the inputs of ``q/k/v``, ``gate/up`` and ``lm_head`` become ``W q``; the outputs
    of ``o_proj`` and ``down_proj`` (and their biases) ``q^T W``. Computed in float64, stored in each
    weight's dtype.
    """

    def right(linear) -> None:
        linear.weight.copy_(linear.weight.double() @ q)

    def left(linear) -> None:
        linear.weight.copy_(q.T @ linear.weight.double())
        if linear.bias is not None:
            linear.bias.copy_(linear.bias.double() @ q)

    embed = model.model.embed_tokens
    embed.weight.copy_(embed.weight.double() @ q)
    for layer in _decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            right(linear)
        left(attn.o_proj)
        left(mlp.down_proj)
    right(model.lm_head)


class RotatedInputLinear(nn.Linear):
    """``nn.Linear`` whose weight expects its input rotated: ``y = block_hadamard(x, input_hadamard) W^T + b``.

    The float form of a ``down_proj`` after ``rotate_down_proj_inputs`` (calibration passes run it);
    quantized, it becomes a ``W8A8Linear`` with the same ``input_hadamard``.
    """

    input_hadamard: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(block_hadamard(x, self.input_hadamard), self.weight, self.bias)


@torch.no_grad()
def rotate_down_proj_inputs(model, block: int, seed: int = ROTATION_SEED) -> None:
    """Give every ``down_proj`` an online Hadamard input rotation of ``block`` channels.

    With random signs ``d`` (``[intermediate]``) and the +-1 block-diagonal Hadamard ``H``: ``up_proj``'s
    output rows (and bias) are multiplied by ``d`` (``act(gate) * up`` becomes ``x D``), and ``down_proj``
    becomes a ``RotatedInputLinear`` with weight ``W D H / block``: ``block_hadamard(x D) (W D H / block)^T
    == x W^T``, so the model computes the same function.

    Raises:
        ValueError: ``block`` is not a power of two dividing the intermediate size.
    """
    layers = _decoder_layers(model)
    width = layers[0].mlp.down_proj.weight.shape[1]  # intermediate size
    if block < 2 or block & (block - 1) or width % block:
        raise ValueError(
            f"down_proj input of {width} channels is not a multiple of rotation block {block} (a power of two); "
            "use a block that divides it, or --rotation none"
        )
    gen = torch.Generator().manual_seed(seed + 1)
    h = hadamard_matrix(block, torch.float64)
    for layer in layers:
        up, down = layer.mlp.up_proj, layer.mlp.down_proj
        signs = torch.randint(0, 2, (width,), generator=gen, dtype=torch.float64) * 2 - 1  # [intermediate]
        up.weight.mul_(signs[:, None].to(up.weight.dtype))
        if up.bias is not None:
            up.bias.mul_(signs.to(up.bias.dtype))
        w = down.weight.double() * signs[None, :]  # W D, [hidden, intermediate]
        w = (w.view(w.shape[0], width // block, block) @ h).view_as(w) / block  # W D H / block
        rotated = RotatedInputLinear(width, down.out_features, bias=down.bias is not None, dtype=down.weight.dtype)
        rotated.weight.copy_(w)
        if down.bias is not None:
            rotated.bias.copy_(down.bias)
        rotated.input_hadamard = block
        layer.mlp.down_proj = rotated


def rotated_inputs(model) -> dict[str, int]:
    """``{module name: block}`` of the model's ``RotatedInputLinear`` layers."""
    return {name: m.input_hadamard for name, m in model.named_modules() if isinstance(m, RotatedInputLinear)}
