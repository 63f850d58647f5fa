"""The targeted cases of ``lmforge bench reliability --cases``: each sets up one fault against a real tritonserver
(with ``deploy.triton.ModelSupervisor``) and the OpenAI frontend, and measures what a client sees.

* ``huge_n``: the latency of a good request (Triton ``generate_stream``, ``--max-tokens`` greedy tokens) alone,
  then while the worst request the limits allow runs (``n`` = ``max_n``, the longest prompt, the rest of the context
  as ``max_tokens``); target: at most 2x. Then that request's client closes: seconds until the engine is idle.
* ``queued_disconnects``: every seat busy with long streams, 5 more SSE clients connect and close after 1 s (queued,
  no output yet); seconds from each close until ``lmforge_requests_aborted_total`` counted them; then the long
  streams close mid-stream (same measure).
* ``nonstream_disconnects``: 8 non-streaming ``/v1/completions`` clients close after 1 s, and one streaming request
  with ``n`` = ``max_n`` closes after 2 s (through the frontend); seconds until they are aborted / the engine is idle.
* ``kill1`` / ``kill2``: 4 clients loop on streaming chat completions through the frontend; once they got
  ``GOOD_BEFORE_KILL`` good answers, the model's stub (one of its 2 instances for ``kill2``) is killed with SIGKILL.
  Reported: how the requests in flight at the kill ended and how long after it (target: 503 within 1 s), failures
  of requests sent after the kill (target 0 with 2 instances), and the first good answer after the kill (target
  <= 10 s).

Each case runs on a warm ``Stack`` (every instance answered once): whichever cases run, alone or together, none
measures a model's first request (on a new checkout, the build of the C++ kernels).

Every figure comes from timestamps on this side (``time.monotonic``) and Triton's metrics port.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from deploy.export import export
from deploy.triton import ModelSupervisor, TritonServer, free_ports, lmforge_source_root, stop_process

#: The engine of the soak's model (a small KV pool, so preemption and limits are reached).
ENGINE_CONFIG = {"max_model_len": 512, "max_num_seqs": 16, "block_size": 16, "num_kv_blocks": 640}


def read_metrics(server) -> dict[str, float]:
    """The ``lmforge_*`` metrics of model ``llm`` summed over labels (``{}`` when unreachable)."""
    try:
        with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    values: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(lmforge_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        if 'model="llm"' in labels:
            values[name] = values.get(name, 0.0) + float(value)
    return values


CASES = ("huge_n", "queued_disconnects", "nonstream_disconnects", "kill1", "kill2")
GOOD_PROMPT = "Write a short story about a robot who learns to paint."
#: Target ratio of a good request's latency while the worst allowed request runs to its latency alone.
FAIRNESS_TARGET = 2.0
ABORT_TARGET_S = 1.0
RECOVERY_TARGET_S = 10.0
#: Longest wait for a good answer after a stub kill (seconds).
KILL_WINDOW_S = 120.0
#: Longest wait for the warm-up answers of a new stack: a checkout's first request builds the C++ kernels (minutes on
#: a busy machine).
WARMUP_TIMEOUT_S = 900.0
#: Good answers the kill cases' clients get before the stub is killed.
GOOD_BEFORE_KILL = 4


# --------------------------------------------------------------------------------------------
# clients
# --------------------------------------------------------------------------------------------


def _greedy(max_tokens: int, **extra) -> str:
    return json.dumps({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **extra})


def good_request(server: TritonServer, max_tokens: int, timeout_s: float = 300.0) -> float:
    """Seconds for one greedy streaming request over Triton's HTTP API (raises on a failure)."""
    body = {"text_input": GOOD_PROMPT, "stream": True, "sampling_parameters": _greedy(max_tokens)}
    start = time.monotonic()
    with requests.post(
        f"{server.http_url}/v2/models/llm/generate_stream", json=body, stream=True, timeout=timeout_s
    ) as response:
        response.raise_for_status()
        finish = None
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                finish = event.get("finish_reason") or finish
    if finish is None:
        raise RuntimeError("the stream ended without a finish_reason")
    return time.monotonic() - start


class RawClient:
    """An HTTP/1.1 POST over a plain socket that can be closed at any moment (a client that goes away)."""

    def __init__(self, host_port: str, path: str, body: dict, headers: dict | None = None) -> None:
        host, port = host_port.replace("http://", "").split(":")
        payload = json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        head.append(f"Content-Length: {len(payload)}")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        self.received = b""
        self.closed_at: float | None = None

    def read_for(self, seconds: float) -> None:
        self.sock.settimeout(0.1)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                chunk = self.sock.recv(65536)
            except (TimeoutError, socket.timeout):
                continue
            if not chunk:
                return
            self.received += chunk

    def close(self) -> None:
        self.closed_at = time.monotonic()
        self.sock.close()


def _aborted(server: TritonServer) -> float:
    return read_metrics(server).get("lmforge_requests_aborted_total", 0.0)


def wait_for_aborts(server: TritonServer, baseline: float, count: int, since: float, timeout_s: float = 60.0):
    """Seconds from ``since`` until the aborted counter reached ``baseline + count`` (``None``: never)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _aborted(server) >= baseline + count:
            return time.monotonic() - since
        time.sleep(0.05)
    return None


def wait_idle(server: TritonServer, since: float, timeout_s: float = 120.0):
    """Seconds from ``since`` until no request runs or waits in the engine (``None``: not within the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        values = read_metrics(server)
        busy = values.get("lmforge_num_requests_running", 1) + values.get("lmforge_num_requests_waiting", 1)
        if values and busy == 0:
            return time.monotonic() - since
        time.sleep(0.05)
    return None


# --------------------------------------------------------------------------------------------
# serving
# --------------------------------------------------------------------------------------------


class Stack:
    """tritonserver (supervised) + the OpenAI frontend on free ports, for one exported repository.

    On entry every one of the model's ``instances`` has answered a good request (``warm_up``), so a case measures
    a served model, not a first request (the kernels' build or load, thread pools starting): a stub killed during
    its first request is another fault than the one a case sets up.
    """

    def __init__(self, repo: Path, out: Path, log, instances: int = 1) -> None:
        http, grpc, metrics, openai_port = free_ports(4)
        self.server = TritonServer(
            repo, http, grpc, metrics, models=["llm"], log_path=out / "tritonserver.log", write_pid_file=False
        )
        self.openai_url = f"http://127.0.0.1:{openai_port}"
        self.openai_port = openai_port
        self.out, self.log, self.instances = out, log, instances
        self.supervisor: ModelSupervisor | None = None
        self.frontend: subprocess.Popen | None = None

    def __enter__(self) -> "Stack":
        self.server.start()
        self.supervisor = ModelSupervisor(self.server, report=self.log).start()
        env = dict(os.environ, PYTHONPATH=str(lmforge_source_root()))
        log = open(self.out / "openai.log", "w")
        self.frontend = subprocess.Popen(
            [sys.executable, "-m", "deploy.openai", "--repo", str(self.server.repo), "--models", "llm"]
            + ["--grpc-url", self.server.grpc_url, "--port", str(self.openai_port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        try:
            self.log(f"stack: warm-up answered in {self.warm_up():.1f} s")
        except Exception:
            self.__exit__()
            raise
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.openai_url}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.__exit__()
        raise RuntimeError(f"the OpenAI frontend did not start; see {self.out / 'openai.log'}")

    def warm_up(self) -> float:
        """``instances`` good requests at once, twice (Triton gives concurrent requests to different instances);
        returns the seconds they took."""
        start = time.monotonic()
        with ThreadPoolExecutor(self.instances) as pool:
            for _ in range(2):
                list(pool.map(lambda _: good_request(self.server, 8, WARMUP_TIMEOUT_S), range(self.instances)))
        return time.monotonic() - start

    def __exit__(self, *exc) -> None:
        if self.frontend is not None:
            stop_process(self.frontend.pid, 10, wait=self.frontend.wait)
        if self.supervisor is not None:
            self.supervisor.stop()
        self.server.stop()


def export_repo(checkpoint: Path, out: Path, instances: int, num_threads: int | None) -> Path:
    repo = out / f"model_repository_{instances}"
    engine = dict(ENGINE_CONFIG, **({"num_threads": num_threads} if num_threads else {}))
    export(checkpoint, repo, name="llm", engine=engine, instances=instances)
    return repo


# --------------------------------------------------------------------------------------------
# the cases
# --------------------------------------------------------------------------------------------


def _tokens_of(server: TritonServer) -> int:
    return ENGINE_CONFIG["max_model_len"]


def case_huge_n(stack: Stack, max_tokens: int, log) -> dict:
    """Good-request latency alone and beside the worst allowed request, and that request's abort time."""
    server = stack.server
    good_request(server, max_tokens)  # warm-up
    alone = [good_request(server, max_tokens) for _ in range(5)]
    max_model_len = _tokens_of(server)
    long_prompt = " ".join(["tell me everything about the history of the sea"] * 38)  # ~400 tokens
    big = RawClient(
        server.http_url,
        "/v2/models/llm/generate_stream",
        {
            "text_input": long_prompt,
            "stream": True,
            "sampling_parameters": json.dumps({"n": 128, "max_tokens": max_model_len - 420, "ignore_eos": True}),
        },
    )
    big.read_for(1.0)
    loaded = [good_request(server, max_tokens) for _ in range(5)]
    big.read_for(0.1)
    big_was_running = read_metrics(server).get("lmforge_num_requests_running", 0)
    big.close()
    idle_s = wait_idle(server, big.closed_at)
    result = {
        "good_alone_s": statistics.median(alone),
        "good_beside_worst_request_s": statistics.median(loaded),
        "ratio": statistics.median(loaded) / statistics.median(alone),
        "worst_request": "n=128, ~400-token prompt, max_tokens to the end of the context (Triton generate_stream)",
        "running_when_closed": big_was_running,
        "idle_after_close_s": idle_s,
        "worst_request_bytes_received": len(big.received),
    }
    log(
        f"huge_n: good request {result['good_alone_s']:.2f} s alone, {result['good_beside_worst_request_s']:.2f} s "
        f"beside n=128 ({result['ratio']:.2f}x); idle {idle_s if idle_s is None else round(idle_s, 2)} s after close"
    )
    return result


def _long_streams(server: TritonServer, count: int) -> list[RawClient]:
    clients = []
    for i in range(count):
        body = {"text_input": f"{GOOD_PROMPT} Part {i}.", "stream": True, "sampling_parameters": _greedy(400)}
        clients.append(RawClient(server.http_url, "/v2/models/llm/generate_stream", body))
    return clients


def case_queued_disconnects(stack: Stack, log) -> dict:
    server = stack.server
    fills = _long_streams(server, ENGINE_CONFIG["max_num_seqs"])
    time.sleep(2.0)  # every seat taken
    baseline = _aborted(server)
    queued = _long_streams(server, 5)
    for client in queued:
        client.read_for(0.2)
    waiting = read_metrics(server).get("lmforge_num_requests_waiting", 0)  # they wait for a seat
    time.sleep(0.4)
    for client in queued:
        client.close()
    queued_s = wait_for_aborts(server, baseline, len(queued), max(c.closed_at for c in queued))
    baseline = _aborted(server)
    for client in fills:
        client.close()
    mid_s = wait_for_aborts(server, baseline, len(fills), max(c.closed_at for c in fills))
    idle_s = wait_idle(server, max(c.closed_at for c in fills))
    result = {
        "queued_clients": len(queued),
        "waiting_when_they_connected": waiting,
        "queued_aborted_within_s": queued_s,
        "mid_stream_clients": len(fills),
        "mid_stream_aborted_within_s": mid_s,
        "idle_after_s": idle_s,
    }
    log(
        f"queued_disconnects: {len(queued)} queued SSE clients aborted within {queued_s} s; {len(fills)} mid-stream "
        f"within {mid_s} s"
    )
    return result


def case_nonstream_disconnects(stack: Stack, log) -> dict:
    server = stack.server
    baseline = _aborted(server)
    clients = [
        RawClient(
            stack.openai_url,
            "/v1/completions",
            {"model": "llm", "prompt": f"{GOOD_PROMPT} {i}", "max_tokens": 400, "ignore_eos": True},
        )
        for i in range(8)
    ]
    for client in clients:
        client.read_for(1.0 / len(clients))
    time.sleep(0.5)
    for client in clients:
        client.close()
    nonstream_s = wait_for_aborts(server, baseline, len(clients), max(c.closed_at for c in clients))
    idle1 = wait_idle(server, max(c.closed_at for c in clients))
    big = RawClient(
        stack.openai_url,
        "/v1/completions",
        {"model": "llm", "prompt": GOOD_PROMPT, "max_tokens": 400, "n": 128, "stream": True, "ignore_eos": True},
    )
    big.read_for(2.0)
    big.close()
    idle2 = wait_idle(server, big.closed_at)
    result = {
        "nonstream_clients": len(clients),
        "nonstream_aborted_within_s": nonstream_s,
        "idle_after_nonstream_close_s": idle1,
        "n128_stream_idle_after_close_s": idle2,
    }
    log(f"nonstream_disconnects: {len(clients)} aborted within {nonstream_s} s; n=128 idle {idle2} s after close")
    return result


class ChatLoop:
    """``clients`` threads sending streaming chat completions through the frontend until stopped."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.records: list[dict] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> "ChatLoop":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def wait_good(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` requests succeeded (False: not within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(r["ok"] for r in list(self.records)) >= count:
                return True
            time.sleep(0.1)
        return False

    def _run(self) -> None:
        body = {
            "model": "llm",
            "messages": [{"role": "user", "content": GOOD_PROMPT}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        while not self.stop.is_set():
            record = {"start": time.monotonic(), "ok": False, "status": None, "error": None}
            try:
                with requests.post(f"{self.url}/v1/chat/completions", json=body, stream=True, timeout=120) as r:
                    record["status"] = r.status_code
                    if r.status_code != 200:
                        record["error"] = r.text[:200]
                    else:
                        done = False
                        for line in r.iter_lines():
                            if line.startswith(b"data: [DONE]"):
                                done = True
                            elif line.startswith(b"data: ") and b'"error"' in line[:20]:
                                record["error"] = line[6:206].decode(errors="replace")
                        record["ok"] = done and record["error"] is None
                        if not done and record["error"] is None:
                            record["error"] = "stream ended without [DONE]"
            except requests.RequestException as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"[:200]
            record["end"] = time.monotonic()
            self.records.append(record)
            if not record["ok"]:
                time.sleep(0.1)


def case_kill(stack: Stack, instances: int, max_tokens: int, log) -> dict:
    server = stack.server
    with ChatLoop(stack.openai_url, 4, max_tokens) as loop:
        loop.wait_good(GOOD_BEFORE_KILL, KILL_WINDOW_S)
        time.sleep(1.0)  # the clients are mid-request
        stubs = server.stub_pids("llm")
        victim = stubs[0]
        kill_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        log(f"kill{instances}: killed stub {victim} of {len(stubs)}")
        deadline = kill_at + KILL_WINDOW_S
        while time.monotonic() < deadline:  # until a request sent after the kill succeeded, plus 10 s
            time.sleep(0.5)
            if any(r["start"] >= kill_at and r["ok"] for r in list(loop.records)):
                deadline = min(deadline, time.monotonic() + 10.0)
    records = loop.records
    in_flight = [r for r in records if r["start"] < kill_at <= r["end"]]
    after = [r for r in records if r["start"] >= kill_at]
    failed_in_flight = [r for r in in_flight if not r["ok"]]
    first_good = min((r["end"] for r in after if r["ok"]), default=None)
    result = {
        "instances": instances,
        "requests_before_kill": sum(r["end"] < kill_at for r in records),
        "failed_before_kill": sum(r["end"] < kill_at and not r["ok"] for r in records),
        "in_flight_at_kill": len(in_flight),
        "in_flight_failed": len(failed_in_flight),
        "in_flight_failed_within_s": [round(r["end"] - kill_at, 2) for r in failed_in_flight],
        "in_flight_statuses": sorted({str(r["status"]) for r in failed_in_flight}),
        "sent_after_kill": len(after),
        "sent_after_kill_failed": sum(not r["ok"] for r in after),
        "failure_examples": [r["error"] for r in records if not r["ok"]][:4],
        "first_good_answer_after_kill_s": None if first_good is None else first_good - kill_at,
        "supervisor_reloads": [list(x) for x in stack.supervisor.reloads],
    }
    log(
        f"kill{instances}: {len(failed_in_flight)} of {len(in_flight)} in flight failed within "
        f"{result['in_flight_failed_within_s']} s; {result['sent_after_kill_failed']} of {len(after)} sent after "
        f"failed; first good answer {result['first_good_answer_after_kill_s']} s after the kill"
    )
    return result


def run_cases(cases: list[str], checkpoint: Path, out: Path, max_tokens: int, num_threads: int | None, log) -> dict:
    """Run ``cases`` (names of ``CASES``) and return their results with the targets checked."""
    results: dict = {}
    single = [c for c in cases if c != "kill2"]
    if single:
        repo = export_repo(checkpoint, out, 1, num_threads)
        with Stack(repo, out, log) as stack:
            for case in single:
                if case == "huge_n":
                    results[case] = case_huge_n(stack, max_tokens, log)
                elif case == "queued_disconnects":
                    results[case] = case_queued_disconnects(stack, log)
                elif case == "nonstream_disconnects":
                    results[case] = case_nonstream_disconnects(stack, log)
                elif case == "kill1":
                    results[case] = case_kill(stack, 1, max_tokens, log)
    if "kill2" in cases:
        repo = export_repo(checkpoint, out, 2, num_threads)
        with Stack(repo, out, log, instances=2) as stack:
            results["kill2"] = case_kill(stack, 2, max_tokens, log)
    results["targets"] = case_targets(results)
    return results


def _within(value, target: float) -> bool:
    return value is not None and value <= target


def case_targets(results: dict) -> dict[str, bool]:
    targets = {}
    if "huge_n" in results:
        targets[f"good request beside the worst allowed one <= {FAIRNESS_TARGET:g}x alone"] = (
            results["huge_n"]["ratio"] <= FAIRNESS_TARGET
        )
    if "queued_disconnects" in results:
        r = results["queued_disconnects"]
        targets["queued and mid-stream SSE disconnects aborted within 1 s"] = _within(
            r["queued_aborted_within_s"], ABORT_TARGET_S
        ) and _within(r["mid_stream_aborted_within_s"], ABORT_TARGET_S)
    if "nonstream_disconnects" in results:
        r = results["nonstream_disconnects"]
        within = _within(r["nonstream_aborted_within_s"], ABORT_TARGET_S)
        targets["non-streaming disconnects aborted within 1 s"] = within
    for name in ("kill1", "kill2"):
        if name in results:
            r = results[name]
            targets[f"{name}: in-flight requests fail within 1 s"] = all(
                t <= ABORT_TARGET_S for t in r["in_flight_failed_within_s"]
            )
            targets[f"{name}: first good answer within {RECOVERY_TARGET_S:g} s"] = _within(
                r["first_good_answer_after_kill_s"], RECOVERY_TARGET_S
            )
    if "kill2" in results:
        targets["kill2: no request sent after the kill fails"] = results["kill2"]["sent_after_kill_failed"] == 0
    return targets
