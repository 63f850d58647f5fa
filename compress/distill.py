"""``lmforge distill``: knowledge distillation of a teacher causal LM into a smaller student.

Student (``build_student``):

* ``layers`` (default): the teacher with a subset of its decoder layers, initialised from those
  layers' weights (every other layer by default), as DistilBERT does (Sanh et al. 2019,
  "DistilBERT, a distilled version of BERT", section 3); embeddings, final norm and head are
  copied. The student keeps the teacher's ``model_type`` (e.g. ``llama``), so the engine runs it.
* ``config``: a randomly initialised model from the teacher's config with overrides (e.g. fewer
  layers, a smaller ``intermediate_size``).

Loss per micro-batch (``distillation_loss``), weights configurable:

    alpha * T^2 * KL(softmax(z_t / T) || softmax(z_s / T))       Hinton, Vinyals & Dean 2015,
                                                                   "Distilling the Knowledge in a
                                                                   Neural Network" (T^2 keeps the
                                                                   gradient scale independent of T)
  + beta  * cross-entropy(z_s, labels)                            on assistant tokens
  + gamma * mean(1 - cos(h_s, h_t))                               DistilBERT's cosine embedding
                                                                   loss on hidden states

The KL term covers every non-padding position; the hidden-state term pairs student layer input i
with the teacher layer it was copied from (and the final normed outputs). The teacher runs in
eval mode under ``torch.no_grad``. The loop, monitoring, checkpoints and resume are those of
``compress.training``, shared with fine-tuning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

import torch
import torch.nn.functional as F

from compress.errors import UsageError
from compress.finetune import add_train_arguments, run_recipe, train_config_kwargs
from compress.training import TrainConfig, TrainingError, TrainingRecipe, token_losses


@dataclasses.dataclass
class DistillConfig(TrainConfig):
    """``TrainConfig`` plus the student and the loss weights.

    Attributes:
        student_layers: ``every-other`` (teacher layers 0, 2, 4, ...) or comma-separated teacher
            layer indices to copy (``layers`` student).
        student_config: ``config.json`` overrides for a randomly initialised student instead of
            a layer subset (e.g. ``{"num_hidden_layers": 4}``); ``None``: use ``student_layers``.
        alpha: weight of the temperature-scaled KL term.
        beta: weight of the cross-entropy on labels.
        gamma: weight of the hidden-state cosine loss (needs equal hidden sizes).
        temperature: softmax temperature T of the KL term.
    """

    run_dir: str = "runs/distill"
    lr: float = 2e-4
    student_layers: str = "every-other"
    student_config: dict[str, Any] | None = None
    alpha: float = 0.5
    beta: float = 0.5
    gamma: float = 0.1
    temperature: float = 2.0

    def validate(self) -> None:
        super().validate()
        for name in ("alpha", "beta", "gamma"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name}={getattr(self, name)}: loss weights must be >= 0")
        if self.alpha + self.beta + self.gamma == 0:
            raise UsageError("alpha, beta and gamma are all 0: nothing to train on")
        if self.temperature <= 0:
            raise UsageError(f"temperature={self.temperature}: must be > 0")
        if self.student_config is not None:
            check_student_config(self.student_config)


#: ``config.json`` shape fields a student may override; each must be an integer >= 1.
STUDENT_SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")


def check_student_config(overrides: Any) -> None:
    """Refuse ``--student-config`` values a model could not be built from, before the teacher loads.

    Raises:
        UsageError: not a JSON object, or a shape field that is not an integer >= 1.
    """
    example = '{"num_hidden_layers": 4}'
    if not isinstance(overrides, dict):
        raise UsageError(f"--student-config {json.dumps(overrides)}: expected a JSON object of config.json fields", fix=f"e.g. '{example}'")
    for key in STUDENT_SHAPE_FIELDS:
        value = overrides.get(key)
        if key in overrides and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UsageError(f"--student-config {key}={value!r}: must be an integer >= 1", fix=f"e.g. '{example}'")


def select_layers(spec: str, num_teacher_layers: int) -> list[int]:
    """Teacher layer indices from ``every-other`` or ``"0,2,5"``.

    Raises:
        ValueError: an index out of range, unsorted or repeated indices, or an empty list.
    """
    if spec == "every-other":
        return list(range(0, num_teacher_layers, 2))
    try:
        layers = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError as exc:
        raise UsageError(f"student_layers={spec!r}: use 'every-other' or comma-separated layer indices") from exc
    if not layers or layers != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= num_teacher_layers:
        raise UsageError(f"student_layers={spec!r}: need increasing, distinct indices in [0, {num_teacher_layers - 1}]")
    return layers


def build_student(teacher, layers: list[int] | None = None, config_overrides: dict[str, Any] | None = None):
    """A student causal LM from ``teacher``.

    Args:
        teacher: a ``transformers`` causal LM (Llama-style ``model.layers``).
        layers: teacher layer indices to copy (weights included); used when ``config_overrides``
            is ``None``.
        config_overrides: fields of a fresh, randomly initialised config derived from the teacher's.

    Returns:
        ``(student, layer_map)``: the model (fp32) and, for each student layer, the teacher layer
        it corresponds to (copied from, or evenly spaced for a fresh config).
    """
    from transformers import AutoModelForCausalLM

    config = teacher.config.__class__.from_dict(teacher.config.to_dict())
    n_teacher = teacher.config.num_hidden_layers
    if config_overrides is not None:
        for key, value in config_overrides.items():
            if not hasattr(config, key):
                raise UsageError(f"--student-config: unknown config field {key!r}", fix="use fields of the teacher's config.json")
            setattr(config, key, value)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise UsageError(f"--student-config: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
                             fix="choose head counts that divide")
        _fix_layer_types(config, None)
        student = AutoModelForCausalLM.from_config(config)
        n = config.num_hidden_layers
        layer_map = [round(i * (n_teacher - 1) / max(n - 1, 1)) for i in range(n)]
        return student.float(), layer_map
    config.num_hidden_layers = len(layers)
    _fix_layer_types(config, layers)
    student = AutoModelForCausalLM.from_config(config)
    state = {}
    for name, tensor in teacher.state_dict().items():
        parts = name.split(".")
        if "layers" in parts:
            k = parts.index("layers")
            teacher_layer = int(parts[k + 1])
            if teacher_layer not in layers:
                continue
            parts[k + 1] = str(layers.index(teacher_layer))
        state[".".join(parts)] = tensor.detach().clone()
    student.load_state_dict(state, strict=True)
    return student.float(), list(layers)


def _fix_layer_types(config, layers: list[int] | None) -> None:
    """Keep per-layer lists in the config (``layer_types``) consistent with the new depth."""
    types = getattr(config, "layer_types", None)
    if isinstance(types, list):
        config.layer_types = [types[i] for i in layers] if layers else types[: config.num_hidden_layers]


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    alpha: float,
    beta: float,
    gamma: float,
    temperature: float,
    hidden_pairs: list[tuple[torch.Tensor, torch.Tensor]] = (),
) -> tuple[torch.Tensor, dict[str, float]]:
    """The KD loss of the module docstring.

    Args:
        student_logits / teacher_logits: ``(batch, seq, vocab)``.
        labels: ``(batch, seq)`` with ``IGNORE_INDEX`` where no CE is taken.
        attention_mask: ``(batch, seq)``, 1 on real tokens (positions of the KL and cosine terms).
        hidden_pairs: ``[(student_hidden, teacher_hidden)]``, each ``(batch, seq, hidden)``.

    Returns:
        ``(loss, {"kd_loss", "ce_loss", "cos_loss"})``: scalar loss and its unweighted parts.
    """
    mask = attention_mask.bool()  # (batch, seq)
    t = temperature
    s_logp = F.log_softmax(student_logits[mask].float() / t, dim=-1)  # (tokens, vocab)
    t_logp = F.log_softmax(teacher_logits[mask].float() / t, dim=-1)  # (tokens, vocab)
    kd = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean() * (t * t)
    ce_sum, n = token_losses(student_logits, labels)
    ce = ce_sum / n.clamp(min=1)
    cos = torch.zeros((), device=student_logits.device)
    if hidden_pairs:
        cos = torch.stack([
            (1 - F.cosine_similarity(hs[mask].float(), ht[mask].float(), dim=-1)).mean() for hs, ht in hidden_pairs
        ]).mean()
    loss = alpha * kd + beta * ce + gamma * cos
    return loss, {"kd_loss": float(kd.detach()), "ce_loss": float(ce.detach()), "cos_loss": float(cos.detach())}


class DistillRecipe(TrainingRecipe):
    """Distil ``config.model`` (teacher) into a student (see the module docstring)."""

    method = "distill"

    def __init__(self, config: DistillConfig) -> None:
        super().__init__(config)
        self.teacher = None

    def build_model(self, device: torch.device) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        cfg = self.config
        teacher = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        n_teacher = teacher.config.num_hidden_layers
        layers = None if cfg.student_config is not None else select_layers(cfg.student_layers, n_teacher)
        student, self.layer_map = build_student(teacher, layers, cfg.student_config)
        if cfg.gamma > 0 and student.config.hidden_size != teacher.config.hidden_size:
            raise TrainingError(
                f"gamma={cfg.gamma} needs equal hidden sizes (student {student.config.hidden_size}, "
                f"teacher {teacher.config.hidden_size}); set --gamma 0 or keep hidden_size"
            )
        teacher.requires_grad_(False)
        self.teacher = teacher.to(device).eval()
        self.teacher_layers = n_teacher
        return student.to(device)

    def setup(self) -> None:
        super().setup()
        self.teacher_val_loss = self.evaluate(self.teacher)
        if self.is_main:
            print(f"teacher val loss {self.teacher_val_loss:.4f} (perplexity {math.exp(self.teacher_val_loss):.2f}), "
                  f"{self.teacher_layers} layers; student layers {self.layer_map}")

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        want_hidden = cfg.gamma > 0
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        out = model(**inputs, output_hidden_states=want_hidden)
        with torch.no_grad():
            t_out = self.teacher(**inputs, output_hidden_states=want_hidden)
        pairs = []
        if want_hidden:
            n = len(self.layer_map)
            # hidden_states[i] is the input of layer i; hidden_states[n] the final normed output.
            pairs = [(out.hidden_states[i], t_out.hidden_states[self.layer_map[i]]) for i in range(1, n)]
            pairs.append((out.hidden_states[n], t_out.hidden_states[self.teacher_layers]))
        return distillation_loss(
            out.logits, t_out.logits, batch["labels"], batch["attention_mask"],
            alpha=cfg.alpha, beta=cfg.beta, gamma=cfg.gamma, temperature=cfg.temperature, hidden_pairs=pairs,
        )

    def final_metrics(self) -> dict[str, Any]:
        s = self.state
        return {
            "teacher_val_loss": self.teacher_val_loss,
            "teacher_val_ppl": math.exp(self.teacher_val_loss),
            "val_ppl_before": math.exp(s.val_loss_before),
            "val_ppl_after": math.exp(s.val_loss_last),
            "teacher_num_layers": self.teacher_layers,
            "student_num_layers": len(self.layer_map),
            "student_layer_map": self.layer_map,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistillConfig()
    add_train_arguments(parser, d)
    parser.add_argument("--student-layers", default=d.student_layers, help="'every-other' or teacher layer indices '0,2,4'")
    parser.add_argument("--student-config", default=None, help='JSON config overrides for a fresh student, e.g. \'{"num_hidden_layers": 4}\'')
    parser.add_argument("--alpha", type=float, default=d.alpha, help="weight of T^2 * KL(teacher || student)")
    parser.add_argument("--beta", type=float, default=d.beta, help="weight of the cross-entropy on labels")
    parser.add_argument("--gamma", type=float, default=d.gamma, help="weight of the hidden-state cosine loss")
    parser.add_argument("--temperature", type=float, default=d.temperature)


def run(args: argparse.Namespace) -> int:
    try:
        student_config = json.loads(args.student_config) if args.student_config else None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--student-config: not JSON ({exc})", fix='write e.g. \'{"num_hidden_layers": 4}\'') from exc
    config = DistillConfig(
        **train_config_kwargs(args), student_layers=args.student_layers, student_config=student_config,
        alpha=args.alpha, beta=args.beta, gamma=args.gamma, temperature=args.temperature,
    )
    return run_recipe(DistillRecipe, config)
