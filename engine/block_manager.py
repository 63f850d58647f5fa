"""Paged KV cache bookkeeping: block allocation, reference counts and prefix caching.

Design after vLLM's v1 KV cache manager and nano-vllm's block manager: the KV pool is split into
``num_blocks`` blocks of ``block_size`` token slots. A full, computed block is identified by a
chained hash ``h_i = H(h_{i-1}, tokens of block i)``, so equal hashes mean equal prefixes up to
that block. A request that starts with a cached prefix shares those blocks (refcount + 1). A
block whose refcount drops to 0 keeps its contents and hash in an LRU list and is only evicted
when a free block is needed. Every block is in exactly one of three states: free (no valid
contents), cached (refcount 0, hashed, in the LRU) or used (refcount >= 1).

A sequence run with a LoRA adapter chains its hashes from the adapter's key (``Sequence.lora_hash``)
instead of ``ROOT_HASH``, and a hit must match that key as well as the tokens: KV computed under
one adapter is never reused by another adapter or the base, while requests of one adapter share.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable

from engine.sequence import Sequence

#: The hash that precedes the first block of every sequence.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained 64-bit hash of one full block: BLAKE2b over the parent hash and the token ids."""
    data = parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class KVCacheInvariantError(RuntimeError):
    """The block manager's bookkeeping is inconsistent (a bug, never user input)."""


class Block:
    """One physical KV block: its refcount and, once full and computed, its hash and tokens."""

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "lora_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.lora_hash: int | None = None  # the adapter key its K/V was computed under (None: the base)


class BlockManager:
    """Allocates KV blocks to sequences and shares identical prefixes.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: hash full blocks and reuse them across requests.
        hash_fn: ``(parent_hash, token_ids) -> int``; replaceable to test collisions.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: Callable[[int, tuple[int, ...]], int] = hash_block_tokens,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_lru: OrderedDict[int, None] = OrderedDict()  # refcount-0 hashed blocks, oldest first
        self.hash_to_block: dict[int, int] = {}
        self.num_used_blocks = 0
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0

    # ---------------------------------------------------------------- queries

    @property
    def num_available_blocks(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self.free_block_ids) + len(self.cached_lru)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (0..1)."""
        return self.num_used_blocks / self.num_blocks

    def full_block_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of every full block of ``seq.token_ids`` (extends ``seq.block_hashes``); the first
        block's parent is ``ROOT_HASH``, or the LoRA adapter's key."""
        hashes = seq.block_hashes
        bs = self.block_size
        root = ROOT_HASH if seq.lora_hash is None else seq.lora_hash
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[i - 1] if i else root
            hashes.append(self.hash_fn(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Physical blocks holding the longest cached prefix of ``seq`` (no state change).

        Every hit is verified token by token and by LoRA adapter (a hash collision is a miss). The
        prefix never covers the last token, whose logits the next step needs.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        bs = self.block_size
        for i, h in enumerate(self.full_block_hashes(seq)[:max_blocks]):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            if self.blocks[block_id].lora_hash != seq.lora_hash:
                break
            hits.append(block_id)
        return hits

    def find_partial_block(
        self, seq: Sequence, cached_blocks: list[int], donors: list[Sequence]
    ) -> tuple[int, int] | None:
        """Computed tokens of a running sequence that continue ``seq``'s cached prefix inside a block
        the prefix cache cannot share: ``(donor block id, num_tokens)``, or ``None``.

        Full-block hashes share only whole blocks, so requests that agree for a few tokens past
        their last common full block (a system prompt that ends mid-block) would recompute those
        tokens each. A donor qualifies when its block table starts with ``cached_blocks`` (so the
        same context precedes) and its computed tokens after them equal ``seq``'s; the caller
        copies their K/V slots (at most ``block_size``, never ``seq``'s last token, whose logits
        the next step needs) into ``seq``'s next block. Token-granular prefix reuse as in SGLang's
        radix cache, done here by copy so blocks stay unshared below the hashed prefix.
        """
        if not self.enable_prefix_caching:
            return None
        start = len(cached_blocks) * self.block_size
        limit = min(self.block_size, seq.num_tokens - 1 - start)
        if limit <= 0:
            return None
        wanted = seq.token_ids[start : start + limit]
        best: tuple[int, int] | None = None
        for donor in donors:
            available = min(limit, donor.num_computed_tokens - start)
            if donor is seq or available <= (best[1] if best else 0) or len(donor.block_table) <= len(cached_blocks):
                continue
            if donor.lora_hash != seq.lora_hash:
                continue  # K/V of another adapter (or of the base)
            if donor.block_table[: len(cached_blocks)] != cached_blocks:
                continue
            have = donor.token_ids[start : start + available]
            n = next((i for i, (a, b) in enumerate(zip(wanted, have)) if a != b), available)
            if n > (best[1] if best else 0):
                best = (donor.block_table[len(cached_blocks)], n)
                if n == limit:
                    break
        return best

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> int:
        """New physical blocks to hold ``num_new_tokens`` more computed tokens."""
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        total_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        return max(0, total_blocks - len(seq.block_table) - len(cached_blocks))

    # ---------------------------------------------------------------- state changes

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give ``seq`` the blocks for ``num_new_tokens`` more tokens; False (and no change) if short.

        ``cached_blocks`` (from ``find_cached_prefix``, only for a sequence with no blocks yet)
        are shared and counted as computed.
        """
        evictable_hits = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        needed = self.num_blocks_needed(seq, num_new_tokens, cached_blocks)
        if needed > self.num_available_blocks - evictable_hits:
            return False
        for block_id in cached_blocks:
            self._touch(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens += len(cached_blocks) * self.block_size
        for _ in range(needed):
            seq.block_table.append(self._take_block())
        return True

    def record_prefix_query(self, seq: Sequence, cached_blocks: list[int], copied_tokens: int = 0) -> None:
        """Count a lookup of ``seq``'s tokens and its hit (in tokens: the cached blocks' and the
        ``copied_tokens`` of ``find_partial_block``) for the stats."""
        self.prefix_cache_queries_tokens += seq.num_tokens
        self.prefix_cache_hits_tokens += len(cached_blocks) * self.block_size + copied_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of ``seq``'s blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        hashes = self.full_block_hashes(seq)
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            block.block_hash = hashes[i]
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.lora_hash = seq.lora_hash
            self.hash_to_block.setdefault(hashes[i], block.block_id)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, so a prefix outlives its suffix in the LRU."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.num_used_blocks -= 1
                if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
                    self.cached_lru[block_id] = None
                else:
                    self._reset(block)
                    self.free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def free_unused_tail(self, seq: Sequence) -> int:
        """Free the blocks past ``seq``'s computed tokens (slots of rejected speculative tokens).

        A block is freed only when it holds no computed token; such a block is never hashed or
        shared (hashes cover full computed blocks only). Returns the number of blocks freed.
        """
        keep = -(-seq.num_computed_tokens // self.block_size)
        freed = 0
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            if block.ref_count != 1 or block.block_hash is not None:
                raise KVCacheInvariantError(
                    f"block {block.block_id} past the computed tokens of {seq.request_id} is shared or hashed"
                )
            block.ref_count = 0
            self.num_used_blocks -= 1
            self.free_block_ids.append(block.block_id)
            freed += 1
        return freed

    def reset_prefix_cache(self) -> None:
        """Forget every cached (refcount-0) block."""
        while self.cached_lru:
            block_id, _ = self.cached_lru.popitem(last=False)
            self._evict(block_id)
            self.free_block_ids.append(block_id)

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.cached_lru.pop(block_id)
            self.num_used_blocks += 1
        block.ref_count += 1

    def _take_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.cached_lru.popitem(last=False)  # least recently freed
            self._evict(block_id)
        block = self.blocks[block_id]
        block.ref_count = 1
        self.num_used_blocks += 1
        return block_id

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if self.hash_to_block.get(block.block_hash) == block_id:
            del self.hash_to_block[block.block_hash]
        self._reset(block)

    @staticmethod
    def _reset(block: Block) -> None:
        block.block_hash = None
        block.token_ids = None
        block.lora_hash = None

    # ---------------------------------------------------------------- checks

    def check_invariants(self, sequences: list[Sequence] = ()) -> None:
        """Verify free + cached + used == total and the consistency of refcounts and hashes.

        Args:
            sequences: every sequence currently holding blocks; their block tables must account
                for every refcount exactly.

        Raises:
            KVCacheInvariantError: naming the first inconsistency found.
        """
        free, cached = set(self.free_block_ids), set(self.cached_lru)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        if len(free) != len(self.free_block_ids):
            raise KVCacheInvariantError("a block appears twice in the free list")
        if free & cached or free & used or cached & used:
            raise KVCacheInvariantError(
                f"blocks in two states: free&cached={free & cached} free&used={free & used} cached&used={cached & used}"
            )
        if len(free) + len(cached) + len(used) != self.num_blocks:
            raise KVCacheInvariantError(
                f"free {len(free)} + cached {len(cached)} + used {len(used)} != total {self.num_blocks}"
            )
        if len(used) != self.num_used_blocks:
            raise KVCacheInvariantError(
                f"num_used_blocks={self.num_used_blocks} but {len(used)} blocks have refcount > 0"
            )
        if any(b.ref_count < 0 for b in self.blocks):
            raise KVCacheInvariantError("negative refcount")
        for block_id in cached:
            block = self.blocks[block_id]
            if block.block_hash is None or self.hash_to_block.get(block.block_hash) != block_id:
                raise KVCacheInvariantError(f"cached block {block_id} is not reachable by its hash")
        for h, block_id in self.hash_to_block.items():
            if self.blocks[block_id].block_hash != h or block_id in free:
                raise KVCacheInvariantError(f"hash table points to block {block_id} that does not hold hash {h}")
        if sequences is not None:
            counts = [0] * self.num_blocks
            for seq in sequences:
                for block_id in seq.block_table:
                    counts[block_id] += 1
            for block in self.blocks:
                if counts[block.block_id] != block.ref_count:
                    raise KVCacheInvariantError(
                        f"block {block.block_id}: refcount {block.ref_count} but {counts[block.block_id]} "
                        "block-table references"
                    )
