"""The figures of ``lmforge bench engine``: table rows and their ratios to the baselines, greedy-token
agreement, ABBA rounds and their medians, the targets, and the printed tables.

``bench.engine_bench`` runs the systems and hands their raw results here.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

from bench.bound import ratio
from bench.engine_backends import BACKENDS
from bench.harness import align_columns, percentiles
from engine.tables import fmt

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


def summarize(results: list[dict], bound_tok_s: dict[str, float]) -> list[Summary]:
    """Turn raw per-configuration results into table rows with ratios to the baselines.

    Args:
        results: ``RunResult`` dicts (plus ``load_avg_1m``).
        bound_tok_s: per matmul dtype, the workload's compute-bound output tok/s.
    """
    by_name = {r["config"]: r for r in results}
    tok_s = {r["config"]: output_tok_s(r) for r in results}
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


def output_tok_s(result: dict) -> float | None:
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
        ranked = sorted(column, key=lambda r: output_tok_s(r) or -1.0)
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
