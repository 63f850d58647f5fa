"""``lmforge bench structured``: structured-output requests vs plain ones, same load, same server.

    lmforge bench structured [--checkpoint smollm2-135m] [--dtype bfloat16] [--users 16] \\
        [--run-time 30s] [--max-tokens 64] [--out reports/structured]

Starts lmforge's stack (``tritonserver`` + the OpenAI frontend, as ``lmforge serve --openai-port``
does, :func:`bench.serving_compare.lmforge_stack`) on a temporary export of ``--checkpoint`` and
sends the same closed-loop Locust load (:func:`bench.loadtest.run_loadtest`, ``--users`` streams
on ``/v1/chat/completions``, greedy) twice: plain requests, then the same requests with
``response_format`` ``json_schema`` of :class:`Person` (five fields, ``strict``). Every prompt asks
for that JSON object, so plain answers are about as long; both phases have the same
``max_tokens`` and stop at EOS, and a structured request ends where its grammar ends, so the two
are compared per output token (output tok/s; target: structured >= 0.9x plain).

Reported per phase: output tok/s, TTFT and ITL p50 / p99, failed requests, mean output tokens;
for the structured phase also the share of outputs that parse and validate against the schema
(pydantic, strict), the grammar compile time of the first request (later ones hit the cache) and
the mask time per engine step and per masked token, read from the model's
``lmforge_structured_output_*`` counters on Triton's metrics endpoint. ``OUT/`` gets
``structured.json``, ``structured.md`` and each phase's load-test directory (``plain/``,
``structured/``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pydantic

from bench.harness import write_json
from bench.loadtest import LoadTestConfig, LoadTestError, parse_duration, run_loadtest
from bench.report import read_samples
from bench.serving_compare import lmforge_stack, row_from_summary
from bench.serving_profile import lmforge_counters
from engine.checkpoint.outputs import BENCH_STRUCTURED, check_output_dir
from engine.checkpoint.store import resolve_checkpoint
from engine.cli_options import add_option
from engine.errors import UsageError
from engine.tables import fmt

#: The structured phase's output tok/s over the plain phase's that the benchmark aims for.
TARGET_RATIO = 0.9
#: TTFT bound of the goodput column (the same as ``lmforge bench serving``'s default).
TTFT_BOUND_MS = 2000.0
#: How long the model's statistics thread may take to publish the last counters of a phase (s).
COUNTERS_SETTLE_S = 0.5
PHASES = ("plain", "structured")
_COUNTER = "lmforge_structured_output_{}_total".format
#: Row fields of the table, after the phase's name, and their format.
ROW_COLUMNS = [
    ("output_tok_s", ".1f"),
    ("ttft_p50_ms", ".0f"),
    ("ttft_p99_ms", ".0f"),
    ("itl_p50_ms", ".1f"),
    ("itl_p99_ms", ".1f"),
    ("mean_output_tokens", ".1f"),
]

#: Who the prompts ask about (one prompt each), so the answers differ.
PEOPLE = [
    ("a nurse", "Lisbon"),
    ("a retired teacher", "Osaka"),
    ("a software engineer", "Nairobi"),
    ("a baker", "Lyon"),
    ("a student of music", "Toronto"),
    ("a bus driver", "Glasgow"),
    ("a marine biologist", "Perth"),
    ("a chess coach", "Tbilisi"),
    ("a carpenter", "Valparaiso"),
    ("a photographer", "Reykjavik"),
    ("a pharmacist", "Seville"),
    ("a farmer", "Iowa City"),
    ("a librarian", "Krakow"),
    ("a firefighter", "Denver"),
    ("a painter", "Florence"),
    ("a pilot", "Dubai"),
]


class Person(pydantic.BaseModel):
    """The five-field object every structured request must produce (``strict``: no extra fields, no coercion)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    name: str
    age: int
    city: str
    email: str
    active: bool


def response_format() -> dict:
    """The OpenAI ``response_format`` of the structured phase: ``json_schema`` of :class:`Person`, strict."""
    schema = Person.model_json_schema()
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def prompts() -> list[str]:
    """One prompt per entry of ``PEOPLE``, each asking for the :class:`Person` JSON object."""
    return [
        f"Describe {who} who lives in {city} as a JSON object with the fields name (string), age (integer), "
        "city (string), email (string) and active (boolean). Answer with the JSON object only."
        for who, city in PEOPLE
    ]


def valid_share(texts: list[str | None]) -> float | None:
    """The share of ``texts`` that parse as one :class:`Person` (``None`` when there is none)."""
    if not texts:
        return None
    valid = 0
    for text in texts:
        try:
            Person.model_validate_json(text or "")
            valid += 1
        except pydantic.ValidationError:
            pass
    return valid / len(texts)


def grammar_costs(mid: dict[str, float], end: dict[str, float]) -> dict[str, float | None]:
    """Compile and mask costs from the ``lmforge_structured_output_*`` counters (:func:`lmforge_counters`).

    Args:
        mid: the counters between the phases (the plain phase masks nothing).
        end: the counters after the structured phase.

    Returns:
        ``compiles``; ``compile_ms`` (mean over the compiles since the server started: the one
        schema compiles on its first request, the warm-up, then comes from the cache);
        ``mask_ms_per_step`` and ``mask_ms_per_token`` over the structured phase (``None`` without masks).
    """
    total = lambda name: end.get(_COUNTER(name), 0.0)  # noqa: E731
    phase = lambda name: total(name) - mid.get(_COUNTER(name), 0.0)  # noqa: E731
    per = lambda seconds, count: 1000.0 * seconds / count if count else None  # noqa: E731
    return {
        "compiles": int(total("compiles")),
        "compile_ms": per(total("compile_seconds"), total("compiles")),
        "mask_ms_per_step": per(phase("mask_seconds"), phase("mask_steps")),
        "mask_ms_per_token": per(phase("mask_seconds"), phase("masked_tokens")),
        "masked_tokens": int(phase("masked_tokens")),
    }


def build_report(rows: dict[str, dict], texts: list[str | None], costs: dict, config: dict) -> dict:
    """``structured.json``: the two phases' rows (:func:`bench.serving_compare.row_from_summary` plus
    ``mean_output_tokens``), their output tok/s ratio against ``TARGET_RATIO``, the valid share and ``costs``."""
    plain, structured = rows["plain"]["output_tok_s"], rows["structured"]["output_tok_s"]
    ratio = structured / plain if plain and structured is not None else None
    return {
        "config": config,
        "rows": rows,
        "structured_over_plain_tok_s": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio is not None and ratio >= TARGET_RATIO,
        "structured_valid_share": valid_share(texts),
        "structured_outputs_checked": len(texts),
        "grammar": costs,
    }


def format_report(report: dict) -> str:
    """The table and the structured-output lines printed at the end of the run (``structured.md``)."""
    lines = [
        "| requests | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | mean output tokens | done "
        "| failed |",
        "|" + "---|" * 9,
    ]
    for name in PHASES:
        r = report["rows"][name]
        cells = [fmt(r[k], spec) for k, spec in ROW_COLUMNS] + [str(r["requests"]), str(r["failed"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    g, share = report["grammar"], report["structured_valid_share"]
    verdict = "meets" if report["meets_target"] else "misses"
    lines += [
        "",
        f"structured / plain output tok/s: {fmt(report['structured_over_plain_tok_s'], '.2f')}x "
        f"({verdict} the >= {report['target_ratio']:g}x target)",
        f"structured outputs that parse and validate: {fmt(share, '.1%')} of {report['structured_outputs_checked']}",
        f"grammar compile (first request): {fmt(g['compile_ms'], '.2f')} ms over {g['compiles']} compile(s); "
        f"mask: {fmt(g['mask_ms_per_step'], '.3f')} ms per engine step, {fmt(g['mask_ms_per_token'], '.3f')} ms "
        f"per token ({g['masked_tokens']} tokens masked)",
    ]
    return "\n".join(lines)


def _phase(args, openai_url: str, out: Path, prompts_path: Path, structured: bool) -> tuple[dict, list]:
    """One phase's load test; ``(row, samples)``."""
    name = PHASES[structured]
    config = LoadTestConfig(
        host=openai_url,
        model="llm",
        api="openai",
        endpoint="chat",
        users=args.users,
        spawn_rate=float(args.users),
        run_time_s=parse_duration(args.run_time),
        prompts=str(prompts_path),
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout_s,
        response_format=response_format() if structured else None,
        record_text=structured,
    )
    print(f"{name}: {args.users} streams for {config.run_time_s:g} s ...", flush=True)
    summary = run_loadtest(config, out / name, log=lambda _m: None)
    samples, _ = read_samples(out / name / "samples.jsonl")
    row = row_from_summary(name, args.users, summary, samples, TTFT_BOUND_MS)
    row["mean_output_tokens"] = (summary["metrics"]["output_tokens_per_request"] or {}).get("mean")
    return row, samples


def measure(args, out: Path) -> dict:
    """Start the stack, run both phases, read the counters; the report."""
    prompts_path = out / "prompts.jsonl"
    prompts_path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts()))
    checkpoint = str(resolve_checkpoint(args.checkpoint))
    engine = {"dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": args.users}
    rows: dict[str, dict] = {}
    with lmforge_stack(checkpoint, engine, out, args.stall_timeout_s) as (server, openai_url):
        rows["plain"], _ = _phase(args, openai_url, out, prompts_path, structured=False)
        time.sleep(COUNTERS_SETTLE_S)
        mid = lmforge_counters(server.metrics_url)
        rows["structured"], samples = _phase(args, openai_url, out, prompts_path, structured=True)
        time.sleep(COUNTERS_SETTLE_S)
        end = lmforge_counters(server.metrics_url)
    texts = [s.text for s in samples if s.ok]
    config = {
        "checkpoint": checkpoint,
        "engine": engine,
        "users": args.users,
        "run_time": args.run_time,
        "max_tokens": args.max_tokens,
        "stall_timeout_s": args.stall_timeout_s,
        "response_format": response_format(),
    }
    return build_report(rows, texts, grammar_costs(mid, end), config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--checkpoint", "smollm2-135m", "causal LM checkpoint")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16", help="engine dtype (default bf16)"
    )
    parser.add_argument("--users", type=int, default=16, help="concurrent streams (default 16; max_num_seqs too)")
    add_option(parser, "--run-time", "30s", "measured time of each phase")
    add_option(parser, "--max-tokens", 64, "max_tokens of every request")
    add_option(parser, "--max-model-len", 1024, "EngineConfig.max_model_len")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--stall-timeout-s",
        type=float,
        default=None,
        help="the OpenAI frontend's --stall-timeout-s (default: its own); raise it on a machine whose cores are "
        "shared with other work, where an engine step can outlast it",
    )
    add_option(parser, "--out", "reports/structured", "report directory")


def run(args: argparse.Namespace) -> int:
    try:
        parse_duration(args.run_time)
    except LoadTestError as exc:
        raise UsageError(f"--run-time: {exc}") from exc
    for flag, value in (("--users", args.users), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise UsageError(f"{flag} {value}: it must be >= 1")
    out = check_output_dir(args.out, kind=BENCH_STRUCTURED)
    out.mkdir(parents=True, exist_ok=True)
    report = measure(args, out)
    write_json(out / "structured.json", report)
    table = format_report(report)
    (out / "structured.md").write_text(table + "\n")
    print(table)
    print(f"report: {out}")
    return 0 if all(r["requests"] for r in report["rows"].values()) else 1
