"""AsyncLLMEngine: concurrent streams, abort mid-stream, a bad request failing alone."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import AsyncLLMEngine, EngineConfig, SamplingParams, async_engine
from engine.errors import CheckpointError
from tests.engine.test_engine_greedy import hf_greedy, random_prompts


def test_async_streams_abort_and_bad_request(tiny_llama_dir):
    prompts = random_prompts([5, 11, 17], seed=21)
    reference = hf_greedy(tiny_llama_dir, prompts[:2], 8)
    config = EngineConfig(
        model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128, max_model_len=128, dtype="float32"
    )

    async def collect(engine, prompt, request_id, params):
        outs = []
        async for out in engine.generate(prompt, params, request_id):
            outs.append(out)
        return outs

    async def abort_after(engine, prompt, request_id, n):
        outs = []
        async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=60), request_id):
            outs.append(out)
            if len(outs) == n:
                await engine.abort(request_id)
                engine.check_invariants()  # blocks of the aborted request are already free
        return outs

    async def bad(engine):
        with pytest.raises(ValueError, match="top_p"):
            async for _ in engine.generate([5, 6], SamplingParams(top_p=2.0), "bad"):
                pass
        with pytest.raises(ValueError, match="prompt"):
            async for _ in engine.generate("", SamplingParams(), "bad2"):
                pass

    async def early_exit(engine, prompt):
        async for _ in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=60), "leaver"):
            break  # closing the stream aborts the request

    async def main():
        with AsyncLLMEngine(config) as engine:
            greedy = SamplingParams(temperature=0, max_tokens=8)
            results = await asyncio.gather(
                collect(engine, prompts[0], "a", greedy),
                collect(engine, prompts[1], "b", greedy),
                abort_after(engine, prompts[2], "c", 3),
                bad(engine),
            )
            await early_exit(engine, prompts[2])
            await asyncio.sleep(0.2)
            engine.check_invariants()
            return results, engine.get_stats()

    (a, b, c, _), stats = asyncio.run(main())
    assert a[-1].outputs[0].token_ids == reference[0] and b[-1].outputs[0].token_ids == reference[1]
    lengths = [len(o.outputs[0].token_ids) for o in a]  # one output per step, fewer if the reader fell behind
    assert lengths == sorted(set(lengths)) and lengths[-1] == 8
    assert all(not o.finished for o in a[:-1]) and a[-1].outputs[0].finish_reason == "length"
    assert c[-1].finished and c[-1].outputs[0].finish_reason == "abort"
    assert len(c[-1].outputs[0].token_ids) < 60
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_a_reader_that_falls_behind_gets_the_newest_output_with_every_token(tiny_llama_dir):
    """Outputs are cumulative: a reader that was away while the engine ran gets one output holding
    every token since its last one (vLLM's output collector), not a backlog of one per step."""
    prompt = random_prompts([9], seed=5)[0]
    reference = hf_greedy(tiny_llama_dir, [prompt], 12)[0]
    config = EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=64, max_model_len=64, dtype="float32")

    async def main():
        with AsyncLLMEngine(config) as engine:
            outs = []
            async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12), "slow"):
                outs.append(out)
                if len(outs) == 1:  # stay away until the engine has finished the request
                    for _ in range(600):
                        if engine.get_stats().num_requests_finished_total == 1:
                            break
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.05)  # the step's hand-over to this loop precedes its stats
            return outs

    outs = asyncio.run(main())
    assert len(outs) == 2 and len(outs[0].outputs[0].token_ids) == 1
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == reference


def test_the_engine_loads_on_its_step_thread_and_a_failed_load_raises_in_the_caller(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """The model is built on the step-loop thread (the caller's thread opens no OpenMP team); a load error
    reaches the constructor's caller and leaves no thread behind."""
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(CheckpointError):
        AsyncLLMEngine(EngineConfig(model=str(tmp_path / "missing"), dtype="float32"))
    assert "lmforge-engine" not in {t.name for t in threading.enumerate()} - before
    built_on = []

    class Recording(async_engine.LLMEngine):
        def __init__(self, config):
            built_on.append(threading.current_thread().name)
            super().__init__(config)

    monkeypatch.setattr(async_engine, "LLMEngine", Recording)
    with AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=64)):
        pass
    assert built_on == ["lmforge-engine"]
