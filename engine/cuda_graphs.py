"""Decode steps from static, bucket-padded buffers; captured as CUDA graphs on a GPU.

A step whose requests all decode one token (the steady state of serving) runs at a fixed batch
size: the smallest capture size (``capture_sizes``) that holds it. Its inputs are written into
host buffers (pinned on CUDA), copied with one non-blocking copy per tensor into device buffers
at fixed addresses, and the forward pass + final norm + lm head replays the CUDA graph captured
for that size at start-up, as vLLM and SGLang do. Padding rows carry slot ``-1`` (no KV write)
and context length 0 (attention writes zeros); their logits are dropped. Any other step
(prefill chunks, a batch above the largest size) runs eagerly through ``ModelRunner``.

Graph capture needs CUDA; without it (``device='cpu'`` with the Triton backend under the
interpreter, for tests) the same static-buffer path runs eagerly, so padding and staging are
exercised on CPU. Sampling stays on the device: the sampler reduces the ``[S, vocab]`` logits
there and copies back one id per request.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from engine.model_runner import ModelRunner
from engine.scheduler import SchedulerOutput

#: Largest decode batch run from a captured graph; bigger batches run eagerly.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, up to ``max_num_seqs`` (included).

    Raises:
        ValueError: ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}; it must be >= 1")
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16))
    return sizes + [top]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (sorted) holding ``num_seqs``; ``None`` when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def is_decode_step(out: SchedulerOutput) -> bool:
    """Every scheduled request runs exactly one new token and samples it."""
    return bool(out.scheduled) and all(item.num_new_tokens == 1 and item.samples for item in out.scheduled)


@dataclasses.dataclass
class DecodeBuffers:
    """Inputs of a decode batch of at most ``B`` requests (rows past the batch are padding).

    Attributes:
        input_ids: ``[B]`` int64 the token each request decodes.
        positions: ``[B]`` int64 its position.
        slot_mapping: ``[B]`` int64 physical KV slot of the token (``-1``: padding, not stored).
        seq_lens: ``[B]`` int32 context length including the token (0: padding).
        block_table: ``[B, max_blocks]`` int32 physical block ids.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: str, pin_memory: bool = False) -> "DecodeBuffers":
        def make(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

        return cls(
            make(max_batch),
            make(max_batch),
            make(max_batch),
            make(max_batch, dtype=torch.int32),
            make(max_batch, max_blocks, dtype=torch.int32),
        )

    def fields(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_table]


class DecodeStaging:
    """Host buffers (pinned when CUDA is available) filled from a decode step and copied to device buffers.

    Args:
        max_batch: rows (the largest capture size).
        max_blocks: block-table width (``ceil(max_model_len / block_size)``).
        block_size: tokens per KV block.
        device: where the model runs; ``device_buffers`` live there at fixed addresses.
    """

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: str):
        pin = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.host = DecodeBuffers.allocate(max_batch, max_blocks, "cpu", pin_memory=pin)
        self.device_buffers = DecodeBuffers.allocate(max_batch, max_blocks, device)
        self.block_size, self.max_blocks = block_size, max_blocks
        self._host_table = self.host.block_table.numpy()  # shares memory

    def fill(self, out: SchedulerOutput, batch: int) -> int:
        """Write the decode step ``out`` into rows ``[0, n)`` and padding into ``[n, batch)``; copy them to the device.

        The copies are asynchronous from pinned memory; the host rows are rewritten only at the
        next step, after the sampler has read this step's logits (which waits for the copies).

        Returns:
            ``n``, the number of real requests.

        Raises:
            ValueError: more requests than ``batch``, or a block table wider than ``max_blocks``.
        """
        n = len(out.scheduled)
        if n > batch:
            raise ValueError(f"{n} decodes do not fit a batch of {batch}")
        h, bs = self.host, self.block_size
        table = self._host_table  # numpy view of h.block_table (row writes cost half of building a tensor)
        ids, positions, slots = [], [], []
        for row, item in enumerate(out.scheduled):
            seq = item.seq
            pos = seq.num_computed_tokens
            blocks = seq.block_table
            if len(blocks) > self.max_blocks:
                raise ValueError(
                    f"block table of {len(blocks)} blocks > max_blocks={self.max_blocks}; increase max_model_len"
                )
            table[row, : len(blocks)] = blocks
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
        h.input_ids[:n] = torch.tensor(ids)
        pos = torch.tensor(positions)
        h.positions[:n] = pos
        h.slot_mapping[:n] = torch.tensor(slots)
        h.seq_lens[:n] = pos.int() + 1
        h.input_ids[n:batch] = 0
        h.positions[n:batch] = 0
        h.slot_mapping[n:batch] = -1
        h.seq_lens[n:batch] = 0
        for src, dst in zip(h.fields(), self.device_buffers.fields()):
            dst[:batch].copy_(src[:batch], non_blocking=True)
        return n


class StaticDecodeModelRunner(ModelRunner):
    """``ModelRunner`` whose decode steps run from bucket-padded static buffers (CUDA graphs on CUDA).

    Needs an attention backend with ``decode_metadata`` (``engine.attention_triton``).

    Args:
        args, kwargs: as ``ModelRunner`` (path, dtype, device, block_size, max_model_len, attention_backend,
            kv_cache_dtype).
        max_num_seqs: largest decode batch (sizes the buckets, ``capture_sizes``).
        enforce_eager: never capture graphs (the static buffers are still used).
    """

    def __init__(self, *args: Any, max_num_seqs: int, enforce_eager: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not hasattr(self.attn, "decode_metadata"):
            raise ValueError(
                f"{type(self.attn).__name__} has no decode_metadata; static decode batches need "
                "attention_backend='triton'"
            )
        self.sizes = capture_sizes(max_num_seqs)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.staging = DecodeStaging(self.sizes[-1], max_blocks, self.block_size, self.device)
        self.use_graphs = not enforce_eager and torch.device(self.device).type == "cuda" and torch.cuda.is_available()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        super().allocate_kv_cache(num_blocks)
        if self.use_graphs:
            self.capture_graphs()

    def _decode_logits(self, batch: int) -> torch.Tensor:
        """Forward + logits of the first ``batch`` rows of the device buffers -> ``[batch, vocab]`` float32."""
        b = self.staging.device_buffers
        meta = self.attn.decode_metadata(b.slot_mapping[:batch], b.block_table[:batch], b.seq_lens[:batch])
        hidden = self.model.forward(
            b.input_ids[:batch], b.positions[:batch], self.kv_cache, self.attn, meta
        )  # [batch, hidden]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture one CUDA graph per size, largest first, sharing one memory pool.

        Warm-up runs (which also compile the Triton kernels) use all-padding rows, so the KV
        cache is not written.
        """
        pool = torch.cuda.graph_pool_handle()
        h, dev = self.staging.host, self.staging.device_buffers
        h.slot_mapping.fill_(-1)
        h.seq_lens.zero_()
        for src, dst in zip(h.fields(), dev.fields()):
            dst.copy_(src)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._decode_logits(size)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._decode_logits(size)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, float_logits: bool = True, mask: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Decode steps that fit a bucket run from the static buffers (float32 logits, ``mask`` applied to
        them); the rest, and steps with LoRA rows, as ``ModelRunner.execute``."""
        base_only = all(item.seq.lora_request is None for item in out.scheduled)
        batch = bucket_for(len(out.scheduled), self.sizes) if base_only and is_decode_step(out) else None
        if batch is None:
            return super().execute(out, float_logits, mask)
        self.copy_kv_slots(out.kv_copies)
        n = self.staging.fill(out, batch)
        if batch in self.graphs:
            graph, logits = self.graphs[batch]
            graph.replay()
        else:
            logits = self._decode_logits(batch)
        logits = logits[:n]  # [n, vocab]; overwritten by the next replay, read by the sampler before it
        if mask is not None:
            mask(logits)
        return logits
