"""LoRA adapters served on one base: ``LoRARequest``, adapter files, active slots and the grouped delta.

Vocabulary and limits follow vLLM (``--enable-lora``): a request names its adapter with
``LoRARequest(lora_name, lora_int_id, lora_path)``; at most ``max_loras`` adapters are active (held
in the slots the forward pass reads) and ``max_cpu_loras`` kept loaded in memory, least recently
used first out; ranks above ``max_lora_rank`` are refused.

An adapter is a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``, as
``lmforge finetune --lora`` writes it) on the q/k/v/o projections and the SwiGLU MLP (gate, up,
down) of the engine's base. Adapted layer ``W`` computes ``W x + s B A x`` (Hu et al. 2021), with
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``, Kalajdzievski 2023).

One forward pass serves a batch that mixes requests of several adapters and of the base
(``LoRABatch``): each linear layer computes its base output once for every row, then the rows of
each active slot are gathered into one group per slot (the segmented gather of Punica, Chen et al.
2023), one batched matmul with the slots' stacked ``A`` and one with their (block-diagonal) ``B`` give
the deltas of every module of a fused layer (q, k, v or gate, up), and one ``index_select`` and one
add put them back on their rows. Each adapter's weights are read once per layer and step,
whatever its number of rows, and the number of kernel calls does not grow with the number of
adapters; the base output is whatever the layer computes (fp32, bf16, or an INT8 kernel); the
delta runs in the activation dtype.

Raises ``LoRAError`` (a ``ValueError``) for every bad adapter or request, naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from engine import cpu_ops
from engine.checkpoint.model_spec import ModelSpec
from engine.checkpoint.store import (
    ADAPTER_BASE_FIELDS,
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    MANIFEST_NAME,
    read_manifest,
)
from engine.errors import CheckpointError, UsageError

#: Module names an adapter may target -> (the engine's fused layer, the module's index in it).
LORA_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
#: The engine's fused linear layers (``engine.model.LayerWeights``) -> their modules, in output order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}

_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(UsageError):
    """A LoRA request or adapter the engine cannot serve; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with (vLLM's ``LoRARequest``).

    Attributes:
        lora_name: the adapter's name (what the OpenAI ``model`` field selects).
        lora_int_id: its id, ``>= 1``, unique per adapter in an engine (slots and caches are keyed by it).
        lora_path: the adapter directory (PEFT format).

    Raises:
        LoRAError: an empty name, an id below 1, or a path that is not a string.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name={self.lora_name!r}", fix="give the adapter a non-empty name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id={self.lora_int_id!r}", fix="give each adapter an integer id >= 1")
        if isinstance(self.lora_path, Path):
            object.__setattr__(self, "lora_path", str(self.lora_path))
        if not isinstance(self.lora_path, str):
            raise LoRAError(f"lora_path={self.lora_path!r}", fix="give the adapter directory as a string")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


# ------------------------------------------------------------------------------------ adapter files


@dataclasses.dataclass
class LoRAAdapter:
    """One adapter in memory, checked against the base.

    Attributes:
        request: the ``LoRARequest`` it was loaded for.
        rank: the largest rank of its modules.
        weights: ``(layer, module) -> (A [r, in], B [out, r], scaling)`` in the engine dtype on CPU.
        cache_key: 64-bit key of the adapter's identity (name, id, path, file size and time) for the
            prefix cache: KV blocks computed under it are reused only under the same key.
    """

    request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    cache_key: int

    @property
    def nbytes(self) -> int:
        """Bytes of its A and B tensors."""
        return sum(a.nbytes + b.nbytes for a, b, _ in self.weights.values())

    @property
    def fused_targets(self) -> set[tuple[int, str]]:
        """``(layer, fused layer)`` pairs it changes."""
        return {(layer, LORA_TARGETS[module][0]) for layer, module in self.weights}


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """``module -> (in_features, out_features)`` of the base's adaptable projections."""
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def adapter_cache_key(request: LoRARequest) -> int:
    """64-bit BLAKE2b of the adapter's name, id, path and weight file's size and modification time (a file
    rewritten in place gets a new key, so its old KV blocks are never reused)."""
    weights = Path(request.lora_path) / ADAPTER_WEIGHTS_NAME
    try:
        stat = weights.stat()
        stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        stamp = "missing"
    text = f"lora|{request.lora_name}|{request.lora_int_id}|{Path(request.lora_path).resolve()}|{stamp}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _read_adapter_config(path: Path) -> dict:
    config_path = path / ADAPTER_CONFIG_NAME
    if not path.is_dir():
        what = "is a file, not an adapter directory" if path.exists() else "no such adapter directory"
        raise LoRAError(f"lora_path={str(path)!r}: {what}", fix="pass a PEFT LoRA adapter directory")
    if not config_path.is_file():
        raise LoRAError(
            f"lora_path={str(path)!r}: no {ADAPTER_CONFIG_NAME}",
            fix="pass a PEFT LoRA adapter directory (`lmforge finetune --lora` writes one)",
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRAError(f"{config_path}: not valid JSON ({exc})", fix="re-save the adapter") from exc
    if not isinstance(config, dict):
        raise LoRAError(
            f"{config_path}: expected a JSON object, got {type(config).__name__}", fix="re-save the adapter"
        )
    return config


def _check_adapter_config(config: dict, where: Path) -> None:
    """Refuse PEFT settings the engine does not run (each names its field)."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type={peft_type!r}", fix="the engine serves LoRA adapters only")
    refused = {
        "use_dora": "DoRA adapters are not supported; train without use_dora",
        "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layers) is not supported",
        "lora_bias": "adapters with a LoRA bias are not supported; train with lora_bias=False",
        "modules_to_save": "fully trained modules (modules_to_save) are not supported; merge them into the base",
        "trainable_token_indices": "trained token embeddings are not supported",
        "alora_invocation_tokens": "activated LoRA is not supported",
    }
    for field, reason in refused.items():
        if config.get(field):
            raise LoRAError(f"{where}: {field}={config[field]!r}", fix=reason)
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias={config['bias']!r}", fix="train with bias='none' (biases stay the base's)")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise LoRAError(f"{where}: {field}={value!r}", fix=f"{field} must be a positive number")


def _check_base(path: Path, spec: ModelSpec) -> None:
    """The base facts an ``lmforge`` adapter records (``config["base"]`` of its manifest) against the engine's."""
    if not (path / MANIFEST_NAME).is_file():
        return
    try:
        base = read_manifest(path).config.get("base")
    except CheckpointError as exc:
        raise LoRAError(str(exc)) from exc
    if not isinstance(base, dict):
        return
    for field in ADAPTER_BASE_FIELDS:
        want, have = base.get(field), getattr(spec, field, None)
        if want is not None and have is not None and want != have:
            raise LoRAError(
                f"lora_path={str(path)!r}: {field}={want!r} in the adapter's base ({base.get('path')}), "
                f"{have!r} in the engine's",
                fix="serve the adapter on the base it was trained on (or a compressed copy of that base)",
            )


def _pattern_value(patterns: dict, module_key: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key matching the end of ``module_key``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return value
    return default


def _load_adapter_tensors(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The adapter's ``adapter_model.safetensors`` (its path and tensors); pickled ``.bin`` files are refused."""
    # optional or heavy dependency: imported only on the path that needs it
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path = path / ADAPTER_WEIGHTS_NAME
    if not weights_path.is_file():
        pickled = [p.name for p in path.glob("*.bin")]
        raise LoRAError(
            f"lora_path={str(path)!r}: no {ADAPTER_WEIGHTS_NAME}"
            + (f" ({', '.join(pickled)} found)" if pickled else ""),
            fix="save the adapter with safe_serialization=True (the engine never loads pickled files)",
        )
    try:
        return weights_path, load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoRAError(f"{weights_path}: corrupt or truncated safetensors ({exc})", fix="re-save the adapter") from exc


def _group_lora_pairs(
    tensors: dict[str, torch.Tensor], spec: ModelSpec, weights_path: Path
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """``(layer, module) -> {"A": lora_A, "B": lora_B}`` of the tensors, each name, module and layer checked."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.search(name)
        if match is None:
            raise LoRAError(
                f"{weights_path}: tensor {name!r} is not a LoRA A/B weight of a decoder layer projection",
                fix=f"the engine adapts {', '.join(LORA_TARGETS)} (embeddings, lm_head and DoRA are not supported)",
            )
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in LORA_TARGETS:
            raise LoRAError(
                f"{weights_path}: target module {module!r} ({name})",
                fix=f"the engine adapts {', '.join(LORA_TARGETS)}",
            )
        if layer >= spec.num_hidden_layers:
            raise LoRAError(
                f"{weights_path}: {name} is for layer {layer}, the base has num_hidden_layers={spec.num_hidden_layers}",
                fix="serve the adapter on the base it was trained on",
            )
        if tensor.dim() != 2 or not tensor.dtype.is_floating_point:
            raise LoRAError(f"{weights_path}: {name} has shape {tuple(tensor.shape)} {tensor.dtype}", fix="re-save it")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"{weights_path}: no LoRA weights", fix="re-save the adapter")
    return pairs


def _check_pair_shapes(
    pair: dict[str, torch.Tensor], module: str, key: str, shape: tuple[int, int], weights_path: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """Module ``key``'s ``(A [r, in], B [out, r])``, both present and fitting the base's ``(in, out)`` ``shape``."""
    if set(pair) != {"A", "B"}:
        missing = "lora_B" if "A" in pair else "lora_A"
        raise LoRAError(f"{weights_path}: {key}.{missing}.weight is missing", fix="re-save the adapter")
    a, b = pair["A"], pair["B"]
    r = a.shape[0]
    in_features, out_features = shape
    if a.shape[1] != in_features:
        field = {"o_proj": "num_attention_heads * head_dim", "down_proj": "intermediate_size"}.get(
            module, "hidden_size"
        )
        raise LoRAError(
            f"{weights_path}: {key}.lora_A takes {a.shape[1]} inputs, the base's {field} is {in_features}",
            fix="serve the adapter on the base it was trained on",
        )
    if b.shape != (out_features, r):
        field = {"q_proj": "num_attention_heads * head_dim", "k_proj": "num_key_value_heads * head_dim"}
        field |= {"v_proj": field["k_proj"], "gate_proj": "intermediate_size", "up_proj": "intermediate_size"}
        raise LoRAError(
            f"{weights_path}: {key}.lora_B has shape {tuple(b.shape)}, the base needs ({out_features}, {r}) "
            f"({field.get(module, 'hidden_size')} = {out_features}, rank {r})",
            fix="serve the adapter on the base it was trained on",
        )
    return a, b


def load_adapter(request: LoRARequest, spec: ModelSpec, max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check an adapter directory against the base ``spec``.

    Args:
        request: names the directory (``lora_path``).
        spec: the base model's shape.
        max_lora_rank: the engine's limit.
        dtype: the engine's activation dtype (the tensors are converted to it).

    Raises:
        LoRAError: a missing or corrupt file, a PEFT setting the engine does not run, a module it does
            not adapt, a shape or layer that does not fit the base (``hidden_size``,
            ``intermediate_size``, ``num_hidden_layers``...), a base of another vocabulary
            (``vocab_size``), or a rank above ``max_lora_rank``.
    """
    path = Path(request.lora_path).expanduser()
    config = _read_adapter_config(path)
    _check_adapter_config(config, path / ADAPTER_CONFIG_NAME)
    _check_base(path, spec)
    weights_path, tensors = _load_adapter_tensors(path)
    shapes = module_shapes(spec)
    pairs = _group_lora_pairs(tensors, spec, weights_path)
    alpha = config.get("lora_alpha", config.get("r", 8))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    max_rank = 0
    for (layer, module), pair in sorted(pairs.items()):
        block = "mlp" if LORA_TARGETS[module][0] in ("gate_up", "down") else "self_attn"
        key = f"model.layers.{layer}.{block}.{module}"
        a, b = _check_pair_shapes(pair, module, key, shapes[module], weights_path)
        r = a.shape[0]
        if r > max_lora_rank:
            raise LoRAError(
                f"lora_path={str(path)!r}: rank {r} ({key}) > max_lora_rank={max_lora_rank}",
                fix=f"start the engine with max_lora_rank >= {r}",
            )
        r_config = _pattern_value(rank_pattern, key, r)
        module_alpha = _pattern_value(alpha_pattern, key, alpha)
        scaling = module_alpha / math.sqrt(r_config) if config.get("use_rslora") else module_alpha / r_config
        weights[(layer, module)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scaling))
        max_rank = max(max_rank, r)
    return LoRAAdapter(request, max_rank, weights, adapter_cache_key(request))


# ------------------------------------------------------------------------------------ slots


class SlotStack:
    """The active slots' weights of one fused layer, stacked for batched matmuls over slots.

    ``A [slots, in, n R]``: module ``j``'s ``A^T`` in rank columns ``[j R, j R + r_j)``, zeros past its rank
    (``R = max_lora_rank``, ``n`` modules: q, k, v or gate, up); ``B [slots, n R, out]``: module ``j``'s
    ``(s B)^T`` (scaling folded in) in rank rows ``[j R, j R + r_j)`` and its own output columns, zeros
    elsewhere (block-diagonal). One batched matmul gives every module's ``x A^T`` of every slot and one
    more every module's delta, whatever the number of modules and slots.
    """

    def __init__(self, capacity: int, in_features: int, out_widths: list[int], rank_rows: int, dtype, device):
        self.A = torch.zeros(capacity, in_features, rank_rows, dtype=dtype, device=device)
        self.B = torch.zeros(capacity, rank_rows, sum(out_widths), dtype=dtype, device=device)
        #: ``[n + 1]`` int64: module ``j``'s output columns are ``out_splits[j]:out_splits[j + 1]``
        self.out_splits = torch.tensor([0, *itertools.accumulate(out_widths)], dtype=torch.long)

    def grow(self, capacity: int) -> None:
        """Hold ``capacity`` slots (the new ones zero)."""
        extra = capacity - self.A.shape[0]
        if extra > 0:
            self.A = torch.cat((self.A, self.A.new_zeros(extra, *self.A.shape[1:])))
            self.B = torch.cat((self.B, self.B.new_zeros(extra, *self.B.shape[1:])))

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()

    @property
    def nbytes(self) -> int:
        return self.A.nbytes + self.B.nbytes


class LoRAManager:
    """Loaded adapters (``max_cpu_loras``, LRU) and the active slots (``max_loras``) of one model.

    ``check`` (any thread) validates a request's adapter and loads it; ``activate`` (the engine's
    thread, before a step) puts a step's adapters into slots, reloading one that left memory since
    (an adapter evicted while its requests wait is read again, never dropped). State is keyed by the
    ``LoRARequest`` itself, so requests already queued keep their adapter's weights even when its
    ``lora_int_id`` is removed and given to another adapter.

    Args:
        spec: the base model's shape.
        dtype: activation dtype; ``device``: where the slots live.
        max_loras / max_lora_rank / max_cpu_loras: ``EngineConfig`` limits.
    """

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: str,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
    ):
        self.spec, self.dtype, self.device = spec, dtype, device
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.shapes = module_shapes(spec)
        self.compute_dtype = dtype  # the deltas run in the activation dtype
        self._lock = threading.RLock()
        self.loaded: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: list[LoRARequest | None] = [None] * max_loras  # the adapter each slot holds
        self.slot_targets: list[set[tuple[int, str]]] = [set() for _ in range(max_loras)]
        self.stacks: dict[tuple[int, str], SlotStack] = {}
        self.capacity = 0  # slots the stacks hold (grows with the highest slot used)
        self.slot_used: list[int] = [0] * max_loras  # clock of the last use, for LRU slot eviction
        self.num_loads_total = 0  # adapters read from disk (a reload counts again)
        self.num_evictions_total = 0  # adapters dropped from memory (LRU)
        self._clock = 0

    # ---------------------------------------------------------------- requests

    def check(self, request: LoRARequest) -> int:
        """Validate ``request`` and keep its adapter loaded; returns the adapter's prefix-cache key.

        Raises:
            LoRAError: not a ``LoRARequest``, an id held by another adapter in memory, or a bad adapter
                (``load_adapter``).
        """
        if not isinstance(request, LoRARequest):
            raise LoRAError(f"lora_request={request!r}", fix="pass an engine.lora.LoRARequest")
        with self._lock:
            for other in [*self.loaded, *self.slots]:
                if other is not None and other.lora_int_id == request.lora_int_id and other != request:
                    raise LoRAError(
                        f"lora_int_id={request.lora_int_id} is adapter {other.lora_name!r} ({other.lora_path}), "
                        f"not {request.lora_name!r} ({request.lora_path})",
                        fix="give each adapter its own lora_int_id (or remove the old one first)",
                    )
            return self._get(request).cache_key

    @torch.inference_mode()
    def remove(self, lora_int_id: int) -> bool:
        """Drop the adapter of ``lora_int_id`` from memory and its slot; True if one was there.

        Requests still queued with it read it from disk again when they next run (or fail, naming the
        file, when it is gone); none runs on other weights.
        """
        with self._lock:
            found = False
            for request in [r for r in self.loaded if r.lora_int_id == lora_int_id]:
                del self.loaded[request]
                found = True
            for slot, held in enumerate(self.slots):
                if held is not None and held.lora_int_id == lora_int_id:
                    self._clear_slot(slot)
                    found = True
            return found

    def list_loras(self) -> list[LoRARequest]:
        """The adapters in memory, by id."""
        with self._lock:
            return sorted(self.loaded, key=lambda r: r.lora_int_id)

    def _get(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of ``request``, read from disk if it is not in memory (LRU update)."""
        adapter = self.loaded.get(request)
        if adapter is not None:
            self.loaded.move_to_end(request)
            return adapter
        adapter = load_adapter(request, self.spec, self.max_lora_rank, self.dtype)
        self.num_loads_total += 1
        self.loaded[request] = adapter
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
            self.num_evictions_total += 1
        return adapter

    # ---------------------------------------------------------------- slots

    @torch.inference_mode()
    def activate(self, request: LoRARequest, keep: set[LoRARequest]) -> int:
        """Put ``request``'s adapter in a slot (a free one, else the least recently used one not in ``keep``).

        Args:
            keep: the adapters the coming step also needs (never evicted for this one).

        Returns:
            The slot.

        Raises:
            LoRAError: the adapter can no longer be read (``load_adapter``), or every slot holds one of ``keep``.
        """
        with self._lock:
            self._clock += 1
            if request in self.slots:
                slot = self.slots.index(request)
            else:
                free = [s for s, held in enumerate(self.slots) if held is None]
                if not free:
                    evictable = [s for s, held in enumerate(self.slots) if held not in keep]
                    free = sorted(evictable, key=self.slot_used.__getitem__)
                if not free:
                    raise LoRAError(
                        f"{len(keep)} adapters in one step > max_loras={self.max_loras}",
                        fix="raise max_loras (the scheduler keeps a step within it)",
                    )
                slot = free[0]
                self._fill_slot(slot, self._get(request))
            self.slot_used[slot] = self._clock
            return slot

    def slot_of(self, request: LoRARequest) -> int:
        """The slot holding ``request``'s adapter (``activate`` put it there)."""
        return self.slots.index(request)

    def _clear_slot(self, slot: int) -> None:
        for key in self.slot_targets[slot]:
            self.stacks[key].clear(slot)
        self.slot_targets[slot] = set()
        self.slots[slot] = None

    def _fill_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        self._clear_slot(slot)
        if slot >= self.capacity:
            self.capacity = slot + 1
            for stack in self.stacks.values():
                stack.grow(self.capacity)
        R = self.max_lora_rank
        for (layer, module), (a, b, scaling) in adapter.weights.items():
            fused, j = LORA_TARGETS[module]
            stack = self._stack(layer, fused)
            r = a.shape[0]
            a32 = a.float()
            first = sum(self.shapes[m][1] for m in FUSED_MODULES[fused][:j])  # the module's output columns
            stack.A[slot, :, j * R : j * R + r] = a32.t().to(device=self.device, dtype=self.compute_dtype)
            stack.B[slot, j * R : j * R + r, first : first + b.shape[0]] = (
                (b.float() * scaling).t().to(device=self.device, dtype=self.compute_dtype)
            )
            self.slot_targets[slot].add((layer, fused))
        self.slots[slot] = adapter.request

    def _stack(self, layer: int, fused: str) -> SlotStack:
        stack = self.stacks.get((layer, fused))
        if stack is None:
            modules = FUSED_MODULES[fused]
            stack = SlotStack(
                self.capacity,
                self.shapes[modules[0]][0],
                [self.shapes[m][1] for m in modules],
                len(modules) * self.max_lora_rank,
                self.compute_dtype,
                self.device,
            )
            self.stacks[(layer, fused)] = stack
        return stack

    @property
    def slot_bytes(self) -> int:
        """Bytes of the slots' stacked weights."""
        return sum(s.nbytes for s in self.stacks.values())

    @property
    def loaded_bytes(self) -> int:
        """Bytes of the adapters held in memory."""
        return sum(a.nbytes for a in self.loaded.values())

    # ---------------------------------------------------------------- one step

    def batch(self, row_slots: list[int]) -> LoRABatch | None:
        """The grouping of one step's rows (``row_slots[i]``: slot of row ``i``, ``-1`` for the base), or
        ``None`` when no row has an adapter (the base-only forward runs unchanged)."""
        used = {s for s in row_slots if s >= 0}
        if not used:
            return None
        targets = set().union(*(self.slot_targets[s] for s in used))
        return LoRABatch(row_slots, self.stacks, targets, self.device, self.compute_dtype)


class LoRABatch:
    """One step's rows grouped by LoRA slot; ``apply`` adds each slot's delta to a layer's output.

    Args:
        row_slots: ``[N]`` slot of each token row, ``-1`` for base rows.
        stacks: the manager's ``(layer, fused layer) -> SlotStack``.
        targets: ``(layer, fused layer)`` pairs some slot of this step changes.
        dtype: the activation dtype (of the deltas and the mask).

    Layout: ``G`` groups (slots ``0..G-1``, ``G`` = highest slot used + 1) of ``M`` rows each (the
    largest group, plus one padding row so that a zero row always exists); ``gather [G M]`` gives each
    group position its source row (padding: row 0) and ``mask [G, M, 1]`` zeroes the padding;
    ``inverse [N]`` gives each row its group position (base rows: a padding position, whose delta is
    0), so the deltas come back with one ``index_select`` and one add. When every row of the step
    belongs to one slot, the rows are used in place (no gather, and ``addmm_`` adds the deltas).

    On CPU the step instead runs ``cpu_ops.lora_apply`` where it can: one C++ call per layer that reads
    each slot's weights once per task of up to 16 of its rows and adds the deltas in place, in place of
    the ~10 torch ops above and their padding (8 slots of 8 to 256 rows: 3.3x to 3.7x faster). Only a
    step whose rows all belong to one slot and number more than ``KERNEL_MAX_ONE_SLOT_ROWS`` (a prefill)
    keeps the two GEMMs of ``addmm_``.
    """

    #: Rows of a one-slot step above which its two GEMMs beat the C++ path (2,048 rows: 0.50 vs 1.09 ms).
    KERNEL_MAX_ONE_SLOT_ROWS = 128
    #: Rows per task of the C++ path (its limit).
    KERNEL_TASK_ROWS = 16

    def __init__(
        self, row_slots: list[int], stacks: dict, targets: set, device: str, compute_dtype: torch.dtype
    ) -> None:
        self.stacks, self.targets, self.compute_dtype = stacks, targets, compute_dtype
        self.num_rows = len(row_slots)
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(row)
        G = self.num_groups = max(groups) + 1
        largest = max(len(rows) for rows in groups.values())
        self.only_slot = next(iter(groups)) if len(groups) == 1 and largest == self.num_rows else None
        self.tasks = None
        if device == "cpu" and (self.only_slot is None or self.num_rows <= self.KERNEL_MAX_ONE_SLOT_ROWS):
            self.tasks = self._kernel_tasks(groups)
        if self.only_slot is not None:
            return
        M = self.max_rows = largest + 1
        gather = [0] * (G * M)
        mask = [0.0] * (G * M)
        inverse = [M - 1] * self.num_rows  # the last position of group 0: always padding
        for slot, rows in groups.items():
            gather[slot * M : slot * M + len(rows)] = rows
            mask[slot * M : slot * M + len(rows)] = [1.0] * len(rows)
            for k, row in enumerate(rows):
                inverse[row] = slot * M + k
        self.gather = torch.tensor(gather, dtype=torch.long, device=device)
        self.inverse = torch.tensor(inverse, dtype=torch.long, device=device)
        self.mask = torch.tensor(mask, dtype=compute_dtype, device=device).view(G, M, 1)

    def _kernel_tasks(self, groups: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows [M], task_bounds [T + 1], task_slots [T])`` for ``cpu_ops.lora_apply``: each slot's rows in
        tasks of up to ``KERNEL_TASK_ROWS``."""
        rows, bounds, slots = [], [0], []
        for slot, members in groups.items():
            for start in range(0, len(members), self.KERNEL_TASK_ROWS):
                rows += members[start : start + self.KERNEL_TASK_ROWS]
                bounds.append(len(rows))
                slots.append(slot)
        return tuple(torch.tensor(v, dtype=torch.long) for v in (rows, bounds, slots))

    def has(self, layer: int, fused: str) -> bool:
        """Whether some slot of this step changes ``fused`` of ``layer``."""
        return (layer, fused) in self.targets

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y[rows] += (x[rows] @ A_s^T) @ B_s^T`` for every slot ``s`` over its rows, in place; returns ``y``.

        Args:
            x: ``[>= N, in]`` the layer's input (rows past ``N`` are padding, never read).
            y: ``[>= N, out]`` its output (base rows and padding rows unchanged).
        """
        key = (layer, fused)
        if key not in self.targets:
            return y
        stack, n, dtype = self.stacks[key], self.num_rows, self.compute_dtype
        if self.tasks is not None and cpu_ops.lora_apply(y, x, *self.tasks, stack.A, stack.B, stack.out_splits):
            return y
        if self.only_slot is not None:
            s = self.only_slot
            t = x[:n].to(dtype) @ stack.A[s]  # [N, n_mod * R]
            if dtype == y.dtype:
                y[:n].addmm_(t, stack.B[s])
            else:
                y[:n] += (t @ stack.B[s]).to(y.dtype)
            return y
        G, M = self.num_groups, self.max_rows
        xg = x.index_select(0, self.gather).view(G, M, -1).to(dtype)  # [G, M, in]
        t = torch.bmm(xg, stack.A[:G])  # [G, M, n_mod * R]
        t.mul_(self.mask)
        delta = torch.bmm(t, stack.B[:G]).view(G * M, -1)  # [G M, out]
        y[:n] += delta.index_select(0, self.inverse).to(y.dtype)  # base rows add a padding row's zeros
        return y
