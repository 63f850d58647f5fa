"""Block manager: refcounts, prefix hits verified by tokens, LRU eviction tail first, invariants."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, KVCacheInvariantError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, None, tokens, SamplingParams(temperature=0), detokenizer=None, generator=None)


def compute(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and 'run' the whole sequence, registering its full blocks."""
    cached = bm.find_cached_prefix(seq)
    n = seq.num_tokens - len(cached) * bm.block_size
    assert bm.allocate_slots(seq, n, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_shared_prefix_is_refcounted_and_freed_to_lru():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(list(range(10)), "a")  # blocks: [0..3] [4..7] [8, 9]
    compute(bm, a)
    b = make_seq(list(range(8)) + [50, 51, 52], "b")
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:2]
    assert bm.allocate_slots(b, b.num_tokens - 8, cached)
    assert b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0
    assert len(bm.cached_lru) == 2  # the two full blocks stay cached; partial tails are free
    bm.check_invariants([])


def test_hit_never_covers_last_token_exact_multiple():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(8)))
    compute(bm, a)
    bm.free(a)
    again = make_seq(list(range(8)))
    assert len(bm.find_cached_prefix(again)) == 1  # 8 tokens = 2 full blocks, only the first may hit
    longer = make_seq(list(range(9)))
    assert len(bm.find_cached_prefix(longer)) == 2
    bm.check_invariants([])


def test_hash_collision_is_rejected_by_token_check():
    bm = BlockManager(num_blocks=8, block_size=4, hash_fn=lambda parent, tokens: 42)
    a = make_seq([1, 2, 3, 4, 5], "a")
    compute(bm, a)
    other = make_seq([9, 9, 9, 9, 5], "b")
    assert bm.find_cached_prefix(other) == []  # same hash, different tokens -> miss
    same = make_seq([1, 2, 3, 4, 7], "c")
    assert bm.find_cached_prefix(same) == a.block_table[:1]
    bm.check_invariants([a])


def test_lru_evicts_tail_blocks_first_and_keeps_prefix():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")  # needs 5 blocks > 4
    assert not bm.allocate_slots(a, a.num_tokens)
    bm.check_invariants([])
    a = make_seq([1, 2, 3, 4, 5, 6, 7], "a")  # 4 blocks, 3 full
    compute(bm, a)
    head, middle, tail = a.block_table[:3]
    bm.free(a)
    assert list(bm.cached_lru) == [tail, middle, head]  # freed tail first
    b = make_seq([30, 31, 32], "b")  # needs 2 blocks: the free partial block, then evict the tail
    assert bm.allocate_slots(b, 3)
    assert tail in b.block_table and head in bm.cached_lru and middle in bm.cached_lru
    c = make_seq([1, 2, 3, 4, 99], "c")
    assert bm.find_cached_prefix(c) == [head, middle]
    bm.check_invariants([b])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(list(range(8)), "a")
    compute(bm, a)
    b = make_seq(list(range(100, 110)), "b")
    assert not bm.allocate_slots(b, b.num_tokens)
    assert b.block_table == [] and b.num_computed_tokens == 0
    bm.check_invariants([a])


def test_invariant_violation_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq([1, 2, 3], "a")
    compute(bm, a)
    bm.blocks[a.block_table[0]].ref_count = 0  # corrupt on purpose
    with pytest.raises(KVCacheInvariantError):
        bm.check_invariants([a])
