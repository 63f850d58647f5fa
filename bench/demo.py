"""``lmforge demo``: the whole job on the embedded default checkpoint.

Stages: load (convert the shipped GGUF once) -> generate. The remaining stages (fine-tune,
quantize, evaluate, export, serve, load test, report) join as they are built; the demo lists
the ones this installation does not have yet instead of pretending to run them.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

from compress.checkpoints import DEFAULT_MODEL, read_manifest, resolve_checkpoint

LATER_STAGES = {
    "fine-tune": "compress.finetune",
    "quantize": "compress.quantize",
    "evaluate": "compress.evaluate",
    "export": "deploy.export",
    "serve on Triton": "deploy.serve",
    "load test": "bench.loadtest",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or checkpoint directory")
    parser.add_argument("--prompt", default="What is the capital of France?", help="prompt for the generation stage")


def run(args: argparse.Namespace) -> int:
    from engine.cli import hf_generate

    start = time.perf_counter()
    print(f"[1/2] load {args.model}")
    path = resolve_checkpoint(args.model)
    manifest = read_manifest(path)
    print(f"      {path} ({manifest.num_parameters:,} parameters, {manifest.size_bytes / 2**20:.0f} MiB, {time.perf_counter() - start:.1f} s)")
    print(f"[2/2] generate (greedy): {args.prompt}")
    t = time.perf_counter()
    print("      " + hf_generate(str(path), args.prompt, chat=True, max_tokens=48).replace("\n", "\n      "))
    print(f"      ({time.perf_counter() - t:.1f} s)")
    missing = [name for name, module in LATER_STAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(f"not yet built, so not run: {', '.join(missing)}")
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0
