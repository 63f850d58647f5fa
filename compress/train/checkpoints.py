"""Training checkpoints of a run: ``RUN_DIR/checkpoints/step_NNNNNN/``, their rotation and resume.

A checkpoint holds the trainable weights (``model.pt``), the optimizer (``optimizer.pt``), the
scheduler (``scheduler.pt``), the fp16 loss scaler when one is used (``scaler.pt``), each rank's
RNG states (``rng_rank{R}.pt``) and the progress (``trainer_state.json``: step, data position,
tokens, losses). It is built in ``checkpoints/.tmp_step_NNNNNN`` and swapped into place with
``engine.checkpoint.outputs.replace_dir``, so a checkpoint directory is always complete; only the newest
``keep`` stay. Every rank takes part in ``save`` and ``restore`` (rank 0 writes the shared files).
"""

from __future__ import annotations

import dataclasses
import json
import pickle  # only for its UnpicklingError: files are read with weights_only=True
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from engine.checkpoint.outputs import TRAINING_CHECKPOINT, replace_dir
from engine.errors import LmforgeError

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"


class TrainingError(LmforgeError, RuntimeError):
    """A run cannot start or had to stop (bad config, no data, non-finite loss, bad checkpoint)."""


@dataclasses.dataclass
class TrainState:
    """Progress saved in a checkpoint (``trainer_state.json``)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # passes over the training rows started
    micro_batch: int = 0  # next micro-batch within the epoch
    tokens: int = 0  # non-padding input tokens seen, all ranks
    elapsed_s: float = 0.0  # wall time spent in train() before this process
    val_loss_before: float | None = None
    val_loss_last: float | None = None


def load_state_file(path: Path) -> Any:
    """Load a training-state file (``torch.save`` of tensors, numbers, strings, lists, tuples and
    dicts: weights, AdamW and scheduler state, RNG states) without unpickling code.

    ``weights_only=True`` refuses any other object, so a planted file cannot run code.

    Raises:
        TrainingError: the file is missing, corrupt or holds other objects (names the file).
    """
    fix = "delete that checkpoint directory to resume from an earlier one, or run without --resume"
    if not path.is_file():
        raise TrainingError(f"{path}: missing; {fix}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrainingError(f"{path}: not a training-state file lmforge wrote ({first_line}); {fix}") from exc


def _state_options():
    return StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


class TrainingCheckpoints:
    """Save, find, rotate and restore the checkpoints of one run directory.

    Args:
        run_dir: the training run directory (checkpoints go to ``run_dir/checkpoints``).
        rank: this process's rank (0 writes the shared files).
        device: where the model trains (CUDA RNG state is saved for a CUDA device).
        keep: how many of the newest checkpoints to keep.
        barrier: waits for every rank (a no-op in a single process).
    """

    def __init__(
        self, run_dir: Path, *, rank: int, device: torch.device, keep: int, barrier: Callable[[], None]
    ) -> None:
        self.root = Path(run_dir) / CHECKPOINTS
        self.rank = rank
        self.device = device
        self.keep = keep
        self.barrier = barrier

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def save(self, model, optimizer, scheduler, scaler, state: TrainState) -> Path:
        """Write ``step_NNNNNN`` for ``state.step`` and drop all but the newest ``keep``; returns its path."""
        model_state, optim_state = get_state_dict(model, optimizer, options=_state_options())
        final = self.root / f"step_{state.step:06d}"
        tmp = self.root / f".tmp_step_{state.step:06d}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, tmp / f"rng_rank{self.rank}.pt")
        if self.is_main:
            torch.save(model_state, tmp / "model.pt")
            torch.save(optim_state, tmp / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            if scaler:
                torch.save(scaler.state_dict(), tmp / "scaler.pt")
        self.barrier()
        if self.is_main:
            (tmp / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=2) + "\n")
            replace_dir(tmp, final, kind=TRAINING_CHECKPOINT)
            for old in sorted(self.root.glob("step_*"))[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.barrier()
        return final

    def latest(self, required: bool = True) -> Path | None:
        """The newest complete checkpoint, or ``None``.

        Raises:
            TrainingError: ``required`` and there is none (the fix: run without ``--resume``).
        """
        found = sorted(p for p in self.root.glob("step_*") if (p / STATE_FILE).is_file())
        if not found and required:
            raise TrainingError(f"{self.root}: no checkpoint to resume from; run without --resume")
        return found[-1] if found else None

    def restore(self, path: Path, model, optimizer, scheduler, scaler) -> TrainState:
        """Load weights, optimizer, scheduler, scaler and this rank's RNG states from ``path``;
        returns the saved progress.

        Raises:
            TrainingError: a file is missing or not one lmforge wrote; a rank's RNG file is
                missing (resumed with another number of processes).
        """
        model_state = load_state_file(path / "model.pt")
        optim_state = load_state_file(path / "optimizer.pt")
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=_state_options()
        )
        scheduler.load_state_dict(load_state_file(path / "scheduler.pt"))
        if scaler and (path / "scaler.pt").is_file():
            scaler.load_state_dict(load_state_file(path / "scaler.pt"))
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        rng_file = path / f"rng_rank{self.rank}.pt"
        if not rng_file.is_file():
            raise TrainingError(f"{rng_file}: missing; resume with the same number of processes as the original run")
        rng = load_state_file(rng_file)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        return state
