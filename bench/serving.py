"""Benchmark: the engine in process vs the same engine behind Triton (HTTP streaming).

    python -m bench.serving [--model smollm2-135m] [--concurrency 1 16] [--max-tokens 64]

For each concurrency C, ``--requests-per-level`` (default ``max(4, 2C)``) greedy requests run
with at most C in flight on an in-process ``AsyncLLMEngine`` and through the real
``tritonserver`` (``/v2/models/NAME/generate_stream``, SSE, one aiohttp client) on a repository
exported with the same ``EngineConfig``. Both are loaded at once and measured in alternation,
``--rounds`` times, keeping each one's best round, so load from other processes on a shared
machine biases neither side. Printed side by side: output tokens per second (all
tokens / wall time), TTFT p50 (ms, from the client's send to the first text), and Triton's
throughput overhead ``1 - triton_tok_s / engine_tok_s`` (target: <= 10% at 16).

``--lora NAME=DIR`` (repeatable) exports the adapters with the model and spreads the requests over
them (request i runs with adapter i mod N: a ``LoRARequest`` in process, ``lora_name`` in
``sampling_parameters`` through Triton).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from deploy.export import export, parse_lora_flags
from deploy.triton import TritonServer, free_ports
from engine.checkpoint.outputs import check_output_file, write_output_file
from engine.checkpoint.store import resolve_checkpoint
from engine.cli_options import add_option

PROMPTS = [
    "Explain why the sky is blue in one paragraph.",
    "Write a short story about a robot learning to paint.",
    "List three uses of a paperclip and explain each.",
    "What are the main causes of the seasons on Earth?",
    "Describe how a bicycle works to a child.",
    "Give advice to someone starting to learn the piano.",
    "Summarise the water cycle in simple words.",
    "Why do cats purr? Give a few possible reasons.",
]


@dataclass
class LevelResult:
    """One backend at one concurrency level."""

    backend: str
    concurrency: int
    num_requests: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_p50_ms: float


def _summarise(backend: str, concurrency: int, ttfts_s: list[float], tokens: list[int], wall_s: float) -> LevelResult:
    return LevelResult(
        backend, concurrency, len(tokens), sum(tokens), wall_s, sum(tokens) / wall_s, statistics.median(ttfts_s) * 1000
    )


async def _bounded(coroutines, concurrency: int) -> list:
    semaphore = asyncio.Semaphore(concurrency)

    async def run(coroutine):
        async with semaphore:
            return await coroutine

    return await asyncio.gather(*(run(c) for c in coroutines))


async def _engine_level(engine, concurrency: int, prompts: list[str], params, loras: list | None = None) -> LevelResult:
    async def one(index: int, prompt: str):
        start = time.perf_counter()
        ttft, last = None, None
        lora = loras[index % len(loras)] if loras else None
        request_id = f"bench-{concurrency}-{index}-{time.monotonic_ns()}"
        async for output in engine.generate(prompt, params, request_id, lora_request=lora):
            if ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            last = output
        return ttft, len(last.outputs[0].token_ids)

    start = time.perf_counter()
    results = await _bounded([one(i, p) for i, p in enumerate(prompts)], concurrency)
    wall = time.perf_counter() - start
    return _summarise("engine", concurrency, [r[0] for r in results], [r[1] for r in results], wall)


async def _triton_level(
    session, url: str, concurrency: int, prompts: list[str], params: dict, lora_names: list[str] | None = None
) -> LevelResult:
    async def one(index: int, prompt: str):
        sampling = {**params, "lora_name": lora_names[index % len(lora_names)]} if lora_names else params
        body = {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling)}
        start = time.perf_counter()
        ttft, tokens = None, 0
        async with session.post(url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"Triton answered HTTP {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    raise RuntimeError(f"Triton error: {event['error']}")
                if ttft is None and event.get("text_output"):
                    ttft = time.perf_counter() - start
                tokens = event.get("num_output_tokens", tokens)
        return ttft, tokens

    start = time.perf_counter()
    results = await _bounded([one(i, p) for i, p in enumerate(prompts)], concurrency)
    wall = time.perf_counter() - start
    return _summarise("triton", concurrency, [r[0] for r in results], [r[1] for r in results], wall)


async def _run_rounds(
    engine,
    session,
    url: str,
    levels: list[int],
    prompts_per_level: dict[int, list[str]],
    params: dict,
    rounds: int,
    loras: dict[str, Path] | None = None,
):
    """Alternate engine and Triton at each level, ``rounds`` times; keep each one's best round."""
    # torch-heavy: imported on use, so importing this module stays light
    from engine import LoRARequest, SamplingParams

    engine_params = SamplingParams(**params)
    names = list(loras or {})
    requests = [LoRARequest(name, i + 1, str(loras[name])) for i, name in enumerate(names)]
    await _engine_level(engine, 1, PROMPTS[:1], engine_params, requests)  # warm-up both
    await _triton_level(session, url, 1, PROMPTS[:1], params, names)
    best: dict[tuple[str, int], LevelResult] = {}
    for round_index in range(rounds):
        for c in levels:
            for result in (
                await _engine_level(engine, c, prompts_per_level[c], engine_params, requests),
                await _triton_level(session, url, c, prompts_per_level[c], params, names),
            ):
                print(
                    f"  round {round_index + 1}: {result.backend:>6} c={c:<3} {result.output_tok_s:7.1f} tok/s "
                    f" TTFT p50 {result.ttft_p50_ms:8.1f} ms",
                    flush=True,
                )
                key = (result.backend, c)
                if key not in best or result.output_tok_s > best[key].output_tok_s:
                    best[key] = result
    return [best[("engine", c)] for c in levels], [best[("triton", c)] for c in levels]


def bench(
    model: str,
    engine_config: dict,
    levels: list[int],
    prompts_per_level: dict[int, list[str]],
    params: dict,
    *,
    ports: list[int],
    rounds: int,
    loras: dict[str, Path] | None = None,
):
    """In-process ``AsyncLLMEngine`` and the same engine behind the real ``tritonserver``
    (exported into a temporary repository, with ``loras``), both loaded, measured in alternation."""
    # optional or heavy dependency: imported only on the path that needs it
    import aiohttp

    # torch-heavy: imported on use, so importing this module stays light
    from engine import AsyncLLMEngine, EngineConfig

    with tempfile.TemporaryDirectory(prefix="lmforge-bench-serving-") as tmp:
        if loras:
            engine_config = {"enable_lora": True, "max_loras": len(loras), **engine_config}
        export(model, Path(tmp), name="llm", engine=engine_config, kind="llm", loras=loras)
        with TritonServer(tmp, *ports, models=["llm"], write_pid_file=False, startup_timeout_s=600) as server:
            url = f"{server.http_url}/v2/models/llm/generate_stream"
            engine = AsyncLLMEngine(EngineConfig(model=model, **engine_config))

            async def main():
                timeout = aiohttp.ClientTimeout(total=3600)
                connector = aiohttp.TCPConnector(limit=max(levels))
                async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                    return await _run_rounds(engine, session, url, levels, prompts_per_level, params, rounds, loras)

            try:
                return asyncio.run(main())
            finally:
                engine.shutdown()


def format_table(engine: list[LevelResult], triton: list[LevelResult]) -> str:
    """Side-by-side figures and Triton's overhead per concurrency level."""
    lines = [
        f"{'concurrency':>11} | {'engine tok/s':>12} | {'triton tok/s':>12} | {'overhead':>8} | "
        f"{'engine TTFT p50 ms':>18} | {'triton TTFT p50 ms':>18}",
        "-" * 96,
    ]
    for e, t in zip(engine, triton):
        overhead = 1 - t.output_tok_s / e.output_tok_s
        lines.append(
            f"{e.concurrency:>11} | {e.output_tok_s:>12.1f} | {t.output_tok_s:>12.1f} | {overhead:>7.1%} | "
            f"{e.ttft_p50_ms:>18.1f} | {t.ttft_p50_ms:>18.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0])
    add_option(parser, "--model", "smollm2-135m", "causal LM checkpoint")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="concurrency levels (default 1 16)")
    add_option(parser, "--max-tokens", 64, "output tokens per request")
    parser.add_argument("--requests-per-level", type=int, help="requests per level (default max(4, 2 x concurrency))")
    parser.add_argument("--num-threads", type=int, help="EngineConfig.num_threads for both (default: torch's)")
    add_option(parser, "--max-num-seqs", 16, "EngineConfig.max_num_seqs")
    add_option(parser, "--max-model-len", 512, "EngineConfig.max_model_len")
    add_option(parser, "--rounds", 2, "alternating rounds; each backend's best is reported")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a LoRA adapter to spread the requests over (repeatable; request i runs with adapter i mod N)",
    )
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.rounds < 1 or any(c < 1 for c in args.concurrency):
        parser.error("--max-tokens, --rounds and --concurrency must be >= 1")
    if args.out:
        check_output_file(args.out, flag="--out")  # before the run, not after minutes of it

    model = str(resolve_checkpoint(args.model))
    engine_config = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    if args.num_threads:
        engine_config["num_threads"] = args.num_threads
    params = {"temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True}
    prompts = {
        c: [PROMPTS[i % len(PROMPTS)] for i in range(args.requests_per_level or max(4, 2 * c))]
        for c in args.concurrency
    }
    print(
        f"model {model}, engine {engine_config}, {args.max_tokens} output tokens per request, best of "
        f"{args.rounds} rounds"
    )
    engine, triton = bench(
        model,
        engine_config,
        args.concurrency,
        prompts,
        params,
        ports=free_ports(3),
        rounds=args.rounds,
        loras=parse_lora_flags(args.lora),
    )
    print(format_table(engine, triton))
    if args.out:
        write_output_file(
            args.out,
            json.dumps({"engine": [asdict(r) for r in engine], "triton": [asdict(r) for r in triton]}, indent=2) + "\n",
            flag="--out",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
