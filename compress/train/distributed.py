"""The process group of a training run: rank, device, DDP/FSDP2 wrapping and collectives.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment, read when a
``ProcessGroup`` is made) the run uses gloo on CPU or NCCL on CUDA and wraps the model in DDP, or
with ``fsdp`` in FSDP2 (``torch.distributed.fsdp.fully_shard`` per decoder layer, then the whole
model). In a single process every collective is a no-op.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


def distributed_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the ``torchrun`` environment (read at call time)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (the first ``ModuleList`` named ``layers``)."""
    for module in model.modules():
        if hasattr(module, "layers") and isinstance(module.layers, torch.nn.ModuleList):
            return list(module.layers)
    return []


class ProcessGroup:
    """This process's place in the run; ``start`` picks the device and joins the group."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.local_rank = distributed_env()
        self.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def start(self, want: str) -> torch.device:
        """Pick the device (``auto``: CUDA when present, ``cpu``, or ``cuda``, which the caller
        has checked is present) and start the process group under torchrun."""
        if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        return self.device

    def wrap(self, model: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
        """``model`` itself in one process; else DDP, or FSDP2 with ``fsdp``."""
        if self.world_size == 1:
            return model
        if fsdp:
            for layer in decoder_layers(model):
                fully_shard(layer)
            return fully_shard(model)

        return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
