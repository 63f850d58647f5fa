"""``ModelSupervisor`` treats a server that stopped answering as dead: it kills it and starts it again.

The server here is a stand-in, a small Python HTTP server answering the endpoints the supervisor uses
(``/v2/health/live``, ``/v2/repository/index``), so the test runs in seconds without Triton. It is hung the way
Triton 2.51 hangs after a stub dies mid-request: the process stays, its sockets accept, nothing answers
(SIGSTOP), with or without the "terminate called ..." line in its log first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from deploy.triton import ModelSupervisor, TritonError, TritonServer, free_ports, http_json

STAND_IN = r"""
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200 if self.path == "/v2/health/live" else 404, {})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/v2/repository/index":
            self.reply(200, [{"name": "m", "version": "1", "state": "READY", "reason": ""}])
        elif self.path == "/crash":  # what Triton 2.51 printed before it hung
            print("terminate called after throwing an instance of 'boost::interprocess::lock_exception'", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            self.reply(404, {})

    def log_message(self, *args):
        pass

print("stand-in serving", flush=True)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


class StandInServer(TritonServer):
    """``TritonServer`` whose ``start`` runs ``STAND_IN`` (its own process group, log at ``log_path``)."""

    def start(self) -> "StandInServer":
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", STAND_IN, str(self.ports["http"])],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        for _ in range(600):  # 60 s at most: a busy machine starts Python slowly
            if self.process.poll() is not None:
                raise TritonError(f"the stand-in exited: {self.log_tail()}")
            try:
                if http_json(self.http_url + "/v2/health/live", timeout_s=1.0)[0] == 200:
                    return self
            except OSError:
                time.sleep(0.1)
        raise TritonError("the stand-in did not answer within 60 s")


def _eventually(condition, timeout_s: float = 60.0):
    """``condition()`` once it is truthy, polled every 0.1 s for up to ``timeout_s`` (a generous bound)."""
    for _ in range(int(timeout_s * 10)):
        if value := condition():
            return value
        time.sleep(0.1)
    return condition()


@pytest.fixture
def stand_in(tmp_path):
    """A started stand-in server and a supervisor factory; both stopped (and every process killed) at the end."""
    log_path = tmp_path / "server.log"
    server = StandInServer(tmp_path, *free_ports(3), models=["m"], log_path=log_path, write_pid_file=False)
    server.start()
    started = [server.process]
    supervisors = []

    def supervise(**kwargs) -> tuple[ModelSupervisor, list[str]]:
        lines: list[str] = []
        supervisors.append(ModelSupervisor(server, interval_s=0.1, report=lines.append, **kwargs).start())
        return supervisors[-1], lines

    yield server, supervise
    for supervisor in supervisors:
        supervisor.stop()
    for process in {*started, server.process}:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def test_a_server_that_stops_answering_is_killed_and_started_again(stand_in, tmp_path):
    server, supervise = stand_in
    supervisor, lines = supervise(hang_after_s=1.0)
    hung = server.process
    os.kill(hung.pid, signal.SIGSTOP)  # alive, accepting connections, answering nothing
    assert _eventually(lambda: supervisor.restarts), lines
    assert hung.wait(timeout=10) == -signal.SIGKILL  # the hung process (its group) was killed
    assert server.process is not hung and server.is_running()
    assert http_json(server.http_url + "/v2/health/live", timeout_s=10)[0] == 200  # the new one answers
    ((why, _took_s),) = supervisor.restarts  # one hang, one restart
    assert why.startswith("stopped answering for ") and "terminate" not in why
    assert (tmp_path / "server.log.1").read_text().startswith("stand-in serving")  # the old log is kept
    assert any(f"(pid {hung.pid}) stopped answering for" in line and "killing it" in line for line in lines), lines
    assert any("log kept as" in line and line.endswith("restarting it") for line in lines), lines
    assert not supervisor.finished.is_set()


def test_terminate_called_in_the_log_then_silence_is_a_hang_at_once(stand_in):
    server, supervise = stand_in
    # hang_after_s far beyond the wait below: only the log line can make the supervisor act in time
    supervisor, lines = supervise(hang_after_s=600.0)
    hung = server.process
    with pytest.raises(OSError):
        http_json(server.http_url + "/crash", method="POST", body={}, timeout_s=1.0)
    assert _eventually(lambda: supervisor.restarts), lines
    assert hung.wait(timeout=10) == -signal.SIGKILL
    (why, _took_s), *_ = supervisor.restarts
    assert "boost::interprocess::lock_exception" in why and why.startswith("stopped answering for ")
    assert http_json(server.http_url + "/v2/health/live", timeout_s=10)[0] == 200


def test_a_hang_counts_against_max_restarts(stand_in):
    server, supervise = stand_in
    supervisor, lines = supervise(hang_after_s=1.0, max_restarts=0)
    hung = server.process
    os.kill(hung.pid, signal.SIGSTOP)
    assert supervisor.finished.wait(timeout=60), lines  # killed, not started again: the supervisor gives up
    assert supervisor.restarts == [] and supervisor.exit_status == -signal.SIGKILL
    assert server.process is hung and not server.is_running()
    assert any("not restarting after 0 restarts" in line for line in lines), lines
