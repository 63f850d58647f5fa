"""``lmforge generate``: completions from a checkpoint with the engine (or ``--backend hf``)."""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch

from engine import LLM, SamplingParams
from engine.checkpoint.store import DEFAULT_MODEL, check_device, load_causal_lm
from engine.cli_options import add_config_option, add_engine_dtype_option, add_option, config_fields
from engine.config import KV_CACHE_DTYPES, EngineConfig
from engine.errors import LmforgeError, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or checkpoint directory")
    parser.add_argument("--prompt", required=True, action="append", help="the prompt text (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    add_option(parser, "--max-tokens", 64, "new tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    parser.add_argument("--seed", type=int, default=None, help="seed of the request's sampler")
    add_engine_dtype_option(
        parser, "--dtype", "engine dtype (auto: bfloat16 where the CPU has native bf16, else float32)"
    )
    e = EngineConfig()
    add_config_option(
        parser,
        e,
        "kv_cache_dtype",
        "how the KV cache stores K and V (auto: the engine dtype; int8: per-token, per-head scales, about half "
        "the bytes of bf16)",
        choices=list(KV_CACHE_DTYPES),
    )
    add_config_option(parser, e, "device", "cpu or cuda")
    add_config_option(
        parser, e, "max_model_len", "longest prompt + output (default: the checkpoint's, capped at 8192)", type=int
    )
    add_config_option(parser, e, "num_threads", "torch CPU threads (default: torch's choice)", type=int)
    parser.add_argument(
        "--stats", action="store_true", help="print tokens/s, TTFT, prefix-cache and speculation figures (stderr)"
    )
    add_config_option(
        parser,
        e,
        "speculative_method",
        "speculative decoding: ngram (prompt lookup) or draft (a small model); default off",
        choices=["ngram", "draft"],
    )
    add_config_option(
        parser, e, "num_speculative_tokens", "tokens proposed per step (default: 4 ngram, 3 draft)", type=int
    )
    add_config_option(
        parser,
        e,
        "speculative_model",
        "draft checkpoint (default: the newest `lmforge distill` output of --model under ./runs)",
    )
    add_config_option(
        parser,
        e,
        "speculative_ngram_corpus",
        "chat records whose n-grams the ngram proposer also looks up, e.g. the teacher_generated.jsonl of an "
        "`lmforge distill` run (default: prompt lookup only)",
        metavar="JSONL",
    )
    parser.add_argument(
        "--backend",
        choices=["engine", "hf"],
        default="engine",
        help="engine: lmforge engine (default); hf: transformers generate (greedy reference)",
    )


def hf_generate(model_spec: str, prompt: str, *, chat: bool, max_tokens: int) -> str:
    """Greedy completion with ``transformers`` ``generate`` (the reference path).

    Raises:
        CheckpointError: the model cannot be resolved; ValueError: ``max_tokens < 1``; UsageError: the prompt
            and ``max_tokens`` exceed the model's context (``max_position_embeddings``).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}; it must be >= 1")
    model, tokenizer, _ = load_causal_lm(model_spec)
    if chat:
        input_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
    else:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and input_ids.shape[1] + max_tokens > context:
        raise UsageError(
            f"prompt ({input_ids.shape[1]} tokens) + --max-tokens ({max_tokens}) = {input_ids.shape[1] + max_tokens} "
            f"> the model's context of {context} tokens",
            fix=f"pass --max-tokens <= {max(context - input_ids.shape[1], 0)} or shorten the prompt",
        )
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


#: ``SamplingParams`` / ``EngineConfig`` fields that a ``generate`` flag of the same name sets.
FLAG_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "dtype",
    "kv_cache_dtype",
    "max_model_len",
    "num_threads",
    "speculative_method",
    "num_speculative_tokens",
    "speculative_model",
    "speculative_ngram_corpus",
)


def flag_error(exc: ValueError) -> ValueError:
    """``exc`` as a ``UsageError`` (exit status 2) naming the ``generate`` flags of the fields it
    names; ``exc`` itself when it names none or is another lmforge error (a checkpoint problem)."""
    flags = ["--" + f.replace("_", "-") for f in FLAG_FIELDS if re.search(rf"\b{f}\b", str(exc))]
    if not flags or (isinstance(exc, LmforgeError) and not isinstance(exc, UsageError)):
        return exc
    return UsageError(str(exc), fix=f"change {' / '.join(flags)}")


def engine_generate(args: argparse.Namespace) -> list[str]:
    """Completions of ``args.prompt`` with the lmforge engine, one per prompt.

    Raises:
        UsageError: a flag value the sampler or the engine refuses (the flag is named).
    """
    try:
        params = SamplingParams(**config_fields(SamplingParams, args))
        check_device(args.device)
        engine_flags = config_fields(EngineConfig, args)
        del engine_flags["seed"]  # --seed is the request's (SamplingParams.seed), not the engine's default
        llm = LLM(**engine_flags)
    except ValueError as exc:
        raise flag_error(exc) from exc
    start = time.perf_counter()
    try:  # the prompt's checks against the flags: prompt + --max-tokens within --max-model-len...
        outputs = llm.generate(args.prompt, params, chat=args.chat)
    except ValueError as exc:
        raise flag_error(exc) from exc
    elapsed_s = time.perf_counter() - start
    if args.stats:
        stats = llm.engine.get_stats()
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        ttft = [o.metrics.ttft_s for o in outputs]
        print(
            f"[engine] {num_tokens} tokens in {elapsed_s:.2f} s = {num_tokens / elapsed_s:.1f} tok/s; "
            f"TTFT max {max(ttft):.3f} s; prefix cache hits {stats.prefix_cache_hits_tokens_total}/"
            f"{stats.prefix_cache_queries_tokens_total} tokens",
            file=sys.stderr,  # stdout stays the completions (`> out.txt`)
        )
        if args.speculative_method:
            print(
                f"[engine] speculative ({args.speculative_method}): {stats.spec_decode_num_accepted_tokens_total}/"
                f"{stats.spec_decode_num_draft_tokens_total} proposed tokens accepted "
                f"({stats.spec_decode_acceptance_rate:.0%}), "
                f"{stats.spec_decode_mean_accepted_length:.2f} tokens per verifying step",
                file=sys.stderr,
            )
    return [o.outputs[0].text for o in outputs]


def run(args: argparse.Namespace) -> int:
    for number, prompt in enumerate(args.prompt, start=1):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes that are not UTF-8 arrive as lone surrogates
            raise UsageError(
                f"--prompt #{number}: not UTF-8 text (character {exc.start})", fix="pass the prompt as UTF-8"
            ) from exc
        if not prompt.strip():  # with --chat the template alone would still make a prompt
            raise UsageError(f"--prompt #{number} is empty", fix="pass some text")
    if args.backend == "hf":
        if args.temperature != 0:
            raise UsageError("--backend hf is the greedy reference", fix="use --temperature 0")
        texts = [hf_generate(args.model, p, chat=args.chat, max_tokens=args.max_tokens) for p in args.prompt]
    else:
        texts = engine_generate(args)
    for text in texts:
        print(text)
    return 0
