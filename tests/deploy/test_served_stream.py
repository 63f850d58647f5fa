"""The served stream under load: a response (model) or event (frontend) may carry several engine
steps when its reader fell behind, and no token is lost or repeated on the way.

The model runs with the recording stand-in of ``triton_python_backend_utils`` of
tests/test_triton_llm_faults.py; the frontend's event writer runs on hand-made Triton pieces.
The same paths against the real tritonserver are in tests/test_serve.py and
tests/test_deploy_openai.py.
"""

from __future__ import annotations

import asyncio
import json
import types

import numpy as np
import pytest

from deploy.openai.prompts import Plan
from deploy.openai.serving_chat import OpenAIServingChat
from deploy.openai.serving_completions import OpenAIServingCompletion
from deploy.openai.triton_client import Piece, coalesce
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.deploy.test_triton_llm_faults import FINAL, FakeEngine, _model, _request, _tensors, pb  # noqa: F401

TOKENS = [11, 12, 13, 14, 15, 16, 17, 18, 19]
WORDS = [" a", " b", "c", " d", "", " é", " f", "g", " h"]  # "" : a token held back by the detokenizer


def _cumulative(upto: int, finished: bool) -> RequestOutput:
    """The engine's output after ``upto`` tokens (cumulative text and ids)."""
    completion = CompletionOutput(0, "".join(WORDS[:upto]), TOKENS[:upto], "length" if finished else None)
    metrics = RequestMetrics(0.0, 0.1, 0.5 if finished else None, 32, upto)
    return RequestOutput("r", "Hello", list(range(40)), [completion], finished, metrics)


def test_model_sends_what_each_coalesced_output_adds_and_every_token_once(pb):  # noqa: F811
    # the engine handed over only its newest output after steps 1, 4, 5, 7 and 9 (the reader was behind)
    outputs = [_cumulative(n, n == len(TOKENS)) for n in (1, 4, 5, 7, 9)]
    model = _model(pb, FakeEngine(outputs))
    request = _request(sampling=json.dumps({"max_tokens": 9}))
    request.inputs["stream"] = np.array([True])
    asyncio.run(model._serve(request))
    sent = [(_tensors(r), flags) for r, flags in request.sender.sent]
    assert "".join(t["text_output"][0].decode() for t, _ in sent) == "".join(WORDS)
    assert [i for t, _ in sent for i in t["output_token_ids"].tolist()] == TOKENS
    # the output after step 5 added no text (a held-back token): its token rides with the next response
    assert [int(t["num_output_tokens"][0]) for t, _ in sent] == [1, 4, 7, 9]
    assert [flags for _, flags in sent] == [0, 0, 0, FINAL]
    final = sent[-1][0]
    assert final["finish_reason"][0].decode() == "length" and int(final["num_cached_tokens"][0]) == 32
    assert all("num_cached_tokens" not in t and "finish_reason" not in t for t, _ in sent[:-1])
    assert model.metrics.num_responses == 4


def _piece(index: int, start: int, stop: int, finished: bool = False, prompt_index: int = 0) -> Piece:
    return Piece(
        prompt_index,
        index,
        "".join(WORDS[start:stop]),
        TOKENS[start:stop],
        None,
        "length" if finished else None,
        40,
        stop,
        32 if finished else None,
    )


def test_coalesce_merges_each_choice_in_order():
    pieces = [_piece(0, 0, 2), _piece(1, 0, 1), _piece(0, 2, 3), _piece(1, 1, 4), _piece(0, 3, 9, True)]
    merged = coalesce(pieces)
    assert [(p.index, p.text, p.token_ids, p.num_output_tokens, p.finish_reason) for p in merged] == [
        (0, "".join(WORDS), TOKENS, 9, "length"),
        (1, "".join(WORDS[:4]), TOKENS[:4], 4, None),
    ]
    assert merged[0].num_cached_tokens == 32
    assert pieces[0].token_ids == TOKENS[:2]  # the pieces themselves are left as they were


class FakePieces:
    """``PieceQueue`` stand-in: each ``drain`` returns the next batch of pieces waiting."""

    def __init__(self, batches: list[list[Piece]]) -> None:
        self.batches, self.closed = list(batches), False

    async def drain(self) -> list[Piece]:
        return self.batches.pop(0) if self.batches else []

    async def aclose(self) -> None:
        self.closed = True


def _plan(n: int = 1) -> Plan:
    model = types.SimpleNamespace(name="llm", tokenizer=None)
    return Plan(model, [list(range(40))], {}, n, None, True, True)


def _events(chunks: list[bytes]) -> list:
    body = b"".join(chunks).decode()
    assert body.endswith("data: [DONE]\n\n")
    return [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("serving", [OpenAIServingChat, OpenAIServingCompletion])
def test_event_writer_sends_one_event_per_choice_per_batch_with_every_token(serving):
    plan = _plan(n=2)
    first = [_piece(0, 0, 1), _piece(1, 0, 1)]
    later = [
        [_piece(0, 1, 2), _piece(0, 2, 5), _piece(1, 1, 5)],  # the writer fell behind: merged per choice
        [_piece(0, 5, 9, True)],
        [_piece(1, 5, 9, True)],
    ]
    pieces = FakePieces(later)
    writer = serving({}, None)

    async def collect():
        return [chunk async for chunk in writer.sse(plan, first, pieces)]

    chunks = asyncio.run(collect())
    events = _events(chunks)
    assert pieces.closed
    content = {0: "", 1: ""}
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"].get("content", "") if "delta" in choice else choice["text"]
            content[choice["index"]] += delta
        assert event["usage"] is None and event["object"] == writer.chunk_kind and event["model"] == "llm"
    assert content == {0: "".join(WORDS), 1: "".join(WORDS)}
    text_events = [
        e for e in events[:-1] if any(c.get("delta", {}).get("content") or c.get("text") for c in e["choices"])
    ]
    assert len(text_events) == 6  # per choice: first piece, one merged batch, the finish
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 18 and usage["prompt_tokens"] == 40
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
    assert len({e["id"] for e in events}) == 1 and chunks[-1] == b"data: [DONE]\n\n"
