"""LoRA adapters served through the real tritonserver and the OpenAI frontend, driven by the ``openai`` client.

The tiny random Llama is exported with one adapter declared (``lmforge export --lora a1=DIR``); a second is
loaded and unloaded at run time (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, behind the API
key). Oracle: the in-process engine with the same ``EngineConfig`` and ``LoRARequest`` (whose greedy tokens
equal PEFT's: tests/engine/test_engine_lora.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
import requests

from deploy.export import export
from deploy.triton import TritonServer, free_ports
from engine import LLM, LoRARequest, SamplingParams
from tests.conftest import ENGINE_CONFIG, SHORT_LOAD
from tests.engine.test_engine_lora import make_peft_adapter

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "lora-key-1"
PROMPT = "The quick brown fox"
LORA_ENGINE = {**ENGINE_CONFIG, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-adapters")
    return {
        "a1": make_peft_adapter(tiny_llama_dir, root / "a1", 4, ["q_proj", "v_proj"], seed=21),
        "a2": make_peft_adapter(tiny_llama_dir, root / "a2", 8, ["o_proj", "gate_proj", "down_proj"], seed=22),
        "big": make_peft_adapter(tiny_llama_dir, root / "big", 32, ["q_proj"], seed=23),
    }


@pytest.fixture(scope="module")
def lora_repo(tiny_llama_dir, adapters, tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("lora-repository")
    export(tiny_llama_dir, repo, name="llm", engine=dict(LORA_ENGINE), loras={"a1": adapters["a1"]})
    return repo


@pytest.fixture(scope="module")
def lora_server(lora_repo):
    http, grpc, metrics = free_ports(3)
    with TritonServer(lora_repo, http, grpc, metrics, models=["llm"], startup_timeout_s=600, exit_timeout_s=3) as s:
        yield s


@pytest.fixture(scope="module")
def lora_frontend(lora_server, lora_repo, start_frontend):
    with start_frontend(lora_repo, lora_server, "--models", "llm", "--api-key", API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, adapters) -> dict[str | None, str]:
    """The in-process engine's greedy text of PROMPT under each adapter (``None``: the base)."""
    llm = LLM(str(tiny_llama_dir), **LORA_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    loras = [None, LoRARequest("a1", 1, str(adapters["a1"])), LoRARequest("a2", 2, str(adapters["a2"]))]
    outs = llm.generate([PROMPT] * 3, params, lora_request=loras)
    return {None: outs[0].outputs[0].text, "a1": outs[1].outputs[0].text, "a2": outs[2].outputs[0].text}


def post(frontend: str, route: str, body: dict, key: str | None = API_KEY) -> requests.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return requests.post(f"{frontend}/v1/{route}", json=body, headers=headers, timeout=120)


def lora_metric(server, name: str, lora_name: str) -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    pattern = rf'^{re.escape(name)}\{{[^}}]*lora_name="{re.escape(lora_name)}"[^}}]*\}} ([0-9.eE+-]+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_declared_load_serve_unload_through_triton_and_the_openai_client(
    lora_frontend, lora_server, adapters, expected
):
    client = openai.OpenAI(base_url=f"{lora_frontend}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"llm", "a1"} and cards["a1"].parent == "llm" and cards["llm"].parent is None
    assert len({expected[None], expected["a1"], expected["a2"]}) == 3  # each adapter changes the text

    # the declared adapter, selected by the OpenAI `model` field
    out = client.completions.create(model="a1", prompt=PROMPT, **GREEDY)
    assert out.model == "a1" and out.choices[0].text == expected["a1"]
    assert client.completions.create(model="llm", prompt=PROMPT, **GREEDY).choices[0].text == expected[None]

    # loading at run time is behind the API key; bad adapters are refused naming the field
    body = {"lora_name": "a2", "lora_path": str(adapters["a2"])}
    assert post(lora_frontend, "load_lora_adapter", body, key=None).status_code == 401
    too_big = post(lora_frontend, "load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["big"])})
    assert too_big.status_code == 400 and "max_lora_rank=16" in too_big.json()["error"]["message"]
    assert too_big.json()["error"]["param"] == "lora_path"
    missing = post(lora_frontend, "load_lora_adapter", {"lora_name": "gone", "lora_path": "/nonexistent/adapter"})
    assert missing.status_code == 400 and "no such adapter directory" in missing.json()["error"]["message"]
    loaded = post(lora_frontend, "load_lora_adapter", body)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'a2' added successfully."
    again = post(lora_frontend, "load_lora_adapter", body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert client.models.retrieve("a2").parent == "llm"

    # served through the frontend (whole and streamed) and straight through Triton's generate endpoint
    assert client.completions.create(model="a2", prompt=PROMPT, **GREEDY).choices[0].text == expected["a2"]
    stream = client.completions.create(model="a2", prompt=PROMPT, stream=True, **GREEDY)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected["a2"]
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "lora_name": "a2"}
    direct = requests.post(
        f"{lora_server.http_url}/v2/models/llm/generate",
        json={"text_input": PROMPT, "sampling_parameters": json.dumps(params), "exclude_input_in_output": True},
        timeout=120,
    )
    assert direct.status_code == 200 and direct.json()["text_output"] == expected["a2"]
    unknown = requests.post(
        f"{lora_server.http_url}/v2/models/llm/generate",
        json={"text_input": PROMPT, "sampling_parameters": json.dumps({**params, "lora_name": "nope"})},
        timeout=120,
    )
    assert unknown.status_code == 400 and "lora_name='nope'" in unknown.json()["error"]
    # per-adapter counters on Triton's metrics port
    assert lora_metric(lora_server, "lmforge_lora_requests_finished_total", "a2") >= 3
    assert lora_metric(lora_server, "lmforge_lora_generation_tokens_total", "a2") >= 36
    assert lora_metric(lora_server, "lmforge_lora_requests_finished_total", "a1") >= 1

    # unloading: new requests get 404, a declared adapter stays
    assert post(lora_frontend, "unload_lora_adapter", {"lora_name": "a2"}, key="wrong").status_code == 401
    unloaded = post(lora_frontend, "unload_lora_adapter", {"lora_name": "a2"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'a2' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=PROMPT, **GREEDY)
    assert post(lora_frontend, "unload_lora_adapter", {"lora_name": "a2"}).status_code == 404
    declared = post(lora_frontend, "unload_lora_adapter", {"lora_name": "a1"})
    assert declared.status_code == 400 and "declared at export" in declared.json()["error"]["message"]
    assert {m.id for m in client.models.list().data} == {"llm", "a1"}
    gone = requests.post(
        f"{lora_server.http_url}/v2/models/llm/generate",
        json={"text_input": PROMPT, "sampling_parameters": json.dumps(params)},
        timeout=120,
    )
    assert gone.status_code == 400 and "no such adapter" in gone.json()["error"]
    assert client.completions.create(model="a1", prompt=PROMPT, **GREEDY).choices[0].text == expected["a1"]


def test_export_checks_the_adapters_against_the_base(tiny_llama_dir, adapters, tmp_path):
    from engine.errors import UsageError

    with pytest.raises(UsageError, match="--lora big=.*rank 32.*max_lora_rank=16"):
        export(tiny_llama_dir, tmp_path / "repo", name="llm", engine=dict(LORA_ENGINE), loras={"big": adapters["big"]})
    export(tiny_llama_dir, tmp_path / "repo", name="llm", loras={"a1": adapters["a1"], "a2": adapters["a2"]})
    info = json.loads((tmp_path / "repo" / "llm" / "1" / "model.json").read_text())
    assert info["lora_adapters"] == {"a1": "loras/a1", "a2": "loras/a2"}
    assert info["engine"]["enable_lora"] is True and info["engine"]["max_loras"] == 2
    assert (tmp_path / "repo" / "llm" / "1" / "loras" / "a2" / "adapter_model.safetensors").is_file()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(UsageError, match="--lora llm2: the --name of this export too"):
        export(tiny_llama_dir, tmp_path / "repo", name="llm2", loras={"llm2": adapters["a1"]})
    with pytest.raises(UsageError, match=r"--lora llm: .*repo/llm is a model too, and a request's `model` could not"):
        export(tiny_llama_dir, tmp_path / "repo", name="llm2", loras={"llm": adapters["a1"]})
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_loadtest_spreads_requests_over_adapters(lora_frontend, lora_server, adapters, tmp_path):
    from bench.loadtest import LoadTestConfig, LoadTestError, run_loadtest
    from bench.report import read_samples

    body = {"lora_name": "a2", "lora_path": str(adapters["a2"]), "load_inplace": True}
    assert post(lora_frontend, "load_lora_adapter", body).status_code == 200
    before = {n: lora_metric(lora_server, "lmforge_lora_requests_finished_total", n) for n in ("a1", "a2")}
    common = {**SHORT_LOAD, "max_tokens": 4}
    for api, host in (("openai", lora_frontend), ("triton", lora_server.http_url)):
        config = LoadTestConfig(
            host=host,
            model="llm",
            api=api,
            api_key=API_KEY if api == "openai" else None,
            lora_names=["a1", "a2"],
            request_timeout_s=60.0,
            **common,
        )
        summary = run_loadtest(config, tmp_path / api, log=lambda _m: None)
        samples, _ = read_samples(tmp_path / api / "samples.jsonl")
        assert len(samples) >= 2 and all(s.ok for s in samples), summary["metrics"]["errors"]
    after = {n: lora_metric(lora_server, "lmforge_lora_requests_finished_total", n) for n in ("a1", "a2")}
    assert after["a1"] - before["a1"] >= 2 and after["a2"] - before["a2"] >= 2  # warm-ups and runs, both adapters
    bad = LoadTestConfig(host=lora_frontend, model="llm", api="openai", api_key=API_KEY, lora_names=["zz"], **common)
    with pytest.raises(LoadTestError, match=r"LoRA adapter\(s\) \[.zz.\] are not served"):
        run_loadtest(bad, tmp_path / "bad", log=lambda _m: None)
