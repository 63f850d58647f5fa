"""The training loop shared by ``lmforge finetune`` and ``lmforge distill``.

A recipe (torchtune style) is ``setup() -> train() -> save()``, driven by one config dataclass
that is recorded in ``RUN_DIR/run.json`` and in the output manifest. ``TrainingRecipe`` owns
everything the two methods share; a subclass supplies the model (``build_model``), the loss
(``compute_loss``) and the manifest ``method``.

What the loop does, per optimizer step:

* ``grad_accum_steps`` micro-batches of ``micro_batch_size`` packed rows per rank, each forward
  under autocast (bf16 on CPU and CUDA, or fp16 with ``torch.amp.GradScaler`` on CUDA; the
  parameters and optimizer state stay fp32: "master weights", Micikevicius et al. 2018); DDP
  gradient sync only on the last micro-batch (``no_sync``);
* global gradient-norm clipping (``clip_grad_norm_``), AdamW (Loshchilov & Hutter 2019; no
  weight decay on norms and biases), then one scheduler step: linear warmup from 0 over
  ``warmup_ratio`` of the optimizer steps, cosine decay to 0 after (``transformers.
  get_cosine_schedule_with_warmup``); the schedule counts optimizer steps, never micro-batches;
* a non-finite loss or gradient norm stops the run with a message; the checkpoints already
  written (the last good state) are kept and nothing is written after the failure;
* metrics appended to ``metrics.jsonl`` (``compress.train.monitor``), validation every
  ``eval_every`` steps, a checkpoint every ``save_every`` steps.

The recipe keeps the loop; three classes own the rest: ``compress.train.distributed.ProcessGroup``
(device, DDP/FSDP2, collectives), ``compress.train.checkpoints.TrainingCheckpoints`` (save,
rotation, resume) and ``compress.train.monitor.MetricsLog`` (``metrics.jsonl`` and its plots).

Checkpoints (``RUN_DIR/checkpoints/step_NNNNNN/``, written to a temporary directory and swapped
in, so a checkpoint directory is always complete) hold the trainable weights, the optimizer and
scheduler state, each rank's RNG states and the data position (epoch, micro-batch), so a resumed
run continues exactly where the original would have been (same batches, same losses on the
same hardware). Under ``torchrun`` the loop runs DDP (gloo on CPU, NCCL on CUDA) or, with
``fsdp``, FSDP2 (``torch.distributed.fsdp.fully_shard`` per decoder layer); rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from compress.data.packing import IGNORE_INDEX, PackedData, tokenize_and_pack
from compress.data.prepare import read_data_file
from compress.train.checkpoints import TrainingCheckpoints, TrainingError, TrainState
from compress.train.distributed import ProcessGroup, local_shard
from compress.train.monitor import MetricsLog
from engine.checkpoint.outputs import TRAINING_FINAL, TRAINING_RUN, check_output_dir, staged_output_dir
from engine.checkpoint.store import Manifest, describe_weights, read_manifest, resolve_checkpoint, write_manifest
from engine.config import resolve_dtype
from engine.errors import UsageError

__all__ = ["TrainConfig", "TrainResult", "TrainState", "TrainingError", "TrainingRecipe", "token_losses"]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
#: Seconds between two progress lines on stderr where there is no terminal for the progress bar (logs, CI, pipes).
PROGRESS_LINE_EVERY_S = 60.0


def resolve_precision(device: str) -> str:
    """``TrainConfig.precision="auto"`` on ``device`` (``"cpu"`` / ``"cuda"``): ``"bf16"`` where it computes
    bf16 natively (``engine.config.resolve_dtype``), else ``"fp32"``."""
    return "bf16" if resolve_dtype("auto", device) == "bfloat16" else "fp32"


@dataclasses.dataclass
class TrainConfig:
    """Settings shared by every training recipe (recorded in ``run.json`` and the manifest).

    Attributes:
        model: input checkpoint (name, .gguf, or directory; ``engine.checkpoint.store``).
        data: directory with ``train.jsonl`` and ``val.jsonl`` from ``lmforge data``.
        run_dir: output directory (metrics, plots, checkpoints, ``final/``).
        max_steps: optimizer steps in the whole run (the schedule's length).
        micro_batch_size: packed rows per forward pass per rank.
        grad_accum_steps: micro-batches per optimizer step.
        max_length: tokens per packed row.
        lr: peak learning rate (reached at the end of warmup).
        weight_decay: AdamW decoupled weight decay (matrices only).
        adam_beta1 / adam_beta2 / adam_eps: AdamW moments.
        warmup_ratio: share of ``max_steps`` spent in linear warmup (at least one step if > 0).
        max_grad_norm: global L2 norm gradients are clipped to; ``None`` disables clipping.
        precision: ``bf16`` (autocast, fp32 weights), ``fp32``, ``fp16`` (CUDA, loss scaling), or ``auto``:
            ``bf16`` where the device computes it natively (CUDA with bf16, a CPU with AVX-512 BF16 or AMX),
            else ``fp32`` (on an AVX2-only CPU a bf16 matmul runs ~28x slower than fp32; docs/distillation.md).
        gradient_checkpointing: recompute activations in backward (less memory, ~30% slower).
        eval_every: validation every N steps (and always at step 0 and at the end); 0: only those.
        max_val_batches: cap on validation micro-batches per rank; ``None``: the whole split.
        save_every: checkpoint every N steps; 0: none except ``stop_after``.
        keep_checkpoints: how many recent checkpoints to keep.
        stop_after: stop after this optimizer step with a checkpoint (an interruption on purpose;
            continue with ``resume``); ``None``: run to ``max_steps``.
        resume: continue from the newest checkpoint in ``run_dir``.
        seed: seed of weights added, data order and dropout.
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda``.
        fsdp: shard with FSDP2 instead of DDP under ``torchrun``.
        param_change_every: log relative parameter change every N steps (0: never).
        progress: show a tqdm progress bar.
    """

    model: str = "smollm2-135m"
    data: str = "runs/data"
    run_dir: str = "runs/finetune"
    max_steps: int = 24
    micro_batch_size: int = 4
    grad_accum_steps: int = 1
    max_length: int = 64
    lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    warmup_ratio: float = 0.1
    max_grad_norm: float | None = 1.0
    precision: str = "auto"
    gradient_checkpointing: bool = False
    eval_every: int = 12
    max_val_batches: int | None = None
    save_every: int = 0
    keep_checkpoints: int = 2
    stop_after: int | None = None
    resume: bool = False
    seed: int = 0
    device: str = "auto"
    fsdp: bool = False
    param_change_every: int = 1
    progress: bool = True

    def validate(self) -> None:
        """Raise ``UsageError`` (a ``ValueError``) naming the first bad field and the fix."""
        positive = ("max_steps", "micro_batch_size", "grad_accum_steps", "max_length", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise UsageError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.lr <= 0:
            raise UsageError(f"lr={self.lr}: must be > 0")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise UsageError(f"warmup_ratio={self.warmup_ratio}: must be in [0, 1)")
        if self.precision not in PRECISIONS:
            raise UsageError(f"precision={self.precision!r}: use one of {PRECISIONS}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise UsageError(f"max_grad_norm={self.max_grad_norm}: must be > 0 (or None to disable clipping)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"device={self.device!r}: use auto, cpu or cuda")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.max_steps:
            raise UsageError(f"stop_after={self.stop_after}: must be in [1, max_steps={self.max_steps}]")
        for name in ("eval_every", "save_every", "param_change_every"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name}={getattr(self, name)}: must be >= 0")

    @property
    def warmup_steps(self) -> int:
        """Warmup length in optimizer steps: ``round(warmup_ratio * max_steps)``, at least 1 if the ratio is > 0."""
        if self.warmup_ratio == 0:
            return 0
        return max(1, round(self.warmup_ratio * self.max_steps))


@dataclasses.dataclass
class TrainResult:
    """How ``train()`` ended: ``status`` is ``completed``, ``stopped`` (``stop_after``) or ``nan``."""

    status: str
    step: int
    message: str = ""


# --------------------------------------------------------------------------------------------
# Distributed helpers
# --------------------------------------------------------------------------------------------


def layer_group(name: str) -> str:
    """Layer group of a parameter name: ``embed``, ``layers.N``, ``norm``, ``lm_head`` or ``other``."""
    m = re.search(r"layers\.(\d+)\.", name)
    if m:
        return f"layers.{m.group(1)}"
    if "embed_tokens" in name:
        return "embed"
    if "lm_head" in name:
        return "lm_head"
    if name.endswith("norm.weight"):
        return "norm"
    return "other"


def cosine_schedule(optimizer: torch.optim.Optimizer, config: TrainConfig):
    """Linear warmup from 0 to ``lr`` over ``config.warmup_steps``, then cosine decay to 0 at ``max_steps``.

    Stepped once per optimizer step. Returns a ``torch.optim.lr_scheduler.LambdaLR``.
    """
    return get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=config.max_steps
    )


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only (not norms, biases)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
    )


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Scale gradients in place so their global L2 norm is at most ``max_norm`` (``None``: no
    clipping) and return the norm before clipping (``inf``/``nan`` when a gradient is not finite).
    Works on DTensor gradients (FSDP2)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of label tokens.

    Args:
        logits: ``(batch, seq, vocab)``.
        labels: ``(batch, seq)``; position t is predicted from logits at t-1; ``IGNORE_INDEX`` skipped.

    Returns:
        ``(loss_sum, num_tokens)``, fp32 scalars.
    """
    shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])  # (batch*(seq-1), vocab)
    shift_labels = labels[:, 1:].reshape(-1)  # (batch*(seq-1),)
    loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (shift_labels != IGNORE_INDEX).sum().float()


# --------------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------------


class TrainingRecipe:
    """``setup() -> train() -> save()`` for a causal LM; subclasses define model and loss.

    Subclass hooks:
        ``method``: manifest method name.
        ``build_model(device) -> torch.nn.Module``: the model to train (fp32, on ``device``).
        ``compute_loss(model, batch) -> (loss, parts)``: scalar mean loss of a micro-batch and
            extra float metrics to log (may be empty).
        ``export_model() -> PreTrainedModel``: the plain model to save in ``final/``.
        ``write_final(model, directory)``: write the exported model's files (default: fp32 safetensors,
            config, tokenizer, chat template).
        ``output_method``: manifest method of ``final/`` (default ``method``).
        ``final_metrics() -> dict``: extra manifest metrics.
    """

    method = "train"

    def __init__(self, config: TrainConfig) -> None:
        config.validate()
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.state = TrainState()
        self.group = ProcessGroup()
        self.rank, self.world_size = self.group.rank, self.group.world_size
        self.model: torch.nn.Module | None = None

    # -- hooks -------------------------------------------------------------------------------

    def build_model(self, device: torch.device) -> torch.nn.Module:
        raise NotImplementedError

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def export_model(self):
        return self._unwrapped()

    def final_metrics(self) -> dict[str, Any]:
        return {}

    @property
    def output_method(self) -> str:
        return self.method

    def write_final(self, model, directory: Path) -> None:
        model.to(torch.float32).save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)

    # -- setup ---------------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def setup(self) -> None:
        """Start the process group (under torchrun), load data and model, build optimizer and
        schedule, and restore the newest checkpoint when ``resume`` is set.

        Raises:
            TrainingError: bad device/precision combination, missing data, nothing to resume.
        """
        cfg = self.config
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise TrainingError("device=cuda but CUDA is not available; use --device cpu")
        if cfg.precision == "fp16" and (cfg.device == "cpu" or not torch.cuda.is_available()):
            raise TrainingError("precision=fp16 needs CUDA (loss scaling); use --precision bf16 or fp32 on CPU")
        self.device = self.group.start(cfg.device)
        if cfg.precision == "auto":
            self.config = cfg = dataclasses.replace(cfg, precision=resolve_precision(self.device.type))
        self._seed(cfg.seed)
        self.model_path = resolve_checkpoint(cfg.model)
        data = Path(cfg.data)
        self.run_dir = check_output_dir(self.run_dir, kind=TRAINING_RUN, sources=(self.model_path, data))
        self.checkpoints = TrainingCheckpoints(
            self.run_dir, rank=self.rank, device=self.device, keep=cfg.keep_checkpoints, barrier=self.group.barrier
        )
        resume_from = self.checkpoints.latest() if cfg.resume else None  # before anything is written
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.train_data = tokenize_and_pack(self.tokenizer, read_data_file(data / "train.jsonl"), cfg.max_length)
        self.val_data = tokenize_and_pack(self.tokenizer, read_data_file(data / "val.jsonl"), cfg.max_length)
        if len(self.train_data) < cfg.micro_batch_size * self.world_size:
            raise TrainingError(
                f"{data / 'train.jsonl'}: {len(self.train_data)} packed rows, fewer than one global micro-batch "
                f"({cfg.micro_batch_size} x {self.world_size} ranks); lower --micro-batch-size or add data"
            )
        model = self.build_model(self.device)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        self.model = self.group.wrap(model, cfg.fsdp)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = cosine_schedule(self.optimizer, cfg)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
        self.metrics = MetricsLog(self.run_dir, enabled=self.is_main)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            run_info = {
                "train_data": str(data / "train.jsonl"),
                "val_data": str(data / "val.jsonl"),
                "config": dataclasses.asdict(cfg),
                "method": self.method,
            }
            (self.run_dir / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")
        if resume_from is not None:
            self.restore_checkpoint(resume_from)
        else:
            self.metrics.reset()

    def _unwrapped(self) -> torch.nn.Module:
        return self.model.module if hasattr(self.model, "module") else self.model

    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)

    # -- data ------------------------------------------------------------------------------------

    def _micro_batches_per_epoch(self) -> int:
        return len(self.train_data) // (self.config.micro_batch_size * self.world_size)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's next micro-batch; the order is a seeded permutation per epoch, so the
        position ``(epoch, micro_batch)`` fully determines what comes next."""
        cfg = self.config
        if self.state.micro_batch >= self._micro_batches_per_epoch():
            self.state.epoch += 1
            self.state.micro_batch = 0
        order = torch.randperm(
            len(self.train_data), generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.state.epoch)
        )
        start = (self.state.micro_batch * self.world_size + self.rank) * cfg.micro_batch_size
        self.state.micro_batch += 1
        batch = self.train_data.batch(order[start : start + cfg.micro_batch_size])
        return {k: v.to(self.device) for k, v in batch.items()}

    # -- evaluation ------------------------------------------------------------------------------

    def autocast(self):
        precision = self.config.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module | None = None, data: PackedData | None = None) -> float:
        """Token-weighted mean next-token cross-entropy (nats) of ``model`` on the validation rows,
        split over ranks and summed with ``all_reduce``."""
        model = model if model is not None else self.model
        data = data if data is not None else self.val_data
        cfg = self.config
        was_training = model.training
        model.eval()
        rows = list(range(self.rank, len(data), self.world_size))
        batches = [rows[i : i + cfg.micro_batch_size] for i in range(0, len(rows), cfg.micro_batch_size)]
        if cfg.max_val_batches is not None:
            batches = batches[: cfg.max_val_batches]
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for rows_b in batches:
            batch = {k: v.to(self.device) for k, v in data.batch(rows_b).items()}
            with self.autocast():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss_sum, n = token_losses(logits, batch["labels"])
            total += torch.stack([loss_sum.double(), n.double()])
        self.group.all_reduce(total)
        model.train(was_training)
        return float(total[0] / total[1].clamp(min=1))

    # -- the loop --------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Run optimizer steps until ``max_steps`` (or ``stop_after``, or a non-finite loss).

        Returns:
            ``TrainResult``; on ``nan`` the message names the step and the last good checkpoint.
        """
        cfg = self.config
        start_time = time.monotonic() - self.state.elapsed_s
        self._first_step, self._run_start = self.state.step, time.monotonic()
        if self.state.step == 0 and self.state.val_loss_before is None:
            self.state.val_loss_before = self.evaluate()
            self.state.val_loss_last = self.state.val_loss_before
            self._log({"step": 0, "split": "val", "loss": self.state.val_loss_before})
        end = cfg.stop_after or cfg.max_steps
        bar = tqdm(
            total=cfg.max_steps,
            initial=self.state.step,
            disable=None if cfg.progress and self.is_main else True,  # None: off where stderr is not a terminal
            desc=self.method,
            unit="step",
        )
        lines = cfg.progress and self.is_main and bar.disable  # no terminal: a line a minute instead of the bar
        last_line = time.monotonic()
        self.model.train()
        try:
            while self.state.step < end:
                record = self._optimizer_step()
                if record is None:
                    return self._stop_on_nan()
                record["time_s"] = round(time.monotonic() - start_time, 4)
                self._log(record)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
                if lines and time.monotonic() - last_line >= PROGRESS_LINE_EVERY_S:
                    last_line = time.monotonic()
                    print(self._progress_line(record, start_time), file=sys.stderr, flush=True)
                step = self.state.step
                if step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0):
                    self.state.val_loss_last = self.evaluate()
                    self._log({"step": step, "split": "val", "loss": self.state.val_loss_last})
                self.state.elapsed_s = time.monotonic() - start_time
                if (cfg.save_every and step % cfg.save_every == 0) or (cfg.stop_after == step and step < cfg.max_steps):
                    self.save_checkpoint()
        finally:
            bar.close()
            self.metrics.plot()
        if self.state.step < cfg.max_steps:
            return TrainResult(
                "stopped", self.state.step, f"stopped after step {self.state.step} (stop_after); continue with --resume"
            )
        return TrainResult("completed", self.state.step)

    def _progress_line(self, record: dict[str, Any], start_time: float) -> str:
        """``"distill: step 120/400 (30%), loss 2.3141, 312 s, ~728 s left"`` (the time left at this run's pace)."""
        step, total = self.state.step, self.config.max_steps
        elapsed_s = time.monotonic() - start_time
        done, pace_s = step - self._first_step, time.monotonic() - self._run_start  # this run's steps (after a resume)
        left = f", ~{pace_s / done * (total - step):.0f} s left" if done > 0 and step < total else ""
        loss = record["loss"]
        return f"{self.method}: step {step}/{total} ({step / total:.0%}), loss {loss:.4f}, {elapsed_s:.0f} s{left}"

    def _optimizer_step(self) -> dict[str, Any] | None:
        """One optimizer step over ``grad_accum_steps`` micro-batches; ``None`` on a non-finite loss."""
        cfg = self.config
        accum = cfg.grad_accum_steps
        data_wait = compute = 0.0
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        parts_total: dict[str, float] = {}
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        for k in range(accum):
            t0 = time.perf_counter()
            batch = self.next_batch()
            t1 = time.perf_counter()
            sync = k == accum - 1 or not hasattr(self.model, "no_sync")
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with self.autocast():
                    loss, parts = self.compute_loss(self.model, batch)
                scaled = loss / accum
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_total += loss.detach().double() / accum
            for name, value in parts.items():
                parts_total[name] = parts_total.get(name, 0.0) + value / accum
            tokens += batch["attention_mask"].sum()
            data_wait += t1 - t0
            compute += time.perf_counter() - t1
        t2 = time.perf_counter()
        stats = self.group.all_reduce(torch.stack([loss_total, tokens]))
        loss_value = float(stats[0]) / self.world_size
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = clip_gradients(params, cfg.max_grad_norm)
        if not math.isfinite(loss_value) or (self.scaler is None and not math.isfinite(grad_norm)):
            self._bad_value = (loss_value, grad_norm)
            return None
        lr = self.scheduler.get_last_lr()[0]
        track = cfg.param_change_every and (self.state.step + 1) % cfg.param_change_every == 0
        before = [local_shard(p).detach().clone() for p in params] if track else None
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        change = self._param_change(before) if track else {}
        self.state.step += 1
        self.state.tokens += int(stats[1])
        compute += time.perf_counter() - t2
        record = {
            "step": self.state.step,
            "split": "train",
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.state.tokens,
            "data_wait_s": round(data_wait, 6),
            "compute_s": round(compute, 6),
            "param_change": change,
        }
        record.update(
            {
                k: float(self.group.all_reduce(torch.tensor(v, device=self.device))) / self.world_size
                for k, v in parts_total.items()
            }
        )
        return record

    @torch.no_grad()
    def _param_change(self, before: list[torch.Tensor]) -> dict[str, float]:
        """``||w_after - w_before|| / ||w_before||`` per layer group of the trainable parameters."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        groups: dict[str, int] = {}
        for name in names:
            groups.setdefault(layer_group(name), len(groups))
        sums = torch.zeros(len(groups), 2, dtype=torch.float64, device=self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        for name, p, b in zip(names, params, before):
            g = groups[layer_group(name)]
            sums[g, 0] += (local_shard(p).double() - b.double()).pow(2).sum()
            sums[g, 1] += b.double().pow(2).sum()
        if self.config.fsdp:
            self.group.all_reduce(sums)
        return {name: float(sums[g, 0].sqrt() / sums[g, 1].sqrt().clamp(min=1e-30)) for name, g in groups.items()}

    def _stop_on_nan(self) -> TrainResult:
        loss, grad_norm = self._bad_value
        latest = self.checkpoints.latest(required=False)
        keep = f"last good checkpoint: {latest}" if latest else "no checkpoint was written before it (use --save-every)"
        message = (
            f"non-finite training loss at step {self.state.step + 1} (loss={loss}, grad_norm={grad_norm}); "
            f"stopped without updating the weights; {keep}. Lower --lr, use --precision fp32, or check the data"
        )
        self._log({"step": self.state.step + 1, "split": "train", "event": "nan", "loss": loss, "grad_norm": grad_norm})
        return TrainResult("nan", self.state.step, message)

    def _log(self, record: dict[str, Any]) -> None:
        self.metrics.append(record)

    # -- checkpoints -------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNN`` for the current step (``compress.train.checkpoints``)."""
        return self.checkpoints.save(self.model, self.optimizer, self.scheduler, self.scaler, self.state)

    def restore_checkpoint(self, path: Path) -> None:
        """Continue from the checkpoint ``path``: weights, optimizer, schedule, RNG, data position."""
        self.state = self.checkpoints.restore(path, self.model, self.optimizer, self.scheduler, self.scaler)
        self.metrics.truncate_after(self.state.step)

    # -- save ----------------------------------------------------------------------------------------

    def save(self) -> Path:
        """Write ``RUN_DIR/final/``: the model's files (``write_final``: fp32 safetensors, config, tokenizer,
        chat template) and an ``lmforge.json`` manifest (parent = input checkpoint, method, config, metrics)."""

        out = self.run_dir / "final"
        full_state = None
        if self.config.fsdp and self.world_size > 1:
            full_state = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if self.is_main:
            model = self.export_model() if full_state is None else self._model_from_state(full_state)
            with staged_output_dir(out, kind=TRAINING_FINAL, sources=(self.model_path,)) as tmp:
                self.write_final(model, tmp)
                parent_manifest = None
                try:
                    parent_manifest = read_manifest(self.model_path)
                except ValueError:
                    pass
                num_parameters, size_bytes, dtype = describe_weights(tmp)
                metrics = {
                    "val_loss_before": self.state.val_loss_before,
                    "val_loss_after": self.state.val_loss_last,
                    "steps": self.state.step,
                    "train_tokens": self.state.tokens,
                    "train_wall_s": round(self.state.elapsed_s, 2),
                    **self.final_metrics(),
                }
                write_manifest(
                    tmp,
                    Manifest(
                        source=parent_manifest.source if parent_manifest else str(self.model_path),
                        parent=str(self.model_path),
                        method=self.output_method,
                        config=self.manifest_config(),
                        dtype=dtype,
                        num_parameters=num_parameters,
                        size_bytes=size_bytes,
                        metrics=metrics,
                    ),
                )
        self.group.barrier()
        return out

    def manifest_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config)

    def _model_from_state(self, state: dict[str, torch.Tensor]):
        model = AutoModelForCausalLM.from_config(self._unwrapped().config)
        model.load_state_dict(state, strict=True)
        return model

    def close(self) -> None:
        self.group.close()

    def run(self) -> tuple[TrainResult, Path | None]:
        """``setup``, ``train``, and ``save`` when training completed; returns the result and
        the final directory (``None`` unless completed)."""
        try:
            self.setup()
            result = self.train()
            final = self.save() if result.status == "completed" else None
            return result, final
        finally:
            self.close()
