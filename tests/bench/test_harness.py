"""The bench harness: processes start, become ready and always end with their whole group; peers
are found where ``make peers`` put them; percentiles are exact; reports are written."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.harness import (
    ManagedProcess,
    Peers,
    ProcessStartError,
    align_columns,
    peers_dir,
    percentiles,
    run_process,
    wait_for_url,
    write_json,
)
from deploy.triton import free_ports

#: A parent that starts a child which ignores SIGTERM, prints both pids, says "ready", then waits.
STUBBORN_TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(0.2)
print("ready to serve", flush=True)
time.sleep(600)
"""


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_process_ready_by_log_line_ends_with_its_whole_group(tmp_path):
    log = tmp_path / "tree.log"
    with ManagedProcess(
        [sys.executable, "-c", STUBBORN_TREE], log_path=log, ready_line="ready to serve", stop_timeout_s=1.0
    ) as tree:
        child = int(log.read_text().splitlines()[0])
        leader = tree.proc.pid
        assert tree.proc.poll() is None and not _gone(child, 0.1)
        assert os.getpgid(child) == leader  # in the group the harness ends
    # the leader ended on SIGTERM; its child ignored it and was ended by the group's SIGKILL
    assert tree.exit_code == -signal.SIGTERM and _gone(leader) and _gone(child)


def test_a_process_ready_by_url_and_ended_when_the_block_raises(tmp_path):
    port = free_ports(1)[0]
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with pytest.raises(RuntimeError, match="measurement failed"):
        with ManagedProcess(command, ready_url=f"http://127.0.0.1:{port}/", log_path=tmp_path / "http.log") as server:
            pid = server.proc.pid
            assert wait_for_url(f"http://127.0.0.1:{port}/", 10.0) is not None
            raise RuntimeError("measurement failed")
    assert _gone(pid) and server.exit_code is not None
    assert wait_for_url(f"http://127.0.0.1:{port}/", 60.0, alive=lambda: False) is None  # gone: no wait


def test_a_process_that_exits_or_is_late_fails_to_start_with_its_log_tail(tmp_path):
    failing = ManagedProcess(
        [sys.executable, "-c", "import sys; print('no model file'); sys.exit(3)"],
        name="stub server",
        log_path=tmp_path / "fail.log",
        ready_url="http://127.0.0.1:9/health",
    )
    with pytest.raises(ProcessStartError, match="stub server exited with 3: no model file") as info:
        failing.__enter__()
    assert info.value.exit_code == 3 and failing.exit_code == 3
    late = ManagedProcess(
        [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(600)"],
        log_path=tmp_path / "late.log",
        ready_line="listening",
        ready_timeout_s=1.0,
    )
    with pytest.raises(ProcessStartError, match="not ready after 1 s: loading") as info:
        late.__enter__()
    assert info.value.exit_code is None and _gone(late.proc.pid)
    with pytest.raises(ValueError, match="ready_line needs log_path"):
        ManagedProcess(["true"], ready_line="x")


def test_run_process_kills_the_group_at_its_time_limit():
    done = run_process([sys.executable, "-c", "print('hi')"], 60)
    assert (done.returncode, done.stdout, done.timed_out) == (0, "hi\n", False)
    started = time.monotonic()
    late = run_process([sys.executable, "-c", STUBBORN_TREE], 1.0)
    assert late.timed_out and late.returncode == -signal.SIGKILL and time.monotonic() - started < 30
    assert _gone(int(late.stdout.splitlines()[0]))


def test_peers_are_found_in_the_repository_or_in_lmforge_peers(tmp_path, monkeypatch):
    monkeypatch.delenv("LMFORGE_PEERS", raising=False)
    assert peers_dir() == Path(__file__).resolve().parents[2] / ".peers"
    monkeypatch.setenv("LMFORGE_PEERS", str(tmp_path))
    assert peers_dir() == tmp_path
    assert Peers.find() == Peers(None, None, None, None)
    installed = ("vllm/bin/python", "vllm/bin/vllm", "llama.cpp/build/bin/llama-server")
    installed += ("llama.cpp/src/convert_hf_to_gguf.py",)
    for part in installed:
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / part).touch()
    found = Peers.find()
    assert found.vllm_python == tmp_path / "vllm/bin/python" and found.vllm_executable == tmp_path / "vllm/bin/vllm"
    assert found.llama_server == tmp_path / "llama.cpp/build/bin/llama-server"
    assert found.gguf_converter == (tmp_path / "vllm/bin/python", tmp_path / "llama.cpp/src/convert_hf_to_gguf.py")
    assert found.openvino_python is None and found.python("vllm") == found.vllm_python
    assert Peers.find(llama_server="/opt/llama-server").llama_server == Path("/opt/llama-server")


def test_percentiles_are_exact_and_reports_are_written(tmp_path):
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values) == {"p50": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert percentiles([7.0], (50, 99.9)) == {"p50": 7.0, "p99_9": 7.0}
    path = write_json(tmp_path / "report.json", {"rows": [{"tok_s": 1.5}], "model": tmp_path})
    assert json.loads(path.read_text()) == {"rows": [{"tok_s": 1.5}], "model": str(tmp_path)}
    lines = [["engine_fp32", "fp32", "123.4"], ["vllm_bf16", "not installed"], ["hf", "bf16", "9.0"]]
    assert align_columns(["config", "dtype", "tok/s"], lines).splitlines() == [
        "config       dtype  tok/s",
        "engine_fp32   fp32  123.4",
        "vllm_bf16    not installed",
        "hf            bf16    9.0",
    ]


def test_bench_serving_starts_the_installed_peers_and_stops_them(tmp_path, monkeypatch, tiny_llama_dir):
    """``lmforge bench serving --peers``: llama-server from the peers directory (here the fake one) becomes an
    endpoint once ready, a missing vLLM is a note, and the stack ends the server."""
    import argparse
    import contextlib

    from bench.serving_compare import start_peers

    peers = tmp_path / "peers"
    (peers / "bin").mkdir(parents=True)
    (peers / "bin" / "llama-server").symlink_to(Path(__file__).resolve().parents[1] / "fakes" / "fake_llama_server.py")
    (peers / "model-f32.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("LMFORGE_PEERS", str(peers))
    args = argparse.Namespace(
        checkpoint=str(tiny_llama_dir),
        peer_model_name="tiny",
        dtype="float32",
        gguf=None,
        users=[1, 2],
        max_model_len=64,
        shared_system_prompt=False,
        peer_endpoint="completions",
    )
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        (endpoint,) = start_peers(args, tmp_path, notes, stack)
        assert (endpoint.name, endpoint.api, endpoint.model, endpoint.endpoint) == (
            "llama-server",
            "openai",
            "tiny",
            "completions",
        )
        assert wait_for_url(f"{endpoint.url}/health", 5.0) is not None
        pids = [p.pid for p in psutil.Process().children() if str(peers) in " ".join(p.cmdline())]
    assert notes == [f"vllm skipped: no vllm venv under {peers} (install it with `make peers`)"]
    assert len(pids) == 1 and _gone(pids[0])
