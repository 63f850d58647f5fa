"""``lmforge bench compression``: every INT8 method against fp32, side by side in one run.

Causal LM (default: the real SmolLM2-135M-Instruct) on the held-out English dialogs:

* size reduction of the transformer blocks' linear weights (target >= 3.5x) and of the whole
  weight files,
* teacher-forced quality against fp32: perplexity change, mean and p99 KL(fp32 || variant),
  same top-1 token (``compress.evaluate.quality_metrics``),
* free-running greedy agreement with fp32 on the fixed prompt set (secondary),
* CPU decode latency (batch 1, ms/token) and speed-up vs fp32.

Encoder (all-MiniLM-L6-v2): ONNX Runtime INT8 vs PyTorch fp32: file size, cosine similarity of
mean-pooled sentence embeddings (target: mean >= 0.99; the minimum is reported beside it) and
the latency ratio (batch 1 per sentence).

Prints a table and writes every figure to ``OUT/compression.json``. Targets are reported
(``pass``/``miss``), never asserted: the command exits 0 whenever the measurement ran.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from compress.errors import UsageError
from compress.outputs import BENCH_COMPRESSION, check_output_dir

TARGET_LINEAR_REDUCTION = 3.5
TARGET_PPL_CHANGE_PCT = 3.0
PPL_TARGET_METHODS = ("dynamic", "onnx-int8")
TARGET_MINILM_COSINE = 0.99


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="causal LM to quantize (name, .gguf or directory)")
    parser.add_argument("--methods", nargs="+", default=["dynamic", "llm-int8", "onnx-int8"], help="quantization methods to compare")
    parser.add_argument("--out", default="runs/bench-compression", help="work directory (quantized checkpoints, compression.json)")
    parser.add_argument("--data", default=None, help="held-out JSONL; default: held-out chatterbot-corpus English dialogs")
    parser.add_argument("--max-records", type=int, default=200, help="held-out records scored (default 200)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for every model (default 1: steadiest ratios on a shared machine)")
    parser.add_argument("--latency-tokens", type=int, default=32, help="decode tokens timed per repeat (default 32)")
    parser.add_argument("--latency-repeats", type=int, default=3, help="latency repeats, median taken (default 3)")
    parser.add_argument("--skip-minilm", action="store_true", help="skip the MiniLM ONNX INT8 comparison")


# --------------------------------------------------------------------------------------------
# Causal LM
# --------------------------------------------------------------------------------------------


def causal_lm_figures(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Quantize with each method, evaluate all against fp32; returns per-method figures."""
    from compress.checkpoints import resolve_checkpoint
    from compress.evaluate import EvalConfig, default_heldout_records, evaluate, format_table, read_records
    from compress.quantize import quantize

    parent = resolve_checkpoint(args.model)
    if args.data:
        records, data_name = read_records(args.data), args.data
    else:
        records, data_name = default_heldout_records()
    quantized, quantize_s = {}, {}
    for method in args.methods:
        print(f"quantize {method} ...", flush=True)
        start = time.perf_counter()
        quantized[method] = quantize(parent, out / method, method=method)
        quantize_s[method] = round(time.perf_counter() - start, 1)
    config = EvalConfig(
        max_records=args.max_records, latency_tokens=args.latency_tokens, latency_repeats=args.latency_repeats, num_threads=args.threads
    )
    results = evaluate([parent, *quantized.values()], records=records, data_name=data_name, config=config)
    print(format_table(results))
    base = results[str(parent)]
    figures: dict[str, Any] = {"parent": str(parent), "data": data_name, "fp32": base, "methods": {}}
    for method, path in quantized.items():
        m = results[str(path)]
        ppl_change = (m["perplexity"] / base["perplexity"] - 1) * 100
        linear_reduction = base["linear_weight_bytes"] / m["linear_weight_bytes"]
        figures["methods"][method] = {
            "checkpoint": str(path),
            "quantize_s": quantize_s[method],
            "linear_weight_reduction": round(linear_reduction, 3),
            "size_reduction": round(base["size_bytes"] / m["size_bytes"], 3),
            "perplexity_change_pct": round(ppl_change, 3),
            "decode_speedup": round(base["decode_ms_per_token"] / m["decode_ms_per_token"], 3),
            "linear_target": "pass" if linear_reduction >= TARGET_LINEAR_REDUCTION else "miss",
            "perplexity_target": ("pass" if ppl_change <= TARGET_PPL_CHANGE_PCT else "miss") if method in PPL_TARGET_METHODS else "n/a",
            **m,
        }
    return figures


# --------------------------------------------------------------------------------------------
# MiniLM encoder
# --------------------------------------------------------------------------------------------


def _sentences(limit: int = 64) -> list[str]:
    from compress.evaluate import default_heldout_records

    records, _ = default_heldout_records()
    texts = [m["content"] for r in records for m in r.get("messages", [])] + [r["text"] for r in records if "text" in r]
    return texts[:limit]


def _embed_each(model, tokenizer, sentences: list[str]):
    """Mean-pooled embeddings ``[n, hidden]``, one sentence per call (batch 1), and seconds taken."""
    import torch

    from compress.onnx import mean_pool

    rows, start = [], time.perf_counter()
    with torch.no_grad():
        for sentence in sentences:
            batch = tokenizer(sentence, return_tensors="pt", truncation=True, max_length=128)
            rows.append(mean_pool(model(**batch).last_hidden_state, batch["attention_mask"]))
    return torch.cat(rows), time.perf_counter() - start


def minilm_figures(out: Path, threads: int, repeats: int = 3) -> dict[str, Any]:
    """MiniLM: PyTorch fp32 vs ONNX fp32 vs ONNX Runtime INT8."""
    import onnxruntime
    import torch
    from optimum.onnxruntime import ORTModelForFeatureExtraction
    from transformers import AutoModel, AutoTokenizer

    from compress.checkpoints import resolve_checkpoint
    from compress.onnx import export_onnx, quantize_onnx_int8

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
    int8["cosine_target"] = "pass" if int8["cosine_mean"] >= TARGET_MINILM_COSINE else "miss"  # on the mean; min reported beside it
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
        lines.append(f"\n{Path(lm['parent']).name}: {lm['data']}, {base['eval_records']} records, {base['perplexity_tokens']} scored tokens, {base['num_threads']} CPU thread(s)")
        head = (f"{'method':<16} {'linear MiB':>10} {'linear x':>9} {'file MiB':>9} {'ppl':>8} {'Δppl':>8} {'KL mean':>8} {'KL p99':>7} "
                f"{'top-1':>6} {'agree':>6} {'ms/tok':>8} {'speed':>6}  targets")
        lines += [head, "-" * len(head)]
        lines.append(
            f"{'fp32':<16} {base['linear_weight_bytes'] / 2**20:>10.1f} {1:>8.2f}x {base['size_bytes'] / 2**20:>9.1f} "
            f"{base['perplexity']:>8.3f} {0:>+7.2f}% {base['kl_mean']:>8.4f} {base['kl_p99']:>7.3f} {base['same_top1'] * 100:>5.1f}% "
            f"{1:>6.3f} {base['decode_ms_per_token']:>8.2f} {1:>5.2f}x"
        )
        for method, m in lm["methods"].items():
            lines.append(
                f"{method:<16} {m['linear_weight_bytes'] / 2**20:>10.1f} {m['linear_weight_reduction']:>8.2f}x {m['size_bytes'] / 2**20:>9.1f} "
                f"{m['perplexity']:>8.3f} {m['perplexity_change_pct']:>+7.2f}% {m['kl_mean']:>8.4f} {m['kl_p99']:>7.3f} "
                f"{m['same_top1'] * 100:>5.1f}% {m['greedy_agreement']:>6.3f} "
                f"{m['decode_ms_per_token']:>8.2f} {m['decode_speedup']:>5.2f}x  linear>={TARGET_LINEAR_REDUCTION}x {m['linear_target']}, ppl {m['perplexity_target']}"
            )
    mini = report.get("minilm")
    if mini:
        lines.append(f"\nall-MiniLM-L6-v2: {mini['sentences']} sentences, batch 1, {mini['threads']} CPU thread(s)")
        head = f"{'model':<14} {'MiB':>7} {'ms/sent':>8} {'cos mean':>9} {'cos min':>8}"
        lines += [head, "-" * len(head)]
        for name in ("pytorch-fp32", "onnx-fp32", "onnx-int8"):
            m = mini[name]
            lines.append(f"{name:<14} {m['size_bytes'] / 2**20:>7.1f} {m['ms_per_sentence']:>8.2f} {m['cosine_mean']:>9.5f} {m['cosine_min']:>8.5f}")
        i8 = mini["onnx-int8"]
        lines.append(
            f"onnx-int8 vs pytorch-fp32: {i8['size_reduction']:.2f}x smaller, latency ratio {i8['latency_ratio_vs_pytorch']:.2f}, "
            f"cosine mean {i8['cosine_mean']:.4f} (target >= {TARGET_MINILM_COSINE}: {i8['cosine_target']}), min {i8['cosine_min']:.4f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from compress.quantize import METHODS

    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise UsageError(f"--methods {unknown}: unknown", fix=f"use {', '.join(METHODS)}")
    if args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be >= 1")
    out = check_output_dir(args.out, kind=BENCH_COMPRESSION)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {"machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()}}
    report["causal_lm"] = causal_lm_figures(args, out)
    if not args.skip_minilm:
        report["minilm"] = minilm_figures(out, args.threads)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    path = out / "compression.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    print(f"\nwrote {path} ({report['elapsed_s']} s)")
    return 0
