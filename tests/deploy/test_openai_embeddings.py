"""``/v1/embeddings``, ``/tokenize`` and ``/detokenize`` of the OpenAI frontend against the real tritonserver.

The session's Triton server serves the tiny random Llama (``llm``) and all-MiniLM-L6-v2 (``minilm``, the
ONNX graph with the sentence-transformers head); one frontend of this module serves both. The
embeddings are checked against the checkpoint run in process with Hugging Face ``transformers`` in
fp32 (mean pooling over the attention mask, then L2 normalisation: the checkpoint's ``modules.json``),
the token ids against the Hugging Face tokenizer and chat template.
"""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import requests
import torch
from transformers import AutoModel, AutoTokenizer

from engine.checkpoint.store import resolve_checkpoint
from tests.deploy.test_tool_parsers import TOOL

pytestmark = pytest.mark.integration

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog, twice, before breakfast.",
    "Embeddings",
    "Triton serves the encoder; the frontend speaks OpenAI's API.",
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def openai_frontend(server, served_repo, start_frontend):
    """``python -m deploy.openai`` serving the session's LLM (``llm``) and encoder (``minilm``), without an API
    key; yields its base URL."""
    with start_frontend(served_repo, server, "--models", "llm", "minilm") as url:
        yield url


@pytest.fixture(scope="module")
def client(openai_frontend):
    return openai.OpenAI(base_url=f"{openai_frontend}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def minilm():
    """(tokenizer, reference) of the all-MiniLM-L6-v2 checkpoint: ``reference(texts)`` -> ``[n, 384]`` float32,
    the encoder in process (transformers, fp32) + mean pooling + L2 normalisation."""
    checkpoint = resolve_checkpoint("minilm-l6", causal_lm=False)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModel.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()

    def reference(texts: list[str]) -> np.ndarray:
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state  # [n, seq, 384]
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()

    return tokenizer, reference


def test_models_lists_the_llm_and_the_embedding_model(client):
    assert [m.id for m in client.models.list().data] == ["llm", "minilm"]
    card = client.models.retrieve("minilm")
    assert card.id == "minilm" and card.model_extra["max_model_len"] == 256


def test_embeddings_equal_the_encoder_in_process(openai_frontend, client, minilm):
    tokenizer, reference = minilm
    expected = reference(TEXTS)
    out = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    served = np.array([d.embedding for d in out.data], dtype=np.float32)
    assert out.model == "minilm" and [d.index for d in out.data] == [0, 1, 2, 3] and served.shape == (4, 384)
    np.testing.assert_allclose(served, expected, atol=2e-5, rtol=0)
    assert np.allclose(np.linalg.norm(served, axis=-1), 1.0, atol=1e-5)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(tokenizer(t).input_ids) for t in TEXTS)

    # base64: the SDK's default (it decodes); raw, the float32 bytes (each request runs ONNX Runtime again, whose
    # threaded reductions may differ in the last bits: 1e-6)
    sdk_base64 = client.embeddings.create(model="minilm", input=TEXTS)
    np.testing.assert_allclose([d.embedding for d in sdk_base64.data], served, atol=1e-6, rtol=0)
    raw = requests.post(
        f"{openai_frontend}/v1/embeddings",
        json={"model": "minilm", "input": TEXTS[1], "encoding_format": "base64"},
        timeout=60,
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, served[1], atol=1e-6, rtol=0)

    # one string, token ids (the text's, [CLS] and [SEP] included) and lists of ids: the same vectors
    one = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
    ids = client.embeddings.create(model="minilm", input=tokenizer(TEXTS[0]).input_ids, encoding_format="float")
    many_ids = client.embeddings.create(
        model="minilm", input=[tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS[2:]]
    )
    np.testing.assert_allclose(one.data[0].embedding, served[0], atol=1e-6)
    np.testing.assert_allclose(ids.data[0].embedding, served[0], atol=1e-6)
    np.testing.assert_allclose([d.embedding for d in many_ids.data], served[2:], atol=1e-6)
    assert ids.usage.prompt_tokens == len(tokenizer(TEXTS[0]).input_ids)

    # more inputs than the Triton model's max_batch_size (64): several Triton requests, answered in order
    texts = [f"sentence number {i}" for i in range(70)]
    big = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    assert [d.index for d in big.data] == list(range(70))
    np.testing.assert_allclose([big.data[i].embedding for i in (0, 69)], reference([texts[0], texts[69]]), atol=2e-5)
    # dimensions equal to the model's width is accepted
    assert len(client.embeddings.create(model="minilm", input="x", dimensions=384).data[0].embedding) == 384


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"input": ["fine", ""]}, 400, "input.1", "empty text"),
        ({"input": "fine", "dimensions": 128}, 400, "dimensions", "384-dimensional"),
        ({"input": "fine", "encoding_format": "hex"}, 400, "encoding_format", "float"),
        ({"input": "word " * 300}, 400, "input", "limit of 256"),
        ({"input": [[101, 99999, 102]]}, 400, "input.0", "outside the vocabulary"),
        ({"input": [[101, 7592, 102, 2088, 102]]}, 400, "input.0", "special token [SEP] inside"),
        ({"input": []}, 400, "input", "empty list"),
        ({"input": "fine", "temperature": 0.5}, 400, "temperature", "unrecognized"),
        ({"input": "fine", "model": "llm"}, 400, "model", "generative model"),
        ({"input": "fine", "model": "nope"}, 404, "model", "does not exist"),
        ({"input": 7}, 400, "input", "valid"),
    ],
)
def test_bad_embedding_request_is_refused_alone(openai_frontend, client, body, status, param, words):
    answer = requests.post(f"{openai_frontend}/v1/embeddings", json={"model": "minilm", **body}, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == status and error["param"] == param and words in error["message"], error
    assert client.embeddings.create(model="minilm", input="still serving").data[0].embedding  # the server goes on


def test_bad_embedding_request_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="minilm", input="fine", dimensions=64)
    assert caught.value.body["param"] == "dimensions"


# --------------------------------------------------------------------------------------------
# /tokenize and /detokenize (vLLM's shapes)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=60)


def test_tokenize_prompt_and_detokenize_round_trip(openai_frontend, llm_tokenizer):
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé, emoji 🦊 and\nnew lines."
    answer = post(openai_frontend, "/tokenize", {"model": "llm", "prompt": text}).json()
    expected = llm_tokenizer(text).input_ids
    assert answer == {"count": len(expected), "max_model_len": 512, "tokens": expected, "token_strs": None}
    # detokenize: Hugging Face's decode (special tokens kept, as given); without them, back to the text
    decoded = post(openai_frontend, "/detokenize", {"model": "llm", "tokens": expected}).json()
    assert decoded == {"prompt": llm_tokenizer.decode(expected)}
    plain = post(openai_frontend, "/tokenize", {"model": "llm", "prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == llm_tokenizer(text, add_special_tokens=False).input_ids
    assert post(openai_frontend, "/detokenize", {"model": "llm", "tokens": plain["tokens"]}).json() == {"prompt": text}
    # without model (one LLM is served: lm-eval probes so), with token strings
    strs = post(openai_frontend, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert strs["tokens"] == expected and strs["token_strs"] == llm_tokenizer.convert_ids_to_tokens(expected)


def test_tokenizer_info_names_the_special_tokens_and_the_template(openai_frontend, llm_tokenizer):
    info = requests.get(f"{openai_frontend}/tokenizer_info", timeout=60).json()
    assert (info["eos_token"], info["bos_token"], info["chat_template"], info["model_max_length"]) == (
        llm_tokenizer.eos_token,
        llm_tokenizer.bos_token,
        llm_tokenizer.chat_template,
        512,
    )
    assert requests.get(f"{openai_frontend}/tokenizer_info", params={"model": "nope"}, timeout=60).status_code == 404


def test_tokenize_messages_follow_the_chat_template(openai_frontend, client, llm_tokenizer):
    for add_generation_prompt in (True, False):
        body = {"model": "llm", "messages": MESSAGES, "add_generation_prompt": add_generation_prompt}
        answer = post(openai_frontend, "/tokenize", body).json()
        expected = list(
            llm_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
        )
        assert answer["tokens"] == expected and answer["count"] == len(expected)
    # the ids the chat endpoint sends to the engine (default: add_generation_prompt=true)
    with_prompt = post(openai_frontend, "/tokenize", {"model": "llm", "messages": MESSAGES}).json()
    chat = openai.OpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=120)
    completion = chat.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=1, temperature=0)
    assert completion.usage.prompt_tokens == with_prompt["count"]


def test_tokenize_messages_render_the_tools_as_the_chat_endpoint_does(openai_frontend, client, llm_tokenizer):
    body = {"model": "llm", "messages": MESSAGES[1:], "tools": [TOOL]}
    answer = post(openai_frontend, "/tokenize", body).json()
    bare = post(openai_frontend, "/tokenize", {"model": "llm", "messages": MESSAGES[1:]}).json()
    # SmolLM2's template ignores tools: the frontend writes them into a system prompt before the user turn
    text = llm_tokenizer.decode(answer["tokens"])
    assert "get_weather" in text and '"city"' in text and answer["tokens"][-12:] == bare["tokens"][-12:]
    assert answer["count"] > bare["count"] + 10
    completion = client.chat.completions.create(
        model="llm", messages=MESSAGES[1:], tools=[TOOL], max_tokens=1, temperature=0
    )
    assert completion.usage.prompt_tokens == answer["count"]
    # tool_choice none leaves the tools out of the prompt, as the chat endpoint does
    none = post(openai_frontend, "/tokenize", {**body, "tool_choice": "none"}).json()
    assert none["tokens"] == bare["tokens"]


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/detokenize", {"model": "llm", "tokens": [1, 10**9]}, 400, "tokens.1"),
        ("/detokenize", {"model": "llm", "tokens": "abc"}, 400, "tokens"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": "llm"}, 400, "prompt"),
        ("/tokenize", {"model": "llm", "messages": []}, 400, "messages"),
        ("/tokenize", {"model": "llm", "messages": MESSAGES, "continue_final_message": True}, 400,
         "continue_final_message"),
        ("/tokenize", {"model": "llm", "messages": MESSAGES, "tools": [TOOL],
                       "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
         "tool_choice.function.name"),
        ("/tokenize", {"model": "llm", "messages": MESSAGES, "tools": []}, 400, "tools"),
    ],
)  # fmt: skip
def test_bad_tokenize_request_names_the_field(openai_frontend, path, body, status, param):
    answer = post(openai_frontend, path, body)
    assert answer.status_code == status and answer.json()["error"]["param"] == param, answer.text
    assert post(openai_frontend, "/tokenize", {"model": "llm", "prompt": "ok"}).status_code == 200
