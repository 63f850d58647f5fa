"""``bench/gpu/run.py --dry-run``: the device script end to end on CPU, scaled down.

It runs in its own process, as on the device machine: the checks (greedy tokens equal HF,
prefix cache cold == warm, preemption, bf16 log-probabilities) through the Triton backend under
the interpreter, then the workload at a tiny shape, and writes the JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'lmforge[gpu]')")

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_script_dry_run_passes_and_reports(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.run", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["mode"] == "dry-run" and report["passed"]
    assert [c["name"] for c in report["checks"]] == [
        "greedy_fp32_equals_hf_generate",
        "prefix_cache_cold_equals_warm",
        "preemption_safe",
        "bf16_logprobs_within_tolerance_of_hf_bf16",
    ]
    assert all(c["passed"] for c in report["checks"])
    assert report["checks"][0]["attention_backend"] == "TritonAttentionBackend"
    w = report["workload"]
    assert w["output_tokens"] == w["workload"]["num_requests"] * w["workload"]["max_tokens"]
    assert w["all_requests_full_length"] and w["output_tok_s"] > 0 and w["ttft_p50_ms"] > 0
    assert w["prefix_cache_hit_rate"] > 0
