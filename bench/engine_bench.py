"""``lmforge bench engine``: our engine against the usual ways of serving the same model.

One run measures, side by side on the same requests (``bench.workload``): HF ``generate`` one
request at a time, HF ``generate`` as one left-padded static batch, transformers' continuous
batching (``generate_batch``), llama.cpp on the Q4_1 GGUF (when ``llama-cpp-python`` is
installed), our engine with prefix caching off and on, and our engine on an INT8 ``dynamic``
checkpoint. Each configuration runs in a fresh process (``bench.engine_backends``) so peak
RSS figures do not mix. Also measured in the same run: the machine's peak fp32 matmul rate, from
which the workload's compute bound (``bench.bound``) and each configuration's fraction of it
follow. Prints a table and the targets of the engine, writes everything to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bound import ModelShape, measure_matmul_gflops, percentile, ratio, workload_flops
from bench.engine_backends import BACKENDS, RunSpec

#: Baselines every configuration is compared with (``x <baseline>`` columns).
BASELINES = ("hf_sequential", "hf_static", "hf_generate_batch", "llama_cpp")
ENGINE_CONFIGS = ("engine_prefix_off", "engine_prefix_on", "engine_int8")
REFERENCE_CONFIG = "hf_sequential"  # greedy tokens of the others are compared with these
SMOKE = {"num_requests": 4, "max_tokens": 4, "matmul_size": 256, "matmul_time_s": 0.05}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="checkpoint name or directory (default smollm2-135m)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests in the workload (default 64)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request, greedy, EOS ignored (default 64)")
    parser.add_argument("--systems", type=int, default=1, help="distinct system prompts, assigned round-robin (default 1)")
    parser.add_argument("--configs", default=",".join(BACKENDS), help=f"comma-separated subset of: {', '.join(BACKENDS)}")
    parser.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the shipped Q4_1 GGUF of smollm2-135m)")
    parser.add_argument("--int8", default=None, metavar="DIR", help="INT8 checkpoint (w8a8 or int8-weight-only) for engine_int8 (default: made with compress.quantize when available)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="extra EngineConfig field for the engine configs (repeatable), e.g. max_num_seqs=64")
    parser.add_argument("--sequential-requests", type=int, default=None, metavar="N",
                        help="serve only the first N requests in hf_sequential and llama_cpp (one at a time, so tok/s "
                             "does not depend on N; default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch / llama.cpp threads (default: library default)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit for each configuration's process (default 3600)")
    parser.add_argument("--profile", nargs="?", const="engine_prefix_on", default="", metavar="CONFIGS",
                        help="also print torch.profiler top ops of a repeat run of these engine configs "
                             "(comma-separated; default when given without a value: engine_prefix_on)")
    parser.add_argument("--smoke", action="store_true", help=f"tiny run to check the harness: {SMOKE['num_requests']} requests x {SMOKE['max_tokens']} tokens")
    parser.add_argument("--out", default="engine_bench.json", help="JSON report path (default engine_bench.json)")


@dataclasses.dataclass
class Summary:
    """One table row: a configuration's figures and ratios."""

    config: str
    status: str
    reason: str | None
    output_tok_s: float | None
    elapsed_s: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_basis: str
    peak_rss_mib: float | None
    load_s: float | None
    prefix_hit_rate: float | None
    same_tokens_as_hf: float | None  # fraction of requests whose greedy tokens equal hf_sequential's
    same_tokens_checked: int  # requests compared (hf_sequential may serve only the first N)
    speedup: dict[str, float | None]  # output tok/s / baseline's output tok/s
    fraction_of_bound: float | None
    profile_top: str | None


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def parse_engine_args(items: list[str]) -> dict:
    """``["max_num_seqs=64", "enable_x=true"]`` -> ``{"max_num_seqs": 64, "enable_x": True}`` (JSON values, else strings).

    Raises:
        ValueError: an item has no ``=``.
    """
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. max_num_seqs=64")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def default_gguf(model: str) -> str | None:
    """The GGUF llama.cpp runs: the model itself if it is one, the shipped file for ``smollm2-135m``."""
    from compress.checkpoints import named_source_path

    if model.endswith(".gguf"):
        return model
    if model == "smollm2-135m":
        return str(named_source_path(model))
    return None


def find_int8(given: str | None, model_dir: Path, work_dir: Path) -> tuple[str | None, str | None]:
    """The INT8 checkpoint for ``engine_int8``: ``--int8`` as given, else quantize with ``compress.quantize``.

    Returns ``(path or None, note)``; the note says where it came from or why there is none.
    """
    if given is not None:
        return given, f"given: {given}"
    try:
        from compress.quantize import quantize
    except ImportError:
        return None, "compress.quantize is not available yet; pass --int8 DIR"
    out = work_dir / "int8-w8a8"
    try:
        return str(quantize(model_dir, out, method="w8a8")), f"made by compress.quantize (method w8a8) from {model_dir}"
    except (ValueError, RuntimeError, OSError) as exc:  # reported; the benchmark goes on without it
        return None, f"compress.quantize failed: {type(exc).__name__}: {exc}"


def run_config(spec: RunSpec, work_dir: Path, timeout_s: float) -> dict:
    """Run one configuration in a fresh Python process; returns its ``RunResult`` as a dict."""
    spec_path = work_dir / f"{spec.config}.spec.json"
    result_path = work_dir / f"{spec.config}.result.json"
    spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
    cmd = [sys.executable, "-m", "bench.engine_backends", str(spec_path), str(result_path)]
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"config": spec.config, "status": "failed", "reason": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not result_path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        how = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
        return {"config": spec.config, "status": "failed", "reason": f"process {how}: {' | '.join(tail)}".rstrip(": ")}
    return json.loads(result_path.read_text())


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def summarize(results: list[dict], bound_tok_s: float | None) -> list[Summary]:
    """Turn raw per-configuration results into table rows with ratios to the baselines."""
    by_name = {r["config"]: r for r in results}
    tok_s = {r["config"]: _tok_s(r) for r in results}
    reference = by_name.get(REFERENCE_CONFIG, {}).get("token_ids") if by_name.get(REFERENCE_CONFIG, {}).get("status") == "ok" else None
    rows = []
    for r in results:
        ok = r.get("status") == "ok"
        ttft_ms = [t * 1000.0 for t in r.get("ttft_s") or []] if ok else []
        rss = r.get("peak_rss_bytes")
        rows.append(Summary(
            config=r["config"],
            status=r.get("status", "failed"),
            reason=r.get("reason"),
            output_tok_s=tok_s[r["config"]],
            elapsed_s=r.get("elapsed_s") if ok else None,
            ttft_p50_ms=percentile(ttft_ms, 50),
            ttft_p99_ms=percentile(ttft_ms, 99),
            ttft_basis=r.get("ttft_basis", ""),
            peak_rss_mib=rss / 2**20 if rss else None,
            load_s=r.get("load_s"),
            prefix_hit_rate=r.get("prefix_hit_rate") if ok else None,
            same_tokens_as_hf=token_agreement(r.get("token_ids"), reference) if ok else None,
            same_tokens_checked=min(len(r.get("token_ids") or []), len(reference or [])) if ok else 0,
            speedup={b: ratio(tok_s[r["config"]], tok_s.get(b)) for b in BASELINES if b in tok_s},
            fraction_of_bound=ratio(tok_s[r["config"]], bound_tok_s),
            profile_top=r.get("profile_top"),
        ))
    return rows


def _tok_s(result: dict) -> float | None:
    if result.get("status") != "ok" or not result.get("elapsed_s"):
        return None
    return result["output_tokens"] / result["elapsed_s"]


def token_agreement(tokens: list[list[int]] | None, reference: list[list[int]] | None) -> float | None:
    """Fraction of requests whose generated token ids equal the reference's, over the requests both
    served (the first ``min(len)``, same order); ``None`` if either is missing."""
    if not tokens or not reference:
        return None
    pairs = list(zip(tokens, reference))
    return sum(a == b for a, b in pairs) / len(pairs)


def engine_targets(rows: list[Summary]) -> list[tuple[str, float | None, str]]:
    """The issue's CPU targets for ``engine_prefix_on``: ``(what, measured, target)`` triples."""
    by = {r.config: r for r in rows}
    on, off = by.get("engine_prefix_on"), by.get("engine_prefix_off")
    if on is None or on.status != "ok":
        return []
    ttft_ratio = ratio(on.ttft_p50_ms, off.ttft_p50_ms) if off is not None and off.status == "ok" else None
    return [
        ("output tok/s / HF static batch", on.speedup.get("hf_static"), ">= 4"),
        ("output tok/s / llama.cpp", on.speedup.get("llama_cpp"), ">= 2"),
        ("fraction of compute bound", on.fraction_of_bound, ">= 0.5"),
        ("prefix hit rate", on.prefix_hit_rate, ">= 0.8"),
        ("TTFT p50 on / off", ttft_ratio, "<= 0.5"),
    ]


def _met(value: float | None, target: str) -> str:
    if value is None:
        return "n/a"
    op, limit = target.split()
    return "met" if (value >= float(limit) if op == ">=" else value <= float(limit)) else "MISSED"


def _fmt(value, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_table(rows: list[Summary]) -> str:
    """The side-by-side table (one line per configuration, unavailable ones with their reason)."""
    ratio_cols = [b for b in BASELINES if any(b in r.speedup for r in rows)]
    head = ["config", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "peak RSS MiB", "prefix hit", "same tok"] + [f"x {b}" for b in ratio_cols] + ["% bound"]
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append([r.config, f"{r.status}: {r.reason}"])
            continue
        lines.append([
            r.config, _fmt(r.output_tok_s), _fmt(r.ttft_p50_ms, ".0f"), _fmt(r.ttft_p99_ms, ".0f"), _fmt(r.peak_rss_mib, ".0f"),
            _fmt(r.prefix_hit_rate, ".0%", 1.0) if r.prefix_hit_rate is not None else "-",
            _fmt(r.same_tokens_as_hf, ".0%", 1.0) if r.same_tokens_as_hf is not None else "-",
            *[_fmt(r.speedup.get(b), ".2f") for b in ratio_cols], _fmt(r.fraction_of_bound, ".1f", 100.0),
        ])
    widths = [max(len(head[i]), *(len(l[i]) for l in lines if len(l) == len(head))) for i in range(len(head))]
    out = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    for l in lines:
        if len(l) == len(head):
            out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(l, widths))))
        else:
            out.append(f"{l[0].ljust(widths[0])}  {l[1]}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from compress.checkpoints import CheckpointError, resolve_checkpoint
    from bench.workload import WorkloadError, build_workload

    if args.smoke:
        args.num_requests, args.max_tokens = SMOKE["num_requests"], SMOKE["max_tokens"]
    if args.sequential_requests is not None and args.sequential_requests < 1:
        print(f"error: --sequential-requests {args.sequential_requests}; it must be >= 1 (or left out for all)")
        return 2
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in BACKENDS]
    if unknown:
        print(f"error: --configs: unknown {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
        return 2
    try:
        engine_args = parse_engine_args(args.engine_arg)
        model_dir = resolve_checkpoint(args.model)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        workload = build_workload(tokenizer, num_requests=args.num_requests, max_tokens=args.max_tokens, num_systems=args.systems)
    except (CheckpointError, WorkloadError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    matmul = {"size": SMOKE["matmul_size"], "min_time_s": SMOKE["matmul_time_s"]} if args.smoke else {"size": 1024, "min_time_s": 1.0}
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    flops = workload_flops(shape, workload.prompt_lens, workload.max_tokens, workload.shared_prefix_lens, workload.system_of)
    summary = workload.summary()
    print(f"workload: {summary['num_requests']} requests, prompts {summary['prompt_len_min']}-{summary['prompt_len_max']} tokens "
          f"(shared prefix {', '.join(map(str, workload.shared_prefix_lens))}), {workload.max_tokens} new tokens each, greedy, EOS ignored")
    print(f"model: {model_dir}")
    gflops_before = measure_matmul_gflops(**matmul)
    print(f"peak fp32 matmul ({matmul['size']}^3, {_threads()} threads): {gflops_before:.1f} GFLOP/s")

    with tempfile.TemporaryDirectory(prefix="lmforge-engine-bench-") as tmp:
        work_dir = Path(tmp)
        workload_path = work_dir / "workload.json"
        workload_path.write_text(json.dumps({"prompts": workload.prompts, "max_tokens": workload.max_tokens}))
        int8_dir, int8_note = find_int8(args.int8, model_dir, work_dir) if "engine_int8" in configs else (None, "not requested")
        results = []
        for config in configs:
            spec = RunSpec(config=config, model=str(model_dir), workload_path=str(workload_path),
                           gguf=args.gguf or default_gguf(args.model), int8_model=int8_dir, threads=args.threads,
                           engine_args=engine_args, profile=config in ENGINE_CONFIGS and config in args.profile.split(","),
                           sequential_limit=args.sequential_requests)
            start = time.perf_counter()
            result = run_config(spec, work_dir, args.timeout_s)
            status = f"{_tok_s(result):.1f} tok/s" if result.get("status") == "ok" else f"{result['status']}: {result.get('reason')}"
            print(f"  {config}: {status} ({time.perf_counter() - start:.0f} s with load)", flush=True)
            results.append(result)
    gflops_after = measure_matmul_gflops(**matmul)
    gflops = max(gflops_before, gflops_after)
    bound_s = flops / (gflops * 1e9)
    bound_tok_s = summary["output_tokens_total"] / bound_s
    rows = summarize(results, bound_tok_s)

    print()
    print(format_table(rows))
    print()
    print(f"compute bound: {flops / 1e12:.3f} TFLOP of useful work ({_flops_note(shape)}), at the best measured "
          f"{gflops:.1f} GFLOP/s (before {gflops_before:.1f}, after {gflops_after:.1f}) -> {bound_s:.1f} s, {bound_tok_s:.0f} output tok/s")
    print(f"engine_int8 checkpoint: {int8_note}")
    for r in rows:
        if r.status == "ok":
            print(f"TTFT basis, {r.config}: {r.ttft_basis}")
    if args.sequential_requests:
        print(f"hf_sequential and llama_cpp served the first {args.sequential_requests} of {summary['num_requests']} requests "
              f"(one at a time, so their tok/s does not depend on the count); 'same tok' compares those requests")
    targets = engine_targets(rows)
    if targets:
        print("targets (engine_prefix_on):")
        for what, value, target in targets:
            print(f"  {what}: {_fmt(value, '.2f')} (target {target}) {_met(value, target)}")
    for r in rows:
        if r.profile_top:
            print(f"\ntorch.profiler, repeat run of {r.config} (top ops by self CPU time):\n{r.profile_top}")

    report = {
        "workload": summary,
        "sequential_requests": args.sequential_requests or summary["num_requests"],
        "model": str(model_dir),
        "threads": _threads(),
        "matmul_gflops": {"before": gflops_before, "after": gflops_after, "used": gflops, **matmul},
        "bound": {"workload_flops": flops, "seconds": bound_s, "output_tok_s": bound_tok_s},
        "int8_checkpoint": int8_note,
        "rows": [dataclasses.asdict(r) for r in rows],
        "targets": [{"what": w, "measured": v, "target": t, "result": _met(v, t)} for w, v, t in targets],
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0 if all(r.status != "failed" for r in rows) else 1


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _flops_note(shape: ModelShape) -> str:
    return (f"{2 * shape.layer_matmul_params * shape.num_hidden_layers / 1e6:.0f} MFLOP/token in the layers + attention, "
            f"{shape.lm_head_flops / 1e6:.0f} MFLOP/output token in the LM head, shared prefix once")
