"""``lmforge bench reliability``: a fault soak against a real tritonserver (not part of ``make test``).

    lmforge bench reliability [--model tiny|CKPT] [--duration 3m] [--users 16]
                              [--bad-share 0.1] [--disconnect-share 0.1] [--kill-at 0.6]
                              [--cases all|none|huge_n,queued_disconnects,...] [--no-soak]

Exports the model (``tiny``: a random 2-layer Llama with the SmolLM2 tokenizer, made in ``OUT``;
or a checkpoint name / directory such as ``smollm2-135m``) into ``OUT/model_repository``, serves
it on free ports of 127.0.0.1 the way ``lmforge serve`` does (``deploy.triton.TritonServer`` +
``ModelSupervisor``, which loads a broken model again), and runs ``lmforge loadtest``'s Locust
users with a fault mix: ``--bad-share`` of the requests are bad (``bench.locustfile.BAD_REQUESTS``,
each must get HTTP 400), ``--disconnect-share`` are streams closed after their first event. At
``--kill-at`` x the duration the model's Python backend stub is killed with SIGKILL.

Reported (printed and ``OUT/reliability.json``): requests by kind; failures among the good
requests before the kill (target 0) and after it; bad requests not answered with 400; the
stub's RSS growth from the end of the warm-up (``--warmup-fraction`` of the time before the
kill) to the kill (target <= 5%); KV cache usage and running requests after the load (target
0); ``lmforge_requests_aborted_total`` against the disconnects; and the seconds from the kill
until a request is served again (Triton 2.51 does not recover by itself; the supervisor's
unload + load does, or its restart of the server when the kill took the server down too).
Requests in flight in the killed stub are never answered by Triton: they end at the client's
``--request-timeout-s``. ``lmforge_requests_aborted_total`` also counts the requests in flight
when Locust stops at the end (their clients close).

Then ``--cases`` (``bench.reliability_cases``) each set up one fault and measure what a client
sees: a good request's latency beside the worst request the limits allow (``huge_n``), queued and
mid-stream SSE disconnects, non-streaming disconnects through the OpenAI frontend, and a killed
stub with one and with two instances (how in-flight requests end, failures after the kill, the
first good answer).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from bench.loadtest import LoadTestConfig, LoadTestError, parse_duration, run_loadtest
from bench.reliability_cases import CASES, ENGINE_CONFIG, read_metrics, run_cases
from bench.report import read_samples
from deploy.export import export
from deploy.triton import ModelSupervisor, TritonError, TritonServer, free_ports
from engine.checkpoint.store import CheckpointError, make_tiny_llama, resolve_checkpoint
from engine.cli_options import add_option
from engine.errors import LmforgeError

#: Engine of the served model: room for 16 users' prompts and outputs without preemption.
RSS_TARGET_GROWTH = 0.05
PROBE_INTERVAL_S = 0.25
RSS_INTERVAL_S = 1.0


class ReliabilityError(LmforgeError, RuntimeError):
    """The soak could not run (bad flag, model not exportable, server not starting)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="tiny (random 2-layer Llama, default) or a checkpoint name/dir, e.g. smollm2-135m",
    )
    add_option(parser, "--duration", "3m", "soak duration, e.g. 90s, 3m")
    add_option(parser, "--users", 16, "concurrent Locust users")
    add_option(parser, "--bad-share", 0.1, "share of bad requests")
    add_option(parser, "--disconnect-share", 0.1, "share of streams closed after the first event")
    add_option(parser, "--kill-at", 0.6, "kill -9 the model stub at this fraction of the duration; 0 = never")
    add_option(parser, "--warmup-fraction", 0.25, "share of the pre-kill time before the RSS baseline")
    add_option(parser, "--max-tokens", 32, "SamplingParams.max_tokens of the good requests")
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=20.0,
        help="client read timeout (default 20): requests in flight in a killed stub are never answered",
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch threads of the served engine (default: torch's)"
    )
    add_option(parser, "--out", "reports/reliability", "report directory")
    parser.add_argument(
        "--cases",
        default="all",
        help="targeted fault cases after the soak (bench.reliability_cases.CASES), comma-separated; all (default) or "
        "none",
    )
    parser.add_argument("--no-soak", action="store_true", help="run the cases only")


def run(args: argparse.Namespace) -> int:
    # the cases import the export and frontend machinery: imported on use

    try:
        duration_s = parse_duration(args.duration)
        _check_args(args, duration_s)
        cases = [] if args.cases == "none" else list(CASES) if args.cases == "all" else args.cases.split(",")
        unknown = sorted(set(cases) - set(CASES))
        if unknown:
            raise ReliabilityError(f"--cases: unknown {unknown}; use some of {', '.join(CASES)}, all or none")
        report = {"targets": {}, "targets_met": True} if args.no_soak else soak(args, duration_s)
        if cases:
            out = Path(args.out).resolve()
            out.mkdir(parents=True, exist_ok=True)
            checkpoint = _checkpoint(args, out)
            report["cases"] = run_cases(cases, checkpoint, out / "cases", args.max_tokens, args.num_threads, print)
            report["targets"].update(report["cases"]["targets"])
            report["targets_met"] = all(report["targets"].values())
            (out / "reliability.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    except (ReliabilityError, LoadTestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.no_soak:
        print(format_report(report))
    if "cases" in report:
        print(format_cases(report["cases"]))
    print(f"report: {Path(args.out).resolve() / 'reliability.json'}")
    return 0 if report["targets_met"] else 1


def format_cases(cases: dict) -> str:
    """The cases' figures, one line each, and their targets."""
    lines = ["targeted cases:"]
    for name, result in cases.items():
        if name != "targets":
            lines.append(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in result.items() if k != "failure_examples"))
    lines.append("  targets: " + ", ".join(f"{n}: {'met' if ok else 'MISSED'}" for n, ok in cases["targets"].items()))
    return "\n".join(lines)


def _check_args(args: argparse.Namespace, duration_s: float) -> None:
    checks = [
        (duration_s >= 30, f"--duration={args.duration}; give at least 30s (warm-up, kill and recovery must fit)"),
        (args.users >= 1, f"--users={args.users}; it must be >= 1"),
        (
            0 <= args.bad_share and 0 <= args.disconnect_share and args.bad_share + args.disconnect_share < 1,
            f"--bad-share={args.bad_share}, --disconnect-share={args.disconnect_share}; each >= 0, sum < 1",
        ),
        (0 <= args.kill_at < 1, f"--kill-at={args.kill_at}; it must be in [0, 1)"),
        (0 < args.warmup_fraction < 1, f"--warmup-fraction={args.warmup_fraction}; it must be in (0, 1)"),
        (args.max_tokens >= 1, f"--max-tokens={args.max_tokens}; it must be >= 1"),
        (args.request_timeout_s > 0, f"--request-timeout-s={args.request_timeout_s}; it must be > 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ReliabilityError(message)


# --------------------------------------------------------------------------------------------
# the soak
# --------------------------------------------------------------------------------------------


def soak(args: argparse.Namespace, duration_s: float) -> dict:
    """Serve, load with faults, kill the stub once; returns the report (also ``OUT/reliability.json``)."""
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    repo = _export(args, out)
    events: list[dict] = []
    log = lambda line: (events.append({"time_s": time.time(), "event": line}), print(line, flush=True))  # noqa: E731
    http, grpc, metrics = free_ports(3)
    server = TritonServer(
        repo,
        http,
        grpc,
        metrics,
        models=["llm"],
        log_path=out / "tritonserver.log",
        write_pid_file=False,
        startup_timeout_s=900,
    )
    try:
        server.start()
    except TritonError as exc:
        raise ReliabilityError(str(exc)) from exc
    try:
        supervisor = ModelSupervisor(server, report=log).start()
        kill_after_s = args.kill_at * duration_s if args.kill_at > 0 else None
        monitor = StubMonitor(server, kill_after_s, args.warmup_fraction, log)
        config = LoadTestConfig(
            host=server.http_url,
            model="llm",
            users=args.users,
            spawn_rate=float(args.users),
            run_time_s=duration_s,
            max_tokens=args.max_tokens,
            bad_share=args.bad_share,
            disconnect_share=args.disconnect_share,
            request_timeout_s=args.request_timeout_s,
            keep_going=True,
        )
        log(
            f"soak: {args.users} users for {duration_s:.0f} s on {args.model}; stub kill at {kill_after_s or 'never'} s"
        )
        monitor.start_when_load_starts()
        summary = run_loadtest(config, out / "loadtest", log=log)
        monitor.stop()
        after = _wait_idle(server)
        supervisor.stop()
    finally:
        server.stop()
    report = build_report(args, duration_s, out / "loadtest" / "samples.jsonl", monitor, after, summary, events)
    (out / "reliability.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def _checkpoint(args: argparse.Namespace, out: Path) -> Path:
    try:
        if args.model == "tiny":
            checkpoint = out / "tiny-llama"
            if not (checkpoint / "config.json").is_file():
                checkpoint = make_tiny_llama(checkpoint, seed=0)
            return checkpoint
        return resolve_checkpoint(args.model)
    except (CheckpointError, ValueError, OSError) as exc:
        raise ReliabilityError(f"cannot use {args.model}: {exc}") from exc


def _export(args: argparse.Namespace, out: Path) -> Path:
    checkpoint = _checkpoint(args, out)
    try:
        engine = dict(ENGINE_CONFIG, **({"num_threads": args.num_threads} if args.num_threads else {}))
        repo = out / "model_repository"
        export(checkpoint, repo, name="llm", engine=engine)
    except (CheckpointError, ValueError, OSError) as exc:
        raise ReliabilityError(f"cannot export {args.model}: {exc}") from exc
    return repo


class StubMonitor:
    """On a thread: samples the stub's RSS, kills the stub once, then times the recovery.

    Times are ``time.time()`` seconds. ``rss`` holds ``(time_s, bytes)`` of the first stub only.
    """

    def __init__(self, server, kill_after_s: float | None, warmup_fraction: float, log) -> None:
        self.server = server
        self.kill_after_s = kill_after_s
        self.warmup_fraction = warmup_fraction
        self.log = log
        self.rss: list[tuple[float, int]] = []
        self.load_start_s: float | None = None
        self.kill_s: float | None = None
        self.served_again_s: float | None = None
        self.aborted_before_kill = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmforge-stub-monitor", daemon=True)

    def start_when_load_starts(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        (stub,) = self.server.stub_pids("llm")
        process = psutil.Process(stub)
        self.load_start_s = time.time()
        while not self._stop.wait(RSS_INTERVAL_S):
            now = time.time()
            if self.kill_s is None:
                try:
                    self.rss.append((now, process.memory_info().rss))
                except psutil.Error:
                    pass
            if self.kill_after_s is not None and self.kill_s is None and now - self.load_start_s >= self.kill_after_s:
                self.aborted_before_kill = read_metrics(self.server).get("lmforge_requests_aborted_total", 0.0)
                os.kill(stub, signal.SIGKILL)
                self.kill_s = time.time()
                self.log(f"killed the model stub (pid {stub}) with SIGKILL")
                self._time_recovery()

    def _time_recovery(self) -> None:
        deadline = self.kill_s + 600
        body = json.dumps(
            {"text_input": "Hello", "sampling_parameters": json.dumps({"max_tokens": 2, "temperature": 0})}
        ).encode()
        while time.time() < deadline and not self._stop.is_set():
            request = urllib.request.Request(
                f"{self.server.http_url}/v2/models/llm/generate",
                data=body,
                method="POST",
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    if response.status == 200:
                        self.served_again_s = time.time()
                        self.log(f"served again {self.served_again_s - self.kill_s:.1f} s after the kill")
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(PROBE_INTERVAL_S)


def _wait_idle(server, timeout_s: float = 30.0) -> dict[str, float]:
    """Metrics once the engine is idle (no request running or waiting), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    values = read_metrics(server)
    while time.monotonic() < deadline:
        values = read_metrics(server)
        if (
            values
            and values.get("lmforge_num_requests_running", 1) == 0
            and values.get("lmforge_num_requests_waiting", 1) == 0
        ):
            time.sleep(0.5)  # one more stats interval
            return read_metrics(server)
        time.sleep(0.25)
    return values


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------


def build_report(
    args, duration_s: float, samples_path: Path, monitor: StubMonitor, after: dict, summary: dict, events: list[dict]
) -> dict:
    """The figures of one soak (see the module docstring) and whether each target is met."""
    samples, _ = read_samples(samples_path)
    kill_s = monitor.kill_s
    before = [s for s in samples if kill_s is None or s.end_s < kill_s]
    after_kill = [s for s in samples if kill_s is not None and s.end_s >= kill_s]
    by_kind = lambda group, kind: [s for s in group if (s.fault or "good") == kind]  # noqa: E731
    good_failures_before = [s.error for s in by_kind(before, "good") if not s.ok]
    bad_not_refused = [s.error for s in by_kind(before, "bad") if not s.ok]
    rss_growth = _rss_growth(monitor)
    recovery_s = None if monitor.served_again_s is None else monitor.served_again_s - kill_s
    aborted_after = after.get("lmforge_requests_aborted_total", 0.0)  # a reloaded model counts from 0
    aborted_before = monitor.aborted_before_kill if kill_s is not None else aborted_after
    report = {
        "model": args.model,
        "duration_s": duration_s,
        "users": args.users,
        "requests": {kind: len(by_kind(samples, kind)) for kind in ("good", "bad", "disconnect")},
        "good_failures_before_kill": len(good_failures_before),
        "good_failures_before_kill_examples": good_failures_before[:5],
        "good_requests_after_kill": len(by_kind(after_kill, "good")),
        "good_failures_after_kill": sum(1 for s in by_kind(after_kill, "good") if not s.ok),
        "bad_not_refused_with_400_before_kill": len(bad_not_refused),
        "bad_not_refused_examples": bad_not_refused[:5],
        "bad_failed_after_kill": sum(1 for s in by_kind(after_kill, "bad") if not s.ok),
        "disconnects_before_kill": len(by_kind(before, "disconnect")),
        "requests_aborted_total_before_kill": aborted_before,
        "requests_aborted_total_after_reload": aborted_after if kill_s is not None else None,
        "rss": rss_growth,
        "after_load": {
            "kv_cache_usage_ratio": after.get("lmforge_kv_cache_usage_ratio"),
            "num_requests_running": after.get("lmforge_num_requests_running"),
            "num_requests_waiting": after.get("lmforge_num_requests_waiting"),
        },
        "kill": None
        if kill_s is None
        else {
            "after_load_start_s": kill_s - monitor.load_start_s,
            "served_again_after_s": recovery_s,
            "recovered_by": _recovered_by(events),
        },
        "good_metrics": {k: summary["metrics"].get(k) for k in ("successful", "failed", "output_throughput_tok_s")},
        "events": events,
    }
    report["targets"] = {
        "good_failures_before_kill == 0": report["good_failures_before_kill"] == 0,
        "bad requests all refused with 400": report["bad_not_refused_with_400_before_kill"] == 0,
        f"rss growth <= {RSS_TARGET_GROWTH:.0%}": rss_growth["growth"] is not None
        and rss_growth["growth"] <= RSS_TARGET_GROWTH,
        "kv usage 0 after load": report["after_load"]["kv_cache_usage_ratio"] == 0.0,
        "served again after the kill": kill_s is None or recovery_s is not None,
    }
    report["targets_met"] = all(report["targets"].values())
    return report


def _recovered_by(events: list[dict]) -> str:
    lines = " ".join(e["event"] for e in events)
    if "tritonserver exited" in lines:
        return "the server died with the stub; lmforge's ModelSupervisor started it again"
    if "loading it again" in lines:
        return "lmforge's ModelSupervisor (unload + load); Triton 2.51 alone keeps the dead stub"
    return "not recovered"


def _rss_growth(monitor: StubMonitor) -> dict:
    """RSS at the end of the warm-up vs at the kill (or the end): ``{"baseline_bytes", "final_bytes", "growth"}``."""
    if len(monitor.rss) < 2 or monitor.load_start_s is None:
        return {"baseline_bytes": None, "final_bytes": None, "growth": None}
    end = monitor.kill_s or monitor.rss[-1][0]
    warm = monitor.load_start_s + monitor.warmup_fraction * (end - monitor.load_start_s)
    baseline = next((rss for t, rss in monitor.rss if t >= warm), monitor.rss[-1][1])
    final = monitor.rss[-1][1]
    return {"baseline_bytes": baseline, "final_bytes": final, "growth": (final - baseline) / baseline}


def format_report(report: dict) -> str:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f} MiB"  # noqa: E731
    rss, kill, after = report["rss"], report["kill"], report["after_load"]
    growth = "-" if rss["growth"] is None else f"{rss['growth']:+.1%}"
    lines = [
        f"reliability soak: {report['users']} users, {report['duration_s']:.0f} s, model {report['model']}",
        "  requests: " + ", ".join(f"{n} {k}" for k, n in report["requests"].items()),
        f"  good requests failed before the kill: {report['good_failures_before_kill']} (target 0)",
        f"  good requests failed after the kill: {report['good_failures_after_kill']} of "
        f"{report['good_requests_after_kill']} (during recovery)",
        "  bad requests not refused with 400 before the kill: "
        f"{report['bad_not_refused_with_400_before_kill']} (target 0); "
        f"bad requests failed otherwise after the kill: {report['bad_failed_after_kill']}",
        f"  before the kill: {report['disconnects_before_kill']} disconnects, lmforge_requests_aborted_total "
        f"{report['requests_aborted_total_before_kill']:.0f} (also counts clients closed by Locust's stop)",
        f"  stub RSS after warm-up {mib(rss['baseline_bytes'])} -> {mib(rss['final_bytes'])} at the kill: "
        f"{growth} (target <= {RSS_TARGET_GROWTH:.0%})",
        f"  after the load: KV usage {after['kv_cache_usage_ratio']}, running {after['num_requests_running']}, "
        f"waiting {after['num_requests_waiting']} (target 0)",
    ]
    if kill is not None:
        served = (
            "not served again"
            if kill["served_again_after_s"] is None
            else f"served again after {kill['served_again_after_s']:.1f} s"
        )
        lines.append(f"  stub killed at {kill['after_load_start_s']:.0f} s: {served} ({kill['recovered_by']})")
    lines += [
        f"  example failure: {e}"
        for e in report["good_failures_before_kill_examples"] + report["bad_not_refused_examples"]
    ]
    lines.append(
        "  targets: " + ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in report["targets"].items())
    )
    return "\n".join(lines)
