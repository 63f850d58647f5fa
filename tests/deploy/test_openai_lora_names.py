"""Names a run-time LoRA adapter may not take on the OpenAI frontend (``POST /v1/load_lora_adapter``):
the name of any model the API serves, an LLM or a sentence encoder, since ``model`` would then select two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.openai.models import ServedModel
from deploy.openai.protocol import OpenAIError
from deploy.openai.serving_models import OpenAIServingModels, check_unique_names


@pytest.fixture
def serving(tmp_path) -> OpenAIServingModels:
    llm = ServedModel(
        name="llm",
        checkpoint=tmp_path,
        tokenizer=None,
        max_model_len=64,
        created=0,
        vocab_size=32,
        version_dir=tmp_path,
        engine={"enable_lora": True, "max_lora_rank": 16},
    )
    return OpenAIServingModels({"llm": llm}, backend=None, other_names={"minilm"})


def _load(serving: OpenAIServingModels, name: str) -> OpenAIError:
    body = json.dumps({"lora_name": name, "lora_path": str(Path("/nonexistent/adapter"))}).encode()
    with pytest.raises(OpenAIError) as info:
        serving.load_lora_adapter(body)
    return info.value


@pytest.mark.parametrize("name", ["llm", "minilm"])
def test_an_adapter_cannot_take_a_served_models_name(serving, name):
    error = _load(serving, name)
    assert (error.status, error.param) == (400, "lora_name")
    assert error.message == f"lora_name={name!r} is the name of a served model; pick another"
    assert serving.list()["data"] == [serving.card(serving.models["llm"])]  # nothing was added


def test_the_frontend_refuses_to_start_with_an_adapter_named_as_another_model(serving, tmp_path):
    llm = serving.models["llm"]
    check_unique_names({"llm": llm}, {"minilm"})  # no adapter: nothing to refuse
    llm.adapters = {"minilm": tmp_path / "a"}  # e.g. left in multi_lora.json by an older version
    with pytest.raises(ValueError, match=r"adapter 'minilm' of llm has the name of a served model; rename or remove"):
        check_unique_names({"llm": llm}, {"minilm"})
    other = ServedModel(name="llm2", checkpoint=tmp_path, tokenizer=None, max_model_len=64, created=0, vocab_size=32)
    other.adapters = {"support": tmp_path / "b"}
    llm.adapters = {"support": tmp_path / "c"}
    with pytest.raises(ValueError, match="adapter 'support' of llm2 has the name of an adapter of llm"):
        check_unique_names({"llm": llm, "llm2": other})
