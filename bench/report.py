"""Load-test report: read the raw samples back, plot them (matplotlib, Agg), print the table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.metrics import RequestSample, latency_by_concurrency, throughput_timeline
from engine.errors import LmforgeError
from engine.records import read_jsonl
from engine.tables import fmt

PLOT_FILES = ("ttft_cdf.png", "e2e_cdf.png", "output_tok_s_over_time.png", "concurrency_vs_latency.png")


class SamplesFileError(LmforgeError, ValueError):
    """A samples file with a line that is not a sample record; the message names file and line."""


def read_samples(path: Path) -> tuple[list[RequestSample], list[dict]]:
    """``(requests, other records)`` from a samples JSONL written by the locustfile.

    A last line cut off mid-write (the load generator was killed) is ignored; any other bad
    line raises.

    Raises:
        SamplesFileError: a line that is not JSON or not a valid record, with its line number.
    """
    samples: list[RequestSample] = []
    records: list[dict] = []
    if not path.is_file():
        return samples, records
    for number, record in read_jsonl(path, _numbered, SamplesFileError, torn_tail_ok=True):
        kind = record.pop("kind", None)
        if kind == "request":
            try:
                samples.append(RequestSample.from_json(record))
            except TypeError as exc:
                raise SamplesFileError(f"{path}:{number}: not a request sample ({exc})") from exc
        else:
            records.append({"kind": kind, **record})
    return samples, records


def _numbered(record: object, source: str, line: int) -> tuple[int, dict]:
    if not isinstance(record, dict):
        raise SamplesFileError(f"{source}:{line}: not a JSON object")
    return line, record


def plot_report(samples: Sequence[RequestSample], out_dir: Path, title: str) -> list[Path]:
    """Write the four PNGs of :data:`PLOT_FILES` into ``out_dir``; returns their paths."""
    import matplotlib  # the bench extra (pip install 'lmforge[bench]')

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in samples if s.ok]
    paths = []
    for name, values, label in (
        ("ttft_cdf.png", [s.ttft_s * 1000 for s in ok if s.ttft_s is not None], "TTFT (ms)"),
        ("e2e_cdf.png", [s.e2e_s * 1000 for s in ok], "end-to-end latency (ms)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        _cdf(ax, values, label)
        ax.set_title(f"{title}: {label} CDF")
        paths.append(_save(fig, out_dir / name, plt))
    fig, ax = plt.subplots(figsize=(6, 4))
    t, rate = throughput_timeline(samples, bin_s=1.0)
    ax.plot(t, rate, drawstyle="steps-post")
    ax.set_xlabel("time since first request (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{title}: output throughput")
    paths.append(_save(fig, out_dir / "output_tok_s_over_time.png", plt))
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = latency_by_concurrency(samples)
    levels = [r["concurrency"] for r in rows]
    for key, label in (("ttft_ms", "TTFT p50"), ("e2e_ms", "E2E p50")):
        values = [r[key]["p50"] for r in rows]
        if any(v is not None for v in values):
            ax.plot(levels, [np.nan if v is None else v for v in values], marker="o", label=label)
    ax.set_xlabel("requests in flight when sent")
    ax.set_ylabel("latency (ms)")
    if rows:
        ax.legend()
    ax.set_title(f"{title}: concurrency vs latency")
    paths.append(_save(fig, out_dir / "concurrency_vs_latency.png", plt))
    return paths


def _cdf(ax, values: list[float], label: str) -> None:
    if values:
        x = np.sort(np.asarray(values))
        ax.plot(x, np.arange(1, x.size + 1) / x.size, drawstyle="steps-post")
    else:
        ax.text(0.5, 0.5, "no successful requests", ha="center", transform=ax.transAxes)
    ax.set_xlabel(label)
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def format_table(summary: dict) -> str:
    """The one-screen result: throughput, TTFT/ITL/E2E percentiles (ms) and failures."""
    ttft, itl, e2e = summary["ttft_ms"], summary["itl_ms"], summary["e2e_ms"]
    rows = [
        ("requests (ok / failed)", f"{summary['successful']} / {summary['failed']}"),
        ("duration (s)", fmt(summary["duration_s"])),
        ("requests/s", fmt(summary["request_throughput_req_s"], ".2f")),
        ("output tok/s", fmt(summary["output_throughput_tok_s"])),
        ("TTFT p50 / p90 / p99 (ms)", f"{fmt(ttft['p50'])} / {fmt(ttft['p90'])} / {fmt(ttft['p99'])}"),
        ("ITL p50 / p99 (ms)", f"{fmt(itl['p50'])} / {fmt(itl['p99'])}"),
        ("TPOT p50 (ms)", fmt(summary["tpot_ms"]["p50"])),
        ("E2E p50 / p99 (ms)", f"{fmt(e2e['p50'])} / {fmt(e2e['p99'])}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
