"""``lmforge generate``: one completion from a checkpoint."""

from __future__ import annotations

import argparse

from compress.checkpoints import DEFAULT_MODEL, CheckpointError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or checkpoint directory")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens to generate (default 64)")
    parser.add_argument("--backend", choices=["hf"], default="hf", help="hf: transformers generate (reference)")


def hf_generate(model_spec: str, prompt: str, *, chat: bool, max_tokens: int) -> str:
    """Greedy completion with ``transformers`` ``generate`` (the reference path).

    Raises:
        CheckpointError: the model cannot be resolved; ValueError: ``max_tokens < 1``.
    """
    import torch

    from compress.checkpoints import load_causal_lm

    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}; it must be >= 1")
    model, tokenizer, _ = load_causal_lm(model_spec)
    if chat:
        input_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt")
    else:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)


def run(args: argparse.Namespace) -> int:
    try:
        text = hf_generate(args.model, args.prompt, chat=args.chat, max_tokens=args.max_tokens)
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}")
        return 1
    print(text)
    return 0
