"""The OpenAI-compatible frontend (deploy/openai/) in front of the real tritonserver,
driven by the official ``openai`` client (sync and async, streaming and not) and raw HTTP.

The session's Triton server (tests/conftest.py) serves the tiny random Llama as ``llm``; one
frontend process per session forwards to it over gRPC, with an API key.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests
from transformers import AutoTokenizer

from bench.loadtest import LoadTestConfig, run_loadtest
from bench.report import read_samples
from lmforge_cli import main
from tests.conftest import SHORT_LOAD

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="session")
def frontend(server, served_repo, start_frontend):
    """``python -m deploy.openai`` on a free port; yields its base URL."""
    with start_frontend(served_repo, server, "--models", "llm", "--api-key", API_KEY) as url:
        yield url


@pytest.fixture(scope="session")
def client(frontend):
    return openai.OpenAI(base_url=f"{frontend}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def async_client(frontend: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{frontend}/v1", api_key=API_KEY, max_retries=0, timeout=120)


async def greedy_chat_stream(aclient: openai.AsyncOpenAI, messages: list[dict], max_tokens: int) -> list:
    """The chunks of a greedy chat stream of exactly ``max_tokens`` tokens (EOS ignored), usage chunk last."""
    stream = await aclient.chat.completions.create(
        model="llm",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    return [chunk async for chunk in stream]


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def metric(server, name: str) -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    values = [
        float(v)
        for labels, v in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", text, re.M)
        if 'model="llm"' in labels
    ]
    assert values, f"metric {name} not exported"
    return sum(values)


def wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


def test_health_and_models(frontend, client):
    assert requests.get(f"{frontend}/health", timeout=10).status_code == 200  # no key needed
    models = client.models.list()
    assert [m.id for m in models.data] == ["llm"]


def test_a_stop_string_across_tokens_is_cut_whole_streamed_or_not(client, engine_text):
    """The served text ends before the stop string, as the engine's does: nothing of it was streamed first."""
    full, _ = engine_text(PROMPT, temperature=0, max_tokens=24, ignore_eos=True)
    stop = full[len(full) // 2 - 1 : len(full) // 2 + 2]
    expected, _ = engine_text(PROMPT, temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    assert expected == full[: full.index(stop)]
    whole = client.completions.create(model="llm", prompt=PROMPT, stop=[stop], **GREEDY).choices[0]
    assert (whole.text, whole.finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(model="llm", prompt=PROMPT, stop=[stop], stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_completions_greedy_equals_engine_with_exact_usage(client, engine_text, tokenizer):
    expected, num_tokens = engine_text(PROMPT, temperature=0, max_tokens=24, ignore_eos=True)
    out = client.completions.create(model="llm", prompt=PROMPT, **GREEDY)
    assert (
        out.object == "text_completion" and out.choices[0].text == expected and out.choices[0].finish_reason == "length"
    )
    prompt_tokens = len(tokenizer(PROMPT).input_ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        prompt_tokens,
        24,
        prompt_tokens + 24,
    )
    # a list of prompts (text and token ids): one choice each, usage summed
    other = tokenizer("Once upon a time").input_ids
    many = client.completions.create(model="llm", prompt=[PROMPT, "Once upon a time"], **GREEDY)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == expected
    assert many.usage.completion_tokens == 48
    ids = client.completions.create(model="llm", prompt=other, **GREEDY)
    assert (
        ids.choices[0].text
        == engine_text({"prompt_token_ids": other}, temperature=0, max_tokens=24, ignore_eos=True)[0]
    )
    assert ids.usage.prompt_tokens == len(other)


def test_completions_stream_with_usage_and_done(frontend, client, engine_text):
    expected, _ = engine_text(PROMPT, temperature=0, max_tokens=24, ignore_eos=True)
    chunks = list(
        client.completions.create(
            model="llm", prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    body = {"model": "llm", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with requests.post(
        f"{frontend}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, stream=True, timeout=60
    ) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]" and all(line.startswith(b"data: ") for line in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_chat_async_stream_and_not_equal_engine(frontend, engine_text, tokenizer):
    ids = chat_ids(tokenizer, MESSAGES)
    expected, _ = engine_text({"prompt_token_ids": ids}, temperature=0, max_tokens=16, ignore_eos=True)

    async def run():
        async with async_client(frontend) as aclient:
            return await asyncio.gather(
                aclient.chat.completions.create(
                    model="llm",
                    messages=MESSAGES,
                    max_completion_tokens=16,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                ),
                greedy_chat_stream(aclient, MESSAGES, 16),
            )

    whole, chunks = asyncio.run(run())
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 16)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 16


def test_n_2_stop_strings_and_logprobs(client, engine_text):
    expected, _ = engine_text(PROMPT, temperature=0, max_tokens=24, ignore_eos=True)
    greedy = client.completions.create(model="llm", prompt=PROMPT, n=2, **GREEDY)
    assert [c.index for c in greedy.choices] == [0, 1] and greedy.choices[0].text == greedy.choices[1].text == expected
    assert greedy.usage.completion_tokens == 48
    sampled = client.chat.completions.create(
        model="llm", messages=MESSAGES, n=2, seed=3, temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    again = client.chat.completions.create(
        model="llm", messages=MESSAGES, n=2, seed=3, temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    texts = [c.message.content for c in sampled.choices]
    assert texts[0] != texts[1] and texts == [c.message.content for c in again.choices]
    stop = expected[len(expected) // 3 : len(expected) // 3 + 4]
    cut = client.completions.create(model="llm", prompt=PROMPT, stop=[stop], **GREEDY)
    assert cut.choices[0].text == expected[: expected.index(stop)] and cut.choices[0].finish_reason == "stop"
    logprobs = client.completions.create(
        model="llm", prompt=PROMPT, logprobs=2, temperature=0, max_tokens=5, extra_body={"ignore_eos": True}
    )
    lp = logprobs.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        and "".join(lp.tokens) == logprobs.choices[0].text
    )
    assert all(
        max(top.values()) == token_lp for top, token_lp in zip(lp.top_logprobs, lp.token_logprobs)
    )  # greedy: the top token
    chat_lp = client.chat.completions.create(
        model="llm", messages=MESSAGES, logprobs=True, top_logprobs=3, temperature=0, max_tokens=4
    )
    content = chat_lp.choices[0].logprobs.content
    assert len(content) == chat_lp.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)


BAD_INPUTS = [
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "llm", "prompt": 42}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "llm"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "llm", "messages": []}, 400, "messages"),
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "best_of_luck": 1}, 400, "best_of_luck"),
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": "llm", "messages": MESSAGES, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": "llm", "prompt": "x" * (1 << 20)}, 400, "prompt"),
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", {"model": "gpt-5", "prompt": PROMPT}, 404, "model"),
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "min_tokens": 40, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"model": "llm", "prompt": ""}, 400, "prompt"),  # the engine's blank-prompt rule
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "logit_bias": {"\u00b2": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "logit_bias": {"7": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "n": 129}, 400, "n"),
    ("/v1/completions", {"model": "llm", "prompt": [PROMPT] * 10_000, "n": 2}, 400, "prompt"),  # by count
    ("/v1/completions", {"model": "llm", "prompt": [2**63]}, 400, "prompt"),
    ("/v1/completions", "", 400, None),
    ("/v1/chat/completions", "[1, 2]", 400, None),  # valid JSON, not an object
    (
        "/v1/chat/completions",
        {"model": "llm", "messages": MESSAGES, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
    ),
    ("/v1/completions", {"model": "llm", "prompt": PROMPT, "logprobs": 50}, 400, "logprobs"),
    (
        "/v1/chat/completions",
        {"model": "llm", "messages": [{"role": "user", "content": None}]},
        400,
        "messages.0.content",
    ),
]


@pytest.mark.parametrize(
    "route, body, status, param",
    BAD_INPUTS,
    ids=[
        "wrong-type",
        "prompt-type",
        "missing-messages",
        "empty-messages",
        "unknown-field",
        "max-tokens-beyond-context",
        "n-0",
        "negative-temperature",
        "1-MB-prompt",
        "invalid-json",
        "unknown-model",
        "min-tokens-over-max",
        "empty-prompt",
        "logit-bias-unicode-digit",
        "logit-bias-101",
        "stop-token-id-outside-vocabulary",
        "n-over-limit",
        "10000-prompts",
        "token-id-beyond-int64",
        "empty-body",
        "array-body",
        "chat-top-logprobs-over-limit",
        "completion-logprobs-over-limit",
        "null-user-content",
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(frontend, client, route, body, status, param):
    data = body if isinstance(body, str) else json.dumps(body)
    response = requests.post(
        f"{frontend}{route}",
        data=data,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (
        set(error) == {"message", "type", "param", "code"}
        and error["message"]
        and error["type"] == "invalid_request_error"
    )
    assert error["param"] == param or (param is not None and param in error["message"]), error
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def test_errors_say_what_the_client_sent_or_left_to_the_default(frontend):
    def post(route: str, data: str) -> dict:
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        response = requests.post(f"{frontend}{route}", data=data, headers=headers, timeout=60)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    nan = post(
        "/v1/chat/completions", '{"model": "llm", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    )
    assert nan["param"] == "temperature" and nan["message"] == "temperature: must be a finite number (got nan)"
    # no max_tokens: /v1/completions gives 16 (as OpenAI's legacy API), which 500 prompt tokens leave no room for
    default = post("/v1/completions", json.dumps({"model": "llm", "prompt": [5] * 500}))
    assert default["param"] == "max_tokens" and default["message"].endswith(
        "(500 in the prompt, 16 in the completion: the default max_tokens of /v1/completions); "
        "shorten the prompt or pass a smaller max_tokens"
    )


def test_api_key_is_required_on_v1_routes(frontend):
    for key in ("wrong", None):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        response = requests.get(f"{frontend}/v1/models", headers=headers, timeout=10)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{frontend}/v1", api_key="wrong", max_retries=0).completions.create(
            model="llm", prompt=PROMPT, max_tokens=2
        )


def test_locust_load_through_the_openai_api(frontend, tmp_path):
    config = LoadTestConfig(
        host=frontend, model="llm", api="openai", api_key=API_KEY, max_tokens=8, request_timeout_s=30.0, **SHORT_LOAD
    )
    summary = run_loadtest(config, tmp_path, log=lambda _m: None)
    samples, _ = read_samples(tmp_path / "samples.jsonl")
    assert len(samples) >= 2 and all(s.ok for s in samples), summary["metrics"]["errors"]
    for s in samples:  # token counts come from the final chunk's usage
        assert 0 < s.ttft_s <= s.e2e_s and s.output_tokens == 8 and s.input_tokens > 0 and s.finish_reason == "length"
        # the frontend merges tokens that are ready together, so a stream has 1 to 8 text chunks
        assert len(s.itl_s) <= 7 and all(gap >= 0 for gap in s.itl_s)
    assert any(s.itl_s for s in samples)
    assert summary["server"] == {"unreachable_during_run": None, "ready_after_run": True}


def test_serving_comparison_report_over_triton_and_the_frontend(frontend, server, tmp_path):
    assert (
        main(
            [
                "bench",
                "serving",
                "--endpoint",
                f"name=triton,api=triton,url={server.http_url},model=llm",
                "--endpoint",
                f"name=openai,api=openai,url={frontend},model=llm,endpoint=completions,key={API_KEY}",
                "--users",
                "1",
                "2",
                "--run-time",
                "2s",
                "--max-tokens",
                "6",
                "--num-prompts",
                "8",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "serving.json").read_text())
    assert [(r["endpoint"], r["users"]) for r in report["rows"]] == [
        ("triton", 1),
        ("openai", 1),
        ("triton", 2),
        ("openai", 2),
    ]
    assert all(
        r["failed"] == 0 and r["requests"] >= 1 and r["output_tok_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
        for r in report["rows"]
    )
    assert all(r["goodput_tok_s"] <= r["output_tok_s"] + 1e-9 for r in report["rows"])
    assert all(
        (tmp_path / name).stat().st_size > 0
        for name in ("serving.md", "throughput_vs_users.png", "ttft_p99_vs_users.png")
    )
    assert report["endpoints"][1]["key"] is None  # the key is not written to the report


#: Streams a chat completion, reads three SSE events, then exits (closing its connection).
_DISCONNECTING_CLIENT = r"""
import sys, urllib.request
url, body, key = sys.argv[1:4]
request = urllib.request.Request(url, data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
with urllib.request.urlopen(request, timeout=60) as response:
    events = 0
    for line in response:
        events += line.startswith(b"data: ") and b'"top_logprobs"' in line  # token events: the engine runs it
        if events == 3:
            break
"""


def test_disconnect_mid_stream_cancels_the_triton_request(frontend, server, client, tokenizer):
    aborted_before = (
        metric(server, "lmforge_requests_aborted_total")
        if "lmforge_requests_aborted_total{" in requests.get(server.metrics_url, timeout=10).text
        else 0.0
    )
    longest = 512 - len(chat_ids(tokenizer, MESSAGES))  # the whole context: a window of seconds
    body = {
        "model": "llm",
        "messages": MESSAGES,
        "max_tokens": longest,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        # four completions with 20 log-probabilities per token keep the stream busy for seconds
        # even on a fast machine, so the disconnect lands while the request still runs
        "n": 4,
        "logprobs": True,
        "top_logprobs": 20,
    }
    # The client runs in its own process and exits after a few events, so its socket really
    # closes (locust, imported by other tests of this session, monkey-patches sockets here).
    subprocess.run(
        [sys.executable, "-c", _DISCONNECTING_CLIENT, f"{frontend}/v1/chat/completions", json.dumps(body), API_KEY],
        check=True,
        timeout=60,
    )
    closed = time.monotonic()
    # the abort counter first: the gauges are published by a stats thread and may still show the
    # moment before the request started, when nothing ran either
    assert wait_for(lambda: metric(server, "lmforge_requests_aborted_total") >= aborted_before + 1)
    assert wait_for(
        lambda: (
            metric(server, "lmforge_num_requests_running") == 0
            and metric(server, "lmforge_kv_cache_usage_ratio") == 0.0
        )
    )
    freed_s = time.monotonic() - closed
    print(f"KV blocks back in the pool {freed_s * 1000:.0f} ms after the client disconnected")
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def test_chat_streams_under_load_equal_the_engine_with_every_token_and_cached_tokens(frontend, engine_text, tokenizer):
    """8 concurrent chat streams sharing a system prompt: each one's deltas add up to the in-process
    engine's greedy text (an event may carry several steps when a reader fell behind), usage counts
    every token, and ``prompt_tokens_details.cached_tokens`` reports the prefix-cache hits."""
    system = {"role": "system", "content": "You answer in one short sentence about colours and animals. " * 3}
    conversations = [
        [system, {"role": "user", "content": f"Question {i}: name a {w}."}] for i, w in enumerate("abcdefgh")
    ]
    all_ids = [chat_ids(tokenizer, c) for c in conversations]
    expected = engine_text(
        [{"prompt_token_ids": ids} for ids in all_ids], temperature=0, max_tokens=24, ignore_eos=True
    )

    async def run():
        async with async_client(frontend) as aclient:
            await greedy_chat_stream(aclient, conversations[0], 24)  # fills the prefix cache with the system prompt
            return await asyncio.gather(*(greedy_chat_stream(aclient, c, 24) for c in conversations))

    common = min(next((i for i, (x, y) in enumerate(zip(all_ids[0], ids)) if x != y), len(ids)) for ids in all_ids[1:])
    for ids, (text, _), chunks in zip(all_ids, expected, asyncio.run(run())):
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        usage = chunks[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 24)
        # the shared prefix's full blocks at least (a partial block may be copied too), never the last token
        assert 0 < common // 16 * 16 <= usage.prompt_tokens_details.cached_tokens < len(ids)


_LEAVING_CLIENT = r"""
import socket, sys, time
host, port, body, key = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), sys.argv[4]
sock = socket.create_connection((host, port), timeout=60)
head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n")
sock.sendall(head.encode() + body)
sys.stdin.readline()  # the test says when: the request runs in the engine, its answer is not ready
sock.close()
"""


def test_a_non_streaming_client_that_leaves_gets_its_request_aborted(frontend, server, client, tokenizer):
    # an earlier test's request still winding down would read as this one running: start from an idle engine
    assert wait_for(lambda: metric(server, "lmforge_num_requests_running") == 0)
    aborted_before = (
        metric(server, "lmforge_requests_aborted_total")
        if "lmforge_requests_aborted_total{" in requests.get(server.metrics_url, timeout=10).text
        else 0.0
    )
    ids = tokenizer(PROMPT).input_ids
    body = {"model": "llm", "prompt": PROMPT, "max_tokens": 512 - len(ids), "ignore_eos": True, "n": 4}
    host, port = frontend.removeprefix("http://").split(":")
    command = [sys.executable, "-c", _LEAVING_CLIENT, host, port, json.dumps(body), API_KEY]
    with subprocess.Popen(command, stdin=subprocess.PIPE, text=True) as leaving:
        running = wait_for(lambda: metric(server, "lmforge_num_requests_running") >= 1)
        leaving.communicate("\n", timeout=60)  # the client closes its socket
    assert running and leaving.returncode == 0
    assert wait_for(lambda: metric(server, "lmforge_requests_aborted_total") >= aborted_before + 1)
    assert wait_for(lambda: metric(server, "lmforge_num_requests_running") == 0)
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
