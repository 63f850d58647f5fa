"""Batch-invariant greedy decoding (``EngineConfig(batch_invariant=True)``): a request's tokens do not depend on
what else runs in its steps. Five fixed prompts decoded greedily alone must give the same tokens while 16 other
requests (sampled, of other lengths, arriving before and after) share the batch, in fp32 and in bf16, with the
real SmolLM2 checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import UsageError
from engine.platform import onednn_bf16_supported

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers and say why they are prime.",
    "What is the tallest mountain on Earth?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
WORDS = "tell me about cats and dogs in history science music the ocean stars a short story".split()


def run_under_load(llm: LLM, prompt_ids: list[int], rng: random.Random) -> list[int]:
    """Greedy tokens of ``prompt_ids`` with 16 other requests in flight: 8 already running, 8 added after it."""
    engine = llm.engine
    others = [
        llm.apply_chat_template(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 80)))) for _ in range(16)
    ]
    for i, ids in enumerate(others[:8]):
        engine.add_request(None, ids, SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(8, 48)))
    for _ in range(rng.randint(1, 4)):
        engine.step()
    target = engine.add_request(None, prompt_ids, GREEDY)
    for i, ids in enumerate(others[8:]):
        engine.add_request(None, ids, SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(8, 48)))
    tokens = None
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id == target and out.finished:
                tokens = out.outputs[0].token_ids
    assert tokens is not None
    return tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_alone_equal_tokens_under_16_concurrent_requests(smollm2_dir, dtype):
    if dtype == "bfloat16" and not onednn_bf16_supported():
        pytest.skip("this CPU's oneDNN has no bf16 kernels")
    llm = LLM(
        str(smollm2_dir),
        dtype=dtype,
        batch_invariant=True,
        max_model_len=512,
        max_num_seqs=32,
        num_kv_blocks=1024,
        max_num_batched_tokens=256,  # long prompts of the others are chunked: the target shares chunked steps
        num_threads=2,
    )
    prompts = [llm.apply_chat_template(p) for p in PROMPTS]
    alone = [llm.generate([ids], GREEDY)[0].outputs[0].token_ids for ids in prompts]
    rng = random.Random(0)
    loaded = [run_under_load(llm, ids, rng) for ids in prompts]
    assert loaded == alone
    llm.engine.check_invariants()


def test_batch_invariant_configurations_that_cannot_hold_are_refused():
    with pytest.raises(UsageError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, device="cuda")
    with pytest.raises(UsageError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, attention_backend="triton")
    with pytest.raises(UsageError, match="enable_lora"):
        EngineConfig(batch_invariant=True, enable_lora=True)


def test_batch_invariant_linear_rows_do_not_depend_on_the_row_count():
    """The property the mode is built on, for each float linear of a packed model: a row's output is the same
    bits whatever number of rows shares the call (compared with each row computed alone)."""
    from engine.model import BATCH_INVARIANT_TILE_ROWS, PACKED_MIN_ROWS, Linear, packed_rows

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        rows = packed_rows("cpu", dtype, batch_invariant=True)
        if rows is None:
            continue
        for out_features, in_features in ((960, 576), (576, 1536), (4096, 576)):
            layer = Linear(torch.randn(out_features, in_features).to(dtype) * 0.05, pack=True, pack_rows=rows)
            layer.invariant_tiles(BATCH_INVARIANT_TILE_ROWS, PACKED_MIN_ROWS)
            x = torch.randn(300, in_features).to(dtype)
            alone = torch.cat([layer(x[i : i + 1]) for i in range(0, 300, 7)])
            for m in (1, 5, 32, 33, 64, 100, 300):
                out = layer(x[:m])
                assert torch.equal(out[:m:7], alone[: len(range(0, m, 7))]), (dtype, out_features, in_features, m)
