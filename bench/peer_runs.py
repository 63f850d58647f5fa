"""Running one benchmark configuration: where the peers are, whether they are installed, the
GGUF a llama.cpp configuration serves, and each configuration in a fresh process of its own
interpreter (``bench.engine_backends``), ended with the session it leads.

Shared by ``bench.engine_bench`` and ``bench.spec_bench``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import peers
from bench.engine_backends import BACKENDS, RunSpec
from bench.peers import NOT_INSTALLED, PeerError, convert_to_gguf


@dataclasses.dataclass
class Peers:
    """Where the peers are for this run (``None``: not installed)."""

    vllm_python: Path | None
    llama_server: Path | None
    gguf_converter: tuple[Path, Path] | None

    @classmethod
    def find(cls, vllm_python: str | None, llama_server: str | None) -> "Peers":
        """The given paths, else what ``make peers`` installed (:mod:`bench.peers`)."""
        return cls(
            Path(vllm_python) if vllm_python else peers.default_vllm_python(),
            Path(llama_server) if llama_server else peers.default_llama_server(),
            peers.gguf_converter(),
        )


def not_installed(config: str, peers: Peers) -> str | None:
    """Why ``config`` cannot run here ("... not installed: run `make peers`"), or ``None``."""
    backend = BACKENDS[config]
    if backend.interpreter == "vllm" and (peers.vllm_python is None or not peers.vllm_python.exists()):
        return f"vLLM {NOT_INSTALLED} (or pass --vllm-python)"
    if backend.gguf_type is not None and (peers.llama_server is None or not peers.llama_server.exists()):
        return f"llama-server {NOT_INSTALLED} (or pass --llama-server)"
    return None


def prepare_gguf(config: str, model_dir: Path, gguf_dir: Path, peers: Peers) -> tuple[str | None, str, bool]:
    """Convert the checkpoint to the GGUF type ``config`` serves (``gguf_dir/<name>-<type>.gguf``,
    reused if already there).

    Returns ``(path or None, note, converter missing)``.
    """
    outtype = BACKENDS[config].gguf_type
    out = gguf_dir / f"{model_dir.name}-{outtype}.gguf"
    existed = out.is_file()
    if not existed and peers.gguf_converter is None:
        return None, f"llama.cpp's convert_hf_to_gguf.py {NOT_INSTALLED}", True
    start = time.perf_counter()
    try:
        convert_to_gguf(model_dir, outtype, out, peers.gguf_converter)
    except PeerError as exc:
        return None, str(exc), False
    how = "reused" if existed else f"converted in {time.perf_counter() - start:.0f} s"
    return str(out), f"{out} ({how}, {out.stat().st_size / 2**20:.0f} MiB)", False


def run_config(
    spec: RunSpec, work_dir: Path, timeout_s: float, python: Path | None = None, env: dict | None = None
) -> dict:
    """Run one configuration in a fresh process of ``python`` (default: this interpreter);
    returns its ``RunResult`` as a dict."""
    spec_path = work_dir / f"{spec.config}.spec.json"
    result_path = work_dir / f"{spec.config}.result.json"
    spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
    cmd = [str(python or sys.executable), "-m", "bench.engine_backends", str(spec_path), str(result_path)]
    root = Path(__file__).resolve().parent.parent
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    # A session of its own: the processes a configuration starts (vLLM's engine core, a server)
    # are found by session for their RSS and ended with it.
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end_session(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"config": spec.config, "status": "failed", "reason": f"timed out after {timeout_s:.0f} s"}
    _end_session(proc.pid, signal.SIGTERM)  # whatever the configuration left running
    if proc.returncode != 0 or not result_path.is_file():
        tail = (stderr or stdout).strip().splitlines()[-3:]
        how = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
        return {"config": spec.config, "status": "failed", "reason": f"process {how}: {' | '.join(tail)}".rstrip(": ")}
    return json.loads(result_path.read_text())


def _end_session(pgid: int, sig: signal.Signals) -> None:
    """Signal the process group a configuration's process led (ours alone); gone is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
