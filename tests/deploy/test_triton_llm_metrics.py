"""``deploy.triton_llm.LLMMetrics`` turns ``EngineStats`` snapshots into Prometheus metrics.

Triton's ``triton_python_backend_utils`` exists only inside the server, so a recording stand-in
with the same ``MetricFamily`` / ``Metric`` calls is put in its place (the live server path is
covered by tests/deploy/test_serve.py).
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from engine.stats import EngineStats


class FakeMetric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0.0

    def set(self, value):
        self.value = value

    def increment(self, value):
        assert value >= 0, "a counter only goes up"
        self.value += value

    def observe(self, value):
        self.value = value


class FakeFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    created: dict = {}

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind
        FakeFamily.created[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (Triton's name)
        self.metric = FakeMetric(labels)
        return self.metric


@pytest.fixture
def triton_llm(monkeypatch):
    fake = types.ModuleType("triton_python_backend_utils")
    fake.MetricFamily = FakeFamily
    fake.TritonModelException = RuntimeError
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "deploy.triton_llm", raising=False)
    FakeFamily.created = {}
    yield importlib.import_module("deploy.triton_llm")
    sys.modules.pop("deploy.triton_llm", None)


def _stats(**spec) -> EngineStats:
    return EngineStats(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.5,
        num_preemptions_total=2,
        prefix_cache_queries_tokens_total=10,
        prefix_cache_hits_tokens_total=5,
        num_prompt_tokens_total=10,
        num_generation_tokens_total=20,
        num_requests_finished_total=1,
        num_steps_total=7,
        num_kv_blocks=8,
        num_free_kv_blocks=4,
        num_cached_kv_blocks=0,
        **spec,
    )


def test_speculative_counters_and_gauges(triton_llm):
    metrics = triton_llm.LLMMetrics({"model": "m", "version": "1"})
    metrics.update_stats(
        _stats(
            spec_decode_num_drafts_total=4,
            spec_decode_num_draft_tokens_total=16,
            spec_decode_num_accepted_tokens_total=8,
        )
    )
    metrics.update_stats(
        _stats(
            spec_decode_num_drafts_total=6,
            spec_decode_num_draft_tokens_total=24,
            spec_decode_num_accepted_tokens_total=18,
        )
    )
    value = {name: family.metric.value for name, family in FakeFamily.created.items() if hasattr(family, "metric")}
    assert FakeFamily.created["lmforge_spec_decode_num_draft_tokens_total"].kind == "counter"
    assert value["lmforge_spec_decode_num_drafts_total"] == 6
    assert value["lmforge_spec_decode_num_draft_tokens_total"] == 24
    assert value["lmforge_spec_decode_num_accepted_tokens_total"] == 18
    assert value["lmforge_spec_decode_acceptance_rate"] == pytest.approx(18 / 24)
    assert value["lmforge_spec_decode_mean_accepted_length"] == pytest.approx(1 + 18 / 6)
    assert value["lmforge_num_preemptions_total"] == 2  # counted once over two snapshots


def test_structured_output_cost_counters(triton_llm):
    metrics = triton_llm.LLMMetrics({"model": "m", "version": "1"})
    for compile_s, mask_s, steps, tokens in ((0.004, 0.25, 10, 30), (0.004, 0.5, 20, 70)):
        metrics.update_stats(
            _stats(
                structured_output_num_compiles_total=1,
                structured_output_compile_seconds_total=compile_s,
                structured_output_mask_seconds_total=mask_s,
                structured_output_num_mask_steps_total=steps,
                structured_output_num_masked_tokens_total=tokens,
            )
        )
    value = {name: family.metric.value for name, family in FakeFamily.created.items() if hasattr(family, "metric")}
    assert FakeFamily.created["lmforge_structured_output_mask_seconds_total"].kind == "counter"
    assert value["lmforge_structured_output_compiles_total"] == 1
    assert value["lmforge_structured_output_compile_seconds_total"] == pytest.approx(0.004)
    assert value["lmforge_structured_output_mask_seconds_total"] == pytest.approx(0.5)
    assert value["lmforge_structured_output_mask_steps_total"] == 20
    assert value["lmforge_structured_output_masked_tokens_total"] == 70
