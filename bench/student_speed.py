"""``lmforge bench student``: engine throughput of a teacher and its students, alternated in one process.

Every model is loaded once into its own ``engine.LLM`` (bf16 by default); then, for each round,
each model in turn serves the engine benchmark's workload (``bench.workload``: chat requests x
greedy tokens, EOS ignored, all submitted at once). Alternating the models round by round, in
one process, keeps a background load that changes over time from favouring one of them. Per run
it prints output tokens per second of wall time and per CPU-second of this process (the steadier
figure on a shared machine), then each student's ratio to the teacher, round by round.
"""

from __future__ import annotations

import argparse
import os
import time

from bench.workload import build_workload
from engine import LLM, SamplingParams
from engine.cli_options import add_option
from engine.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("teacher", help="reference checkpoint (name, .gguf or directory)")
    parser.add_argument("students", nargs="+", help="checkpoints compared with the teacher")
    add_option(parser, "--rounds", 3, "runs of the workload per model")
    add_option(parser, "--requests", 64, "requests of the workload")
    add_option(parser, "--tokens", 64, "greedy tokens per request")
    add_option(parser, "--threads", 1, "torch threads")
    add_option(parser, "--dtype", "bfloat16", "engine dtype")


def measure(
    paths: list[str], *, rounds: int, requests: int, tokens: int, threads: int, dtype: str, log=print
) -> dict[str, list[dict[str, float]]]:
    """Output tok/s of each model, round by round.

    Returns:
        ``{path: [{"wall_tok_s", "cpu_tok_s", "load_1min"} per round]}``.

    Raises:
        UsageError: ``rounds``, ``requests``, ``tokens`` or ``threads`` below 1.
    """
    for name, value in (("rounds", rounds), ("requests", requests), ("tokens", tokens), ("threads", threads)):
        if value < 1:
            raise UsageError(f"{name}={value}: must be >= 1 (--{name})")

    llms = {p: LLM(p, dtype=dtype, num_threads=threads) for p in paths}
    workload = build_workload(llms[paths[0]].tokenizer, num_requests=requests, max_tokens=tokens)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for llm in llms.values():
        llm.generate([workload.prompts[0][:16]], warm)
    figures: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
    output_tokens = requests * tokens
    for r in range(rounds):
        for path, llm in llms.items():
            cpu0, wall0 = time.process_time(), time.perf_counter()
            llm.generate([list(p) for p in workload.prompts], params)
            cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0  # process CPU: user + system
            row = {
                "wall_tok_s": output_tokens / wall_s,
                "cpu_tok_s": output_tokens / cpu_s,
                "load_1min": os.getloadavg()[0],
            }
            figures[path].append(row)
            log(
                f"round {r} {path}: {row['wall_tok_s']:.1f} tok/s wall, {row['cpu_tok_s']:.1f} tok/CPU-s "
                f"(load average {row['load_1min']:.1f})"
            )
    return figures


def run(args: argparse.Namespace) -> int:
    paths = [args.teacher, *args.students]
    figures = measure(
        paths, rounds=args.rounds, requests=args.requests, tokens=args.tokens, threads=args.threads, dtype=args.dtype
    )
    teacher = figures[args.teacher]
    for student in args.students:
        rows = figures[student]
        wall = [s["wall_tok_s"] / t["wall_tok_s"] for s, t in zip(rows, teacher)]
        cpu = [s["cpu_tok_s"] / t["cpu_tok_s"] for s, t in zip(rows, teacher)]
        print(
            f"{student} / {args.teacher}: per CPU-second {', '.join(f'{x:.2f}x' for x in cpu)}; "
            f"wall {', '.join(f'{x:.2f}x' for x in wall)}"
        )
    return 0
