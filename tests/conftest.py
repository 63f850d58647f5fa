"""Shared fixtures: the real checkpoint (converted once per cache) and tiny random models."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # the Triton attention kernels run under Triton's interpreter on CPU tensors; it must be chosen before
    # any test module (collected in folder order) imports engine.attention_triton and decorates them
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.harness import ManagedProcess, ProcessStartError
from compress.data.prepare import DataConfig, prepare
from deploy.export import export
from deploy.triton import TritonServer, free_ports
from engine import LLM, SamplingParams
from engine.checkpoint.store import make_tiny_llama, resolve_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Engine configuration of the LLM the session's Triton server serves (and the in-process reference).
ENGINE_CONFIG = {"max_model_len": 512, "max_num_seqs": 16, "block_size": 16, "num_kv_blocks": 256, "num_threads": 1}
#: A short Locust load (``bench.loadtest.LoadTestConfig`` fields): 2 users for 4 s over 8 prompts, EOS ignored.
SHORT_LOAD = {"users": 2, "spawn_rate": 2.0, "run_time_s": 4.0, "ignore_eos": True, "num_prompts": 8}
#: A two-turn chat record: training labels and evaluation scores cover only its assistant turns.
DIALOG = {
    "messages": [
        {"role": "user", "content": "What is AI?"},
        {"role": "assistant", "content": "A branch of science."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ]
}
#: What the SmolLM2 chat template trains or scores of ``DIALOG``: the assistant turns with their end tokens.
DIALOG_ASSISTANT_TEXT = "A branch of science.<|im_end|>\nYou are welcome.<|im_end|>\n"


@pytest.fixture(scope="session")
def lmforge():
    """``lmforge(*args, timeout=600)``: ``python -m lmforge_cli ARGS`` run in the repository root, with its
    stdout and stderr captured as text; returns the ``CompletedProcess``."""

    def run(*args, timeout: float = 600.0) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "lmforge_cli", *map(str, args)]
        return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def start_frontend(tmp_path_factory):
    """``start_frontend(repo, server, *flags)``: a context manager running ``python -m deploy.openai`` for ``repo``
    in front of ``server`` (a ``TritonServer``, over gRPC) on a free port of 127.0.0.1 (ready once ``/health``
    answers, within 300 s: a shared machine can take minutes to import torch), its log in a fresh temporary
    directory, stopped at its end; yields the base URL."""

    @contextlib.contextmanager
    def start(repo: Path, server: TritonServer, *flags: str):
        log_path = tmp_path_factory.mktemp("openai-frontend") / "frontend.log"
        url = f"http://127.0.0.1:{free_ports(1)[0]}"
        command = [sys.executable, "-m", "deploy.openai", "--repo", repo, "--grpc-url", server.grpc_url]
        command += ["--port", url.rsplit(":", 1)[1], *flags]
        process = ManagedProcess(
            command,
            name="the OpenAI frontend",
            log_path=log_path,
            cwd=REPO_ROOT,
            ready_url=f"{url}/health",
            ready_timeout_s=300,
            stop_timeout_s=15,
            stop_signal=signal.SIGINT,
        )
        try:
            process.__enter__()
        except ProcessStartError as exc:
            pytest.fail(f"{exc}\n{Path(log_path).read_text()[-3000:]}")
        try:
            yield url
        finally:
            process.stop()

    return start


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct checkpoint, converted from the shipped GGUF (cached)."""
    return resolve_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama with grouped-query attention (4 heads, 2 KV heads) and the SmolLM2 tokenizer."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> Path:
    """A small train/val split of the English chatterbot dialogs (48 train, 8 val dialogs)."""
    out = tmp_path_factory.mktemp("chat-data")
    prepare(DataConfig(), out, verbose=False)
    for name, keep in (("train.jsonl", 48), ("val.jsonl", 8)):
        lines = (out / name).read_text().splitlines()[:keep]
        (out / name).write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="session")
def served_repo(tmp_path_factory, tiny_llama_dir) -> Path:
    """A model repository with the tiny random Llama (``llm``) and MiniLM (``minilm``)."""
    repo = tmp_path_factory.mktemp("model_repository")
    export(tiny_llama_dir, repo, name="llm", engine=ENGINE_CONFIG)
    export("minilm-l6", repo, name="minilm", instances=1)
    return repo


@pytest.fixture(scope="session")
def server(served_repo):
    """One real tritonserver for the whole session, on free ports of 127.0.0.1."""
    http, grpc, metrics = free_ports(3)
    with TritonServer(
        served_repo, http, grpc, metrics, models=["llm", "minilm"], startup_timeout_s=600, exit_timeout_s=3
    ) as triton:
        yield triton
        if not triton.is_running():  # tests that used it failed on a closed connection: say why
            pytest.fail(
                f"the session's tritonserver exited during the tests (status {triton.process.returncode}); "
                f"log tail:\n{triton.log_tail(80)}"
            )


@pytest.fixture(scope="session")
def engine_text(tiny_llama_dir):
    """Greedy completions of the in-process engine (same checkpoint and EngineConfig)."""
    llm = LLM(str(tiny_llama_dir), **ENGINE_CONFIG)
    cache = {}

    def complete(prompt: str | dict | list[str], **params):
        """(text, number of tokens) of one prompt (text or ``{"prompt_token_ids": ids}``), or a list of them."""
        prompts = [prompt] if isinstance(prompt, (str, dict)) else prompt
        key = json.dumps(params, sort_keys=True)
        missing = [p for p in prompts if (json.dumps(p), key) not in cache]
        if missing:  # one batched call
            for p, output in zip(missing, llm.generate(missing, SamplingParams(**params))):
                cache[(json.dumps(p), key)] = (output.outputs[0].text, len(output.outputs[0].token_ids))
        results = [cache[(json.dumps(p), key)] for p in prompts]
        return results[0] if isinstance(prompt, (str, dict)) else results

    return complete


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-kernel-path",
        default="auto",
        choices=("auto", "amx", "vnni", "onednn", "torch"),
        help="force one CPU kernel path for the whole run (engine.kernel_paths); default: what the CPU supports",
    )


def pytest_configure(config):
    from engine.kernel_paths import force_cpu_kernel_path

    force_cpu_kernel_path(config.getoption("--cpu-kernel-path"))


def pytest_report_header(config):
    lines = [f"cpu kernel path: {config.getoption('--cpu-kernel-path')}"]
    with contextlib.suppress(OSError):  # the Python backend's stubs map their regions there
        shm = os.statvfs("/dev/shm")
        free_mib, size_mib = (n * shm.f_frsize / 2**20 for n in (shm.f_bavail, shm.f_blocks))
        lines.append(f"/dev/shm: {free_mib:.0f} of {size_mib:.0f} MiB free")
    return lines


@pytest.fixture
def kernel_path_allows():
    """``kernel_path_allows(name)``: skip a test of kernel set ``name`` (amx, fused, gemv, decode, engine) that
    the forced ``--cpu-kernel-path`` holds off; the run of that path tests the fallback instead."""
    from engine.kernel_paths import _FORBIDDEN, forced_cpu_kernel_path

    def check(*names: str) -> None:
        path = forced_cpu_kernel_path()
        held = [n for n in names if n in _FORBIDDEN[path]]
        if held:
            pytest.skip(f"--cpu-kernel-path={path} holds {', '.join(held)} off")

    return check
