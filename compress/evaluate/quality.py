"""``lmforge evaluate A B ...``: compare causal-LM checkpoints of every kind lmforge writes.

Metrics per checkpoint (also merged into its ``lmforge.json`` under ``metrics``), all
teacher-forced on held-out records against a reference checkpoint (``--reference``, else the
first checkpoint listed: put the parent first):

* ``perplexity``: ``exp`` of the mean next-token negative log-likelihood on held-out records.
  ``{"messages": [...]}`` records are formatted with the tokenizer's chat template and scored on
  the assistant replies only (the tokens a chat model is trained to produce, as in fine-tuning);
  ``{"text": ...}`` records are scored on every token after the first.
* ``kl_mean`` / ``kl_p99`` / ``kl_max``: KL(reference || checkpoint) of the next-token
  distributions (nats) over the scored tokens; ``same_top1``: fraction of scored tokens whose
  argmax equals the reference's. These judge a compressed model (perplexity can improve while
  the outputs move away from the parent's).
* ``greedy_agreement`` (secondary): fraction of identical tokens, position by position, between
  the checkpoint's and the reference's free-running greedy continuations of a fixed prompt set
  (one early flip changes the rest of a sequence, so it understates closeness).
* ``size_bytes`` (weight files on disk), ``linear_weight_bytes`` (bytes of the transformer
  blocks' linear-layer weights with their scales), ``num_parameters`` (stored elements).
* ``decode_ms_per_token``: batch 1, CPU, greedy, with the KV cache:
  ``(time(1 + n tokens) - time(1 token)) / n``, each time the fastest of the repeats.

With ``lora`` (``--lora DIR``) one LoRA adapter (PEFT format, ``lmforge finetune --lora``) runs on
every checkpoint, the reference included: adapter-on-INT8-base is then judged against
adapter-on-fp32-base, i.e. what compressing the base costs the adapted model. The adapter is added
as a forward hook on each adapted projection (``y + s B A x``, Hu et al. 2021, in the layer's input
dtype), which works the same on float, INT8 and bitsandbytes layers; ONNX checkpoints cannot take
it. Those metrics describe the adapted model, so they are not merged into the checkpoints'
manifests.

A served model (``--served URL``, ``compress.evaluate.served``) gets a row of its own: its perplexity on
the same records and scored tokens, through the OpenAI ``/v1/completions`` echo + prompt logprobs (KL and
same top-1 need the whole distribution, which the API does not return).

Checkpoint kinds (``checkpoint_kind``): ``pytorch`` (float safetensors), ``int8``
(``engine.quant.int8`` format: ``int8-weight-only``, ``w8a8`` and the former ``dynamic``), ``llm-int8``
(bitsandbytes), ``onnx`` (fp32 or INT8 ONNX, run with
ONNX Runtime through Optimum).

KV cache dtypes (``--kv-cache-dtype bfloat16,int8``): every checkpoint then runs on the lmforge engine
(kind ``engine``, ``EngineLM``) once per listed ``EngineConfig.kv_cache_dtype``, and the reference is the
reference checkpoint at the first one listed. Teacher-forced logits come from one engine prefill that
writes the record's K and V into the cache and reads them back, so each position sees the quantized keys
and values of every position before it, as a decode step would: KL and same top-1 of ``int8`` against
``bfloat16`` judge the int8 KV cache the way the other metrics judge compressed weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from compress.data import records as records_module
from compress.data.records import default_split_records
from compress.evaluate.served import served_model_name, served_quality
from compress.quantize.methods import load_int8_model, load_llm_int8_model
from compress.quantize.onnx import onnx_num_parameters
from engine import LLM
from engine.checkpoint.model_spec import ModelSpec
from engine.checkpoint.outputs import check_output_file, write_output_file
from engine.checkpoint.store import (
    MANIFEST_NAME,
    describe_weights,
    read_safetensors_header,
    resolve_checkpoint,
    update_metrics,
)
from engine.cli_options import add_config_option, add_engine_dtype_option, errors_name_flags
from engine.config import KV_CACHE_DTYPES
from engine.errors import LmforgeError, UsageError
from engine.lora import LORA_TARGETS, LoRARequest, load_adapter
from engine.model import read_model_spec
from engine.quant.int8 import INT8_WEIGHT_SUFFIX
from engine.records import encode_record
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence as EngineSequence
from engine.tables import fmt, table_lines

#: Fixed prompts of the greedy-agreement metric (chat-formatted).
AGREEMENT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain what a neural network is in one sentence.",
    "Write a short poem about the sea.",
    "How do I make a cup of tea?",
    "What is your favourite book and why?",
    "Tell me a fun fact about space.",
    "What is 12 times 7?",
)


class EvaluationError(LmforgeError, ValueError):
    """Bad evaluation input (data file, record, option); the message names the file or field."""


#: The kind of a checkpoint evaluated on the lmforge engine (``--kv-cache-dtype``).
ENGINE_KIND = "engine"
#: The kind of the row of a served model (``--served``: perplexity only, ``compress.evaluate.served``).
SERVED_KIND = "served"


# --------------------------------------------------------------------------------------------
# Loading every checkpoint kind
# --------------------------------------------------------------------------------------------


def checkpoint_kind(checkpoint_dir: str | Path) -> str:
    """``onnx``, ``int8``, ``llm-int8`` or ``pytorch``, from the files (not the directory name)."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / "model.onnx").is_file():
        return "onnx"
    config = json.loads((checkpoint_dir / "config.json").read_text())
    if config.get("quantization_config", {}).get("quant_method") == "bitsandbytes":
        return "llm-int8"
    for file in checkpoint_dir.glob("*.safetensors"):
        if any(name.endswith(INT8_WEIGHT_SUFFIX) for name in read_safetensors_header(file)):
            return "int8"
    return "pytorch"


def _load_pytorch(path: Path, num_threads: int | None = None):
    # optional or heavy dependency: imported only on the path that needs it
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()  # as stored: a bf16 checkpoint runs in bf16


def _load_int8(path: Path, num_threads: int | None = None):
    return load_int8_model(path)


def _load_llm_int8(path: Path, num_threads: int | None = None):
    return load_llm_int8_model(path, device="cpu")


def _load_onnx(path: Path, num_threads: int | None = None):
    # optional or heavy dependency: imported only on the path that needs it
    import onnxruntime
    from optimum.onnxruntime import ORTModelForCausalLM

    options = onnxruntime.SessionOptions()
    if num_threads:
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
    return ORTModelForCausalLM.from_pretrained(path, session_options=options)


#: checkpoint kind -> loader ``(path, num_threads) -> model`` (CPU).
LOADERS: dict[str, Callable[[Path, int | None], Any]] = {
    "pytorch": _load_pytorch,
    "int8": _load_int8,
    "llm-int8": _load_llm_int8,
    "onnx": _load_onnx,
}


@dataclasses.dataclass
class LoadedCheckpoint:
    """A checkpoint ready to run: ``model(input_ids=[1, T]).logits -> [1, T, vocab]``, ``model.generate``.

    ``kv_cache_dtype`` is set for kind ``engine`` (the lmforge engine with that KV cache dtype)."""

    path: Path
    kind: str
    model: Any
    tokenizer: Any
    kv_cache_dtype: str | None = None

    @property
    def label(self) -> str:
        """How its results are keyed: the path, and ``[kv DTYPE]`` on the engine."""
        return str(self.path) if self.kv_cache_dtype is None else f"{self.path} [kv {self.kv_cache_dtype}]"


class EngineLM:
    """A checkpoint on the lmforge engine, with the calls evaluation makes of a ``transformers`` model.

    ``model(input_ids=[1, T]).logits`` are the teacher-forced float32 logits ``[1, T, vocab]`` of one
    engine prefill (``ModelRunner.teacher_forced_logits``: K and V go through the cache, so they carry
    ``kv_cache_dtype``'s rounding); ``generate`` is engine greedy decoding (EOS kept unless
    ``min_new_tokens`` holds it back). Prefix caching is off, so every record computes its own K and V.

    Args:
        path: a resolved checkpoint directory.
        dtype: ``EngineConfig.dtype`` (``"auto"``: bf16 where the CPU computes it natively).
        kv_cache_dtype: ``EngineConfig.kv_cache_dtype``.
        max_model_len: longest record + generation in tokens (capped at the checkpoint's context).
    """

    def __init__(self, path: Path, dtype: str, kv_cache_dtype: str, max_model_len: int):
        max_model_len = min(max_model_len, read_model_spec(path).max_position_embeddings)
        self.llm = LLM(
            path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False, max_model_len=max_model_len
        )

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        ids = input_ids[0].tolist()
        engine = self.llm.engine
        seq = EngineSequence("teacher-forced", None, ids, SamplingParams(max_tokens=1), None, None)
        if not engine.block_manager.allocate_slots(seq, len(ids)):
            raise EvaluationError(f"{len(ids)} tokens do not fit the engine's KV cache; decrease --max-length")
        try:
            logits = engine.runner.teacher_forced_logits(ids, seq.block_table)  # [T, vocab]
        finally:
            engine.block_manager.free(seq)
        return types.SimpleNamespace(logits=logits[None])

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        min_new_tokens: int = 0,
        do_sample: bool = False,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        if do_sample:
            raise EvaluationError("the engine rows of `lmforge evaluate` decode greedily (do_sample=False)")
        prompt = input_ids[0].tolist()
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, min_tokens=min_new_tokens)
        out = self.llm.generate([{"prompt_token_ids": prompt}], params)[0]
        return torch.tensor([prompt + list(out.outputs[0].token_ids)])


def load_for_eval(
    spec: str | Path,
    *,
    num_threads: int | None = None,
    kv_cache_dtype: str | None = None,
    engine_dtype: str = "auto",
    max_model_len: int = 1024,
    lora: str | Path | None = None,
) -> LoadedCheckpoint:
    """Load a causal-LM checkpoint of any kind for evaluation (CPU).

    Args:
        spec: checkpoint name or directory.
        num_threads: CPU threads (``torch.set_num_threads`` for PyTorch kinds, process-wide;
            ONNX Runtime intra-op threads); ``None`` keeps the libraries' defaults.
        kv_cache_dtype: run it on the lmforge engine (kind ``engine``, ``EngineLM``) with this
            ``EngineConfig.kv_cache_dtype``; ``None``: with its own library.
        engine_dtype, max_model_len: the engine's ``dtype`` and ``max_model_len`` (with ``kv_cache_dtype``).
        lora: a LoRA adapter directory to run on the checkpoint (``apply_lora``; not with ``kv_cache_dtype``).

    Raises:
        CheckpointError: missing/corrupt checkpoint or a non-causal model (names the file).
        UsageError: a ``kv_cache_dtype`` or ``engine_dtype`` the engine refuses (names the field).
        LoRAError: the adapter does not fit the checkpoint.
        EvaluationError: ``lora`` on an ONNX checkpoint or with ``kv_cache_dtype``.
    """
    # optional or heavy dependency: imported only on the path that needs it
    from transformers import AutoTokenizer

    path = resolve_checkpoint(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if num_threads:
        torch.set_num_threads(num_threads)
    if lora is not None and kv_cache_dtype is not None:
        raise EvaluationError("--lora with --kv-cache-dtype: the engine rows of evaluate run no adapter; drop one")
    if kv_cache_dtype is not None:
        model = EngineLM(path, engine_dtype, kv_cache_dtype, max_model_len)
        return LoadedCheckpoint(path, ENGINE_KIND, model, tokenizer, kv_cache_dtype)
    kind = checkpoint_kind(path)
    if lora is not None and kind == "onnx":
        raise EvaluationError(f"--lora {lora}: {path} is an ONNX checkpoint, which cannot take a LoRA adapter")
    model = LOADERS[kind](path, num_threads)
    if lora is not None:
        apply_lora(model, lora, path)
    return LoadedCheckpoint(path, kind, model, tokenizer)


def apply_lora(model, adapter_dir: str | Path, checkpoint_dir: Path) -> int:
    """Add a LoRA adapter to a loaded ``transformers`` model as forward hooks: each adapted projection's
    output gains ``s B A x`` (computed in its input's dtype). Returns the number of hooked modules.

    Raises:
        LoRAError: the adapter's files, settings or shapes do not fit the checkpoint
            (``engine.lora.load_adapter``, which names the field).
        EvaluationError: an adapted module is not in the model.
    """
    spec = ModelSpec.from_checkpoint(checkpoint_dir)
    adapter = load_adapter(LoRARequest("evaluate", 1, str(adapter_dir)), spec, 1 << 16, torch.float32)
    modules = dict(model.named_modules())
    for (layer, module), (a, b, scaling) in adapter.weights.items():
        block = "mlp" if LORA_TARGETS[module][0] in ("gate_up", "down") else "self_attn"
        name = f"model.layers.{layer}.{block}.{module}"
        if name not in modules:
            raise EvaluationError(f"--lora {adapter_dir}: {checkpoint_dir} has no module {name}")
        modules[name].register_forward_hook(_lora_hook(a, b * scaling))
    return len(adapter.weights)


def _lora_hook(a: torch.Tensor, b: torch.Tensor):
    """``output + (x A^T) B^T`` (``a [r, in]``, ``b [out, r]`` scaled) as a forward hook, in ``x``'s dtype."""

    def hook(module, args, output):
        x = args[0]
        delta = (x @ a.to(x.dtype).t()) @ b.to(x.dtype).t()
        return output + delta.to(output.dtype)

    return hook


# --------------------------------------------------------------------------------------------
# Held-out data
# --------------------------------------------------------------------------------------------


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file (``val.jsonl`` of ``lmforge data``; ``compress.data.records``).

    Raises:
        EvaluationError: missing file, bad JSON or record (names file:line), or no records.
    """
    return records_module.read_records(path, EvaluationError)


def default_heldout_records() -> tuple[list[dict[str, Any]], str]:
    """The held-out English chatterbot-corpus dialogs (``default_split_records("val")``)."""
    return default_split_records("val")


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def _logits(model, ids: list[int]):
    input_ids = torch.tensor([ids], dtype=torch.long)  # [1, T]
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.float()  # [1, T, vocab]


def scored_logprobs(model, tokenizer, record: dict[str, Any], *, max_length: int = 512):
    """Teacher-forced next-token log-probabilities of one record at its scored positions.

    Returns:
        ``(logprobs, targets)``: float32 ``[n, vocab]`` (row ``i`` is the distribution that
        predicts scored token ``i``) and int64 ``[n]`` (the tokens), or ``None`` when the record
        has no scored token.
    """
    ids, scored = encode_record(tokenizer, record, max_length=max_length)
    if not any(scored):
        return None
    mask = torch.tensor(scored[1:])  # position t predicts token t+1
    logprobs = torch.log_softmax(_logits(model, ids)[0, :-1][mask], dim=-1)  # [n, vocab]
    return logprobs, torch.tensor(ids[1:])[mask]


def reference_logprobs(model, tokenizer, records: Sequence[dict[str, Any]], *, max_length: int = 512):
    """``scored_logprobs`` of every record with a scored token: the reference of ``quality_metrics``.

    Memory: ``4 * vocab`` bytes per scored token (SmolLM2: 190 KiB; 920 tokens = 174 MiB).
    """
    return [
        r for r in (scored_logprobs(model, tokenizer, rec, max_length=max_length) for rec in records) if r is not None
    ]


def quality_metrics(
    model, tokenizer, records: Sequence[dict[str, Any]], reference=None, *, max_length: int = 512
) -> dict[str, Any]:
    """Teacher-forced quality of ``model`` on ``records``, against a reference's distributions.

    Every scored token ``t`` (see ``encode_record``) contributes its negative log-likelihood
    and, given ``reference`` (``reference_logprobs`` of the same records), the KL divergence
    ``KL(P_ref || P_model) = sum_v P_ref(v) (log P_ref(v) - log P_model(v))`` (nats) of the
    next-token distributions and whether the two argmax tokens agree. This is the comparison
    llama.cpp's ``perplexity --kl-divergence`` reports for quantized models: perplexity alone
    can improve while the distributions move away from the reference.

    Returns:
        ``{"perplexity", "perplexity_tokens"}`` and, with a reference, ``"kl_mean"``,
        ``"kl_p99"`` (99th percentile over tokens, nats), ``"kl_max"`` and ``"same_top1"``
        (fraction of tokens with the same argmax).

    Raises:
        EvaluationError: no record has a scored token, or ``reference`` was computed on other
            records or another tokenizer (the scored positions differ).
    """
    total_nll, count, kls, same = 0.0, 0, [], 0
    ours = [
        r for r in (scored_logprobs(model, tokenizer, rec, max_length=max_length) for rec in records) if r is not None
    ]
    if not ours:
        raise EvaluationError(
            "no scored tokens in the evaluation data (every record is empty or has no assistant reply)"
        )
    if reference is not None and [t.tolist() for _, t in reference] != [t.tolist() for _, t in ours]:
        raise EvaluationError(
            "the reference was scored on other tokens: compare checkpoints that share a tokenizer, on the same records"
        )
    for i, (logprobs, targets) in enumerate(ours):
        total_nll -= float(logprobs.gather(1, targets[:, None]).sum())
        count += len(targets)
        if reference is not None:
            ref = reference[i][0]  # [n, vocab]
            kls.append((ref.exp() * (ref - logprobs)).sum(dim=-1).clamp(min=0))  # [n]
            same += int((ref.argmax(dim=-1) == logprobs.argmax(dim=-1)).sum())
    metrics: dict[str, Any] = {"perplexity": math.exp(total_nll / count), "perplexity_tokens": count}
    if reference is not None:
        kl = torch.cat(kls).double()
        metrics.update(
            kl_mean=float(kl.mean()),
            kl_p99=float(torch.quantile(kl, 0.99)),
            kl_max=float(kl.max()),
            same_top1=same / count,
        )
    return metrics


def perplexity(model, tokenizer, records: Sequence[dict[str, Any]], *, max_length: int = 512) -> tuple[float, int]:
    """Perplexity of ``model`` on ``records`` (token-weighted over all scored tokens).

    Returns:
        ``(perplexity, num_scored_tokens)``.

    Raises:
        EvaluationError: no record has a scored token.
    """
    m = quality_metrics(model, tokenizer, records, max_length=max_length)
    return m["perplexity"], m["perplexity_tokens"]


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True
        )
    return tokenizer(prompt)["input_ids"]


def greedy_tokens(model, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 32) -> list[list[int]]:
    """Greedy continuations (new token ids only, up to EOS) of each prompt, batch 1."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([_prompt_ids(tokenizer, prompt)])  # [1, T]
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def agreement(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> float:
    """Fraction of positions where two lists of token sequences hold the same token.

    Each pair is compared position by position over the longer of the two (a missing
    position counts as a mismatch).
    """
    same, total = 0, 0
    for a, b in zip(reference, candidate, strict=True):
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    return same / total if total else 1.0


def decode_ms_per_token(
    model, tokenizer, *, new_tokens: int = 32, repeats: int = 3, prompt: str = AGREEMENT_PROMPTS[0]
) -> float:
    """Decode latency (ms per token, batch 1) with the KV cache, prefill subtracted.

    Times ``generate`` of 1 token and of ``1 + new_tokens`` tokens (EOS suppressed with
    ``min_new_tokens``), each the fastest of ``repeats`` runs (the least disturbed by other
    processes), and returns the difference / ``new_tokens``.
    """
    ids = torch.tensor([_prompt_ids(tokenizer, prompt)])  # [1, T]
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        return time.perf_counter() - start

    timed(2)  # warm-up (allocations, ONNX Runtime first-run optimizations)
    prefill_s = min(timed(1) for _ in range(repeats))
    total_s = min(timed(1 + new_tokens) for _ in range(repeats))
    return (total_s - prefill_s) / new_tokens * 1000


def _onnx_linear_weight_bytes(model_path: Path, vocab_size: int | None) -> int:
    # optional or heavy dependency: imported only on the path that needs it
    import onnx
    from onnx import helper

    graph = onnx.load(str(model_path), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    bases = set()
    for node in graph.node:
        if node.op_type in ("MatMul", "MatMulInteger") and len(node.input) > 1 and node.input[1] in inits:
            weight = inits[node.input[1]]
            if len(weight.dims) == 2 and vocab_size not in weight.dims:
                bases.add(node.input[1].removesuffix("_quantized"))
    total = 0
    for base in bases:
        for name in (base, base + "_quantized", base + "_scale", base + "_zero_point"):
            if name in inits:
                t = inits[name]
                total += math.prod(t.dims) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


_SAFETENSORS_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I64": 8, "I32": 4, "F64": 8, "BOOL": 1}


def linear_weight_bytes(checkpoint_dir: str | Path) -> int:
    """Bytes of the transformer blocks' linear-layer weights (and their INT8 scales).

    Counts every tensor of a ``model.layers.*`` linear layer's weight (``weight``,
    ``weight_int8``, ``weight_scale``, bitsandbytes ``SCB`` / ``weight_format``); for ONNX, the
    2-D ``MatMul`` / ``MatMulInteger`` weight initializers (without the vocabulary projection)
    with their scales and zero points. Biases, norms and embeddings are excluded.
    """
    checkpoint_dir = Path(checkpoint_dir)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    if (checkpoint_dir / "model.onnx").is_file():
        return _onnx_linear_weight_bytes(checkpoint_dir / "model.onnx", config.get("vocab_size"))
    suffixes = (".weight", INT8_WEIGHT_SUFFIX, ".weight_scale", ".SCB", ".weight_format")
    total = 0
    for file in checkpoint_dir.glob("*.safetensors"):
        for name, info in read_safetensors_header(file).items():
            if name == "__metadata__" or ".layers." not in name or not name.endswith(suffixes):
                continue
            if name.endswith(".weight") and len(info["shape"]) != 2:
                continue  # norm weights are 1-D
            total += math.prod(info["shape"]) * _SAFETENSORS_ITEMSIZE.get(info["dtype"], 4)
    return total


def checkpoint_size(checkpoint_dir: Path) -> tuple[int, int]:
    """``(size_bytes, num_parameters)`` of the weight files (safetensors and ONNX)."""

    num_parameters, size_bytes, _ = describe_weights(checkpoint_dir)
    if (checkpoint_dir / "model.onnx").is_file():
        num_parameters = onnx_num_parameters(checkpoint_dir / "model.onnx")
    return size_bytes, num_parameters


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EvalConfig:
    """Settings of ``lmforge evaluate`` (recorded with the metrics).

    Attributes:
        max_records: held-out records scored (the first ones), ``None`` for all.
        max_length: tokens per record (longer records are truncated).
        agreement_tokens: greedy tokens generated per agreement prompt.
        latency_tokens: decode tokens timed per repeat; latency_repeats: repeats (fastest kept).
        measure_latency: skip the latency measurement when False.
        num_threads: CPU threads for every checkpoint (``None``: library defaults). On a busy
            machine 1 thread gives the steadiest latency ratios.
    """

    max_records: int | None = 200
    max_length: int = 512
    agreement_tokens: int = 32
    latency_tokens: int = 32
    latency_repeats: int = 3
    measure_latency: bool = True
    num_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_length", "agreement_tokens", "latency_tokens", "latency_repeats"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise UsageError(f"num_threads={self.num_threads}: must be >= 1 (or None for the library default)")
        if self.max_records is not None and self.max_records < 1:
            raise UsageError(f"max_records={self.max_records}: must be >= 1 (or None for all)")


def evaluate_checkpoint(
    loaded: LoadedCheckpoint,
    records: Sequence[dict[str, Any]],
    reference_tokens: Sequence[Sequence[int]],
    config: EvalConfig,
    reference_logprobs: list | None = None,
    reference_path: Path | None = None,
    reference_kv_cache_dtype: str | None = None,
) -> dict[str, Any]:
    """All metrics of one loaded checkpoint (see the module docstring); when it is the
    reference (``reference_path`` at ``reference_kv_cache_dtype``) its agreement tokens are ``reference_tokens``."""
    quality = quality_metrics(loaded.model, loaded.tokenizer, records, reference_logprobs, max_length=config.max_length)
    is_reference = loaded.path == reference_path and loaded.kv_cache_dtype == reference_kv_cache_dtype
    if reference_path is not None and is_reference:  # it agrees with itself: no second greedy run
        generated = reference_tokens
    else:
        generated = greedy_tokens(
            loaded.model, loaded.tokenizer, AGREEMENT_PROMPTS, max_new_tokens=config.agreement_tokens
        )
    size_bytes, num_parameters = checkpoint_size(loaded.path)
    metrics = {
        "kind": loaded.kind,
        **({} if loaded.kv_cache_dtype is None else {"kv_cache_dtype": loaded.kv_cache_dtype}),
        **{k: round(v, 6) if isinstance(v, float) else v for k, v in quality.items()},
        "greedy_agreement": round(agreement(reference_tokens, generated), 4),
        "size_bytes": size_bytes,
        "linear_weight_bytes": linear_weight_bytes(loaded.path),
        "num_parameters": num_parameters,
    }
    if config.measure_latency:
        metrics["decode_ms_per_token"] = round(
            decode_ms_per_token(
                loaded.model, loaded.tokenizer, new_tokens=config.latency_tokens, repeats=config.latency_repeats
            ),
            3,
        )
    return metrics


def _reference_outputs(reference: LoadedCheckpoint, records: list[dict[str, Any]], config: EvalConfig) -> tuple:
    """The reference's greedy tokens on ``AGREEMENT_PROMPTS`` and its log-probabilities on ``records``."""
    tokens = greedy_tokens(
        reference.model, reference.tokenizer, AGREEMENT_PROMPTS, max_new_tokens=config.agreement_tokens
    )
    return tokens, reference_logprobs(reference.model, reference.tokenizer, records, max_length=config.max_length)


def _manifest_writable(path: Path) -> bool:
    manifest = path / MANIFEST_NAME
    return manifest.is_file() and os.access(manifest, os.W_OK)


def _kv_cache_dtype_list(kv_cache_dtypes: Sequence[str] | None) -> list[str | None]:
    """``evaluate``'s engine rows: each KV cache dtype given, or ``[None]`` (each checkpoint on its own library).

    Raises:
        EvaluationError: a name ``EngineConfig.kv_cache_dtype`` does not know.
    """
    kv_list: list[str | None] = list(kv_cache_dtypes) if kv_cache_dtypes else [None]
    unknown = [kv for kv in kv_list if kv is not None and kv not in KV_CACHE_DTYPES]
    if unknown:
        raise EvaluationError(
            f"--kv-cache-dtype: unknown {', '.join(unknown)}; choose from {', '.join(KV_CACHE_DTYPES)}"
        )
    return kv_list


def evaluate(
    checkpoints: Sequence[str | Path],
    *,
    records: Sequence[dict[str, Any]] | None = None,
    data_name: str | None = None,
    reference: str | Path | None = None,
    config: EvalConfig | None = None,
    write: bool = True,
    log: Callable[[str], None] = print,
    kv_cache_dtypes: Sequence[str] | None = None,
    engine_dtype: str = "auto",
    lora: str | Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Evaluate checkpoints against a reference and (optionally) write metrics into their manifests.

    Args:
        checkpoints: checkpoint specs (names, directories); each is loaded, measured, released.
        records: held-out records; default ``default_heldout_records()``.
        data_name: how the data is described in the metrics.
        reference: model whose distributions define KL / same top-1 (and whose greedy outputs
            define agreement); default ``checkpoints[0]``.
        config: ``EvalConfig``.
        write: merge the metrics into each checkpoint's ``lmforge.json`` (when it has one; never those
            of engine rows, which describe a KV cache dtype rather than the checkpoint).
        kv_cache_dtypes: run every checkpoint on the lmforge engine once per ``EngineConfig.kv_cache_dtype``
            listed (module docstring); the reference is ``reference`` at the first one. ``None``: each
            checkpoint on its own library.
        engine_dtype: the engine's ``dtype`` for those rows.
        lora: a LoRA adapter directory run on every checkpoint and the reference (``apply_lora``); its metrics
            describe the adapted model and are never written into the manifests.

    Returns:
        ``{label: metrics}`` in the order given; the label is the resolved path (``PATH [kv DTYPE]`` for
        engine rows).

    Raises:
        CheckpointError: a missing, corrupt or non-causal checkpoint (checked for all before any
            is loaded, so a typo in the last one fails at once).
        EvaluationError: bad data, or a ``kv_cache_dtypes`` entry the engine does not know.
        LoRAError: ``lora`` does not fit a checkpoint (names the field).
    """
    config = config or EvalConfig()
    if not checkpoints:
        raise EvaluationError("checkpoints: pass at least one checkpoint to evaluate")
    kv_list = _kv_cache_dtype_list(kv_cache_dtypes)
    paths = [resolve_checkpoint(c) for c in checkpoints]
    reference_path = resolve_checkpoint(reference) if reference is not None else paths[0]
    if records is None:
        records, data_name = default_heldout_records()
    records = list(records)[: config.max_records]
    # the engine's context holds a record and the longest generation (agreement prompts are short)
    max_model_len = max(config.max_length, 128) + max(config.agreement_tokens, config.latency_tokens + 1)
    load = functools.partial(
        load_for_eval, num_threads=config.num_threads, engine_dtype=engine_dtype, max_model_len=max_model_len, lora=lora
    )
    reference_entry = (reference_path, kv_list[0])
    loaded_reference = load(reference_path, kv_cache_dtype=kv_list[0])
    reference_tokens, reference_scores = _reference_outputs(loaded_reference, records, config)
    run_fields = {  # what every row was judged against, and how
        "reference": loaded_reference.label,
        "eval_data": data_name or "records",
        "eval_records": len(records),
        "num_threads": config.num_threads,
        **({"lora": str(lora)} if lora is not None else {}),
    }
    results: dict[str, dict[str, Any]] = {}
    for path, kv_cache_dtype in [(p, kv) for p in paths for kv in kv_list]:
        if (path, kv_cache_dtype) == reference_entry and loaded_reference is not None:  # loaded once, reused
            loaded, loaded_reference = loaded_reference, None
        else:
            loaded_reference = None
            loaded = load(path, kv_cache_dtype=kv_cache_dtype)
        log(f"evaluating {loaded.label} ...")
        metrics = evaluate_checkpoint(loaded, records, reference_tokens, config, reference_scores, *reference_entry)
        results[loaded.label] = metrics = {**metrics, **run_fields}
        del loaded  # released before the next checkpoint loads
        if write and kv_cache_dtype is None and lora is None and _manifest_writable(path):
            update_metrics(path, metrics)
    return results


def _distinct_tails(paths: list[str]) -> list[str]:
    """Each path's last component, or as many last components as it takes to tell it from the others
    (``runs/finetune/final`` and ``runs/distill/final`` read ``finetune/final`` and ``distill/final``)."""
    parts = [Path(path).parts or (path,) for path in paths]
    depth = [1] * len(paths)
    for _ in range(max(map(len, parts), default=1)):
        tails = [str(Path(*p[-d:])) for p, d in zip(parts, depth)]
        clashes = {tail for tail in tails if tails.count(tail) > 1}
        if not clashes:
            return tails
        depth = [d + (tail in clashes and d < len(p)) for p, d, tail in zip(parts, depth, tails)]
    return [str(Path(*p[-d:])) for p, d in zip(parts, depth)]


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A comparison table; ratios are against the first row, KL and top-1 against the reference."""
    rows = list(results.items())
    if not rows:
        return ""
    base = rows[0][1]
    names = [m["served_url"].split("://")[-1] if m["kind"] == SERVED_KIND else path for path, m in rows]
    names = _distinct_tails(names)
    columns = [
        ("checkpoint", f"<{max(28, *map(len, names))}"),  # whole names: two checkpoints often differ only at the end
        ("kind", "<9"),
        ("size MiB", ">9"),
        ("linear MiB", ">10"),
        ("ppl", ">9"),
        ("Δppl", ">8"),
        ("KL mean", ">8"),
        ("KL p99", ">7"),
        ("top-1", ">6"),
        ("agree", ">6"),
        ("ms/tok", ">8"),
        ("speed", ">6"),
    ]
    cells = []
    for name, (_, m) in zip(names, rows):  # "-": not measured (a served row)
        dppl = (m["perplexity"] / base["perplexity"] - 1) * 100
        ms = m.get("decode_ms_per_token")
        speed = f"{base['decode_ms_per_token'] / ms:.2f}x" if ms and base.get("decode_ms_per_token") else "-"
        cells.append(
            [
                name,
                m["kind"],
                fmt(m.get("size_bytes"), ".1f", 2**-20),
                fmt(m.get("linear_weight_bytes"), ".1f", 2**-20),
                f"{m['perplexity']:.3f}",
                f"{dppl:+.2f}%",
                fmt(m.get("kl_mean"), ".4f"),
                fmt(m.get("kl_p99"), ".3f"),
                fmt(m.get("same_top1"), ".1%"),
                fmt(m.get("greedy_agreement"), ".3f"),
                f"{ms:.2f}" if ms else "-",
                speed,
            ]
        )
    lines = table_lines(columns, cells)
    if base.get("lora"):  # every row ran with it (``evaluate(lora=...)``)
        lines.append(f"each checkpoint with the LoRA adapter {base['lora']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# ``lmforge evaluate``
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EvalConfig()
    parser.add_argument("checkpoints", nargs="+", metavar="CKPT", help="checkpoints to compare (put the parent first)")
    parser.add_argument(
        "--data",
        default=None,
        help="held-out JSONL ({'messages'} or {'text'} records); default: held-out chatterbot-corpus English dialogs",
    )
    parser.add_argument(
        "--reference",
        default=None,
        help="model whose distributions define KL / same top-1 and whose greedy outputs define agreement (default: "
        "the first checkpoint)",
    )
    add_config_option(parser, d, "max_records", "records scored (default %(default)s)")
    add_config_option(parser, d, "max_length", "tokens per record (default %(default)s)")
    add_config_option(parser, d, "agreement_tokens", "greedy tokens per prompt (default %(default)s)")
    add_config_option(parser, d, "latency_tokens", "decode tokens timed (default %(default)s)")
    parser.add_argument("--no-latency", action="store_true", help="skip the decode latency measurement")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for every checkpoint (default: library defaults)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        metavar="DTYPES",
        help="run every checkpoint on the lmforge engine once per KV cache dtype listed, comma-separated (auto, "
        "bfloat16, float32, int8), against the reference at the first one: e.g. bfloat16,int8 judges the int8 KV "
        "cache against bf16's (default: each checkpoint on its own library)",
    )
    add_engine_dtype_option(
        parser,
        "--engine-dtype",
        "the engine's dtype with --kv-cache-dtype (default auto: bfloat16 where the CPU has native bf16)",
    )
    parser.add_argument(
        "--lora",
        default=None,
        metavar="DIR",
        help="a LoRA adapter (PEFT format) run on every checkpoint and the reference: judges adapter-on-compressed-"
        "base against adapter-on-parent (metrics then go to --json and the table, not into the manifests)",
    )
    parser.add_argument(
        "--served",
        default=None,
        metavar="URL",
        help="also score the model an OpenAI-compatible server serves at URL (e.g. http://127.0.0.1:9000 of "
        "`lmforge serve --openai-port`) on the same records, through /v1/completions echo + prompt logprobs: "
        "perplexity only (KL and top-1 need the whole distribution); it must share the first checkpoint's tokenizer "
        "($LMFORGE_API_KEY: its key)",
    )
    parser.add_argument(
        "--served-model", default=None, help="the served model's name (default: the one GET /v1/models lists)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--no-write", action="store_true", help="do not write metrics into the manifests")


def served_row(args: argparse.Namespace, records: list[dict[str, Any]], data_name: str, max_length: int) -> dict:
    """The metrics of the model served at ``args.served`` (``compress.evaluate.served``) on ``records``, scored
    with the first checkpoint's tokenizer."""
    # optional or heavy dependency: imported only on the path that needs it
    from transformers import AutoTokenizer

    api_key = os.environ.get("LMFORGE_API_KEY")
    model = args.served_model or served_model_name(args.served, api_key)
    print(f"evaluating {model} served at {args.served} ...")
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(args.checkpoints[0]))
    quality = served_quality(args.served, model, tokenizer, records, max_length=max_length, api_key=api_key)
    return {
        "kind": SERVED_KIND,
        **{k: round(v, 6) if isinstance(v, float) else v for k, v in quality.items()},
        "served_url": args.served,
        "served_model": model,
        "eval_data": data_name,
        "eval_records": len(records),
    }


def run(args: argparse.Namespace) -> int:
    if args.json:
        check_output_file(args.json, flag="--json")
    fields = ("max_records", "max_length", "agreement_tokens", "latency_tokens", "num_threads")
    with errors_name_flags(fields, {"num_threads": "--threads"}):
        config = EvalConfig(
            max_records=args.max_records,
            max_length=args.max_length,
            agreement_tokens=args.agreement_tokens,
            latency_tokens=args.latency_tokens,
            measure_latency=not args.no_latency,
            num_threads=args.threads,
        )
    records, data_name = (read_records(args.data), args.data) if args.data else default_heldout_records()
    results = evaluate(
        args.checkpoints,
        records=records,
        data_name=data_name,
        reference=args.reference,
        config=config,
        write=not args.no_write,
        lora=args.lora,
        kv_cache_dtypes=[d.strip() for d in (args.kv_cache_dtype or "").split(",") if d.strip()] or None,
        engine_dtype=args.engine_dtype,
    )
    if args.served:
        records = records[: config.max_records]
        results[f"{SERVED_KIND} {args.served}"] = served_row(args, records, data_name, config.max_length)
    print(format_table(results))
    if args.json:
        write_output_file(args.json, json.dumps(results, indent=2) + "\n", flag="--json")
    return 0
