"""``lmforge serve`` stopped by Ctrl-C at any point after the server is up stops what it started: the
interrupt may land while the startup lines print or the supervisor starts, not only in the serving loop."""

from __future__ import annotations

import argparse
import signal

import pytest

import deploy.serve as serve


class _Server:
    """Stands in for ``TritonServer``: records whether it was stopped."""

    instances: list[_Server] = []

    def __init__(self, repo, *args, **kwargs) -> None:
        self.repo, self.skipped, self.models, self.stopped = repo, {}, ["llm"], False
        self.http_url = self.grpc_url = self.metrics_url = self.log_path = "-"
        _Server.instances.append(self)

    def start(self) -> _Server:
        return self

    def stop(self) -> None:
        self.stopped = True


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["_supervise", "endpoint_examples"])
def test_ctrl_c_before_the_serving_loop_stops_the_server(monkeypatch, tmp_path, capsys, where):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--repo", str(tmp_path), "--http-port", "23901", "--grpc-port", "23902"])
    monkeypatch.setattr(serve, "TritonServer", _Server)
    monkeypatch.setattr(serve, "endpoint_examples", lambda server: [])
    monkeypatch.setattr(serve, where, _interrupt)
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        assert serve.run(args) == 130
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
    assert _Server.instances[-1].stopped
    assert capsys.readouterr().out.endswith("server stopped\n")
