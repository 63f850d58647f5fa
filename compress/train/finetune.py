"""``lmforge finetune``: supervised fine-tuning of a causal LM on chat data.

The recipe is ``FinetuneRecipe(FinetuneConfig).run()`` = setup -> train -> save, on the loop of
``compress.train.loop`` (AdamW, warmup + cosine, clipping, accumulation, bf16 autocast with fp32
master weights, checkpoints with exact resume, DDP/FSDP2 under ``torchrun``). The loss is the
next-token cross-entropy on assistant tokens only (``compress.data.packing``). With ``lora`` the
model gets low-rank adapters (Hu et al. 2021, via ``peft``) on the attention projections, and
``final/`` is the adapter alone in the PEFT format (``adapter_config.json``,
``adapter_model.safetensors``) with an ``lmforge.json`` whose ``parent`` is the base and whose
``config["base"]`` records the base's shape (``engine.checkpoint.store.ADAPTER_BASE_FIELDS``): one
base then serves many adapters (``engine.lora``). With ``merge`` as well, the adapters are merged
into the weights on save and ``final/`` is a plain checkpoint.

Default budget (SmolLM2-135M on 2 CPU cores, a few minutes): 24 optimizer steps of 4 packed
rows of 64 tokens, peak LR 1e-4, 2 warmup steps, validation at steps 0, 12 and 24.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import torch

from compress.train.loop import PRECISIONS, TrainConfig, TrainingRecipe, token_losses
from engine.checkpoint.store import ADAPTER_BASE_FIELDS, ADAPTER_METHOD
from engine.cli_options import add_config_option, config_fields
from engine.errors import UsageError

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclasses.dataclass
class FinetuneConfig(TrainConfig):
    """``TrainConfig`` plus LoRA settings.

    Attributes:
        lora: train low-rank adapters instead of all weights; ``final/`` is the PEFT adapter.
        merge: with ``lora``, merge the adapters into the weights on save (``final/`` is a checkpoint).
        lora_r / lora_alpha / lora_dropout: adapter rank, scaling numerator, dropout.
        lora_target_modules: module names that get adapters.
    """

    run_dir: str = "runs/finetune"
    lora: bool = False
    merge: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))

    def validate(self) -> None:
        super().validate()
        if self.merge and not self.lora:
            raise UsageError("--merge without --lora", fix="add --lora (merge applies to LoRA adapters)")
        if not self.lora:
            return
        if self.lora_r < 1:
            raise UsageError(f"--lora-r {self.lora_r}: must be >= 1")
        if self.lora_alpha <= 0:
            raise UsageError(f"--lora-alpha {self.lora_alpha}: must be > 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UsageError(f"--lora-dropout {self.lora_dropout}: must be in [0, 1)")
        if not self.lora_target_modules:
            raise UsageError(
                "--lora-target-modules is empty",
                fix=f"name modules separated by commas, e.g. {','.join(DEFAULT_LORA_TARGETS)}",
            )
        if self.fsdp:
            raise UsageError("--lora with --fsdp is not supported", fix="use DDP (drop --fsdp) for LoRA runs")


class FinetuneRecipe(TrainingRecipe):
    """Fine-tune ``config.model`` on ``config.data`` (see the module docstring)."""

    method = "finetune"

    def __init__(self, config: FinetuneConfig) -> None:
        super().__init__(config)

    def build_model(self, device: torch.device) -> torch.nn.Module:
        # optional or heavy dependency: imported only on the path that needs it
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(device)
        cfg = self.config
        if cfg.lora:
            # optional or heavy dependency: imported only on the path that needs it
            from peft import LoraConfig, get_peft_model

            linear = sorted(
                {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            )
            missing = sorted(set(cfg.lora_target_modules) - set(linear))
            if missing:
                raise UsageError(
                    f"--lora-target-modules: {', '.join(missing)} not in {self.model_path}",
                    fix=f"choose from its linear layers: {','.join(linear)}",
                )
            lora = LoraConfig(
                r=cfg.lora_r,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=list(cfg.lora_target_modules),
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, lora)
        return model

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean cross-entropy over the micro-batch's label (assistant) tokens."""
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss_sum, n = token_losses(logits, batch["labels"])
        return loss_sum / n.clamp(min=1), {}

    @property
    def keeps_adapter(self) -> bool:
        return self.config.lora and not self.config.merge

    @property
    def output_method(self) -> str:
        return ADAPTER_METHOD if self.keeps_adapter else self.method

    def export_model(self):
        model = self._unwrapped()
        if self.config.lora and self.config.merge:
            model = model.merge_and_unload()
        return model

    def write_final(self, model, directory) -> None:
        """A merged or full model as the base class writes it; an adapter as ``PeftModel.save_pretrained``
        writes it (``adapter_config.json``, ``adapter_model.safetensors``, fp32)."""
        if not self.keeps_adapter:
            super().write_final(model, directory)
            return
        model.to(torch.float32).save_pretrained(directory, safe_serialization=True)

    def manifest_config(self) -> dict[str, Any]:
        config = super().manifest_config()
        if self.keeps_adapter:
            base = self._unwrapped().get_base_model().config.to_dict()
            config["base"] = {"path": str(self.model_path), **{k: base.get(k) for k in ADAPTER_BASE_FIELDS}}
        return config


# --------------------------------------------------------------------------------------------
# CLI (shared with distill)
# --------------------------------------------------------------------------------------------


def add_train_arguments(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Flags of every ``TrainConfig`` field (``--max-steps``...), defaults from ``defaults``."""
    d = defaults
    add_config_option(parser, d, "model", "input checkpoint: name, .gguf or directory")
    add_config_option(parser, d, "data", "directory with train.jsonl and val.jsonl (lmforge data)")
    add_config_option(parser, d, "run_dir", "output: metrics.jsonl, plots/, checkpoints/, final/")
    add_config_option(parser, d, "max_steps", "optimizer steps")
    add_config_option(parser, d, "micro_batch_size", "packed rows per forward, per process")
    add_config_option(parser, d, "grad_accum_steps")
    add_config_option(parser, d, "max_length", "tokens per packed row")
    add_config_option(parser, d, "lr", "peak learning rate")
    add_config_option(parser, d, "weight_decay")
    add_config_option(parser, d, "warmup_ratio", "share of steps in linear warmup")
    add_config_option(parser, d, "max_grad_norm", "clip the global gradient norm (0 disables)")
    add_config_option(parser, d, "precision", choices=PRECISIONS)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    add_config_option(parser, d, "eval_every")
    add_config_option(parser, d, "max_val_batches", type=int)
    add_config_option(parser, d, "save_every", "checkpoint every N steps (0: none)")
    add_config_option(parser, d, "keep_checkpoints")
    add_config_option(parser, d, "stop_after", "stop after step N with a checkpoint (resume later)", type=int)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    add_config_option(parser, d, "seed")
    add_config_option(parser, d, "device", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP under torchrun")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def train_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``TrainConfig`` keyword arguments from parsed ``add_train_arguments`` flags."""
    kwargs = config_fields(TrainConfig, args, progress=not args.no_progress)
    if kwargs.get("max_grad_norm") == 0:
        kwargs["max_grad_norm"] = None
    return kwargs


def run_recipe(recipe_cls, config: TrainConfig) -> int:
    """Run a recipe from the command line: prints the outcome, returns the exit status (errors
    propagate to ``lmforge_cli.main``)."""
    started = time.monotonic()
    recipe = recipe_cls(config)
    result, final = recipe.run()
    if recipe.is_main:
        if result.status == "nan":
            print(f"error: {result.message}", file=sys.stderr)
        elif result.status == "stopped":
            print(result.message)
        else:
            m = recipe.state
            print(
                f"val loss {m.val_loss_before:.4f} -> {m.val_loss_last:.4f} after {m.step} steps, "
                f"{time.monotonic() - started:.1f} s; wrote {final}"
            )
    return 1 if result.status == "nan" else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = FinetuneConfig()
    add_train_arguments(parser, d)
    parser.add_argument(
        "--lora", action="store_true", help="train LoRA adapters; final/ is the adapter (PEFT format) for its base"
    )
    parser.add_argument("--merge", action="store_true", help="with --lora: merge the adapters into a full checkpoint")
    add_config_option(parser, d, "lora_r")
    add_config_option(parser, d, "lora_alpha")
    add_config_option(parser, d, "lora_dropout")
    parser.add_argument("--lora-target-modules", default=",".join(d.lora_target_modules))


def run(args: argparse.Namespace) -> int:
    lora_target_modules = [m for m in args.lora_target_modules.split(",") if m]
    config = FinetuneConfig(
        **config_fields(FinetuneConfig, args, **train_config_kwargs(args), lora_target_modules=lora_target_modules)
    )
    return run_recipe(FinetuneRecipe, config)
