"""``lmforge bench TARGET``: the benchmarks, one module per target.

Each target module implements ``add_arguments(parser)`` and ``run(args) -> int`` and keeps its
heavy imports inside ``run``, so building the parser stays fast. A target whose module is not in
this installation is simply not listed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

#: Benchmark target -> (module, one-line help). One line per target.
TARGETS: dict[str, tuple[str, str]] = {
    "engine": (
        "bench.engine_bench",
        "Engine throughput/TTFT/start-up vs HF generate, llama-server, vLLM; compute bound per dtype.",
    ),
    "serving": (
        "bench.serving_compare",
        "The same Locust load on several servers (Triton, our OpenAI API, vllm serve, llama-server) at 1-64 users.",
    ),
    "compression": (
        "bench.compression",
        "INT8 methods vs fp32 (size, perplexity, agreement, decode speed); MiniLM ONNX INT8.",
    ),
    "reliability": (
        "bench.reliability",
        "Fault soak on tritonserver: bad requests, disconnects, a killed model stub; recovery time.",
    ),
}


def available_targets() -> dict[str, tuple[str, str]]:
    """The targets whose module is present."""
    return {name: entry for name, entry in TARGETS.items() if importlib.util.find_spec(entry[0]) is not None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", metavar="TARGET")
    for name, (module, help_text) in available_targets().items():
        target_parser = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(target_parser)


def run(args: argparse.Namespace) -> int:
    targets = available_targets()
    if getattr(args, "target", None) not in targets:
        print(f"choose a benchmark target: {', '.join(targets) or '(none installed)'}")
        return 2
    return int(importlib.import_module(targets[args.target][0]).run(args) or 0)
