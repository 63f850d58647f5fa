"""``lmforge bench lora``'s report and its vLLM peer script (no engine run: the figures are given)."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import pytest

from bench.lora_bench import add_arguments, format_report, run
from engine.errors import UsageError


def _speed(base: float, spread: float, label: str = "bf16") -> dict:
    def row(tok_s: float) -> dict:
        return {"tokens": 4096, "wall_s": 4096 / tok_s, "tok_s": tok_s, "tok_cpu_s": tok_s / 2}

    return {
        f"{label} base alone": row(base),
        f"{label} + 8 adapters": row(spread),
        "int8 + 8 adapters": row(spread * 1.1),
        "int8 base alone": row(base * 1.2),
    }


MEMORY = {
    "rss_base_bytes": 100 * 2**20,
    "rss_1_adapters_bytes": 102 * 2**20,
    "rss_8_adapters_bytes": 150 * 2**20,
    "adapter_bytes_8": 28 * 2**20,
    "slot_bytes_8": 42 * 2**20,
    "adapter_file_bytes": 7 * 2**20,
    "base_weight_bytes": 256 * 2**20,
}


def test_report_gives_ours_over_vllm_with_the_same_adapters():
    vllm = {"vLLM bf16 base alone": {"tok_s": 500.0}, "vLLM bf16 + 8 adapters": {"tok_s": 200.0}}
    text = format_report(_speed(1000.0, 800.0), MEMORY, 8, vllm)
    assert any(line.startswith("bf16 + 8 adapters") and "800.0   0.80x" in line for line in text.splitlines())
    assert "ours / vLLM with 8 adapters (bf16, wall): 4.00x; base alone: 2.00x" in text
    assert "8 adapters +50.0 MiB" in text


def test_report_names_the_fp32_base_where_the_cpu_has_no_native_bf16():
    vllm = {"vLLM fp32 base alone": {"tok_s": 250.0}, "vLLM fp32 + 8 adapters": {"tok_s": 100.0}}
    text = format_report(_speed(400.0, 320.0, "fp32"), MEMORY, 8, vllm, "fp32")
    assert any(line.startswith("fp32 + 8 adapters") and "320.0   0.80x" in line for line in text.splitlines())
    assert "ours / vLLM with 8 adapters (fp32, wall): 3.20x; base alone: 1.60x" in text
    assert "int8 / fp32 with 8 adapters" in text and "MiB in fp32" in text


def test_report_gives_the_targets_round_by_round_and_their_medians():
    speed = _speed(1000.0, 800.0)
    for name, per_round in {
        "bf16 base alone": [1000.0, 900.0, 950.0],
        "bf16 + 8 adapters": [700.0, 810.0, 800.0],
        "int8 + 8 adapters": [770.0, 800.0, 880.0],
    }.items():
        speed[name]["rounds_tok_s"] = per_round
    text = format_report(speed, MEMORY, 8)
    assert "bf16 + 8 adapters / bf16 base alone, round by round: 0.70x, 0.90x, 0.84x (median 0.84x)" in text
    assert "int8 + 8 adapters / bf16 + 8 adapters, round by round: 1.10x, 0.99x, 1.10x (median 1.10x)" in text


def test_report_says_why_vllm_did_not_run():
    text = format_report(_speed(1000.0, 800.0), MEMORY, 8, "vLLM not installed: run `make peers`")
    assert "vLLM-CPU: vLLM not installed: run `make peers`" in text
    assert "ours / vLLM" not in format_report(_speed(1000.0, 800.0), MEMORY, 8)


def test_the_vllm_script_imports_only_the_standard_library_at_module_level():
    """It runs under vLLM's interpreter, whose venv has none of our dependencies."""
    tree = ast.parse(Path("bench/lora_peer.py").read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert top - {"__future__"} <= set(sys.stdlib_module_names)


@pytest.mark.parametrize("flag", ["--adapters", "--rank", "--requests", "--tokens", "--rounds"])
def test_a_count_below_one_is_a_usage_error_naming_its_flag(flag):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UsageError, match=f"^{flag} 0: it must be >= 1") as refused:
        run(parser.parse_args([flag, "0"]))
    assert refused.value.exit_code == 2
