"""The engine benchmark's peers (vLLM, llama-server) against fakes that speak their protocols,
the "not installed" path, and the matmul peak per dtype. No real peer is needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peers
from bench.bound import MATMUL_DTYPES, measure_matmul_gflops
from bench.engine_backends import RunSpec, run_spec
from bench.harness import Peers, repo_root
from bench.peer_runs import not_installed, prepare_peer_model

ROOT = Path(__file__).resolve().parents[2]
FAKES = ROOT / "tests" / "fakes"
FAKE_SERVER = FAKES / "fake_llama_server.py"


def _fake_tokens(prompt: list[int], n: int, offset: int = 0) -> list[int]:
    return [(sum(prompt) + i + offset) % 1000 for i in range(n)]


def _work(
    tmp_path: Path,
    prompts: list[list[int]],
    max_tokens: int,
    singles: list[list[int]] | None = None,
    alone: list[list[int]] | None = None,
) -> Path:
    path = tmp_path / "workload.json"
    work = {"prompts": prompts, "max_tokens": max_tokens, "single_prompts": singles or [], "single_max_tokens": 3}
    path.write_text(json.dumps(dict(work, alone_prompts=alone or [])))
    return path


def test_missing_peers_are_reported_as_not_installed(tmp_path):
    nothing = Peers(vllm_python=tmp_path / "no-python", llama_server=None, gguf_converter=None)
    for config in ("vllm_fp32", "vllm_bf16", "llama_cpp_server_f32", "llama_cpp_server_q8_0"):
        assert "not installed: run `make peers`" in not_installed(config, nothing)
    assert not_installed("engine_fp32", nothing) is None
    # a llama-server without the converter: not installed unless the GGUF is already there
    server_only = Peers(vllm_python=None, llama_server=FAKE_SERVER, gguf_converter=None)
    assert not_installed("llama_cpp_server_f32", server_only) is None
    path, note, missing = prepare_peer_model("llama_cpp_server_f32", tmp_path / "tiny", tmp_path, server_only)
    assert path is None and missing and "convert_hf_to_gguf.py not installed: run `make peers`" in note
    (tmp_path / "tiny-q8_0.gguf").write_bytes(b"GGUF")
    path, note, missing = prepare_peer_model("llama_cpp_server_q8_0", tmp_path / "tiny", tmp_path, server_only)
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
        workload_path=str(_work(tmp_path, prompts, 5, singles=[[4, 4], [9]])),
        gguf=str(gguf),
        llama_server=str(FAKE_SERVER),
        threads=2,
        log_dir=str(tmp_path),
    )
    result = run_spec(spec)
    assert result.status == "ok", result.reason
    assert result.token_ids == [_fake_tokens(p, 5) for p in prompts]  # token-id prompts arrived intact, one stream each
    assert len(result.ttft_s) == 3 and all(0 < t <= result.elapsed_s for t in result.ttft_s)
    # two prompts alone, one after the other: the first's tokens, the median run's times
    assert result.single.token_ids == _fake_tokens([4, 4], 3) and 0 < result.single.ttft_s <= result.single.elapsed_s
    assert len(result.single.repeats_elapsed_s) == 2 and result.single.elapsed_s == min(result.single.repeats_elapsed_s)
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
    from bench.peer_runs import run_config

    prompts = [[1, 2, 3], [9, 9]]
    env = dict(peers.vllm_env(2), PYTHONPATH=str(FAKES / "fake_vllm"))
    allowed = sorted(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(str(c) for c in allowed[:2])  # cores this process may use
    results = {}
    for config in ("vllm_fp32", "vllm_bf16"):
        spec = RunSpec(
            config=config, model=str(tiny_llama_dir), workload_path=str(_work(tmp_path, prompts, 4, singles=[[3]]))
        )
        results[config] = run_config(spec, tmp_path, timeout_s=120, python=Path(sys.executable), env=env)
    fp32, bf16 = results["vllm_fp32"], results["vllm_bf16"]
    assert fp32["status"] == "ok", fp32["reason"]
    assert fp32["token_ids"] == [_fake_tokens(p, 4) for p in prompts]
    assert bf16["token_ids"] == [_fake_tokens(p, 4, offset=1) for p in prompts]  # dtype reached vLLM
    assert fp32["single"]["token_ids"] == _fake_tokens([3], 3)
    assert len(fp32["ttft_s"]) == 2 and all(0 < t <= fp32["elapsed_s"] for t in fp32["ttft_s"])
    assert 0 < fp32["load_s"] <= fp32["startup_s"] and fp32["peak_rss_bytes"] > 1_000_000
    assert fp32["alone"] == []


def test_vllm_adapter_serves_alone_prompts_one_at_a_time_to_eos(tiny_llama_dir, tmp_path):
    """The speculative benchmark's peer rows: no workload, each prompt served alone, EOS honoured
    (the fake's EOS is token 0: prompt [995] gives 995..999, 0 and stops there)."""
    from bench.peer_runs import run_config

    env = dict(peers.vllm_env(1), PYTHONPATH=str(FAKES / "fake_vllm"))
    alone = [[995], [5, 6]]
    spec = RunSpec(
        config="vllm_fp32", model=str(tiny_llama_dir), workload_path=str(_work(tmp_path, [], 8, alone=alone))
    )
    result = run_config(spec, tmp_path, timeout_s=120, python=Path(sys.executable), env=env)
    assert result["status"] == "ok", result["reason"]
    assert result["token_ids"] == [] and result["elapsed_s"] is None
    assert [r["token_ids"] for r in result["alone"]] == [[995, 996, 997, 998, 999, 0], _fake_tokens([5, 6], 8)]
    assert all(0 < r["ttft_s"] <= r["elapsed_s"] for r in result["alone"])


def test_matmul_peak_per_dtype():
    for dtype in MATMUL_DTYPES:
        assert measure_matmul_gflops(size=64, min_time_s=0.01, repeats=1, dtype=dtype) > 0
    with pytest.raises(ValueError, match="choose one of fp32, bf16, int8"):
        measure_matmul_gflops(size=64, dtype="fp8")


def test_spec_bench_peer_rows_and_the_vllm_target(tiny_llama_dir, tmp_path, monkeypatch):
    """``lmforge bench engine --speculative``'s peer rows: the fake vLLM serves the chat and grounded
    prompts alone (fastest of the repeats per set); the target compares our fastest method with it."""
    from types import SimpleNamespace

    from bench.spec_bench import SpecRow, peer_rows, targets

    monkeypatch.setenv("PYTHONPATH", str(FAKES / "fake_vllm"))
    args = SimpleNamespace(vllm_python=sys.executable, max_tokens=4, spec_repeats=2, threads=1, timeout_s=120)
    rows, note = peer_rows("float32", tiny_llama_dir, args, [[5], [6]], [[7]], tmp_path)
    assert [(r.prompts, r.method, r.concurrency) for r in rows] == [("chat", "vllm", 1), ("grounded", "vllm", 1)]
    assert all(r.output_tok_s > 0 and r.output_tok_per_cpu_s is None for r in rows) and "start-up" in note

    ours = [SpecRow("float32", "chat", 1, m, tok, tok) for m, tok in (("off", 20.0), ("ngram", 21.0), ("draft", 30.0))]
    peer = SpecRow("float32", "chat", 1, "vllm", 24.0, None)
    found = {what: value for what, value, _ in targets(ours + [peer])}
    assert found["float32 alone, chat, draft tok/s vs vLLM-CPU"] == pytest.approx(1.25)

    missing = SimpleNamespace(vllm_python=str(tmp_path / "no-python"), max_tokens=4, spec_repeats=1, threads=1)
    rows, note = peer_rows("bfloat16", tiny_llama_dir, missing, [[5]], [[7]], tmp_path)
    assert rows == [] and "not installed" in note


def test_the_peer_runners_import_without_lmforges_own_dependencies():
    """The vLLM and OpenVINO venvs import ``bench.engine_backends`` and ``bench.peers`` with their own packages
    only: neither may pull in the engine's checkpoint readers (gguf, safetensors, transformers) at import."""
    code = (
        "import sys, bench.engine_backends, bench.peers; "
        "print(sorted(m for m in ('gguf', 'transformers', 'engine.checkpoint.store') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root())
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
