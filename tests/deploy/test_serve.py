"""Serving on the real Triton Inference Server 2.51 (bundled with nvidia-pytriton): HTTP, SSE,
gRPC streaming, concurrency, bad input, client disconnects, the encoder, config checks.

A session fixture exports the tiny random Llama (``llm``) and MiniLM (``minilm``) into a
temporary repository and starts one server on free ports of 127.0.0.1 for all tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import psutil
import pytest
import requests
import torch
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from compress.quantize.onnx import mean_pool
from deploy.export import export
from deploy.model_config import check_repository
from deploy.serve import OPENAI_LOG_FILE, stop_openai_from_pid_file
from deploy.triton import (
    SHM_DIR,
    ModelSupervisor,
    PortsBusyError,
    TritonError,
    TritonServer,
    free_ports,
    stop_from_pid_file,
)
from engine import LLM, SamplingParams
from engine.errors import UsageError

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
SENTENCES = [
    "A man is playing a guitar.",
    "The weather is lovely today.",
    "Quantization makes models smaller.",
    "Triton serves models.",
]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def generate(server, prompt: str, params: dict, **extra) -> requests.Response:
    body = {"text_input": prompt, "sampling_parameters": json.dumps(params), **extra}
    return requests.post(f"{server.http_url}/v2/models/llm/generate", json=body, timeout=120)


def is_heartbeat(event: dict) -> bool:
    """The model's keep-alive response of a quiet stream (``deploy.triton_llm.heartbeat_tensors``)."""
    return event.get("text_output") == "" and not event.get("output_token_ids") and "finish_reason" not in event


def generate_stream(server, prompt: str, params: dict, **extra) -> list[dict]:
    """POST generate_stream and return the SSE events (parsed JSON), heartbeats left out."""
    body = {"text_input": prompt, "sampling_parameters": json.dumps(params), "stream": True, **extra}
    events = []
    with requests.post(
        f"{server.http_url}/v2/models/llm/generate_stream", json=body, stream=True, timeout=120
    ) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: ") :]))
    return [e for e in events if not is_heartbeat(e)]


def metric_values(server, name: str, model: str = "llm") -> list[float]:
    """Values of a Prometheus metric of ``model`` (one per label set)."""
    return [value for _, value in _labelled(server, name, model)]


def _labelled(server, name: str, model: str = "llm") -> list[tuple[str, float]]:
    text = requests.get(server.metrics_url, timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", re.M)
    return [(labels, float(value)) for labels, value in pattern.findall(text) if f'model="{model}"' in labels]


def metric(server, name: str) -> float:
    values = metric_values(server, name)
    assert values, f"metric {name} not exported"
    return sum(values)


def wait_for(condition, timeout_s: float = 30.0, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    return condition()


# --------------------------------------------------------------------------------------------
# health, repository
# --------------------------------------------------------------------------------------------


def test_health_model_ready_and_repository_index(server):
    assert requests.get(f"{server.http_url}/v2/health/live", timeout=5).status_code == 200
    assert requests.get(f"{server.http_url}/v2/health/ready", timeout=5).status_code == 200
    for name in ("llm", "minilm"):
        assert requests.get(f"{server.http_url}/v2/models/{name}/ready", timeout=5).status_code == 200
    index = {e["name"]: e for e in server.repository_index()}
    assert index["llm"]["state"] == "READY" and index["minilm"]["state"] == "READY"
    assert {"minilm_onnx", "minilm_tokenizer", "minilm_ensemble"} <= set(index)  # present, not loaded
    config = requests.get(f"{server.http_url}/v2/models/llm/config", timeout=5).json()
    assert config["model_transaction_policy"]["decoupled"] is True


# --------------------------------------------------------------------------------------------
# generation over HTTP and gRPC
# --------------------------------------------------------------------------------------------


def test_generate_matches_in_process_engine(server, engine_text):
    expected, num_tokens = engine_text(PROMPT, **GREEDY)
    response = generate(server, PROMPT, GREEDY, exclude_input_in_output=True)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["text_output"] == expected
    assert body["finish_reason"] == "length" and body["num_output_tokens"] == num_tokens == GREEDY["max_tokens"]
    assert body["num_input_tokens"] > 0
    with_prompt = generate(server, PROMPT, GREEDY).json()  # exclude_input_in_output defaults to false
    assert with_prompt["text_output"] == PROMPT + expected


def test_generate_stream_sse_matches_in_process_engine(server, engine_text):
    expected, num_tokens = engine_text(PROMPT, **GREEDY)
    events = generate_stream(server, PROMPT, GREEDY)
    assert len(events) > 1  # streamed: several responses, not one
    assert "".join(e["text_output"] for e in events) == expected
    assert events[-1]["finish_reason"] == "length" and events[-1]["num_output_tokens"] == num_tokens
    assert all("finish_reason" not in e for e in events[:-1])


def _stream_inputs(prompt: str, sampling: dict) -> list:
    """The gRPC inputs of one streamed request to the ``llm`` model."""
    inputs = [
        grpcclient.InferInput("text_input", [1], "BYTES"),
        grpcclient.InferInput("stream", [1], "BOOL"),
        grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
    ]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    inputs[1].set_data_from_numpy(np.array([True]))
    inputs[2].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))
    return inputs


def test_grpc_stream_ends_with_final_flag(server, engine_text):
    expected, _ = engine_text(PROMPT, **GREEDY)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = _stream_inputs(PROMPT, GREEDY)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("llm", inputs, request_id="grpc-1", enable_empty_final_response=True)
        pieces, final = [], False
        deadline = time.monotonic() + 60
        while not final and time.monotonic() < deadline:
            result, error = results.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            text = result.as_numpy("text_output")
            if text is not None:
                pieces.append(text[0].decode())
        assert final and "".join(pieces) == expected
    finally:
        client.stop_stream()
        client.close()


def test_token_id_prompt_with_n_2_streams_both_completions(server, engine_text, tiny_llama_dir):
    expected, _ = engine_text(PROMPT, **GREEDY)
    ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(PROMPT).input_ids
    body = {
        "prompt_token_ids": ids,
        "stream": True,
        "sampling_parameters": json.dumps({**GREEDY, "n": 2, "logprobs": 1}),
    }
    events = []
    with requests.post(
        f"{server.http_url}/v2/models/llm/generate_stream", json=body, stream=True, timeout=120
    ) as response:
        assert response.status_code == 200, response.text
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith(b"data: ")]
        events = [e for e in events if not is_heartbeat(e)]
    for index in (0, 1):
        mine = [e for e in events if e["index"] == index]
        assert "".join(e["text_output"] for e in mine) == expected
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["num_output_tokens"] == GREEDY["max_tokens"]
        assert sum(len(json.loads(e["logprobs"])) for e in mine) == GREEDY["max_tokens"]
        assert all(e["num_input_tokens"] == len(ids) for e in mine)


def test_16_concurrent_streams_complete_and_are_batched(server, engine_text):
    prompts = [f"Request number {i} says" for i in range(16)]
    params = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
    with ThreadPoolExecutor(16) as pool:
        all_events = list(pool.map(lambda p: generate_stream(server, p, params), prompts))
    for (expected, _), events in zip(engine_text(prompts, **params), all_events):
        assert events[-1]["finish_reason"] == "length" and events[-1]["num_output_tokens"] == 48
        assert "".join(e["text_output"] for e in events) == expected
    assert metric(server, "lmforge_num_requests_running_max") > 1  # the engine ran them in one batch
    assert wait_for(lambda: metric(server, "lmforge_num_requests_running") == 0)
    assert metric(server, "lmforge_time_to_first_token_seconds_count") >= 16
    assert metric(server, "lmforge_time_per_output_token_seconds_count") >= 16


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        (PROMPT, "{not json", "malformed JSON"),
        (PROMPT, '{"max_tokenz": 4}', "unknown"),
        (PROMPT, '{"max_tokens": -1}', "max_tokens"),
        ("", '{"max_tokens": 4}', "text_input"),
        ("hello " * 1000, '{"max_tokens": 4}', "max_model_len"),
    ],
    ids=["malformed-json", "unknown-field", "negative-max-tokens", "empty-prompt", "prompt-over-max-model-len"],
)
def test_bad_request_fails_alone(server, prompt, params, message):
    body = {"text_input": prompt, "sampling_parameters": params}
    bad = requests.post(f"{server.http_url}/v2/models/llm/generate", json=body, timeout=60)
    assert bad.status_code == 400 and message in bad.json()["error"], bad.text
    good = generate(server, PROMPT, {"temperature": 0, "max_tokens": 4}, exclude_input_in_output=True)
    assert good.status_code == 200 and good.json()["num_output_tokens"] == 4


BAD_BODIES = [  # (JSON body or raw bytes, HTTP status, part of the error)
    (
        {"text_input": PROMPT, "sampling_parameters": json.dumps({"logprobs": 100000})},
        400,
        "logprobs=100000 is over the limit of 20",
    ),
    ({"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": "4"})}, 400, "max_tokens='4'"),
    ({"text_input": PROMPT, "sampling_parameters": json.dumps({"temperature": "hot"})}, 400, "temperature='hot'"),
    ({"text_input": PROMPT, "sampling_parameters": json.dumps({"stop_token_ids": [10**9]})}, 400, "stop_token_ids"),
    ({"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 10**6})}, 400, "max_model_len=512"),
    ({"text_input": PROMPT, "sampling_parameters": "[" * 100000}, 400, "nested too deeply"),
    ({"text_input": PROMPT, "sampling_parameters": "[1, 2]"}, 400, "expected a JSON object"),
    ({"text_input": PROMPT, "temperature": 0}, 400, "unknown field(s) ['temperature']"),
    (b'{"text_input": "caf\xe9 \xff", "sampling_parameters": "{}"}', 400, "text_input: not valid UTF-8"),
    # Triton's HTTP front end converts JSON to tensors before the model sees the request and
    # answers a wrong JSON type with 500 itself; the model keeps serving.
    ({"text_input": PROMPT, "sampling_parameters": {"max_tokens": 4}}, 500, "non-string"),
    ({"text_input": 5}, 500, "non-string"),
    ({"text_input": PROMPT, "stream": "yes"}, 500, "non-boolean"),
    (b"[1, 2]", 500, "non-object"),
]


def test_wrong_types_and_out_of_range_values_get_clear_errors(server):
    url = f"{server.http_url}/v2/models/llm/generate"
    for body, status, message in BAD_BODIES:
        if isinstance(body, bytes):
            bad = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
        else:
            bad = requests.post(url, json=body, timeout=60)
        assert bad.status_code == status and message in bad.json()["error"], (
            body if isinstance(body, bytes) else str(body)[:80],
            bad.text,
        )
    good = generate(server, PROMPT, {"temperature": 0, "max_tokens": 4}, exclude_input_in_output=True)
    assert good.status_code == 200 and good.json()["num_output_tokens"] == 4
    assert requests.get(f"{server.http_url}/v2/models/llm/ready", timeout=5).status_code == 200


def test_client_disconnect_aborts_and_frees_blocks(server):
    aborted_before = (
        metric(server, "lmforge_requests_aborted_total")
        if metric_values(server, "lmforge_requests_aborted_total")
        else 0.0
    )

    def finished_length():
        return sum(
            v
            for labels, v in _labelled(server, "lmforge_requests_finished_total")
            if 'finish_reason="length"' in labels
        )

    def leaves_early(stream_and_leave, aborted: float) -> None:
        """``stream_and_leave(attempt)`` reads a few tokens of a 460-token request and leaves; the engine must abort
        it (the ``aborted``-th abort) and not run it to its end. The tiny model streams 460 tokens in well under a
        second, so on a busy machine a request can end before its client leaves: it is then sent again (at most 3
        tries)."""
        for attempt in range(3):
            length_before = finished_length()
            stream_and_leave(attempt)
            assert wait_for(
                lambda: (
                    metric(server, "lmforge_requests_aborted_total") >= aborted
                    or finished_length() == length_before + 1
                )
            ), "the request was neither aborted nor finished"
            if metric(server, "lmforge_requests_aborted_total") >= aborted:
                assert finished_length() == length_before  # it did not run to max_tokens
                break
        else:
            pytest.fail("every request ended before its client left")
        assert wait_for(lambda: metric(server, "lmforge_num_requests_running") == 0)
        assert wait_for(lambda: metric(server, "lmforge_kv_cache_usage_ratio") == 0.0)  # blocks returned

    def grpc_client(attempt: int) -> None:
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        inputs = _stream_inputs(PROMPT, {"temperature": 0, "max_tokens": 460, "ignore_eos": True})
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("llm", inputs, request_id=f"to-cancel-{attempt}")
        for _ in range(3):  # a few tokens arrive, then the client goes away
            results.get(timeout=60)
        client.stop_stream(cancel_requests=True)
        client.close()

    def http_client(attempt: int) -> None:  # closes its SSE stream
        body = {
            "text_input": PROMPT,
            "stream": True,
            "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 460, "ignore_eos": True}),
        }
        url = f"{server.http_url}/v2/models/llm/generate_stream"
        response = requests.post(url, json=body, stream=True, timeout=60)
        events = (line for line in response.iter_lines() if line.startswith(b"data: "))
        for _ in range(3):
            next(events)
        response.close()

    leaves_early(grpc_client, aborted_before + 1)
    leaves_early(http_client, aborted_before + 2)
    good = generate(server, PROMPT, {"temperature": 0, "max_tokens": 4}, exclude_input_in_output=True)
    assert good.status_code == 200 and good.json()["num_output_tokens"] == 4


@pytest.fixture
def own_llm_server(served_repo, tmp_path):
    """A server of its own for a test that kills a stub: Triton 2.51 can crash later after one died (see
    docs/serving.md, "Supervision"), which must not take the session's server down with it."""
    ports = _free_ports()
    with TritonServer(
        served_repo,
        *ports.values(),
        models=["llm"],
        write_pid_file=False,
        log_path=tmp_path / "own.log",
        exit_timeout_s=3,
        grace_s=5,
    ) as triton:
        yield triton


def test_killed_model_stub_is_loaded_again_by_the_supervisor(own_llm_server, engine_text):
    server = own_llm_server
    supervisor = ModelSupervisor(server, report=lambda line: None)
    (stub,) = server.stub_pids("llm")
    psutil.Process(stub).kill()  # kill -9 of the model's Python backend stub
    assert wait_for(lambda: not server.stub_pids("llm"), timeout_s=10)  # gone (or a zombie Triton never reaps)
    dead = generate(server, PROMPT, GREEDY)
    assert dead.status_code == 400 and "is not healthy" in dead.json()["error"]  # Triton 2.51 does not recover alone
    assert requests.get(f"{server.http_url}/v2/models/llm/ready", timeout=5).status_code == 200  # ... nor notice
    assert supervisor.problems() == {"llm": "1 of its 1 Python backend stub process(es) exited"}
    took = supervisor.check_once()
    assert set(took) == {"llm"} and supervisor.problems() == {}
    expected, _ = engine_text(PROMPT, **GREEDY)
    served = generate(server, PROMPT, GREEDY, exclude_input_in_output=True)
    assert served.status_code == 200 and served.json()["text_output"] == expected
    assert len(server.stub_pids("llm")) == 1


# --------------------------------------------------------------------------------------------
# encoder
# --------------------------------------------------------------------------------------------


def test_encoder_embeddings_match_in_process_onnxruntime(server, served_repo):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(SENTENCES), 1], "data": SENTENCES}]}
    response = requests.post(f"{server.http_url}/v2/models/minilm/infer", json=body, timeout=60)
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    assert output["name"] == "embeddings" and output["datatype"] == "FP32" and output["shape"] == [len(SENTENCES), 384]
    served = np.array(output["data"], dtype=np.float32).reshape(len(SENTENCES), 384)

    model_dir = served_repo / "minilm" / "1"  # reference: raw token states + mean pooling, in process
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    session = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    batch = tokenizer(SENTENCES, padding=True, return_tensors="np")
    feeds = {i.name: batch[i.name].astype(np.int64) for i in session.get_inputs()}
    (hidden,) = session.run(["last_hidden_state"], feeds)
    reference = torch.nn.functional.normalize(mean_pool(hidden, batch["attention_mask"]), dim=-1).numpy()
    cosine = (served * reference).sum(-1) / np.linalg.norm(served, axis=-1) / np.linalg.norm(reference, axis=-1)
    assert cosine.min() >= 0.999, cosine
    assert np.allclose(np.linalg.norm(served, axis=-1), 1.0, atol=1e-4)  # normalised like sentence-transformers
    empty = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [""]}]}
    bad = requests.post(f"{server.http_url}/v2/models/minilm/infer", json=empty, timeout=60)
    assert bad.status_code == 400 and "text: empty" in bad.json()["error"]


# --------------------------------------------------------------------------------------------
# configs against the proto and the real server
# --------------------------------------------------------------------------------------------


def test_every_exported_config_parses_and_the_server_accepts_it(server, served_repo):
    checked, problems = check_repository(served_repo)
    assert problems == [] and {p.parent.name for p in checked} == {
        "llm",
        "minilm",
        "minilm_onnx",
        "minilm_tokenizer",
        "minilm_ensemble",
    }

    # llm and minilm are loaded (the fixture); the tokenizer loads too; the ONNX Runtime model
    # and the ensemble are for the full container: 2.51 accepts their configs and stops only at
    # the missing onnxruntime backend.
    def load(name):
        return requests.post(f"{server.http_url}/v2/repository/models/{name}/load", json={}, timeout=300)

    assert load("minilm_tokenizer").status_code == 200
    onnx_load = load("minilm_onnx")
    assert (
        onnx_load.status_code == 400
        and "unable to find backend library for backend 'onnxruntime'" in onnx_load.json()["error"]
    )
    ensemble_load = load("minilm_ensemble")
    assert ensemble_load.status_code == 400 and "depends on 'minilm_onnx'" in ensemble_load.json()["error"]
    tokens = requests.post(
        f"{server.http_url}/v2/models/minilm_tokenizer/infer",
        json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": ["hello world"]}]},
        timeout=60,
    ).json()
    assert {o["name"] for o in tokens["outputs"]} == {"input_ids", "attention_mask", "token_type_ids"}
    assert tokens["outputs"][0]["shape"] == [1, 256]
    requests.post(f"{server.http_url}/v2/repository/models/minilm_tokenizer/unload", json={}, timeout=60)


# --------------------------------------------------------------------------------------------
# server management
# --------------------------------------------------------------------------------------------


def test_second_server_on_busy_ports_gets_a_clear_error(server, served_repo, tmp_path, lmforge):
    start = time.monotonic()
    with pytest.raises(PortsBusyError, match=f"127.0.0.1:{server.ports['http']}"):
        TritonServer(
            served_repo, *server.ports.values(), write_pid_file=False, log_path=tmp_path / "second.log"
        ).start()
    assert time.monotonic() - start < 10
    result = lmforge("serve", "--repo", tmp_path, *_port_flags(server.ports), timeout=60)
    assert result.returncode == 1 and "already in use" in result.stderr and "--http-port" in result.stderr


ECHO_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        if args["model_name"] == "broken":
            raise pb_utils.TritonModelException("weights missing: run lmforge export first")

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
            for r in requests
        ]
"""

ECHO_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "x" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "y" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""


def _echo_repo(root: Path, names: list[str]) -> Path:
    for name in names:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name))
        (root / name / "1" / "model.py").write_text(ECHO_MODEL)
    return root


def _free_ports() -> dict[str, int]:
    return dict(zip(("http", "grpc", "metrics"), free_ports(3)))


def _port_flags(ports: dict[str, int]) -> list[str]:
    return [
        "--http-port",
        str(ports["http"]),
        "--grpc-port",
        str(ports["grpc"]),
        "--metrics-port",
        str(ports["metrics"]),
    ]


def test_serve_reports_load_failure_reason_and_exits_nonzero(tmp_path, lmforge):
    repo = _echo_repo(tmp_path / "repo", ["echo", "broken"])
    ports = _free_ports()
    result = lmforge("serve", "--repo", repo, *_port_flags(ports), "--startup-timeout-s", "120", timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "broken: " in result.stderr and "weights missing: run lmforge export first" in result.stderr
    assert not (repo / "tritonserver.pid").exists()


def test_a_killed_server_leaves_no_python_backend_shared_memory(tmp_path):
    """Killed stubs and servers leave their /dev/shm regions behind; ``stop`` removes this server's (only)."""
    repo = _echo_repo(tmp_path / "repo", ["echo"])
    ports = _free_ports()
    foreign = SHM_DIR / "lmforge_triton_000000000000_not-this-servers"
    foreign.write_bytes(b"x")
    try:
        server = TritonServer(repo, *ports.values(), models=["echo"], write_pid_file=False, startup_timeout_s=120)
        with server:
            regions = sorted(SHM_DIR.glob(server.shm_prefix + "*"))
            assert len(regions) >= 1  # the echo stub's
            os.killpg(server.process.pid, signal.SIGKILL)  # as a crash would: nothing is cleaned up
            server.process.wait(timeout=30)
            assert all(region.exists() for region in regions)
        assert not any(SHM_DIR.glob(server.shm_prefix + "*")) and foreign.exists()
    finally:
        foreign.unlink(missing_ok=True)


def test_serve_models_flag_refuses_a_missing_model(tmp_path, lmforge):
    repo = _echo_repo(tmp_path / "repo", ["echo"])
    ports = _free_ports()
    result = lmforge(
        "serve",
        "--repo",
        repo,
        *_port_flags(ports),
        "--models",
        "echo",
        "missing",
        "--startup-timeout-s",
        "120",
        timeout=180,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ready in" not in result.stdout
    assert f"missing: no model directory {repo / 'missing'}; the repository has: echo" in result.stderr
    assert not (repo / "tritonserver.pid").exists()


def _popen_serve(command: list[str]) -> subprocess.Popen:
    """``lmforge serve`` in the foreground, its stdout and stderr merged into one text pipe."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)


def _read_until(process: subprocess.Popen, marker: str, timeout_s: float) -> str:
    """The process's output up to the first line holding ``marker``; fails if it ends or ``timeout_s`` passes first
    (checked between lines)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(marker in line for line in lines):
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
    assert any(marker in line for line in lines), "".join(lines)
    return "".join(lines)


def test_serve_foreground_then_stop(tmp_path, lmforge):
    repo = _echo_repo(tmp_path / "repo", ["echo"])
    ports = _free_ports()
    process = _popen_serve([sys.executable, "-m", "lmforge_cli", "serve", "--repo", str(repo), *_port_flags(ports)])
    try:
        _read_until(process, "ready in", timeout_s=120)
        with requests.Session() as session:  # closed: an open keep-alive connection delays Triton's exit
            reply = session.post(
                f"http://127.0.0.1:{ports['http']}/v2/models/echo/infer",
                json={"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]},
                timeout=30,
            )
        assert reply.json()["outputs"][0]["data"] == ["hi"]
        again = lmforge("serve", "--repo", repo, *_port_flags(_free_ports()), timeout=60)
        assert again.returncode == 1 and "already serves" in again.stderr
        stop = lmforge("serve", "--repo", repo, "--stop", timeout=60)
        assert stop.returncode == 0 and "stopped tritonserver" in stop.stdout
        assert process.wait(timeout=60) == 0, process.stdout.read() + (repo / "tritonserver.log").read_text()[-1500:]
        rest = process.stdout.read()  # a clean stop: no health-check errors once the stop was asked
        assert rest.strip().splitlines()[-1] == "server stopped" and "model check failed" not in rest, rest
        assert not (repo / "tritonserver.pid").exists()
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{ports['http']}/v2/health/live", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_ctrl_c_ends_the_streams_in_flight_then_stops_with_130(tmp_path, smollm2_dir):
    """`lmforge serve --openai-port` on a repository whose encoder was never exported: the encoder is skipped, the
    LLM served; Ctrl-C during a stream ends it with an error event and [DONE], then the server stops (exit 130)."""
    repo = tmp_path / "repo"
    # a stream long enough that Ctrl-C always lands while it runs
    export(smollm2_dir, repo, name="llm", engine={"max_model_len": 2048, "num_threads": 1})
    committed = REPO_ROOT / "model_repository" / "minilm"  # its config and model.py, no weights
    (repo / "minilm" / "1").mkdir(parents=True)
    (repo / "minilm" / "config.pbtxt").write_bytes((committed / "config.pbtxt").read_bytes())
    (repo / "minilm" / "1" / "model.py").write_bytes((committed / "1" / "model.py").read_bytes())
    ports = _free_ports()
    openai_port = free_ports(1)[0]
    command = [sys.executable, "-m", "lmforge_cli", "serve", "--repo", str(repo), *_port_flags(ports)]
    process = _popen_serve([*command, "--openai-port", str(openai_port), "--startup-timeout-s", "300"])
    try:
        startup = _read_until(process, "Ctrl-C", timeout_s=420)
        hint = "run `lmforge export --kind encoder --model CHECKPOINT --name minilm`"
        assert f"skipped minilm: not exported yet ({hint})" in startup
        assert f"e.g. POST http://127.0.0.1:{ports['http']}/v2/models/llm/generate" in startup
        assert "/v2/models/minilm/" not in startup
        body = {
            "model": "llm",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 1900,
            "ignore_eos": True,
            "stream": True,
        }
        with requests.post(
            f"http://127.0.0.1:{openai_port}/v1/chat/completions", json=body, stream=True, timeout=120
        ) as reply:
            assert reply.status_code == 200, reply.text
            events = []
            for line in reply.iter_lines():
                if line.startswith(b"data: "):
                    events.append(line[len(b"data: ") :])
                    if len(events) == 1:
                        process.send_signal(signal.SIGINT)  # Ctrl-C while the stream is in flight
        assert events[-1] == b"[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["message"] == "the server is shutting down" and error["type"] == "server_error", error
        assert all("choices" in json.loads(event) for event in events[:-2])  # tokens until then
        status = process.wait(timeout=120)
        rest = process.stdout.read()
        assert status == 130, startup + rest
        assert rest.strip().splitlines()[-1] == "server stopped", rest
        assert "model check failed" not in rest and "Traceback" not in rest, rest
        assert not (repo / "tritonserver.pid").exists() and not (repo / "openai_server.pid").exists()
        frontend_log = (repo / OPENAI_LOG_FILE).read_text()
        assert "Traceback" not in frontend_log and "timeout graceful shutdown" not in frontend_log, frontend_log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stop_openai_from_pid_file(repo, grace_s=5)  # what a killed serve left running (own sessions), if any
        with contextlib.suppress(TritonError):  # no pid file: serve stopped its server
            stop_from_pid_file(repo, grace_s=5)


@pytest.mark.integration
def test_real_smollm2_served_matches_in_process_engine(server, served_repo, smollm2_dir):
    export(smollm2_dir, served_repo, name="smollm2", engine={"max_model_len": 512, "num_threads": 1})
    loaded = requests.post(f"{server.http_url}/v2/repository/models/smollm2/load", json={}, timeout=600)
    assert loaded.status_code == 200, loaded.text
    try:
        prompt = "The capital of France is"
        params = {"temperature": 0, "max_tokens": 12}
        expected = (
            LLM(str(smollm2_dir), max_model_len=512, num_threads=1)
            .generate([prompt], SamplingParams(**params))[0]
            .outputs[0]
            .text
        )
        body = {"text_input": prompt, "sampling_parameters": json.dumps(params), "exclude_input_in_output": True}
        served = requests.post(f"{server.http_url}/v2/models/smollm2/generate", json=body, timeout=120).json()
        assert served["text_output"] == expected and "Paris" in expected
    finally:
        requests.post(f"{server.http_url}/v2/repository/models/smollm2/unload", json={}, timeout=120)


#: A shared prefix of several KV blocks (block_size 16) before each request's own question.
SHARED_PREFIX = "You answer questions about colours, animals and the weather in one short sentence. " * 3


def _cached_tokens_range(tokenizer, warm: str, prompt: str, block_size: int = 16) -> tuple[int, int]:
    """Prompt tokens of ``prompt`` the prefix cache can serve after ``warm`` ran: at least the full
    blocks of their common prefix, at most the whole common prefix (the engine also copies a
    partial block from a running request that holds it), never the last prompt token."""
    a, b = tokenizer(warm).input_ids, tokenizer(prompt).input_ids
    common = min(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))), len(b) - 1)
    return common // block_size * block_size, common


def test_streams_under_load_keep_every_token_and_report_cached_tokens(server, engine_text, tiny_llama_dir):
    """16 concurrent greedy streams sharing a prefix: each one's text equals the in-process engine's,
    its responses carry every token exactly once (several per response when the model's loop fell
    behind), and the last one reports the prompt tokens the prefix cache served."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    params = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    warm = SHARED_PREFIX + "Sky: what colour is it?"
    generate_stream(server, warm, params)  # fills the prefix cache
    # each prompt parts from the others right after the shared prefix, so its hits are that prefix's full blocks
    words = "Leaf Cat Snow Grass Sea Rose Coal Milk Sun Rust Plum Lime Sand Ink Fog Gold".split()
    prompts = [SHARED_PREFIX + f"{word}: what colour is it?" for word in words]
    responses_before = metric(server, "lmforge_responses_total")
    tokens_before = metric(server, "lmforge_generation_tokens_total")
    with ThreadPoolExecutor(16) as pool:
        all_events = list(pool.map(lambda p: generate_stream(server, p, params), prompts))
    for prompt, (expected, _), events in zip(prompts, engine_text(prompts, **params), all_events):
        assert "".join(e["text_output"] for e in events) == expected
        # Triton's JSON writes a one-element tensor as a scalar
        ids = [t for e in events for t in np.atleast_1d(e["output_token_ids"]).tolist()]
        assert len(ids) == events[-1]["num_output_tokens"] == 40
        assert [e["num_output_tokens"] for e in events] == sorted({e["num_output_tokens"] for e in events})
        assert events[-1]["finish_reason"] == "length"
        low, high = _cached_tokens_range(tokenizer, warm, prompt)
        assert 0 < low <= events[-1]["num_cached_tokens"] <= high
        assert all("num_cached_tokens" not in e for e in events[:-1])
    sent = sum(len(events) for events in all_events)
    assert wait_for(lambda: metric(server, "lmforge_responses_total") - responses_before >= sent)
    assert metric(server, "lmforge_generation_tokens_total") - tokens_before >= 16 * 40
    assert sent <= 16 * 40  # one response per step at most


def test_api_key_restricts_every_triton_api_but_health(served_repo, tmp_path):
    """``TritonServer(api_key=...)`` (``lmforge serve --api-key``): inference and model control answer 403 without
    ``Authorization: Bearer KEY``, on HTTP and gRPC; health stays open; the server's own calls send the key."""
    http, grpc, metrics = free_ports(3)
    key = "test-key-42"
    with TritonServer(
        served_repo,
        http,
        grpc,
        metrics,
        models=["minilm"],
        write_pid_file=False,
        log_path=tmp_path / "triton.log",
        api_key=key,
        exit_timeout_s=3,
    ) as secured:
        url = secured.http_url
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": ["hello"]}]}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = requests.post(f"{url}/v2/models/minilm/infer", json=body, headers=headers, timeout=60)
            assert refused.status_code == 403 and "restricted" in refused.json()["error"]
        assert requests.post(f"{url}/v2/repository/models/minilm/unload", json={}, timeout=10).status_code == 403
        assert requests.get(f"{url}/v2/models/minilm", timeout=10).status_code == 403
        assert requests.get(f"{url}/v2/health/ready", timeout=10).status_code == 200
        assert requests.get(f"{url}/v2/models/minilm/ready", timeout=10).status_code == 200
        ok = requests.post(f"{url}/v2/models/minilm/infer", json=body, headers=secured.headers, timeout=60)
        assert ok.status_code == 200 and ok.json()["outputs"][0]["shape"] == [1, 384]
        assert secured.model_state("minilm")[0] == "READY"  # the repository index, called with the key
        client = grpcclient.InferenceServerClient(secured.grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="restricted|authorization"):
                client.get_model_repository_index()
            assert client.is_model_ready("minilm")  # health: open
            assert len(client.get_model_repository_index(headers=secured.grpc_headers).models) >= 1
        finally:
            client.close()
    with pytest.raises(UsageError, match="api-key"):
        TritonServer(served_repo, http, grpc, metrics, api_key="bad:key")
