"""``lmforge bench compression``: every INT8 method against fp32, side by side in one run.

Causal LM (default: the real SmolLM2-135M-Instruct) on the held-out English dialogs:

* size reduction of the transformer blocks' linear weights (target >= 3.5x) and of the whole
  weight files,
* teacher-forced quality against fp32: perplexity change, mean and p99 KL(fp32 || variant),
  same top-1 token (``compress.evaluate.quality.quality_metrics``), with bf16 as a variant too,
* free-running greedy agreement with fp32 on the fixed prompt set (secondary),
* HF decode latency (batch 1, ms/token),
* our engine's output tok/s for 1 sequence alone and for the engine benchmark's workload
  (64 chat requests x 64 greedy tokens, ``bench.workload``), fp32 / bf16 / INT8 variants in one
  process one after another, and a GEMM microbench (``engine.quant.int8.gemm_microbench``) that
  says which variant is fastest on this CPU.

Targets (``TARGETS``): int8-weight-only KL <= 0.005, top-1 >= 97%, perplexity <= +1.5%, 1
sequence >= 1.3x bf16; w8a8 KL <= 0.02, top-1 >= 95%, perplexity <= +2%, 64 sequences >= 1.25x
bf16 (engine).

Encoder (all-MiniLM-L6-v2): ONNX Runtime INT8 vs PyTorch fp32: file size, cosine similarity of
mean-pooled sentence embeddings (target: mean >= 0.99; the minimum is reported beside it) and
the latency ratio (batch 1 per sentence).

Prints a table and writes every figure to ``OUT/compression.json``. Targets are reported
(``pass``/``miss``), never asserted: the command exits 0 whenever the measurement ran.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import onnxruntime
import torch
from optimum.onnxruntime import ORTModelForFeatureExtraction
from transformers import AutoModel, AutoTokenizer

from bench.harness import write_json
from bench.workload import build_workload
from compress.evaluate.quality import (
    EvalConfig,
    default_heldout_records,
    evaluate,
    format_table,
    read_records,
)
from compress.quantize.methods import METHODS, _copy_side_files_missing, quantize
from compress.quantize.onnx import export_onnx, mean_pool, quantize_onnx_int8
from engine import LLM, SamplingParams
from engine.checkpoint.outputs import BENCH_COMPRESSION, check_output_dir
from engine.checkpoint.store import Manifest, describe_weights, load_causal_lm, resolve_checkpoint, write_manifest
from engine.cli_options import add_config_option, add_option, config_fields
from engine.errors import UsageError
from engine.quant.int8 import format_microbench, gemm_microbench, model_linear_shapes
from engine.tables import fmt, table_lines

TARGET_LINEAR_REDUCTION = 3.5
TARGET_MINILM_COSINE = 0.99
#: method -> (max mean KL, min same top-1, max perplexity change %, engine metric, min ratio vs bf16).
TARGETS: dict[str, tuple[float, float, float, str, float]] = {
    "int8-weight-only": (0.005, 0.97, 1.5, "one_seq_tok_s", 1.3),
    "w8a8": (0.02, 0.95, 2.0, "batch_tok_s", 1.25),
}
#: Engine dtype per variant (INT8 activations in bf16: the fastest float path on AVX-512 BF16 / AMX).
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "int8-weight-only": "bfloat16", "w8a8": "bfloat16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="causal LM to quantize (name, .gguf or directory)")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["int8-weight-only", "w8a8", "llm-int8", "onnx-int8"],
        help="quantization methods to compare",
    )
    parser.add_argument(
        "--out", default="runs/bench-compression", help="work directory (quantized checkpoints, compression.json)"
    )
    parser.add_argument(
        "--data", default=None, help="held-out JSONL; default: held-out chatterbot-corpus English dialogs"
    )
    d = EvalConfig()
    add_config_option(parser, d, "max_records", "held-out records scored (default %(default)s)")
    add_option(parser, "--threads", 2, "CPU threads for every model")
    add_config_option(parser, d, "latency_tokens", "decode tokens timed per repeat (default %(default)s)")
    add_config_option(parser, d, "latency_repeats", "latency repeats, median taken (default %(default)s)")
    parser.add_argument(
        "--engine-requests",
        type=int,
        default=64,
        help="requests of the engine throughput workload (default 64; 0 skips the engine)",
    )
    add_option(parser, "--engine-tokens", 64, "greedy tokens per engine request")
    parser.add_argument("--skip-minilm", action="store_true", help="skip the MiniLM ONNX INT8 comparison")


# --------------------------------------------------------------------------------------------
# Causal LM
# --------------------------------------------------------------------------------------------


def bf16_copy(parent: Path, out: Path) -> Path:
    """A bf16 safetensors copy of ``parent`` (for the quality columns of the bf16 row)."""
    model, _, _ = load_causal_lm(parent, dtype="bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    _copy_side_files_missing(parent, out)
    num_parameters, size_bytes, dtype = describe_weights(out)
    write_manifest(
        out,
        Manifest(
            source=str(parent),
            parent=str(parent),
            method="cast",
            config={"dtype": "bfloat16"},
            dtype=dtype,
            num_parameters=num_parameters,
            size_bytes=size_bytes,
        ),
    )
    return out


def engine_speed(
    models: dict[str, tuple[Path, str]], *, threads: int, num_requests: int, max_tokens: int, log=print
) -> dict[str, dict[str, float]]:
    """Output tok/s of our engine per model: one sequence alone, and ``num_requests`` at once.

    Args:
        models: name -> (checkpoint, engine dtype); run one after another in this process.

    Returns:
        ``{name: {"one_seq_tok_s", "batch_tok_s"}}`` (greedy, EOS ignored; the one-sequence
        figure is the best of 2 runs of the workload's first request).
    """
    figures = {}
    for name, (path, dtype) in models.items():
        llm = LLM(str(path), dtype=dtype, num_threads=threads)
        workload = build_workload(llm.tokenizer, num_requests=num_requests, max_tokens=max_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(
            [workload.prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )  # warm-up
        one = []
        for _ in range(2):
            start = time.perf_counter()
            llm.generate([workload.prompts[0]], params)
            one.append(max_tokens / (time.perf_counter() - start))
        start = time.perf_counter()
        llm.generate([list(p) for p in workload.prompts], params)
        batch = num_requests * max_tokens / (time.perf_counter() - start)
        figures[name] = {"one_seq_tok_s": round(max(one), 1), "batch_tok_s": round(batch, 1), "dtype": dtype}
        log(
            f"engine {name:<18} {dtype:<9} 1 sequence {max(one):7.1f} tok/s   {num_requests} sequences "
            f"{batch:7.1f} tok/s"
        )
        del llm
    return figures


def causal_lm_figures(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Quantize with each method, evaluate all against fp32; returns per-method figures."""
    parent = resolve_checkpoint(args.model)
    if args.data:
        records, data_name = read_records(args.data), args.data
    else:
        records, data_name = default_heldout_records()
    microbench = gemm_microbench(model_linear_shapes(parent / "config.json"), threads=args.threads)
    print(format_microbench(microbench), flush=True)
    quantized, quantize_s = {"bf16": bf16_copy(parent, out / "bf16")}, {}
    for method in args.methods:
        print(f"quantize {method} ...", flush=True)
        start = time.perf_counter()
        quantized[method] = quantize(parent, out / method, method=method)
        quantize_s[method] = round(time.perf_counter() - start, 1)
    config = EvalConfig(**config_fields(EvalConfig, args, num_threads=args.threads))
    results = evaluate([parent, *quantized.values()], records=records, data_name=data_name, config=config)
    print(format_table(results))
    engine_models = {"fp32": (parent, "float32")}
    engine_models.update(
        {name: (path, ENGINE_DTYPES[name]) for name, path in quantized.items() if name in ENGINE_DTYPES}
    )
    engine = {}
    if args.engine_requests > 0:
        engine = engine_speed(
            engine_models, threads=args.threads, num_requests=args.engine_requests, max_tokens=args.engine_tokens
        )
    base = results[str(parent)]
    figures: dict[str, Any] = {
        "parent": str(parent),
        "data": data_name,
        "fp32": {**base, "engine": engine.get("fp32")},
        "methods": {},
        "microbench_us": microbench,
        "load_average": os.getloadavg(),
    }
    for method, path in quantized.items():
        m = results[str(path)]
        ppl_change = (m["perplexity"] / base["perplexity"] - 1) * 100
        linear_reduction = base["linear_weight_bytes"] / m["linear_weight_bytes"]
        entry = {
            "checkpoint": str(path),
            "quantize_s": quantize_s.get(method),
            "linear_weight_reduction": round(linear_reduction, 3),
            "size_reduction": round(base["size_bytes"] / m["size_bytes"], 3),
            "perplexity_change_pct": round(ppl_change, 3),
            "decode_speedup": round(base["decode_ms_per_token"] / m["decode_ms_per_token"], 3),
            "linear_target": ("pass" if linear_reduction >= TARGET_LINEAR_REDUCTION else "miss")
            if method != "bf16"
            else "n/a",
            "engine": engine.get(method),
            **m,
        }
        if method in engine and "bf16" in engine:
            entry["engine_vs_bf16"] = {
                k: round(engine[method][k] / engine["bf16"][k], 3) for k in ("one_seq_tok_s", "batch_tok_s")
            }
        entry["targets"] = _targets(method, entry)
        figures["methods"][method] = entry
    return figures


def _targets(method: str, m: dict[str, Any]) -> str:
    if method not in TARGETS:
        return ""
    max_kl, min_top1, max_ppl, speed_key, min_speed = TARGETS[method]
    checks = [
        (f"KL<={max_kl}", m["kl_mean"] <= max_kl),
        (f"top1>={min_top1:.0%}", m["same_top1"] >= min_top1),
        (f"ppl<=+{max_ppl}%", m["perplexity_change_pct"] <= max_ppl),
    ]
    if m.get("engine_vs_bf16"):
        checks.append(
            (
                f"{'1seq' if speed_key == 'one_seq_tok_s' else 'batch'}>={min_speed}x bf16",
                m["engine_vs_bf16"][speed_key] >= min_speed,
            )
        )
    return ", ".join(f"{name} {'pass' if ok else 'miss'}" for name, ok in checks)


# --------------------------------------------------------------------------------------------
# MiniLM encoder
# --------------------------------------------------------------------------------------------


def _sentences(limit: int = 64) -> list[str]:
    records, _ = default_heldout_records()
    texts = [m["content"] for r in records for m in r.get("messages", [])] + [r["text"] for r in records if "text" in r]
    return texts[:limit]


def _embed_each(model, tokenizer, sentences: list[str]):
    """Mean-pooled embeddings ``[n, hidden]``, one sentence per call (batch 1), and seconds taken."""
    rows, start = [], time.perf_counter()
    with torch.no_grad():
        for sentence in sentences:
            batch = tokenizer(sentence, return_tensors="pt", truncation=True, max_length=128)
            rows.append(mean_pool(model(**batch).last_hidden_state, batch["attention_mask"]))
    return torch.cat(rows), time.perf_counter() - start


def minilm_figures(out: Path, threads: int, repeats: int = 3) -> dict[str, Any]:
    """MiniLM: PyTorch fp32 vs ONNX fp32 vs ONNX Runtime INT8."""
    torch.set_num_threads(threads)
    source = resolve_checkpoint("minilm-l6", causal_lm=False)
    print("export MiniLM to ONNX and quantize ...", flush=True)
    fp32_dir = export_onnx(source, out / "minilm-onnx", task="feature-extraction")
    int8_dir = quantize_onnx_int8(fp32_dir, out / "minilm-onnx-int8")
    tokenizer = AutoTokenizer.from_pretrained(source)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    models = {
        "pytorch-fp32": AutoModel.from_pretrained(source).eval(),
        "onnx-fp32": ORTModelForFeatureExtraction.from_pretrained(fp32_dir, session_options=options),
        "onnx-int8": ORTModelForFeatureExtraction.from_pretrained(int8_dir, session_options=options),
    }
    sentences = _sentences()
    embeddings, seconds = {}, {}
    for name, model in models.items():
        _embed_each(model, tokenizer, sentences[:4])  # warm-up
        runs = [_embed_each(model, tokenizer, sentences) for _ in range(repeats)]
        embeddings[name] = runs[0][0]
        seconds[name] = statistics.median(t for _, t in runs)
    reference = embeddings["pytorch-fp32"]
    sizes = {
        "pytorch-fp32": sum(f.stat().st_size for f in source.glob("*.safetensors")),
        "onnx-fp32": (fp32_dir / "model.onnx").stat().st_size,
        "onnx-int8": (int8_dir / "model.onnx").stat().st_size,
    }
    figures: dict[str, Any] = {"sentences": len(sentences), "threads": threads}
    for name in models:
        cosine = torch.nn.functional.cosine_similarity(embeddings[name], reference)
        figures[name] = {
            "size_bytes": sizes[name],
            "ms_per_sentence": round(seconds[name] / len(sentences) * 1000, 3),
            "cosine_mean": round(float(cosine.mean()), 5),
            "cosine_min": round(float(cosine.min()), 5),
        }
    int8 = figures["onnx-int8"]
    int8["size_reduction"] = round(sizes["pytorch-fp32"] / sizes["onnx-int8"], 3)
    int8["latency_ratio_vs_pytorch"] = round(seconds["onnx-int8"] / seconds["pytorch-fp32"], 3)
    int8["cosine_target"] = (
        "pass" if int8["cosine_mean"] >= TARGET_MINILM_COSINE else "miss"
    )  # on the mean; min reported beside it
    return figures


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def format_report(report: dict[str, Any]) -> str:
    """The side-by-side summary table of ``compression.json``."""
    lines = []
    lm = report.get("causal_lm")
    if lm:
        base = lm["fp32"]
        load = ", ".join(f"{x:.1f}" for x in lm.get("load_average", ()))
        lines.append(
            f"\n{Path(lm['parent']).name}: {lm['data']}, {base['eval_records']} records, "
            f"{base['perplexity_tokens']} scored tokens, "
            f"{base['num_threads']} CPU thread(s), load average {load}"
        )
        columns = [
            ("method", "<16"),
            ("linear MiB", ">10"),
            ("file MiB", ">9"),
            ("ppl", ">8"),
            ("Δppl", ">8"),
            ("KL mean", ">8"),
            ("KL p99", ">7"),
            ("top-1", ">6"),
            ("agree", ">6"),
            ("HF ms/tok", ">9"),
            ("eng 1seq", ">9"),
            ("eng batch", ">9"),
            ("", ""),  # two spaces before the free-text column
            ("targets", ""),
        ]
        rows = [("fp32", {**base, "perplexity_change_pct": 0.0, "targets": ""})] + list(lm["methods"].items())
        cells = []
        for method, m in rows:
            e = m.get("engine") or {}
            cells.append(
                [
                    method,
                    fmt(m["linear_weight_bytes"], ".1f", 2**-20),
                    fmt(m["size_bytes"], ".1f", 2**-20),
                    f"{m['perplexity']:.3f}",
                    f"{m['perplexity_change_pct']:+.2f}%",
                    f"{m['kl_mean']:.4f}",
                    f"{m['kl_p99']:.3f}",
                    f"{m['same_top1'] * 100:.1f}%",
                    f"{m['greedy_agreement']:.3f}",
                    f"{m.get('decode_ms_per_token', 0):.2f}",
                    f"{e.get('one_seq_tok_s', 0):.1f}",
                    f"{e.get('batch_tok_s', 0):.1f}",
                    "",
                    m["targets"],
                ]
            )
        lines += table_lines(columns, cells)
        for method, m in lm["methods"].items():
            if m.get("engine_vs_bf16") and method != "bf16":
                r = m["engine_vs_bf16"]
                lines.append(
                    f"engine {method} vs bf16: 1 sequence {r['one_seq_tok_s']:.2f}x, batch of requests "
                    f"{r['batch_tok_s']:.2f}x"
                )
        for rows_label, times in lm.get("microbench_us", {}).items():
            fastest = min(times, key=times.get)
            lines.append(
                f"GEMM microbench {rows_label}: fastest {fastest} ({times['bf16'] / times[fastest]:.2f}x bf16)"
            )
    mini = report.get("minilm")
    if mini:
        lines.append(f"\nall-MiniLM-L6-v2: {mini['sentences']} sentences, batch 1, {mini['threads']} CPU thread(s)")
        columns = [("model", "<14"), ("MiB", ">7"), ("ms/sent", ">8"), ("cos mean", ">9"), ("cos min", ">8")]
        cells = []
        for name in ("pytorch-fp32", "onnx-fp32", "onnx-int8"):
            m = mini[name]
            cells.append(
                [
                    name,
                    fmt(m["size_bytes"], ".1f", 2**-20),
                    f"{m['ms_per_sentence']:.2f}",
                    f"{m['cosine_mean']:.5f}",
                    f"{m['cosine_min']:.5f}",
                ]
            )
        lines += table_lines(columns, cells)
        i8 = mini["onnx-int8"]
        lines.append(
            f"onnx-int8 vs pytorch-fp32: {i8['size_reduction']:.2f}x smaller, latency ratio "
            f"{i8['latency_ratio_vs_pytorch']:.2f}, "
            f"cosine mean {i8['cosine_mean']:.4f} (target >= {TARGET_MINILM_COSINE}: {i8['cosine_target']}), "
            f"min {i8['cosine_min']:.4f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise UsageError(f"--methods {unknown}: unknown", fix=f"use {', '.join(METHODS)}")
    if args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be >= 1")
    out = check_output_dir(args.out, kind=BENCH_COMPRESSION)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()}
    }
    report["causal_lm"] = causal_lm_figures(args, out)
    if not args.skip_minilm:
        report["minilm"] = minilm_figures(out, args.threads)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    path = out / "compression.json"
    write_json(path, report)
    print(format_report(report))
    print(f"\nwrote {path} ({report['elapsed_s']} s)")
    return 0
