"""The engine benchmark's peers (vLLM, llama-server) against fakes that speak their protocols,
the "not installed" path, and the matmul peak per dtype. No real peer is needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import peers
from bench.bound import MATMUL_DTYPES, measure_matmul_gflops
from bench.engine_backends import RunSpec, run_spec
from bench.engine_bench import Peers, not_installed, prepare_gguf

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"
FAKE_SERVER = FAKES / "fake_llama_server.py"


def _fake_tokens(prompt: list[int], n: int, offset: int = 0) -> list[int]:
    return [(sum(prompt) + i + offset) % 1000 for i in range(n)]


def _work(tmp_path: Path, prompts: list[list[int]], max_tokens: int, single: list[int] | None = None) -> Path:
    path = tmp_path / "workload.json"
    path.write_text(
        json.dumps({"prompts": prompts, "max_tokens": max_tokens, "single_prompt": single, "single_max_tokens": 3})
    )
    return path


def test_missing_peers_are_reported_as_not_installed(tmp_path):
    nothing = Peers(vllm_python=tmp_path / "no-python", llama_server=None, gguf_converter=None)
    for config in ("vllm_fp32", "vllm_bf16", "llama_cpp_server_f32", "llama_cpp_server_q8_0"):
        assert "not installed: run `make peers`" in not_installed(config, nothing)
    assert not_installed("engine_fp32", nothing) is None
    # a llama-server without the converter: not installed unless the GGUF is already there
    server_only = Peers(vllm_python=None, llama_server=FAKE_SERVER, gguf_converter=None)
    assert not_installed("llama_cpp_server_f32", server_only) is None
    path, note, missing = prepare_gguf("llama_cpp_server_f32", tmp_path / "tiny", tmp_path, server_only)
    assert path is None and missing and "convert_hf_to_gguf.py not installed: run `make peers`" in note
    (tmp_path / "tiny-q8_0.gguf").write_bytes(b"GGUF")
    path, note, missing = prepare_gguf("llama_cpp_server_q8_0", tmp_path / "tiny", tmp_path, server_only)
    assert path == str(tmp_path / "tiny-q8_0.gguf") and "reused" in note and not missing


def test_vllm_config_without_vllm_is_not_installed(tmp_path):
    spec = RunSpec(config="vllm_bf16", model=str(tmp_path), workload_path=str(_work(tmp_path, [[1, 2]], 2)))
    result = run_spec(spec)  # this interpreter has no vllm
    assert result.status == "not installed" and "run `make peers`" in result.reason and "--vllm-python" in result.reason


def test_llama_server_adapter_against_a_fake_server(tiny_llama_dir, tmp_path):
    gguf = tmp_path / "m-f32.gguf"
    gguf.write_bytes(b"GGUF")
    prompts = [[1, 2, 3], [10, 20, 30, 40], [7]]
    spec = RunSpec(
        config="llama_cpp_server_f32",
        model=str(tiny_llama_dir),
        workload_path=str(_work(tmp_path, prompts, 5, single=[4, 4])),
        gguf=str(gguf),
        llama_server=str(FAKE_SERVER),
        threads=2,
        log_dir=str(tmp_path),
    )
    result = run_spec(spec)
    assert result.status == "ok", result.reason
    assert result.token_ids == [_fake_tokens(p, 5) for p in prompts]  # token-id prompts arrived intact, one stream each
    assert len(result.ttft_s) == 3 and all(0 < t <= result.elapsed_s for t in result.ttft_s)
    assert result.single.token_ids == _fake_tokens([4, 4], 3) and 0 < result.single.ttft_s <= result.single.elapsed_s
    assert 0 < result.load_s <= result.startup_s
    assert result.peak_rss_bytes > 1_000_000  # the server process's, sampled


def test_llama_server_errors_are_reported(tiny_llama_dir, tmp_path):
    # the server refuses the model file: the row fails with the server's own words
    spec = RunSpec(
        config="llama_cpp_server_q8_0",
        model=str(tiny_llama_dir),
        workload_path=str(_work(tmp_path, [[1]], 2)),
        gguf=str(tmp_path / "missing.gguf"),
        llama_server=str(FAKE_SERVER),
        log_dir=str(tmp_path),
    )
    result = run_spec(spec)
    assert result.status == "failed" and "exited with 1" in result.reason and "missing.gguf not found" in result.reason


def test_completion_payload_is_greedy_and_exact_length():
    body = peers.completion_payload([5, 6], 64)
    assert body["prompt"] == [5, 6] and body["n_predict"] == 64 and body["stream"] and body["return_tokens"]
    assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["ignore_eos"] and body["cache_prompt"]


def test_vllm_adapter_runs_under_another_interpreter(tiny_llama_dir, tmp_path):
    """The bench runs vllm_* through `--vllm-python` with `bench.engine_backends`; here that
    interpreter is this one with a fake vllm package first on PYTHONPATH."""
    from bench.engine_bench import run_config

    prompts = [[1, 2, 3], [9, 9]]
    env = dict(peers.vllm_env(2), PYTHONPATH=str(FAKES / "fake_vllm"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    results = {}
    for config in ("vllm_fp32", "vllm_bf16"):
        spec = RunSpec(
            config=config, model=str(tiny_llama_dir), workload_path=str(_work(tmp_path, prompts, 4, single=[3]))
        )
        results[config] = run_config(spec, tmp_path, timeout_s=120, python=Path(sys.executable), env=env)
    fp32, bf16 = results["vllm_fp32"], results["vllm_bf16"]
    assert fp32["status"] == "ok", fp32["reason"]
    assert fp32["token_ids"] == [_fake_tokens(p, 4) for p in prompts]
    assert bf16["token_ids"] == [_fake_tokens(p, 4, offset=1) for p in prompts]  # dtype reached vLLM
    assert fp32["single"]["token_ids"] == _fake_tokens([3], 3)
    assert len(fp32["ttft_s"]) == 2 and all(0 < t <= fp32["elapsed_s"] for t in fp32["ttft_s"])
    assert 0 < fp32["load_s"] <= fp32["startup_s"] and fp32["peak_rss_bytes"] > 1_000_000


def test_matmul_peak_per_dtype():
    for dtype in MATMUL_DTYPES:
        assert measure_matmul_gflops(size=64, min_time_s=0.01, repeats=1, dtype=dtype) > 0
    with pytest.raises(ValueError, match="choose one of fp32, bf16, int8"):
        measure_matmul_gflops(size=64, dtype="fp8")
