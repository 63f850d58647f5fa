"""Exact and near-duplicate detection for training text.

Near duplicates are found with MinHash signatures (Broder, "On the resemblance and containment of
documents", 1997) indexed by locality-sensitive hashing (banded LSH, Leskovec, Rajaraman and
Ullman, *Mining of Massive Datasets*, ch. 3), as in the deduplication of C4/The Pile/RefinedWeb.
Both come from ``datasketch``. A document's set is its character n-gram shingles after lower-casing
and collapsing whitespace, so it works for scripts without spaces (Chinese) too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence

from datasketch import MinHash, MinHashLSH

from engine.errors import UsageError

_WHITESPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lower-case and collapse runs of whitespace to one space (strip the ends)."""
    return _WHITESPACE.sub(" ", text.lower()).strip()


def exact_key(text: str) -> str:
    """Hash of the normalized text: two texts with the same key are exact duplicates."""
    return hashlib.sha1(normalize(text).encode("utf-8")).hexdigest()


def shingles(text: str, size: int) -> set[bytes]:
    """Character ``size``-grams of the normalized text (the whole text when shorter), UTF-8 encoded."""
    norm = normalize(text)
    if len(norm) <= size:
        return {norm.encode("utf-8")}
    return {norm[i : i + size].encode("utf-8") for i in range(len(norm) - size + 1)}


@dataclasses.dataclass(frozen=True)
class MinHashConfig:
    """Near-duplicate settings.

    Attributes:
        threshold: estimated Jaccard similarity at or above which two texts are near duplicates.
        num_perm: number of MinHash permutations (signature length); more = better estimates.
        shingle_size: characters per shingle.
        seed: seed of the MinHash permutations.
    """

    threshold: float = 0.8
    num_perm: int = 128
    shingle_size: int = 5
    seed: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise UsageError(f"threshold={self.threshold}: must be in (0, 1]")
        if self.num_perm < 16:
            raise UsageError(f"num_perm={self.num_perm}: use at least 16 permutations")
        if self.shingle_size < 1:
            raise UsageError(f"shingle_size={self.shingle_size}: must be >= 1")


def minhash(text: str, config: MinHashConfig):
    """The ``datasketch.MinHash`` signature of ``text``'s shingles."""
    m = MinHash(num_perm=config.num_perm, seed=config.seed)
    m.update_batch(list(shingles(text, config.shingle_size)))
    return m


def near_duplicates(texts: Sequence[str], config: MinHashConfig = MinHashConfig()) -> dict[int, int]:
    """Find near duplicates among ``texts``, keeping the first of each group.

    Texts are visited in order; each is looked up in an LSH index of the texts kept so far, and a
    candidate whose estimated Jaccard similarity reaches ``config.threshold`` makes it a duplicate.

    Returns:
        ``{index of a removed text: index of the kept text it duplicates}``.
    """
    lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
    kept: dict[int, object] = {}
    removed: dict[int, int] = {}
    for i, text in enumerate(texts):
        m = minhash(text, config)
        match = _best_match(lsh, kept, m, config.threshold)
        if match is None:
            lsh.insert(i, m)
            kept[i] = m
        else:
            removed[i] = match[0]
    return removed


def cross_duplicates(
    texts_a: Sequence[str], texts_b: Sequence[str], config: MinHashConfig = MinHashConfig()
) -> list[tuple[int, int, float]]:
    """Pairs ``(i, j, jaccard)`` where ``texts_b[j]`` near-duplicates ``texts_a[i]``.

    Used to check that a validation split does not leak from its training split.
    """
    lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
    signatures = {}
    for i, text in enumerate(texts_a):
        signatures[i] = minhash(text, config)
        lsh.insert(i, signatures[i])
    pairs = []
    for j, text in enumerate(texts_b):
        match = _best_match(lsh, signatures, minhash(text, config), config.threshold)
        if match is not None:
            pairs.append((match[0], j, match[1]))
    return pairs


def _best_match(lsh, signatures: dict, m, threshold: float) -> tuple[int, float] | None:
    """The LSH candidate most similar to ``m`` whose estimated Jaccard is >= threshold, or None.

    LSH banding returns candidates near the threshold on both sides; the signatures' own Jaccard
    estimate decides.
    """
    best = None
    for key in lsh.query(m):
        sim = float(m.jaccard(signatures[key]))
        if sim >= threshold and (best is None or sim > best[1]):
            best = (key, sim)
    return best
