"""``lmforge bench TARGET``: the benchmarks, one module per target.

Each target module implements ``add_arguments(parser)`` and ``run(args) -> int``, and runs on
:mod:`bench.harness` (processes, peers, percentiles, reports).
"""

from __future__ import annotations

import argparse
import importlib

#: Benchmark target -> (module, one-line help). One line per target.
TARGETS: dict[str, tuple[str, str]] = {
    "engine": (
        "bench.engine_bench",
        "Engine throughput/TTFT/start-up vs HF generate, llama-server, vLLM, OpenVINO GenAI; compute bound per dtype.",
    ),
    "serving": (
        "bench.serving_compare",
        "The same Locust load on several servers (Triton, our OpenAI API, vllm serve, llama-server) at 1-64 users.",
    ),
    "serving-profile": (
        "bench.serving_profile",
        "Where a streamed token's CPU goes on the served path: CPU s per 1k tokens per process and thread, py-spy.",
    ),
    "structured": (
        "bench.structured_bench",
        "Structured-output (json_schema) vs plain chat requests on the same served load; grammar compile/mask ms.",
    ),
    "compression": (
        "bench.compression",
        "INT8 methods vs fp32 (size, perplexity, agreement, decode speed); MiniLM ONNX INT8.",
    ),
    "student": (
        "bench.student_speed",
        "Engine tok/s of a teacher and its distilled students, alternated round by round in one process.",
    ),
    "lora": (
        "bench.lora_bench",
        "Requests spread over N LoRA adapters vs the base alone, on the bf16 and INT8 bases; memory per adapter.",
    ),
    "reliability": (
        "bench.reliability",
        "Fault soak on tritonserver: bad requests, disconnects, a killed model stub; recovery time.",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", metavar="TARGET")
    for name, (module, help_text) in TARGETS.items():
        target_parser = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(target_parser)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "target", None) not in TARGETS:
        print(f"choose a benchmark target: {', '.join(TARGETS)}")
        return 2
    return int(importlib.import_module(TARGETS[args.target][0]).run(args) or 0)
