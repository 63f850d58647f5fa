"""``lmforge bench structured``'s report: ratio, valid share and grammar costs from known inputs.

The live run (tritonserver + the OpenAI frontend) is the benchmark itself; its figures are in
docs/serving.md. Here the report is fed raw samples and Prometheus counter values whose results
are known.
"""

from __future__ import annotations

import argparse
import json

import pytest

from bench.metrics import RequestSample, summarize
from bench.serving_compare import row_from_summary
from bench.structured_bench import (
    TARGET_RATIO,
    Person,
    add_arguments,
    build_report,
    format_report,
    grammar_costs,
    prompts,
    response_format,
    run,
    valid_share,
)
from engine.errors import UsageError

GOOD = '{"name":"Ana","age":31,"city":"Lisbon","email":"ana@example.com","active":true}'


def _row(name: str, tokens_per_request: int, requests: int, failed: int = 0) -> dict:
    """A phase of ``requests`` 1-second requests back to back, 10 ms between tokens."""
    samples = [
        RequestSample(
            start_s=float(i),
            e2e_s=1.0,
            ttft_s=0.1,
            itl_s=[0.01] * (tokens_per_request - 1),
            output_tokens=tokens_per_request,
        )
        for i in range(requests)
    ]
    samples += [RequestSample(start_s=requests - 1.0, e2e_s=0.5, error="HTTP 500: boom") for _ in range(failed)]
    row = row_from_summary(name, 16, {"metrics": summarize(samples)}, samples, 2000.0)
    row["mean_output_tokens"] = float(tokens_per_request)
    return row


def test_response_format_is_a_strict_five_field_schema():
    rf = response_format()
    schema = rf["json_schema"]["schema"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["strict"] is True
    assert schema["required"] == ["name", "age", "city", "email", "active"]
    assert schema["additionalProperties"] is False
    assert [schema["properties"][k]["type"] for k in schema["required"]] == [
        "string",
        "integer",
        "string",
        "string",
        "boolean",
    ]
    assert len(set(prompts())) == len(prompts()) and all("JSON object" in p for p in prompts())


def test_valid_share_parses_and_validates_strictly():
    assert Person.model_validate_json(GOOD).age == 31
    texts = [
        GOOD,
        GOOD.replace("31", '"31"'),  # a string age: refused in strict mode
        GOOD[:-1],  # cut off at max_tokens
        GOOD.replace("}", ',"extra":1}'),  # a field the schema forbids
        None,
    ]
    assert valid_share(texts) == pytest.approx(1 / 5)
    assert valid_share([]) is None


def test_grammar_costs_from_counters():
    name = "lmforge_structured_output_{}_total".format
    mid = {name("compiles"): 1, name("compile_seconds"): 0.004, name("mask_seconds"): 0.0}
    end = {
        name("compiles"): 1,
        name("compile_seconds"): 0.004,
        name("mask_seconds"): 0.6,
        name("mask_steps"): 300,
        name("masked_tokens"): 1200,
    }
    costs = grammar_costs(mid, end)
    assert costs["compiles"] == 1 and costs["compile_ms"] == pytest.approx(4.0)
    assert costs["mask_ms_per_step"] == pytest.approx(2.0)
    assert costs["mask_ms_per_token"] == pytest.approx(0.5)
    assert costs["masked_tokens"] == 1200
    assert grammar_costs({}, {}) == {
        "compiles": 0,
        "compile_ms": None,
        "mask_ms_per_step": None,
        "mask_ms_per_token": None,
        "masked_tokens": 0,
    }


def test_report_ratio_target_and_table():
    # plain: 10 requests x 50 tokens over 10 s; structured: 10 x 40 tokens over 10 s, one failure
    rows = {"plain": _row("plain", 50, 10), "structured": _row("structured", 40, 10, failed=1)}
    costs = {"compiles": 1, "compile_ms": 4.0, "mask_ms_per_step": 2.0, "mask_ms_per_token": 0.5, "masked_tokens": 9}
    report = build_report(rows, [GOOD] * 9 + ["{"], costs, {"users": 16})
    assert rows["plain"]["output_tok_s"] == pytest.approx(50.0)
    assert rows["structured"]["output_tok_s"] == pytest.approx(40.0)
    assert report["structured_over_plain_tok_s"] == pytest.approx(0.8)
    assert report["meets_target"] is False and report["target_ratio"] == TARGET_RATIO
    assert report["structured_valid_share"] == pytest.approx(0.9)
    assert rows["structured"]["failed"] == 1 and rows["structured"]["ttft_p50_ms"] == pytest.approx(100.0)
    assert rows["plain"]["itl_p99_ms"] == pytest.approx(10.0)
    json.dumps(report)  # what structured.json holds
    table = format_report(report)
    assert "| plain | 50.0 | 100 | 100 | 10.0 | 10.0 | 50.0 | 10 | 0 |" in table
    assert "| structured | 40.0 |" in table and "| 10 | 1 |" in table
    assert "0.80x (misses the >= 0.9x target)" in table
    assert "parse and validate: 90.0% of 10" in table
    assert "4.00 ms over 1 compile(s); mask: 2.000 ms per engine step, 0.500 ms per token" in table


@pytest.mark.parametrize(
    "flags, named",
    [(["--users", "0"], "--users 0"), (["--max-tokens", "0"], "--max-tokens 0"), (["--run-time", "abc"], "--run-time")],
)
def test_bad_flags_are_usage_errors_naming_the_flag(flags, named, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UsageError, match=named) as refused:
        run(parser.parse_args([*flags, "--out", str(tmp_path / "out")]))
    assert refused.value.exit_code == 2 and not (tmp_path / "out").exists()
