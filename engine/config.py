"""``EngineConfig``: every knob of the engine in one validated dataclass (vLLM field names)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.errors import UsageError  # a ValueError: a refused field is a usage error (exit 2)
from engine.limits import RequestLimits
from engine.platform import cpu_flags  # /proc/cpuinfo flags (also decide the INT8 kernels)

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")

#: ``kv_cache_dtype`` names: ``auto`` stores K and V in the model's dtype; ``int8`` stores them as symmetric
#: int8 with one float16 scale per (token, KV head) (``engine.attention.quantize_kv``).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")

#: ``/proc/cpuinfo`` flags of CPUs with native bf16 matmuls (AVX-512 BF16 dot products, AMX tiles).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")

#: ``attention_backend`` names (``engine.attention_backends.get_attention_backend``).
ATTENTION_BACKENDS = ("torch", "triton")

#: Ways to propose tokens for speculative decoding (``EngineConfig.speculative_method``).
SPECULATIVE_METHODS = ("ngram", "draft")

#: KV cache budget used when neither ``num_kv_blocks`` nor ``kv_cache_memory_bytes`` is given.
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30

#: ``num_speculative_tokens`` when speculation is on and it is not given.
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 4, "draft": 3}

#: Tokens whose logits a draft with ``token_frequencies.json`` computes (``speculative_draft_vocab_size``): 2048
#: rows agree with the target as often as 8192 (44.3% of chat positions) and read 3.5 MB less per draft position
#: (docs/speculative-decoding.md).
DEFAULT_SPECULATIVE_DRAFT_VOCAB_SIZE = 2048

#: A draft stops proposing for a request after a token it gave less than this probability
#: (``speculative_draft_confidence_threshold``; measured: docs/speculative-decoding.md).
DEFAULT_SPECULATIVE_DRAFT_CONFIDENCE_THRESHOLD = 0.0

#: Fair scheduling (``EngineConfig.fair_share_*``): while a regular request is running or waiting, large
#: requests together run at most this many sequences (decode rows) and tokens per step. A step's cost on a CPU
#: grows with its rows (docs/serving.md has the measured latencies that set these).
DEFAULT_FAIR_SHARE_SEQS = 8
DEFAULT_FAIR_SHARE_TOKENS = 32
#: Prompt tokens still to compute above which a request is large (vLLM's ``long_prefill_token_threshold``).
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 1024

#: Running requests from which a step does not speculate (measured with ``lmforge bench engine
#: --speculative``: see docs/speculative-decoding.md).
DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE = 8


@dataclasses.dataclass
class EngineConfig:
    """Configuration of an ``LLMEngine``; validated at construction.

    Attributes:
        model: checkpoint name, ``.gguf`` file or directory (``engine.checkpoint.store.resolve_checkpoint``).
        block_size: tokens per KV cache block.
        num_kv_blocks: blocks in the KV pool; ``None`` derives it from ``kv_cache_memory_bytes``.
        kv_cache_memory_bytes: KV pool budget in bytes (K and V of every layer) when
            ``num_kv_blocks`` is ``None``; default 1 GiB.
        max_num_seqs: most requests running (holding KV blocks) at once.
        max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
        max_model_len: longest prompt + output in tokens; ``None`` takes the checkpoint's
            ``max_position_embeddings`` capped at 8192.
        enable_prefix_caching: reuse KV blocks of identical prefixes (hash of full blocks).
        enable_chunked_prefill: split long prompts over steps to respect the token budget.
        dtype: weight and activation dtype for floating-point checkpoints; ``"auto"`` takes
            ``bfloat16`` on a CPU with native bf16 (``CPU_BF16_FLAGS`` in ``/proc/cpuinfo``) or a
            CUDA device that supports it, ``float32`` elsewhere (``resolve_dtype``).
        device: ``cpu`` or ``cuda`` (``cuda:N``).
        num_threads: ``torch.set_num_threads`` for the CPU path; ``None`` leaves torch's default.
        adaptive_threads: on CPU, lower the thread count (down to 1, up to ``num_threads`` or torch's
            default) while other processes keep cores busy, and raise it again when they stop
            (``engine.threads.ThreadGovernor``): a thread on a shared core stalls every step's barrier.
        seed: seeds the generator of requests sampled without their own ``seed``.
        speculative_method: ``None`` (off), ``"ngram"`` (prompt lookup: propose the tokens that
            followed the latest earlier occurrence of the last n tokens) or ``"draft"`` (a small
            checkpoint with the same tokenizer proposes; see ``speculative_model``).
        num_speculative_tokens: tokens proposed per request and step (k); each decode step then
            verifies 1 + k tokens in one forward pass.
        speculative_model: the draft checkpoint for ``"draft"``; ``None`` takes the newest
            ``lmforge distill`` output whose manifest names ``model`` as its parent
            (``engine.spec_decode.find_distilled_draft``).
        speculative_disable_by_batch_size: no speculation in a step that starts with at least
            this many requests enqueued, running or waiting (verifying k extra tokens no longer
            pays when the batch is compute-bound); ``None`` never switches it off.
        speculative_draft_dtype: dtype of the ``"draft"`` model, independent of ``dtype`` (its
            proposals are verified by the target, so output is unchanged); ``"auto"`` as for
            ``dtype`` (``bfloat16`` on a CPU with native bf16: half the bytes per draft forward).
        speculative_adaptive: choose each request's k per step from its acceptance so far and
            the measured cost of a proposed token (``engine.spec_decode.speculator.choose_k``);
            k = 0 (no proposals, a probe now and then) where speculation does not pay. ``False``:
            always ``num_speculative_tokens``.
        speculative_draft_vocab_size: a draft that ships ``token_frequencies.json`` (``lmforge
            distill`` writes it) computes logits for this many frequent tokens only (its lm head
            shrinks; ``engine.spec_decode.draft.read_draft_vocab``); ``None``: the whole vocabulary.
        speculative_draft_confidence_threshold: the ``"draft"`` proposer stops proposing for a
            request (fewer than k tokens this step) after a token it gave a probability below this
            (over its head's tokens): such a token is seldom the target's, and the draft forwards
            after it would be wasted. 0 always proposes k. Output is unchanged (greedy) or keeps
            the target's distribution (sampling: the stop depends on the draft's draws only).
        ngram_prompt_lookup_min / ngram_prompt_lookup_max: shortest / longest suffix n-gram
            the ``ngram`` proposer matches (it tries the longest first).
        speculative_ngram_corpus: a JSONL of chat records (``lmforge data`` format, e.g. the
            ``teacher_generated.jsonl`` of an ``lmforge distill`` run: the model's own replies) whose
            n-grams the ``ngram`` proposer also looks up when the request's own tokens have no match
            of 2 or more tokens (``engine.spec_decode.ngram.NgramCorpus``); ``None``: prompt lookup only.
        attention_backend: ``"torch"`` or ``"triton"`` (``engine.attention``); ``None`` takes
            ``triton`` on CUDA and ``torch`` on CPU (``triton`` on CPU runs under Triton's
            interpreter: tests only).
        enforce_eager: with the ``triton`` backend, never capture CUDA graphs of decode steps
            (``engine.cuda_graphs``); decode batches still run from bucket-padded static buffers.
        fair_share_seqs / fair_share_tokens: fair scheduling (``engine.scheduler``). A request is *large*
            when it has more than ``fair_share_seqs`` unfinished sequences (``n``) or more than
            ``long_prefill_token_threshold`` prompt tokens left to compute. While a regular request runs or
            waits, the large ones together run at most ``fair_share_seqs`` sequences and ``fair_share_tokens``
            tokens per step, give up their seats and KV blocks to regular requests first (preempted by
            recompute), and regular requests are admitted before them; alone they use the whole step.
            ``fair_share_tokens=None`` turns fair scheduling off (first come, first served).
        long_prefill_token_threshold: see ``fair_share_seqs``.
        batch_invariant: a request's output does not depend on what else runs in its steps (greedy
            decoding is reproducible under any load): every linear layer runs on oneDNN's packed weight in
            calls of at most ``engine.model.BATCH_INVARIANT_TILE_ROWS`` rows, and attention computes every
            token as a row of the C++ kernel over its keys in one fixed order (no shared-prefix split, no
            batch-shaped flash call). CPU, float checkpoints (bf16 or fp32) only; it costs prefill speed
            (docs/engine.md has the measured cost).
        kv_cache_dtype: how K and V are stored (``KV_CACHE_DTYPES``): ``"auto"`` in the model's ``dtype``;
            ``"bfloat16"`` / ``"float32"`` in that dtype; ``"int8"``: symmetric int8 with one float16 scale
            (absmax / 127) per token and KV head stored beside each row, about half the bytes of bf16, so a
            ``kv_cache_memory_bytes`` budget holds about twice the blocks (``engine.attention.quantize_kv``;
            quality: docs/engine.md).
        limits: the per-request limits every entry point enforces (``engine.limits.RequestLimits``, or a
            dict of its fields as ``model.json`` holds them); ``None`` takes the defaults.
        enable_lora: serve LoRA adapters on the base (requests name theirs with a ``LoRARequest``;
            ``engine.lora``); a batch mixes adapters and the base in one forward pass.
        max_loras: adapters active in one step (the scheduler holds back requests of another adapter
            while this many are running).
        max_lora_rank: highest adapter rank accepted (the slots are sized by it).
        max_cpu_loras: adapters kept loaded in memory (least recently used out; reloaded from disk when
            needed again); ``None``: ``max_loras``. At least ``max_loras``.

    Raises:
        UsageError (a ValueError): a field out of range or an inconsistent combination (the message names
            the values and the fix).
    """

    model: str = "smollm2-135m"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    num_threads: int | None = None
    adaptive_threads: bool = True
    seed: int = 0
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    speculative_model: str | None = None
    speculative_disable_by_batch_size: int | None = DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE
    speculative_draft_dtype: str = "auto"
    speculative_adaptive: bool = True
    speculative_draft_vocab_size: int | None = DEFAULT_SPECULATIVE_DRAFT_VOCAB_SIZE
    speculative_draft_confidence_threshold: float = DEFAULT_SPECULATIVE_DRAFT_CONFIDENCE_THRESHOLD
    ngram_prompt_lookup_min: int = 1
    ngram_prompt_lookup_max: int = 4
    speculative_ngram_corpus: str | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False
    fair_share_seqs: int = DEFAULT_FAIR_SHARE_SEQS
    fair_share_tokens: int | None = DEFAULT_FAIR_SHARE_TOKENS
    long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD
    batch_invariant: bool = False
    kv_cache_dtype: str = "auto"
    limits: RequestLimits | dict | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        self.model = str(self.model)
        self.limits = RequestLimits.from_value(self.limits)
        _require_positive("fair_share_seqs", self.fair_share_seqs)
        _require_positive("long_prefill_token_threshold", self.long_prefill_token_threshold)
        if self.fair_share_tokens is not None:
            _require_positive("fair_share_tokens", self.fair_share_tokens)
        _require_positive("block_size", self.block_size)
        _require_positive("max_num_seqs", self.max_num_seqs)
        _require_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        for name in ("num_kv_blocks", "kv_cache_memory_bytes", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise UsageError(
                f"num_kv_blocks={self.num_kv_blocks} and kv_cache_memory_bytes={self.kv_cache_memory_bytes} "
                "are both set; give only one of them"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise UsageError(f"dtype={self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise UsageError(f"device={self.device!r}; use 'cpu' or 'cuda' / 'cuda:N'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UsageError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one of {KV_CACHE_DTYPES} "
                "('auto': the model's dtype)"
            )
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise UsageError(
                f"attention_backend={self.attention_backend!r}; use one of {ATTENTION_BACKENDS} or None (by device)"
            )
        if self.batch_invariant and (self.device != "cpu" or self.attention_backend not in (None, "torch")):
            raise UsageError(
                f"batch_invariant=True with device={self.device!r}, attention_backend={self.attention_backend!r}: "
                "batch-invariant kernels exist for the CPU torch backend only; turn it off or run on CPU"
            )
        if self.batch_invariant and self.enable_lora:
            raise UsageError(
                "batch_invariant=True with enable_lora=True: the LoRA deltas are computed per batch; turn one off"
            )
        if self.max_model_len is not None:
            self.check_model_len(self.max_model_len)
        self._check_speculative()
        self._check_lora()

    def _check_lora(self) -> None:
        _require_positive("max_loras", self.max_loras)
        _require_positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _require_positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise UsageError(
                f"max_cpu_loras={self.max_cpu_loras} < max_loras={self.max_loras}: every active adapter is also kept "
                "in memory; raise max_cpu_loras or lower max_loras"
            )

    def _check_speculative(self) -> None:
        method = self.speculative_method
        if method is not None and method not in SPECULATIVE_METHODS:
            raise UsageError(
                f"speculative_method={method!r}; use one of {SPECULATIVE_METHODS}, or None to turn speculation off"
            )
        if method is None:
            for name in ("num_speculative_tokens", "speculative_model", "speculative_ngram_corpus"):
                if getattr(self, name) is not None:
                    raise UsageError(
                        f"{name}={getattr(self, name)!r} without speculative_method; set "
                        "speculative_method='ngram' or 'draft'"
                    )
            return
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS[method]
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UsageError(f"num_speculative_tokens={k!r}; it must be an integer >= 1 (tokens proposed per step)")
        if k >= self.max_num_batched_tokens:
            raise UsageError(
                f"num_speculative_tokens={k} >= max_num_batched_tokens={self.max_num_batched_tokens}: a decode of "
                "1 + k tokens would not fit a step; decrease num_speculative_tokens"
            )
        if self.speculative_disable_by_batch_size is not None:
            _require_positive("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size)
        if self.speculative_draft_vocab_size is not None:
            _require_positive("speculative_draft_vocab_size", self.speculative_draft_vocab_size)
        t = self.speculative_draft_confidence_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < 1.0:
            raise UsageError(
                f"speculative_draft_confidence_threshold={t!r}; it must be a number in [0, 1) (0: always propose k)"
            )
        if self.speculative_draft_dtype not in SUPPORTED_DTYPES:
            raise UsageError(
                f"speculative_draft_dtype={self.speculative_draft_dtype!r} is not supported; use one of "
                f"{SUPPORTED_DTYPES}"
            )
        if method == "ngram":
            if self.speculative_model is not None:
                raise UsageError(
                    f"speculative_model={self.speculative_model!r} with speculative_method='ngram'; the ngram "
                    "proposer uses no model: drop it or use 'draft'"
                )
            _require_positive("ngram_prompt_lookup_min", self.ngram_prompt_lookup_min)
            _require_positive("ngram_prompt_lookup_max", self.ngram_prompt_lookup_max)
            if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
                raise UsageError(
                    f"ngram_prompt_lookup_min={self.ngram_prompt_lookup_min} > ngram_prompt_lookup_max="
                    f"{self.ngram_prompt_lookup_max}; the shortest n-gram must not exceed the longest"
                )
        elif self.speculative_ngram_corpus is not None:
            raise UsageError(
                f"speculative_ngram_corpus={self.speculative_ngram_corpus!r} with speculative_method={method!r}; "
                "the corpus serves the ngram proposer: drop it or use 'ngram'"
            )
        if self.speculative_model is not None:
            self.speculative_model = str(self.speculative_model)
        if self.speculative_ngram_corpus is not None:
            self.speculative_ngram_corpus = str(self.speculative_ngram_corpus)

    def check_model_len(self, max_model_len: int) -> None:
        """Check ``max_model_len`` against the token budget and the KV pool (called again once it is resolved).

        Raises:
            UsageError (a ValueError): a single full-length request could never be scheduled.
        """
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise UsageError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len={max_model_len} with "
                "enable_chunked_prefill=False: a long prompt could never be scheduled; increase "
                "max_num_batched_tokens, decrease max_model_len, or enable chunked prefill"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks * self.block_size < max_model_len:
            raise UsageError(
                f"num_kv_blocks={self.num_kv_blocks} x block_size={self.block_size} = "
                f"{self.num_kv_blocks * self.block_size} tokens < max_model_len={max_model_len}: one request "
                "could not fit; increase num_kv_blocks or decrease max_model_len"
            )

    def replace(self, **changes: Any) -> "EngineConfig":
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """``"auto"`` -> the model's resolved ``dtype``; other ``KV_CACHE_DTYPES`` unchanged."""
    return dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def resolve_dtype(dtype: str, device: str) -> str:
    """``"auto"`` -> ``bfloat16`` where the device computes it natively, else ``float32``; other values unchanged."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "bfloat16" if cpu_flags() & set(CPU_BF16_FLAGS) else "float32"

    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"


def _require_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name}={value!r}; it must be an integer >= 1")
