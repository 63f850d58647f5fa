"""The autoscaling metrics, read from a live tritonserver 2.51 (the one nvidia-pytriton ships).

Starts the real server on 127.0.0.1 with a one-line Python-backend model, sends requests, and
checks that the counters the HPA rule divides exist, are counters, carry the ``model`` label the
adapter query filters on, and count what the rule assumes (successes per request, queue time in
microseconds). ``tests/data/triton_2.51_metrics.txt`` is an offline copy of such a /metrics page,
used by the unit tests in test_deploy_render.py.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from deploy.render import QUEUE_METRIC, SUCCESS_METRIC, DeployValues, adapter_query

MODEL = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
"""

CONFIG = """\
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
START_TIMEOUT_S = 60.0


#: HTTP, gRPC and metrics ports of this test's server (kept apart from the other server tests' ports).
PORTS = (28000, 28001, 28002)


def _check_ports_free(ports: tuple[int, ...]) -> None:
    for port in ports:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise RuntimeError(f"127.0.0.1:{port} is in use; stop what listens there (ports {ports})")


def _pytriton_dir() -> Path:
    # optional or heavy dependency: imported only on the path that needs it
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    """A real tritonserver with the ``echo`` model; yields ``(http_port, metrics_port)``."""
    root = tmp_path_factory.mktemp("triton")
    triton = _pytriton_dir()
    backend = root / "backends" / "python"
    backend.mkdir(parents=True)
    for file in (triton / "backends" / "python").glob("*.*"):
        shutil.copy(file, backend)
    shutil.copy(triton / "python_backend_stubs" / "3.11" / "triton_python_backend_stub", backend)
    (root / "repo" / "echo" / "1").mkdir(parents=True)
    (root / "repo" / "echo" / "config.pbtxt").write_text(CONFIG)
    (root / "repo" / "echo" / "1" / "model.py").write_text(MODEL)
    _check_ports_free(PORTS)
    http, grpc, metrics = PORTS
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "LD_LIBRARY_PATH": str(triton.parent.parent / "nvidia_pytriton.libs"),
    }
    log = (root / "server.log").open("w")
    process = subprocess.Popen(
        [
            str(triton / "bin" / "tritonserver"),
            f"--model-repository={root / 'repo'}",
            f"--backend-directory={root / 'backends'}",
            "--http-address=127.0.0.1",
            f"--http-port={http}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={grpc}",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={metrics}",
            "--allow-gpu-metrics=false",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError(f"tritonserver did not become ready; log: {(root / 'server.log').read_text()[-2000:]}")
        yield http, metrics
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _value(text: str, metric: str) -> float:
    match = re.search(rf'^{metric}\{{model="echo",version="1"\}} (\S+)$', text, re.M)
    assert match, f"{metric} for model echo not in /metrics"
    return float(match.group(1))


@pytest.mark.integration
def test_hpa_metrics_exist_on_a_live_triton_and_count_requests(echo_server):
    http, metrics = echo_server
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
    assert client.get_server_metadata()["version"] == "2.51.0"
    before = _scrape(metrics)
    types = dict(re.findall(r"^# TYPE (\w+) (\w+)$", before, re.M))
    assert types[QUEUE_METRIC] == "counter" and types[SUCCESS_METRIC] == "counter"
    requests = 5
    for i in range(requests):
        data = httpclient.InferInput("INPUT0", [3], "FP32")
        data.set_data_from_numpy(np.arange(3, dtype=np.float32) + i)
        out = client.infer("echo", [data]).as_numpy("OUTPUT0")
        assert out.tolist() == [i, i + 1, i + 2]
    deadline = time.monotonic() + 10
    while (
        _value(_scrape(metrics), SUCCESS_METRIC) < _value(before, SUCCESS_METRIC) + requests
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)  # counters are updated after the response is sent
    after = _scrape(metrics)
    assert _value(after, SUCCESS_METRIC) - _value(before, SUCCESS_METRIC) == requests
    queued_us = _value(after, QUEUE_METRIC) - _value(before, QUEUE_METRIC)
    request_us = _value(after, "nv_inference_request_duration_us") - _value(before, "nv_inference_request_duration_us")
    assert 0 <= queued_us <= request_us  # queue time is part of request time, both in microseconds
    assert set(re.findall(r"\bnv_\w+", adapter_query(DeployValues(model_name="echo")))) <= types.keys()
    assert 'model="echo"' in adapter_query(DeployValues(model_name="echo"))
