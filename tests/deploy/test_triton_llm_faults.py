"""``deploy.triton_llm`` when things go wrong: an engine step error, unknown request fields, and a
dead engine (logged, answered UNAVAILABLE, the model unloaded so its readiness stops answering
200). Triton's ``triton_python_backend_utils`` exists only inside the server, so a recording
stand-in takes its place; the live paths are in tests/deploy/test_serve.py."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from deploy.openai.triton_client import model_error
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.deploy.test_triton_llm_metrics import FakeFamily

FINAL = 1


class FakeTritonError:
    INVALID_ARG, INTERNAL, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"

    def __init__(self, message, code):
        self.message, self.code = message, code


class FakeResponse:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors, error


class FakeSender:
    def __init__(self):
        self.sent = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return False


class FakeRequest:
    def __init__(self, inputs: dict, parameters: dict | None = None):
        self.inputs, self._parameters, self.sender = inputs, parameters or {}, FakeSender()

    def get_response_sender(self):
        return self.sender

    def parameters(self):
        return json.dumps(self._parameters)


@pytest.fixture
def pb(monkeypatch):
    fake = types.ModuleType("triton_python_backend_utils")
    fake.MetricFamily = FakeFamily
    fake.TritonModelException = RuntimeError
    fake.TritonError = FakeTritonError
    fake.InferenceResponse = FakeResponse
    fake.Tensor = lambda name, value: (name, value)
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    fake.unloaded = []
    fake.unload_model = fake.unloaded.append
    fake.logged = []
    fake.Logger = types.SimpleNamespace(
        **{
            f"log_{level}": (lambda level: lambda m: fake.logged.append((level, m)))(level)
            for level in ("info", "warn", "error", "verbose")
        }
    )
    fake.get_input_tensor_by_name = lambda request, name: (
        None if name not in request.inputs else types.SimpleNamespace(as_numpy=lambda: request.inputs[name])
    )
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "deploy.triton_llm", raising=False)
    yield fake
    sys.modules.pop("deploy.triton_llm", None)


class FakeEngine:
    """Yields the given outputs for every request; ``dead_reason`` set = dead."""

    def __init__(self, outputs=(), dead_reason=None):
        self.outputs, self.dead_reason, self.aborted = list(outputs), dead_reason, []

    @property
    def is_dead(self):
        return self.dead_reason is not None

    async def generate(self, prompt, params, request_id, lora_request=None):
        for out in self.outputs:
            yield out

    async def abort(self, request_id):
        self.aborted.append(request_id)


def _model(pb, engine):
    module = importlib.import_module("deploy.triton_llm")
    model = module.TritonPythonModel.__new__(module.TritonPythonModel)
    model.logger, model.model_name, model.engine = pb.Logger, "llm", engine
    model.metrics = module.LLMMetrics({"model": "llm", "version": "1"})
    model.stop_stats = threading.Event()
    return model


def _request(parameters=None, sampling="{}"):
    return FakeRequest(
        {
            "text_input": np.array([b"Hello"], dtype=object),
            "sampling_parameters": np.array([sampling.encode()], dtype=object),
        },
        parameters,
    )


def _error_output(message: str) -> RequestOutput:
    completion = CompletionOutput(0, "", [7], "error", None, message)
    return RequestOutput("r", "Hello", [1, 2], [completion], True, RequestMetrics(0.0, 0.1, 0.2, 0, 1))


def test_engine_step_error_is_an_internal_error_response(pb):
    model = _model(pb, FakeEngine([_error_output("RuntimeError: injected fault")]))
    request = _request()
    asyncio.run(model._serve(request))
    ((response, flags),) = request.sender.sent
    assert flags == FINAL and response.error.code == "INTERNAL"
    assert response.error.message == "the engine failed this request: RuntimeError: injected fault"


def test_unknown_fields_are_refused_and_triton_parameters_pass(pb):
    model = _model(pb, FakeEngine([_error_output("x")]))
    bad = _request({"temperature": 0, "triton_enable_empty_final_response": True})
    asyncio.run(model._serve(bad))
    ((response, _),) = bad.sender.sent
    assert response.error.code == "INVALID_ARG" and "unknown field(s) ['temperature']" in response.error.message
    ok = _request({"triton_enable_empty_final_response": True})
    asyncio.run(model._serve(ok))
    assert ok.sender.sent[0][0].error.code == "INTERNAL"  # reached the engine


def test_dead_engine_is_logged_answered_unavailable_and_unloads_the_model(pb):
    model = _model(pb, FakeEngine(dead_reason="EngineDeadError: 8 steps failed in a row"))
    model._report_dead()
    assert pb.unloaded == ["llm"]
    ((level, message),) = [entry for entry in pb.logged if entry[0] == "error"]
    assert "llm engine is dead (EngineDeadError: 8 steps failed in a row)" in message
    request = _request()
    asyncio.run(model._serve(request))
    ((response, flags),) = request.sender.sent
    assert flags == FINAL and response.error.code == "UNAVAILABLE" and "is dead" in response.error.message


def _n_outputs(finish_second: str | None) -> list[RequestOutput]:
    """Two steps of an ``n=2`` request: both completions grow, then #0 stops and #1 ends with ``finish_second``."""
    metrics = RequestMetrics(0.0, 0.1, None, 0, 2)
    step1 = RequestOutput(
        "r", "Hello", [1, 2], [CompletionOutput(0, "a", [5], None), CompletionOutput(1, "b", [6], None)], False, metrics
    )
    done = RequestMetrics(0.0, 0.1, 0.2, 0, 4)
    step2 = RequestOutput(
        "r",
        "Hello",
        [1, 2],
        [
            CompletionOutput(0, "ac", [5, 8], "stop"),
            CompletionOutput(1, "bd", [6, 9], finish_second, None, "RuntimeError: boom"),
        ],
        True,
        done,
    )
    return [step1, step2]


def _tensors(response) -> dict:
    return dict(response.output_tensors)


def test_n_completions_stream_per_index_with_final_on_the_last(pb):
    model = _model(pb, FakeEngine(_n_outputs("length")))
    request = _request()
    request.inputs["stream"] = np.array([True])
    asyncio.run(model._serve(request))
    sent = [(_tensors(r), flags) for r, flags in request.sender.sent]
    assert [
        (int(t["index"][0]), t["text_output"][0].decode(), t["output_token_ids"].tolist(), flags) for t, flags in sent
    ] == [(0, "a", [5], 0), (1, "b", [6], 0), (0, "c", [8], 0), (1, "d", [9], FINAL)]
    assert [t["finish_reason"][0].decode() for t, _ in sent[2:]] == ["stop", "length"]


def test_one_failed_completion_fails_the_request_and_the_frontend_maps_model_errors(pb):
    model = _model(pb, FakeEngine(_n_outputs("error")))
    request = _request()
    asyncio.run(model._serve(request))
    ((response, flags),) = request.sender.sent  # non-streaming: nothing before the failure
    assert flags == FINAL and response.error.code == "INTERNAL"
    assert response.error.message == "the engine failed this request: RuntimeError: boom"

    assert model_error(response.error.message).status == 500
    assert model_error("the engine of llm is dead (EngineDeadError: x); it is being reloaded, retry").status == 503
    assert model_error("internal error: KeyError('x')").status == 500
    assert model_error("text_input: empty prompt; send some text").status == 400


def test_a_send_refused_because_the_client_left_counts_as_an_abort(pb):
    class GoneSender(FakeSender):
        def send(self, response=None, flags=0):
            if response is not None:
                raise RuntimeError("Unable to send response: the request was cancelled")
            super().send(response, flags)

        def is_cancelled(self):
            return True

    model = _model(pb, FakeEngine(_n_outputs("length")))
    request = _request()
    request.inputs["stream"] = np.array([True])
    request.sender = GoneSender()
    asyncio.run(model._serve(request))
    assert request.sender.sent == [(None, FINAL)]  # no error response, only the closing flag
    assert model.metrics.aborted.value == 1 and model.metrics.errors.value == 0


def test_a_queued_sse_client_that_left_is_found_by_a_heartbeat_and_aborted(pb):
    """Triton's HTTP server flags a closed SSE connection only when it writes to it: a queued streaming request
    sends heartbeats (empty responses), and the first write after the client left gets it aborted."""

    class QueuedEngine(FakeEngine):
        async def generate(self, prompt, params, request_id, lora_request=None):
            self.released = asyncio.Event()
            await self.released.wait()  # waits for a batch slot until aborted
            yield _n_outputs("length")[0]

        async def abort(self, request_id):
            await super().abort(request_id)
            self.released.set()

    class ClosingSender(FakeSender):
        """Its client closed after the first response: Triton flags it once a write reached the connection."""

        def is_cancelled(self):
            return len(self.sent) >= 2

    engine = QueuedEngine()
    model = _model(pb, engine)
    module = sys.modules["deploy.triton_llm"]
    module.HEARTBEAT_INTERVAL_S, module.CANCEL_CHECK_INTERVAL_S = 0.05, 0.01
    request = _request()
    request.inputs["stream"] = np.array([True])
    request.sender = ClosingSender()
    asyncio.run(asyncio.wait_for(model._serve(request), 10))
    heartbeats = [_tensors(r) for r, flags in request.sender.sent if r is not None]
    assert len(heartbeats) >= 2
    assert all(t["text_output"][0] == b"" and len(t["output_token_ids"]) == 0 for t in heartbeats)
    assert all("finish_reason" not in t for t in heartbeats)
    assert len(engine.aborted) == 1 and model.metrics.aborted.value == 1
    assert request.sender.sent[-1] == (None, FINAL)


def test_the_model_module_imports_without_torch():
    """Triton imports ``model.py`` in a stub of its own first (the config auto-complete), then in the instance's stub;
    a stub killed by ``kill -9`` is reloaded through both, so importing the module must stay light: torch, the
    engine and transformers load in ``initialize`` only."""
    code = (
        "import sys, types\n"
        "sys.modules['triton_python_backend_utils'] = types.ModuleType('triton_python_backend_utils')\n"
        "import deploy.triton_llm\n"
        "heavy = ('torch', 'transformers', 'engine.async_engine', 'engine.lora')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
