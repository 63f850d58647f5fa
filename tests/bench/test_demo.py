"""``lmforge demo --smoke`` end to end on a tiny random model and the real Triton server."""

from __future__ import annotations

import json

import psutil
import pytest

from lmforge_cli import main


def _servers_on(repo) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(process.info.get("cmdline") or [])
        if "tritonserver" in cmdline and str(repo) in cmdline:
            found.append(process)
    return found


@pytest.mark.integration
def test_demo_smoke_runs_every_stage_and_stops_the_server(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "demo"
    status = main(["demo", "--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == [
        "load",
        "data",
        "fine-tune",
        "distill",
        "quantize",
        "evaluate",
        "export",
        "serve + load test",
        "baseline: HF generate",
    ]
    assert all(s["status"] == "done" for s in report["stages"]), report["stages"]
    rows = {r["model"]: r for r in report["comparison"]}
    assert list(rows) == ["fp32", "bf16", "int8", "student", "student_int8"]
    for row in rows.values():
        assert row["output_tok_s"] > 0 and row["failed"] == 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert row["perplexity"] > 1 and row["size_mib"] > 0 and 0 <= row["same_top1"] <= 1
    assert rows["fp32"]["kl_mean"] == 0 and rows["fp32"]["same_top1"] == 1.0  # the fine-tuned teacher is the reference
    assert rows["student"]["kl_mean"] > 0
    assert (out / "quality_vs_speed.png").stat().st_size > 0 and report["plot"] == str(out / "quality_vs_speed.png")
    for label in [*rows, "whole_stack"]:
        run_dir = out / "loadtest" / label
        for name in ("summary.json", "samples.jsonl", "locust_stats.csv", "ttft_cdf.png", "e2e_cdf.png"):
            assert (run_dir / name).stat().st_size > 0, name
    assert "fp32" in printed and "int8" in printed and str(out / "report.json") in printed
    baseline = report["baseline"]
    assert baseline["hf_generate_tok_s"] > 0
    assert baseline["factor"] == pytest.approx(baseline["best_served_tok_s"] / baseline["hf_generate_tok_s"])
    assert "whole stack vs HF generate" in printed
    assert baseline["best_served"] == "whole_stack" and baseline["best_served_users"] == 2  # student + INT8
    assert report["config"]["int8_method"] == "w8a8"
    assert _servers_on(out / "model_repository") == []


def test_demo_stops_at_the_failing_stage(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "demo"
    demo = ["demo", "--smoke", "--model", str(tiny_llama_dir), "--out", str(out)]
    assert main([*demo, "--data", str(tmp_path / "missing.jsonl")]) == 2  # refused before any stage
    assert "--data " + str(tmp_path / "missing.jsonl") + ": not found" in capsys.readouterr().err
    assert not out.exists()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    status = main([*demo, "--data", str(broken)])
    err = capsys.readouterr().err
    assert status == 1
    assert "stage 'data' failed" in err and "broken.jsonl" in err
    stages = json.loads((out / "report.json").read_text())["stages"]
    assert [(s["name"], s["status"]) for s in stages] == [("load", "done"), ("data", "failed")]


def test_demo_rejects_bad_budgets(capsys):
    assert main(["demo", "--users", "0"]) == 2
    assert "users=0" in capsys.readouterr().err


def test_smoke_keeps_every_flag_the_user_set():
    import argparse

    from bench.demo import SMOKE_BUDGET, add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--smoke", "--threads", "1", "--finetune-steps", "3"]))
    assert (config.smoke, config.threads, config.finetune_steps) == (True, 1, 3)
    assert config.distill_steps == SMOKE_BUDGET["distill_steps"] and config.out == "reports/demo-smoke"
    assert config_from_args(parser.parse_args(["--smoke"])).threads is None
