"""Running one benchmark configuration: whether its peer is installed (:class:`bench.harness.Peers`),
the GGUF a llama.cpp configuration serves or the OpenVINO IR an OpenVINO configuration runs, each
configuration in a fresh process of its own interpreter (``bench.engine_backends``), ended with
the process group it leads (:func:`bench.harness.run_process`), and the busy processes that
share the cores with it (``--contention``, on :class:`bench.harness.ManagedProcess`).

Shared by ``bench.engine_bench`` and ``bench.spec_bench``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

from bench.engine_backends import BACKENDS, RunSpec
from bench.harness import NOT_INSTALLED, ManagedProcess, Peers, repo_root, run_process
from bench.peers import PeerError, convert_to_gguf, export_openvino


def not_installed(config: str, peers: Peers) -> str | None:
    """Why ``config`` cannot run here ("... not installed: run `make peers`"), or ``None``."""
    backend = BACKENDS[config]
    if backend.interpreter == "vllm" and (peers.vllm_python is None or not peers.vllm_python.exists()):
        return f"vLLM {NOT_INSTALLED} (or pass --vllm-python)"
    if backend.interpreter == "openvino" and (peers.openvino_python is None or not peers.openvino_python.exists()):
        return f"OpenVINO GenAI {NOT_INSTALLED} or `make peers-openvino` (or pass --openvino-python)"
    if backend.gguf_type is not None and (peers.llama_server is None or not peers.llama_server.exists()):
        return f"llama-server {NOT_INSTALLED} (or pass --llama-server)"
    return None


def prepare_peer_model(config: str, model_dir: Path, cache_dir: Path, peers: Peers) -> tuple[str | None, str, bool]:
    """Convert the checkpoint to the form ``config`` runs, reused if already in ``cache_dir``: the
    GGUF type a llama.cpp configuration serves (``<name>-<type>.gguf``, llama.cpp's converter) or
    the OpenVINO IR an OpenVINO configuration runs (``<name>-openvino-<weights>/``,
    ``optimum-cli export openvino``).

    Returns ``(path or None, note, converter missing)``.
    """
    backend = BACKENDS[config]
    if backend.gguf_type is not None:
        out = cache_dir / f"{model_dir.name}-{backend.gguf_type}.gguf"
        tool, have = "llama.cpp's convert_hf_to_gguf.py", peers.gguf_converter is not None

        def convert() -> None:
            convert_to_gguf(model_dir, backend.gguf_type, out, peers.gguf_converter)

    elif backend.openvino_weights is not None:
        out = cache_dir / f"{model_dir.name}-openvino-{backend.openvino_weights}"
        tool, have = "optimum-cli (OpenVINO)", peers.openvino_python is not None

        def convert() -> None:
            export_openvino(model_dir, backend.openvino_weights, out, peers.openvino_python)

    else:
        raise ValueError(f"{config} runs the checkpoint itself; it has no peer model to prepare")
    existed = out.exists()
    if not existed and not have:
        return None, f"{tool} {NOT_INSTALLED}", True
    start = time.perf_counter()
    try:
        convert()
    except PeerError as exc:
        return None, str(exc), False
    how = "reused" if existed else f"converted in {time.perf_counter() - start:.0f} s"
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir() else out.stat().st_size
    return str(out), f"{out} ({how}, {size / 2**20:.0f} MiB)", False


def run_config(
    spec: RunSpec, work_dir: Path, timeout_s: float, python: Path | None = None, env: dict | None = None
) -> dict:
    """Run one configuration in a fresh process of ``python`` (default: this interpreter);
    returns its ``RunResult`` as a dict."""
    spec_path = work_dir / f"{spec.config}.spec.json"
    result_path = work_dir / f"{spec.config}.result.json"
    spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
    cmd = [str(python or sys.executable), "-m", "bench.engine_backends", str(spec_path), str(result_path)]
    root = repo_root()
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    # A process group of its own: the processes a configuration starts (vLLM's engine core, a
    # server) are found by session for their RSS and ended with it.
    proc = run_process(cmd, timeout_s, cwd=root, env=env)
    if proc.timed_out:
        return {"config": spec.config, "status": "failed", "reason": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not result_path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        how = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
        return {"config": spec.config, "status": "failed", "reason": f"process {how}: {' | '.join(tail)}".rstrip(": ")}
    return json.loads(result_path.read_text())


# --------------------------------------------------------------------------------------------
# Busy cores (``--contention``)
# --------------------------------------------------------------------------------------------

#: What each busy process runs: spin until ``argv[1]`` seconds have passed. It asks the kernel to
#: kill it when the benchmark's process (``argv[2]``) dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``),
#: and exits at once if that happened before it asked, so neither a crash nor a kill of the
#: benchmark leaves it behind.
BUSY_LOOP = """
import ctypes, os, sys, time
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[2]):
    sys.exit(0)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""


def busy_cores(count: int) -> list[int]:
    """The cores the ``count`` busy processes spin on: from the last core this process may use
    (``os.sched_getaffinity``) backwards, wrapping around, so with ``--threads`` as many as the
    cores, every busy process shares a core with one of the measured system's threads (peers
    that bind their threads, vLLM among them, take the first cores)."""
    allowed = sorted(os.sched_getaffinity(0))
    return [allowed[-1 - i % len(allowed)] for i in range(count)]


class BusyProcesses:
    """``count`` processes that each spin on one core, for the lifetime of a ``with`` block.

    They model what a served engine shares its cores with (the server, the frontend, the
    tokenizer, a load client): always runnable, never sleeping. Each is bounded in time
    (``limit_s``, a run's own time limit plus a margin), dies with the benchmark's process, and
    is killed and reaped when the block ends, also when it ends with an exception.

    Attributes:
        procs: the running processes (inside the block).
        cores: the core each one is pinned to (:func:`busy_cores`).
    """

    def __init__(self, count: int, limit_s: float) -> None:
        if count < 0:
            raise ValueError(f"busy process count {count}; it must be >= 0")
        self.count, self.limit_s = count, limit_s
        self.cores = busy_cores(count)
        self.procs: list = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "BusyProcesses":
        command = [sys.executable, "-I", "-S", "-c", BUSY_LOOP, f"{self.limit_s:.1f}", str(os.getpid())]
        with contextlib.ExitStack() as stack:
            for core in self.cores:
                busy = stack.enter_context(
                    ManagedProcess(command, name="busy process", affinity={core}, stop_signal=signal.SIGKILL)
                )
                self.procs.append(busy.proc)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self.procs = []
