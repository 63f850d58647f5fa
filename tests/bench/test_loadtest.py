"""Load-test metrics on known samples, prompt loading, bad input, and Locust against real Triton."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
import requests

from bench.harness import percentiles
from bench.loadtest import (
    LoadTestConfig,
    LoadTestError,
    _child_command,
    add_arguments,
    check_host,
    config_from_args,
    parse_duration,
    preflight,
    run_loadtest,
)
from bench.metrics import (
    LoadStep,
    RequestSample,
    goodput,
    latency_by_concurrency,
    step_summaries,
    summarize,
    throughput_timeline,
)
from bench.prompts import PromptError, held_out_dialog_prompts, load_prompts, render_chat, with_system_prompt
from bench.protocol import StreamError, StreamResult, openai_payload, parse_sse_line, read_openai_stream, read_stream
from bench.report import PLOT_FILES, read_samples
from bench.serving_compare import Endpoint, goodput_tok_s
from deploy.export import export
from deploy.triton import TritonServer, free_ports
from tests.fakes.json_http import JSONHandler


def _sample(start, ttft, itls, tokens, error=None, concurrency=1):
    e2e = ttft + sum(itls)
    return RequestSample(
        start_s=start,
        e2e_s=e2e,
        ttft_s=ttft,
        itl_s=list(itls),
        input_tokens=10,
        output_tokens=tokens,
        finish_reason="length",
        error=error,
        concurrency=concurrency,
    )


def test_percentiles_are_exact_on_known_values():
    values = np.arange(1, 101, dtype=float)  # 1..100
    assert percentiles(values) == {"p50": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_summarize_follows_genai_perf_and_vllm_definitions():
    samples = [
        _sample(100.0, 0.2, [0.1, 0.1, 0.1], 4),  # e2e 0.5, tpot (0.5-0.2)/3 = 0.1
        _sample(100.5, 0.4, [0.3], 2),  # e2e 0.7, tpot 0.3
        _sample(101.0, 0.1, [], 1),  # one token: no ITL, no TPOT
        RequestSample(start_s=101.5, e2e_s=0.5, error="HTTP 400: bad", output_tokens=0),
    ]
    s = summarize(samples)
    assert s["requests"] == 4 and s["successful"] == 3 and s["failed"] == 1
    assert s["duration_s"] == pytest.approx(2.0)  # 100.0 -> 102.0 (failed request ends last)
    assert s["total_output_tokens"] == 7
    assert s["output_throughput_tok_s"] == pytest.approx(3.5)
    assert s["request_throughput_req_s"] == pytest.approx(1.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["max"] == pytest.approx(400.0)
    assert s["itl_ms"]["mean"] == pytest.approx(150.0)  # pooled gaps 0.1, 0.1, 0.1, 0.3
    assert s["tpot_ms"]["p50"] == pytest.approx(200.0)  # median of 100 and 300
    assert s["e2e_ms"]["p50"] == pytest.approx(500.0)
    assert s["errors"] == {"HTTP 400: bad": 1}


def test_tpot_is_undefined_for_single_token_or_no_ttft():
    assert _sample(0, 0.1, [], 1).tpot_s is None
    assert RequestSample(start_s=0, e2e_s=1.0, output_tokens=5).tpot_s is None
    assert _sample(0, 0.1, [0.2, 0.2], 3).tpot_s == pytest.approx(0.2)


def test_throughput_timeline_conserves_tokens():
    samples = [_sample(10.0, 0.5, [0.5] * 5, 6), _sample(11.0, 0.2, [0.6] * 4, 5)]
    t, rate = throughput_timeline(samples, bin_s=1.0)
    assert t[0] == 0.0 and len(t) == len(rate)
    assert rate.sum() * 1.0 == pytest.approx(11.0)
    with pytest.raises(ValueError, match="bin_s"):
        throughput_timeline(samples, bin_s=0)


def test_latency_by_concurrency_groups_levels():
    samples = [
        _sample(0, 0.1, [0.1], 2, concurrency=1),
        _sample(1, 0.3, [0.1], 2, concurrency=2),
        _sample(2, 0.5, [0.1], 2, concurrency=2),
    ]
    rows = latency_by_concurrency(samples)
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert rows[1]["requests"] == 2 and rows[1]["ttft_ms"]["p50"] == pytest.approx(400.0)


def test_goodput_is_best_step_within_the_bound():
    fast = [_sample(0.0 + i, 0.1, [0.1] * 9, 10) for i in range(5)]
    faster = [_sample(10.0 + i / 2, 0.2, [0.1] * 9, 10) for i in range(10)]
    slow = [_sample(20.0 + i / 4, 2.0, [0.1] * 9, 10) for i in range(20)]
    steps = [LoadStep(1, 0.0, 10.0), LoadStep(3, 10.0, 20.0), LoadStep(5, 20.0, 30.0)]
    rows = step_summaries(fast + faster + slow, steps, ttft_p90_bound_ms=500.0)
    assert [r["meets_slo"] for r in rows] == [True, True, False]
    assert [r["requests"] for r in rows] == [5, 10, 20]
    best = goodput(rows)
    assert best["users"] == 3 and best["output_throughput_tok_s"] == pytest.approx(10.0)
    assert goodput(rows[2:]) is None


def test_prompts_from_jsonl_and_held_out_dialogs(tmp_path):
    path = tmp_path / "p.jsonl"
    records = [
        {"prompt": "a"},
        {"text": "b"},
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"},
            ]
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert load_prompts(path) == ["a", "b", "c"]
    assert load_prompts(path, limit=2) == ["a", "b"]
    assert with_system_prompt(["x"], "SYS") == ["SYS\n\nx"]
    held_out = held_out_dialog_prompts()
    assert len(held_out) >= 20 and all(p.strip() for p in held_out)
    assert held_out == held_out_dialog_prompts()  # stable choice


def test_chat_template_renders_system_and_user_turns(tiny_llama_dir):
    (text,) = render_chat(["hi there"], str(tiny_llama_dir), system_prompt="Be brief.")
    assert text.index("Be brief.") < text.index("hi there")
    assert text.rstrip().endswith("assistant")  # the generation prompt opens the assistant turn


def test_bad_prompt_files_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:2"):
        load_prompts(bad)
    bad.write_text('{"prompt": "ok"}\n{"other": 1}\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:2: expected"):
        load_prompts(bad)
    with pytest.raises(PromptError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")


def _response(body: bytes, status: int = 200):
    response = requests.Response()
    response.status_code, response.raw = status, io.BytesIO(body)
    return response


def test_sse_stream_parsing_and_errors_inside_the_stream():
    assert parse_sse_line(b'data: {"text_output": "a"}') == {"text_output": "a"}
    assert parse_sse_line(b"") is None and parse_sse_line(b": keep-alive") is None
    with pytest.raises(ValueError):
        parse_sse_line(b"data: [1, 2]")
    events = [
        {"text_output": "Hel", "num_input_tokens": 3, "num_output_tokens": 1},
        {"text_output": "", "num_output_tokens": 1},
        {"text_output": "lo", "num_output_tokens": 2, "finish_reason": "length"},
    ]
    result = StreamResult()
    read_stream(_response(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)), result)
    assert (result.text, result.input_tokens, result.output_tokens, result.finish_reason) == ("Hello", 3, 2, "length")
    assert len(result.chunk_times) == 2  # the empty event carries no text
    partial = StreamResult()
    with pytest.raises(StreamError, match="server error: boom"):
        read_stream(_response(b'data: {"text_output": "x"}\n\ndata: {"error": "boom"}\n\n'), partial)
    assert partial.text == "x"  # what came before the error is kept
    with pytest.raises(StreamError, match="without a final event"):
        read_stream(_response(b'data: {"text_output": "x"}\n\n'), StreamResult())


def test_openai_sse_parsing_usage_and_done():
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
    ]
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    result = StreamResult()
    read_openai_stream(_response(body), result)
    assert (result.text, result.input_tokens, result.output_tokens, result.finish_reason) == ("Hello", 5, 2, "length")
    assert len(result.chunk_times) == 2  # the role-only chunk carries no text
    completions = b'data: {"choices": [{"index": 0, "text": "ab", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
    read_openai_stream(_response(completions), other := StreamResult())
    assert other.text == "ab" and other.finish_reason == "stop"
    with pytest.raises(StreamError, match="DONE"):
        read_openai_stream(
            _response(b'data: {"choices": [{"index": 0, "text": "x", "finish_reason": null}]}\n\n'), StreamResult()
        )
    with pytest.raises(StreamError, match="server error"):
        read_openai_stream(_response(b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'), StreamResult())
    payload = openai_payload(
        "hi", {"max_tokens": 4, "temperature": 0, "ignore_eos": True}, model="m", endpoint="chat", stream=True
    )
    assert payload["messages"] == [{"role": "user", "content": "hi"}] and payload["stream_options"] == {
        "include_usage": True
    }
    assert payload["ignore_eos"] is True and payload["max_tokens"] == 4
    assert "prompt" in openai_payload("hi", {"max_tokens": 4}, model="m", endpoint="completions", stream=False)


def test_serving_comparison_endpoint_specs_and_goodput():
    ep = Endpoint.parse("name=ours,api=openai,url=http://127.0.0.1:9000,model=m,endpoint=completions")
    assert (ep.name, ep.api, ep.url, ep.model, ep.endpoint) == (
        "ours",
        "openai",
        "http://127.0.0.1:9000",
        "m",
        "completions",
    )
    for bad, message in (
        ("name=a,api=x,url=u,model=m", "api='x'"),
        ("name=a,url=u", "missing api, model"),
        ("name=a,colour=red", "colour"),
    ):
        with pytest.raises(ValueError, match=message):
            Endpoint.parse(bad)
    samples = [_sample(0, 0.1, [0.1], 2), _sample(0, 3.0, [0.1], 5), _sample(0, 0.2, [], 1, error="boom")]
    assert goodput_tok_s(samples, bound_ms=1000.0, duration_s=2.0) == pytest.approx(
        1.0
    )  # only the first request counts


def test_the_caller_never_imports_locust():
    """Locust monkey-patches the standard library with gevent; it stays in the child process."""
    code = (
        "import sys, bench.loadtest, bench.demo, bench.report; print('locust' in sys.modules, 'gevent' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_durations_and_hosts():
    assert parse_duration("60s") == 60 and parse_duration("2m") == 120 and parse_duration("1m30s") == 90
    assert parse_duration("45") == 45 and parse_duration("1h") == 3600
    with pytest.raises(LoadTestError, match="not a duration"):
        parse_duration("soon")
    assert check_host("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    for host in ("http://example.com:8000", "https://127.0.0.1:8000", "http://127.0.0.1", "http://0.0.0.0:80"):
        with pytest.raises(LoadTestError, match="127.0.0.1"):
            check_host(host)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_input_fails_before_the_run():
    host = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(LoadTestError, match="cannot reach a Triton server"):
        preflight(LoadTestConfig(host=host, model="m"))
    with pytest.raises(LoadTestError, match="users=0") as refused:
        preflight(LoadTestConfig(host=host, model="m", users=0))
    assert refused.value.exit_code == 2  # a flag to change: a usage error
    with pytest.raises(LoadTestError, match="max_tokens"):
        preflight(LoadTestConfig(host=host, model="m", max_tokens=0))
    with pytest.raises(LoadTestError, match="max_users"):
        preflight(LoadTestConfig(host=host, model="m", users=4, shape="steps", max_users=2))
    with pytest.raises(LoadTestError, match="cannot reach an OpenAI-compatible server"):
        preflight(LoadTestConfig(host=host, model="m", api="openai"))
    with pytest.raises(LoadTestError, match="endpoint='generate'"):
        preflight(LoadTestConfig(host=host, model="m", api="openai", endpoint="generate"))


def _loadtest_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--host", "http://127.0.0.1:9000", "--model", "m", *argv])


# The Locust child (its own process: Locust patches the standard library) parses its command
# line and prints the body of its first request.
_CHILD_BODY = """
import json, sys
from bench.locust_runner import build_parser
from bench.locustfile import config_from_options
config = config_from_options(build_parser().parse_args(sys.argv[1:]))
print(json.dumps(config.payload(config.prompts[0])))
"""


def test_response_format_flag_reaches_every_locust_request(tmp_path):
    schema = {
        "type": "json_schema",
        "json_schema": {
            "name": "p",
            "strict": True,
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
    inline = config_from_args(_loadtest_args("--api", "openai", "--response-format", json.dumps(schema)))
    assert inline.response_format == schema and inline.api == "openai" and inline.endpoint == "chat"
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema), encoding="utf-8")
    config = config_from_args(_loadtest_args("--api", "openai", "--response-format", f"@{schema_file}"))
    assert config.response_format == schema
    assert config_from_args(_loadtest_args()).response_format is None

    command = _child_command(config, tmp_path)
    flag = command.index("--response-format")
    assert json.loads(command[flag + 1]) == schema
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Who are you?"}) + "\n", encoding="utf-8")
    child = subprocess.run(
        [sys.executable, "-c", _CHILD_BODY, *command[3:]], capture_output=True, text=True, timeout=120, check=True
    )
    body = json.loads(child.stdout.strip().splitlines()[-1])
    assert body["response_format"] == schema and body["messages"] == [{"role": "user", "content": "Who are you?"}]


def test_bad_response_format_names_the_flag(tmp_path):
    for bad, reason in (
        ('{"type": "json_schema",', "not valid JSON"),
        ("[1, 2]", "JSON object with a"),
        ('{"type": "xml"}', "JSON object with a"),
        ('{"type": "json_schema"}', 'needs a "json_schema" object'),
        (f"@{tmp_path / 'missing.json'}", "cannot read it"),
    ):
        with pytest.raises(LoadTestError, match=reason) as refused:
            config_from_args(_loadtest_args("--api", "openai", "--response-format", bad))
        assert "--response-format" in str(refused.value) and refused.value.exit_code == 2
    triton = config_from_args(_loadtest_args("--response-format", '{"type": "json_object"}'))
    with pytest.raises(LoadTestError, match="--response-format .* add --api openai") as refused:
        triton.validate()
    assert refused.value.exit_code == 2


def test_samples_file_tolerates_a_cut_last_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    good = json.dumps({"kind": "request", **_sample(0, 0.1, [0.1], 2).to_json()})
    path.write_text(good + "\n" + json.dumps({"kind": "step", "users": 2, "start_s": 1.0}) + "\n" + good[:30])
    samples, records = read_samples(path)
    assert len(samples) == 1 and records == [{"kind": "step", "users": 2, "start_s": 1.0}]


# --------------------------------------------------------------------------------------------
# Against the real Triton server (the tiny random Llama, exported and served once per module)
# --------------------------------------------------------------------------------------------

ENGINE_CONFIG = {"max_model_len": 256, "max_num_seqs": 16, "block_size": 16, "num_kv_blocks": 256, "num_threads": 1}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def triton(tiny_llama_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("loadtest_repo")
    export(tiny_llama_dir, repo, name="llm", engine=ENGINE_CONFIG)
    http, grpc, metrics = free_ports(3)
    with TritonServer(repo, http, grpc, metrics, models=["llm"], startup_timeout_s=600) as server:
        yield server


def _config(server, **changes) -> LoadTestConfig:
    base = dict(
        host=server.http_url,
        model="llm",
        users=2,
        spawn_rate=2.0,
        run_time_s=4.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        num_prompts=8,
        request_timeout_s=30.0,
    )
    return LoadTestConfig(**{**base, **changes})


@pytest.mark.integration
def test_locust_streams_from_triton_with_plausible_metrics(triton, tmp_path):
    summary = run_loadtest(_config(triton), tmp_path, log=lambda _m: None)
    samples, _ = read_samples(tmp_path / "samples.jsonl")
    assert len(samples) >= 2 and all(s.ok for s in samples), summary["metrics"]["errors"]
    for s in samples:
        assert 0 < s.ttft_s <= s.e2e_s
        assert s.output_tokens == MAX_TOKENS and s.input_tokens > 0 and s.finish_reason == "length"
        # a response can carry several tokens (the backend sends what the engine made since its last send)
        assert len(s.itl_s) <= MAX_TOKENS - 1 and all(gap > 0 for gap in s.itl_s)
    assert any(s.itl_s for s in samples)
    m = summary["metrics"]
    assert m["failed"] == 0 and m["output_throughput_tok_s"] > 0
    assert m["ttft_ms"]["p50"] <= m["e2e_ms"]["p50"] and m["itl_ms"]["p50"] > 0
    assert summary["server"] == {"unreachable_during_run": None, "ready_after_run": True}
    for name in (
        "summary.json",
        "samples.jsonl",
        "locust_stats.csv",
        "locust_stats_history.csv",
        "locust_failures.csv",
        "locust_exceptions.csv",
        *PLOT_FILES,
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    with (tmp_path / "locust_stats.csv").open() as handle:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(handle)}
    assert int(rows[("POST", "generate_stream")]["Request Count"]) >= len(samples)
    assert int(rows[("TTFT", "generate_stream")]["Request Count"]) >= len(samples)


@pytest.mark.integration
def test_non_streaming_endpoint_measures_end_to_end(triton, tmp_path):
    summary = run_loadtest(_config(triton, endpoint="generate", run_time_s=3.0), tmp_path, log=lambda _m: None)
    samples, _ = read_samples(tmp_path / "samples.jsonl")
    assert samples and all(s.ok and s.ttft_s is None and s.e2e_s > 0 for s in samples)
    assert all(s.output_tokens == MAX_TOKENS for s in samples)
    assert summary["metrics"]["ttft_ms"]["p50"] is None and summary["metrics"]["e2e_ms"]["p50"] > 0


@pytest.mark.integration
def test_step_shape_reports_goodput(triton, tmp_path):
    config = _config(
        triton,
        users=1,
        shape="steps",
        step_users=1,
        step_s=2.5,
        max_users=2,
        ttft_p90_bound_ms=60_000.0,
        run_time_s=20.0,
    )
    summary = run_loadtest(config, tmp_path, log=lambda _m: None)
    assert [row["users"] for row in summary["steps"]] == [1, 2]
    assert all(row["meets_slo"] for row in summary["steps"])
    assert summary["goodput"]["output_throughput_tok_s"] > 0
    assert "limit" in summary["stop_reason"]


@pytest.mark.integration
def test_unknown_model_is_refused_before_the_run(triton):
    with pytest.raises(LoadTestError, match=r"'nope' is not ready.*llm"):
        preflight(_config(triton, model="nope"))


@pytest.mark.integration
def test_server_that_dies_mid_run_keeps_the_measurements(triton, tmp_path):
    """Last in this module: it stops the module's server."""
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            summary=run_loadtest(_config(triton, run_time_s=60.0), tmp_path, log=lambda _m: None)
        )
    )
    started = time.monotonic()
    worker.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(read_samples(tmp_path / "samples.jsonl")[0]) < 3:
        time.sleep(0.2)
    triton.stop()
    worker.join(timeout=120)
    assert not worker.is_alive()
    summary = result["summary"]
    assert summary["metrics"]["successful"] >= 3
    assert summary["server"]["ready_after_run"] is False
    assert any("stopped answering" in note for note in summary["notes"])
    assert time.monotonic() - started < 60  # ended early, not at the 60 s run time


class _KeyedTriton(JSONHandler):
    """Triton's HTTP API for model ``m`` as ``lmforge serve --api-key k`` restricts it: health open, every other
    API 403 without ``authorization: Bearer k``; ``/generate`` answers one token. Records each POST's header."""

    seen: list = []

    def do_GET(self) -> None:
        self.send_json(200 if self.path in ("/v2/health/ready", "/v2/models/m/ready") else 404, {})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append(self.headers.get("authorization"))
        if self.headers.get("authorization") != "Bearer k":
            self.send_json(403, {"error": "This API is restricted, expecting header 'authorization'"})
        elif self.path == "/v2/models/m/generate":
            self.send_json(
                200, {"text_output": "hi", "finish_reason": "length", "num_input_tokens": 3, "num_output_tokens": 1}
            )
        else:
            self.send_json(404, {"error": f"no {self.path}"})


@pytest.fixture
def keyed_triton():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeyedTriton)
    _KeyedTriton.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_api_key_reaches_a_key_protected_triton_and_a_refused_run_writes_nothing(keyed_triton, tmp_path):
    config = LoadTestConfig(
        host=keyed_triton, model="m", endpoint="generate", users=1, run_time_s=1.0, max_tokens=1, warmup_requests=1
    )
    out = tmp_path / "reports" / "lt"
    with pytest.raises(LoadTestError, match=r"HTTP 403.*the server wants an API key: pass --api-key KEY"):
        run_loadtest(config, out, log=lambda _: None)
    with pytest.raises(LoadTestError, match=r"HTTP 403.*check --api-key"):
        run_loadtest(dataclasses.replace(config, api_key="wrong"), out, log=lambda _: None)
    assert not (tmp_path / "reports").exists()  # the warm-up failed before anything was written

    _KeyedTriton.seen = []
    summary = run_loadtest(dataclasses.replace(config, api_key="k"), out, log=lambda _: None)
    assert summary["metrics"]["successful"] >= 1 and summary["metrics"]["failed"] == 0
    assert len(_KeyedTriton.seen) >= 2 and set(_KeyedTriton.seen) == {"Bearer k"}  # warm-up and Locust's requests
    assert (out / "prompts.jsonl").is_file()
