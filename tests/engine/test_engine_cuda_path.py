"""The engine's CUDA path, exercised on CPU as far as it goes.

On CPU the ``triton`` attention backend runs under Triton's interpreter and decode steps run
from the bucket-padded static buffers of ``engine.cuda_graphs`` (eagerly: graph capture needs
CUDA). Greedy tokens must equal Hugging Face ``generate`` whatever the padding. Tests marked
``gpu`` run the real CUDA graphs and are skipped without CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'lmforge[gpu]')")

from engine import SamplingParams  # noqa: E402
from engine.cuda_graphs import DecodeStaging, StaticDecodeModelRunner, bucket_for, capture_sizes  # noqa: E402
from engine.scheduler import ScheduledSequence, SchedulerOutput  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from tests.engine.test_engine_greedy import hf_greedy, make_llm, random_prompts, tokens  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 4 + 16
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 17, 256)] == [1, 4, 8, 16, 32, 256]
    assert bucket_for(257, sizes) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def _decode_step(seq_specs, block_size):
    """A decode-only SchedulerOutput: per request (tokens, block_table); the last token is decoded."""
    scheduled = []
    for i, (token_ids, table) in enumerate(seq_specs):
        seq = Sequence(f"r{i}", None, token_ids, SamplingParams(temperature=0, max_tokens=4), None, None)
        seq.num_computed_tokens = len(token_ids) - 1
        seq.block_table = table
        scheduled.append(ScheduledSequence(seq, 1))
    return SchedulerOutput(scheduled, len(scheduled), [])


def test_staging_pads_to_the_bucket():
    staging = DecodeStaging(max_batch=8, max_blocks=5, block_size=4, device="cpu")
    out = _decode_step([(list(range(10, 20)), [7, 3, 9]), (list(range(30, 35)), [2, 5])], block_size=4)
    staging.fill(out, 8)  # first a full batch, so the padding below overwrites real rows
    out2 = _decode_step([(list(range(10, 21)), [7, 3, 9])], block_size=4)
    assert staging.fill(out2, 2) == 1
    b = staging.device_buffers
    assert b.input_ids[:2].tolist() == [20, 0]
    assert b.positions[:2].tolist() == [10, 0]
    assert b.slot_mapping[:2].tolist() == [9 * 4 + 2, -1]  # position 10 -> block 2 (id 9), offset 2
    assert b.seq_lens[:2].tolist() == [11, 0]
    assert b.block_table[0, :3].tolist() == [7, 3, 9]
    with pytest.raises(ValueError, match="do not fit"):
        staging.fill(out, 1)


def test_static_decode_runner_requires_a_decode_metadata_backend(tiny_llama_dir):
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        StaticDecodeModelRunner(tiny_llama_dir, "float32", "cpu", 4, 64, max_num_seqs=4, attention_backend="torch")


@pytest.fixture(scope="module")
def prompts():
    # 5 requests (a padded bucket of 8 in steady decode), two sharing a 12-token prefix
    return random_prompts([3, 9, 17], seed=5) + random_prompts([2, 7], seed=6, shared_prefix=12)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts):
    return hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)


def _llm(model_dir, **overrides):
    """``make_llm`` on the ``triton`` attention backend, in the engine's own dtype, 64 tokens at most."""
    small = dict(num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=64, max_num_seqs=8, dtype="auto")
    return make_llm(model_dir, **{**small, "attention_backend": "triton", **overrides})


def test_triton_backend_greedy_equals_hf_with_prefix_cache_cold_and_warm(tiny_llama_dir, prompts, reference):
    llm = _llm(tiny_llama_dir)
    assert isinstance(llm.engine.runner, StaticDecodeModelRunner)
    assert tokens(llm.generate(prompts, GREEDY)) == reference  # cold
    assert tokens(llm.generate(prompts, GREEDY)) == reference  # warm: prompts' full blocks cached
    assert llm.engine.get_stats().prefix_cache_hit_rate > 0
    llm.engine.check_invariants()


def test_triton_backend_greedy_equals_hf_under_preemption(tiny_llama_dir, prompts, reference):
    llm = _llm(tiny_llama_dir, num_kv_blocks=16, enable_prefix_caching=False)  # 5 requests need > 16 blocks
    assert tokens(llm.generate(prompts, GREEDY)) == reference
    assert llm.engine.get_stats().num_preemptions_total > 0
    llm.engine.check_invariants()


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_greedy_equals_eager(tiny_llama_dir, prompts, reference):
    graphs = _llm(tiny_llama_dir, device="cuda")
    assert graphs.engine.runner.graphs, "no CUDA graph was captured"
    assert tokens(graphs.generate(prompts, GREEDY)) == reference
    eager = _llm(tiny_llama_dir, device="cuda", enforce_eager=True)
    assert not eager.engine.runner.graphs
    assert tokens(eager.generate(prompts, GREEDY)) == reference


def test_backend_selection_by_device_and_name():
    from engine.attention import TorchAttentionBackend
    from engine.attention_backends import get_attention_backend
    from engine.attention_triton import TritonAttentionBackend
    from engine.config import EngineConfig

    assert type(get_attention_backend("cpu", 4, 2, 16, None)) is TorchAttentionBackend
    assert type(get_attention_backend("cuda", 4, 2, 16, None)) is TritonAttentionBackend
    assert type(get_attention_backend("cuda:1", 4, 2, 16, None, "torch")) is TorchAttentionBackend
    assert type(get_attention_backend("cpu", 4, 2, 16, None, "triton")) is TritonAttentionBackend
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        EngineConfig(attention_backend="flash")
