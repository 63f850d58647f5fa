"""Serving metrics from raw per-request samples: exact percentiles, throughput, goodput.

Definitions follow NVIDIA GenAI-Perf ("LLM metrics" in its documentation) and vLLM's
``benchmarks/benchmark_serving.py`` so figures can be set next to theirs:

* **TTFT** (time to first token): from sending the request to receiving the first response
  chunk that carries output text.
* **ITL** (inter-token latency): every gap between two consecutive text-carrying chunks of one
  streamed response, pooled over all requests (vLLM's ``itls``). GenAI-Perf's "inter token
  latency" is the per-request average, which equals TPOT below.
* **TPOT** (time per output token): ``(e2e - ttft) / (output_tokens - 1)`` per request; undefined
  for a single output token (vLLM skips those requests, so do we).
* **E2E** (request latency): from sending the request to receiving its last response.
* **Output token throughput**: total output tokens of successful requests / benchmark duration;
  **request throughput**: successful requests / duration. The duration runs from the first
  request's start to the last request's end (vLLM: the benchmark's wall time).
* **Goodput** (DistServe, Zhong et al. 2024; vLLM ``--goodput``): the highest throughput that
  still meets a latency objective, here TTFT p90 <= a bound, measured per load step.

Percentiles are exact over the raw samples (:func:`bench.harness.percentiles`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from bench.harness import PERCENTILES, percentiles


@dataclass
class RequestSample:
    """One request as the load generator saw it. Times in seconds.

    Attributes:
        start_s: wall-clock time (``time.time()``, epoch seconds) the request was sent.
        e2e_s: request latency; for a failed request, the time until the failure.
        ttft_s: time to the first text chunk; ``None`` when no text arrived (failure, or the
            non-streaming endpoint where only E2E exists).
        itl_s: gaps between consecutive text chunks (length = chunks - 1).
        input_tokens / output_tokens: as reported by the server (``num_input_tokens`` /
            ``num_output_tokens``), else ``None`` / the number of text chunks.
        finish_reason: ``"stop"``, ``"length"``, ... as reported by the server, or ``None``.
        error: the failure message, ``None`` for a success.
        concurrency: requests in flight in this load generator when this one was sent (itself included).
        users: Locust users running when it was sent.
        endpoint: ``"generate_stream"`` or ``"generate"``.
        fault: ``None`` for a normal request; with a fault mix (``lmforge bench reliability``)
            ``"bad"`` (a request the server must refuse with HTTP 400) or ``"disconnect"`` (a
            stream the client closes after its first event).
        text: the output text, kept only when the load test records it (``record_text``).
    """

    start_s: float
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    input_tokens: int | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    concurrency: int = 1
    users: int = 1
    endpoint: str = "generate_stream"
    fault: str | None = None
    text: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end_s(self) -> float:
        return self.start_s + self.e2e_s

    @property
    def tpot_s(self) -> float | None:
        """``(e2e - ttft) / (output_tokens - 1)``; ``None`` without a TTFT or with < 2 tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> "RequestSample":
        """Rebuild from :meth:`to_json`; raises ``KeyError``/``TypeError`` on a malformed record."""
        return cls(**record)


def distribution(values: Iterable[float], ps: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """Mean, min, max and exact percentiles of ``values``; all ``None`` when empty."""
    array = np.asarray(list(values), dtype=np.float64)
    base: dict[str, float | None] = {"mean": None, "min": None, "max": None}
    if array.size:
        base = {"mean": float(array.mean()), "min": float(array.min()), "max": float(array.max())}
    return {**base, **percentiles(array, ps)}


def benchmark_window(samples: Sequence[RequestSample]) -> tuple[float, float] | None:
    """``(first start, last end)`` over all samples in epoch seconds; ``None`` when empty."""
    if not samples:
        return None
    return min(s.start_s for s in samples), max(s.end_s for s in samples)


def summarize(samples: Sequence[RequestSample], duration_s: float | None = None) -> dict:
    """Aggregate metrics of a run, in milliseconds for latencies and per second for rates.

    Args:
        samples: every request of the run, failed ones included.
        duration_s: the benchmark duration; default: first start to last end of ``samples``.

    Returns:
        ``{"requests": n, "successful", "failed", "duration_s", "request_throughput_req_s",
        "output_throughput_tok_s", "input_throughput_tok_s", "total_output_tokens",
        "total_input_tokens", "ttft_ms": {mean, min, max, p50, p90, p99}, "itl_ms": {...},
        "tpot_ms": {...}, "e2e_ms": {...}, "output_tokens_per_request": {...}, "errors": {msg: count}}``.
    """
    ok = [s for s in samples if s.ok]
    if duration_s is None:
        window = benchmark_window(samples)
        duration_s = (window[1] - window[0]) if window else 0.0
    out_tokens = sum(s.output_tokens for s in ok)
    in_tokens = sum(s.input_tokens or 0 for s in ok)
    errors: dict[str, int] = {}
    for s in samples:
        if s.error is not None:
            key = s.error[:200]
            errors[key] = errors.get(key, 0) + 1
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    return {
        "requests": len(samples),
        "successful": len(ok),
        "failed": len(samples) - len(ok),
        "duration_s": duration_s,
        "request_throughput_req_s": rate(len(ok)),
        "output_throughput_tok_s": rate(out_tokens),
        "input_throughput_tok_s": rate(in_tokens),
        "total_output_tokens": out_tokens,
        "total_input_tokens": in_tokens,
        "ttft_ms": _ms(distribution(s.ttft_s for s in ok if s.ttft_s is not None)),
        "itl_ms": _ms(distribution(gap for s in ok for gap in s.itl_s)),
        "tpot_ms": _ms(distribution(s.tpot_s for s in ok if s.tpot_s is not None)),
        "e2e_ms": _ms(distribution(s.e2e_s for s in ok)),
        "output_tokens_per_request": distribution(s.output_tokens for s in ok),
        "errors": errors,
    }


def _ms(stats: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (v * 1000.0 if v is not None else None) for k, v in stats.items()}


def token_times(sample: RequestSample) -> list[tuple[float, float]]:
    """``(epoch time, tokens)`` for each text chunk of a successful streamed request.

    Chunk times are ``start + ttft + cumsum(itl)``; the request's output tokens are spread
    evenly over its chunks (our server sends one token per chunk; a detokenizer that holds back
    a partial character makes a chunk carry two). The non-streaming endpoint puts all tokens at
    the request's end.
    """
    if not sample.ok or sample.output_tokens == 0:
        return []
    if sample.ttft_s is None:
        return [(sample.end_s, float(sample.output_tokens))]
    times = [sample.start_s + sample.ttft_s]
    for gap in sample.itl_s:
        times.append(times[-1] + gap)
    per_chunk = sample.output_tokens / len(times)
    return [(t, per_chunk) for t in times]


def throughput_timeline(samples: Sequence[RequestSample], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s over time: ``(bin start in seconds since the first request, tok/s)``.

    Raises:
        ValueError: ``bin_s <= 0``.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s={bin_s}; it must be > 0")
    window = benchmark_window(samples)
    if window is None:
        return np.zeros(0), np.zeros(0)
    t0, t1 = window
    num_bins = max(1, math.ceil((t1 - t0) / bin_s))
    counts = np.zeros(num_bins)
    for s in samples:
        for t, tokens in token_times(s):
            counts[min(num_bins - 1, int((t - t0) / bin_s))] += tokens
    return np.arange(num_bins) * bin_s, counts / bin_s


def latency_by_concurrency(samples: Sequence[RequestSample]) -> list[dict]:
    """Per in-flight concurrency level: request count, TTFT and E2E p50/p90 (ms), sorted by level."""
    levels: dict[int, list[RequestSample]] = {}
    for s in samples:
        if s.ok:
            levels.setdefault(s.concurrency, []).append(s)
    rows = []
    for level in sorted(levels):
        group = levels[level]
        rows.append(
            {
                "concurrency": level,
                "requests": len(group),
                "ttft_ms": _ms(percentiles([s.ttft_s for s in group if s.ttft_s is not None], (50, 90))),
                "e2e_ms": _ms(percentiles([s.e2e_s for s in group], (50, 90))),
            }
        )
    return rows


@dataclass(frozen=True)
class LoadStep:
    """One step of a stepped load: ``users`` ran from ``start_s`` to ``end_s`` (epoch seconds)."""

    users: int
    start_s: float
    end_s: float


def step_summaries(samples: Sequence[RequestSample], steps: Sequence[LoadStep], ttft_p90_bound_ms: float) -> list[dict]:
    """Metrics per load step, each marked whether it met ``TTFT p90 <= ttft_p90_bound_ms``.

    A request belongs to the step in which it ended (in a closed loop, the load it saw is mostly
    that step's); a step's throughput counts those requests' output tokens over the step's
    duration. A step with no successful request does not meet the objective (nothing shows
    that it does).
    """
    rows = []
    for step in steps:
        inside = [s for s in samples if step.start_s <= s.end_s < step.end_s]
        summary = summarize(inside, duration_s=max(step.end_s - step.start_s, 1e-9))
        p90 = summary["ttft_ms"]["p90"]
        rows.append(
            {
                "users": step.users,
                "start_s": step.start_s,
                "duration_s": step.end_s - step.start_s,
                "requests": summary["requests"],
                "failed": summary["failed"],
                "request_throughput_req_s": summary["request_throughput_req_s"],
                "output_throughput_tok_s": summary["output_throughput_tok_s"],
                "ttft_p90_ms": p90,
                "meets_slo": p90 is not None and p90 <= ttft_p90_bound_ms and summary["failed"] == 0,
            }
        )
    return rows


def goodput(step_rows: Sequence[dict]) -> dict | None:
    """The step with the highest output tok/s among those meeting the objective, or ``None``."""
    good = [r for r in step_rows if r["meets_slo"] and r["output_throughput_tok_s"] is not None]
    if not good:
        return None
    return max(good, key=lambda r: r["output_throughput_tok_s"])
