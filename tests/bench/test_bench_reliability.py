"""``lmforge bench reliability``: flag checks and the report's arithmetic (the soak itself runs a
real server for minutes and is not part of the test suite)."""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import types

import pytest

from bench.metrics import RequestSample
from bench.reliability import ReliabilityError, _check_args, add_arguments, build_report, format_report


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--users", "0"], "--users"),
        (["--bad-share", "0.6", "--disconnect-share", "0.5"], "--bad-share"),
        (["--kill-at", "1"], "--kill-at"),
        (["--warmup-fraction", "0"], "--warmup-fraction"),
        (["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_bad_flags_name_the_flag(argv, field):
    with pytest.raises(ReliabilityError, match=field):
        _check_args(_args(*argv), 120.0)
    with pytest.raises(ReliabilityError, match="--duration"):
        _check_args(_args("--duration", "10s"), 10.0)


def test_report_splits_at_the_kill_and_checks_each_target(tmp_path):
    t0 = 1000.0
    samples = [
        RequestSample(start_s=t0 + 1, e2e_s=1.0, output_tokens=8, finish_reason="length"),
        RequestSample(start_s=t0 + 2, e2e_s=0.1, fault="bad"),
        RequestSample(start_s=t0 + 3, e2e_s=0.1, fault="bad", error="expected HTTP 400 with an error, got HTTP 200"),
        RequestSample(start_s=t0 + 4, e2e_s=0.2, fault="disconnect"),
        RequestSample(start_s=t0 + 9, e2e_s=20.0, error="ReadTimeout"),  # in flight at the kill
        RequestSample(start_s=t0 + 30, e2e_s=1.0, output_tokens=8, finish_reason="length"),
    ]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"kind": "request", **s.to_json()}) + "\n" for s in samples))
    monitor = types.SimpleNamespace(
        kill_s=t0 + 10,
        load_start_s=t0,
        served_again_s=t0 + 31.5,
        aborted_before_kill=3.0,
        warmup_fraction=0.25,
        rss=[(t0 + i, 100 + (i >= 5) * 2) for i in range(10)],
    )
    after = {
        "lmforge_kv_cache_usage_ratio": 0.0,
        "lmforge_num_requests_running": 0.0,
        "lmforge_num_requests_waiting": 0.0,
        "lmforge_requests_aborted_total": 1.0,
    }
    events = [
        {"time_s": t0 + 10, "event": "model llm: 1 of its 1 Python backend stub process(es) exited; loading it again"}
    ]
    report = build_report(_args(), 60.0, path, monitor, after, {"metrics": {}}, events)
    assert report["requests"] == {"good": 3, "bad": 2, "disconnect": 1}
    assert report["good_failures_before_kill"] == 0
    assert report["good_requests_after_kill"] == 2 and report["good_failures_after_kill"] == 1
    assert report["bad_not_refused_with_400_before_kill"] == 1 and report["bad_failed_after_kill"] == 0
    assert report["disconnects_before_kill"] == 1 and report["requests_aborted_total_before_kill"] == 3.0
    assert report["requests_aborted_total_after_reload"] == 1.0
    assert report["rss"] == {"baseline_bytes": 100, "final_bytes": 102, "growth": 0.02}  # baseline at t0 + 2.5 s
    assert report["kill"]["served_again_after_s"] == 21.5 and "unload + load" in report["kill"]["recovered_by"]
    assert report["targets"] == {
        "good_failures_before_kill == 0": True,
        "bad requests all refused with 400": False,
        "rss growth <= 5%": True,
        "kv usage 0 after load": True,
        "served again after the kill": True,
    }
    assert not report["targets_met"]
    text = format_report(report)
    assert "served again after 21.5 s" in text and "bad requests all refused with 400: MISSED" in text


def test_case_targets_read_the_measured_figures():
    from bench.reliability_cases import case_targets

    results = {
        "huge_n": {"ratio": 1.6},
        "queued_disconnects": {"queued_aborted_within_s": 0.7, "mid_stream_aborted_within_s": None},
        "nonstream_disconnects": {"nonstream_aborted_within_s": 0.4},
        "kill2": {
            "in_flight_failed_within_s": [0.9, 1.4],
            "first_good_answer_after_kill_s": 3.0,
            "sent_after_kill_failed": 0,
        },
    }
    targets = case_targets(results)
    assert targets["good request beside the worst allowed one <= 2x alone"] is True
    assert targets["queued and mid-stream SSE disconnects aborted within 1 s"] is False  # one never counted
    assert targets["non-streaming disconnects aborted within 1 s"] is True
    assert targets["kill2: in-flight requests fail within 1 s"] is False
    assert targets["kill2: first good answer within 10 s"] is True
    assert targets["kill2: no request sent after the kill fails"] is True


def test_unknown_case_is_refused(capsys):
    from bench.reliability import run

    assert run(_args("--cases", "huge_n,nope", "--no-soak")) == 2
    assert "unknown ['nope']" in capsys.readouterr().err


class _StandInTriton(http.server.BaseHTTPRequestHandler):
    """``generate_stream`` answering one SSE event once ``barrier``'s parties are all in (concurrent requests)."""

    barrier: threading.Barrier
    bodies: list

    def do_POST(self):
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            self.send_error(500, "the warm-up requests were not concurrent")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"text_output": "x", "finish_reason": "length"}\n\n')

    def log_message(self, *args):
        pass


def test_a_stack_is_warm_on_every_instance_before_a_case_starts():
    """A kill case on a cold stack killed the stub in its first request (the C++ kernels building): every
    instance answers first, concurrent requests going to different instances."""
    from bench.reliability_cases import Stack

    handler = type("Handler", (_StandInTriton,), {"barrier": threading.Barrier(2, timeout=60), "bodies": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        stack = Stack.__new__(Stack)
        stack.server = types.SimpleNamespace(http_url=f"http://127.0.0.1:{server.server_address[1]}")
        stack.instances = 2
        assert stack.warm_up() >= 0
    finally:
        server.shutdown()
        server.server_close()
    assert len(handler.bodies) == 4 and all(b["stream"] for b in handler.bodies)
