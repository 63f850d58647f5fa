"""The model spec: one description of a Llama-family decoder, and the architectures lmforge runs.

``ModelSpec`` holds the ``config.json`` fields (transformers' names) that the engine, the
training planner (``compress.scale.memory_model``, ``compress.scale.plan``), the benchmarks' compute bound
(``bench.bound``) and the checkpoint checks need. ``ARCHITECTURES`` is the one registry of
supported ``model_type`` values: Llama (incl. SmolLM2), Mistral (sliding window) and Qwen2
(q/k/v bias); adding an architecture is one entry there.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError


def _llama_bias(config: dict[str, Any]) -> bool:
    return bool(config.get("attention_bias", False))


def _qwen2_refuse(config: dict[str, Any]) -> str | None:
    if config.get("use_sliding_window", False):
        return "qwen2 with use_sliding_window=True is not supported by the engine; set it to false"
    return None


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How a ``model_type`` differs from Llama: q/k/v biases, a sliding attention window, and
    options the engine refuses (``refuse`` returns the reason, or ``None``)."""

    qkv_bias: Callable[[dict[str, Any]], bool]
    sliding_window: Callable[[dict[str, Any]], int | None]
    refuse: Callable[[dict[str, Any]], str | None] = lambda config: None


#: ``config.json`` ``model_type`` -> its readers. The causal-LM stages run exactly these.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(_llama_bias, lambda config: None),
    "mistral": Architecture(lambda config: False, lambda config: config.get("sliding_window")),
    "qwen2": Architecture(lambda config: True, lambda config: None, _qwen2_refuse),
}


def check_positive(name: str, value: int) -> int:
    """``value`` when it is an integer > 0; else ``ValueError`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return value


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Sizes and options of a Llama-family decoder (``config.json`` field names of transformers).

    ``head_dim`` given as ``None`` becomes ``hidden_size // num_attention_heads``. The fields
    after ``gated_mlp`` matter to the engine only; their defaults are Llama's.

    Raises:
        ValueError: a size is not a positive integer, ``hidden_size`` is not divisible by
            ``num_attention_heads`` (without ``head_dim``), or ``num_attention_heads`` is not a
            multiple of ``num_key_value_heads``.
    """

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
    gated_mlp: bool = True  # SwiGLU (gate, up, down); False: a GPT MLP (up, GeLU, down)
    model_type: str = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        for name in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "intermediate_size",
        ):
            check_positive(name, getattr(self, name))
        if self.head_dim is not None:
            check_positive("head_dim", self.head_dim)
        elif self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; "
                "pass head_dim explicitly"
            )
        else:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def dim_head(self) -> int:
        """``head_dim`` (always resolved)."""
        return self.head_dim

    @property
    def q_size(self) -> int:
        """Width of the query projection output: heads x head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection output: KV heads x head_dim."""
        return self.num_key_value_heads * self.head_dim

    # -- FLOPs per token (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Table 1)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's linear maps: q, k, v, o projections and the SwiGLU MLP."""
        attn = self.hidden_size * (2 * self.q_size + 2 * self.kv_size)  # q + o, k + v
        mlp = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        return attn + mlp

    def body_flops(self, context_len: int) -> int:
        """FLOPs to push one token at position ``context_len - 1`` through all layers.

        ``2 * layer weights`` for the linear maps plus ``2 * 2 * context_len * q_size`` per layer
        for ``Q K^T`` and ``P V`` over the ``context_len`` cached tokens (itself included).
        """
        return self.num_hidden_layers * (2 * self.layer_matmul_params + 4 * context_len * self.q_size)

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the LM head for one token (``2 * hidden * vocab``)."""
        return 2 * self.hidden_size * self.vocab_size

    # -- reading

    @classmethod
    def from_config(
        cls, config: dict[str, Any], *, check_architecture: bool = False, where: str | Path = "config.json"
    ) -> ModelSpec:
        """Build from a transformers ``config.json`` dict.

        Args:
            config: the dict (``AutoConfig.to_dict()`` or the file's JSON).
            check_architecture: refuse a ``model_type`` outside ``ARCHITECTURES`` (the engine
                runs only those); otherwise an unknown type is read as Llama.
            where: the file or directory named in errors.

        Raises:
            ValueError: a size field is missing or not valid (``__post_init__``).
            CheckpointError: ``check_architecture`` and the architecture is not supported.
        """
        missing = [
            k
            for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size")
            if k not in config
        ]
        if missing:
            raise ValueError(f"config.json lacks {missing}; pass the model sizes explicitly")
        model_type = config.get("model_type") or "llama"
        if check_architecture:
            check_architecture_supported(config, where, engine=True)
        arch = ARCHITECTURES.get(model_type, ARCHITECTURES["llama"])
        return cls(
            num_hidden_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            intermediate_size=config["intermediate_size"],
            head_dim=config.get("head_dim"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch.qkv_bias(config),
            model_type=model_type,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta") or 10000.0),
            rope_scaling=config.get("rope_scaling"),
            sliding_window=arch.sliding_window(config),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelSpec:
        """Read the spec from ``config.json`` of a checkpoint directory (``resolve_checkpoint``'s result)."""
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))


def check_architecture_supported(config: dict[str, Any], where: str | Path, *, engine: bool = False) -> None:
    """Refuse a ``config.json`` dict the causal-LM stages (with ``engine``: the engine) cannot run.

    Raises:
        CheckpointError: naming ``where``: a ``model_type`` outside ``ARCHITECTURES`` (the
            supported ones are listed) or, with ``engine``, an option of it the engine refuses.
    """
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"{where}: unsupported architecture model_type={model_type!r}; "
            f"supported causal LMs: {', '.join(ARCHITECTURES)}"
        )
    reason = ARCHITECTURES[model_type].refuse(config) if engine else None
    if reason:
        raise CheckpointError(f"{where}: {reason}")
