"""Records: the JSONL files every stage reads, and the one default held-out split.

``read_jsonl`` reads any JSONL file of the project (data splits, training metrics, load-test
samples, prompts) against a schema and names ``file:line`` in every error. A data record is
``{"messages": [{"role", "content"}, ...]}`` or ``{"text": ...}`` (``compress.data.prepare.validate_record``
is its schema); ``read_records`` reads a file of them. The default split is the one ``lmforge data`` writes
with its default settings (the English chatterbot corpus, deduplicated and filtered across both
splits): it is made once and cached in ``CACHE/data/default-<key>/``, where ``<key>`` hashes the
settings and the corpus version (``engine.checkpoint.store.cache_dir``), so evaluation, quantization
calibration and the benchmarks' prompts all use the same validation dialogs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from compress.data.prepare import DataConfig, prepare
from engine.checkpoint.outputs import cache_dir
from engine.records import DataError, read_records

SPLITS = ("train", "val")


def default_data_dir() -> Path:
    """The directory of ``lmforge data``'s default output, made on first use and cached.

    Raises:
        DataError: the chatterbot corpus is not installed (names the package to install).
    """
    config = dataclasses.asdict(DataConfig())
    try:
        corpus = importlib.metadata.version("chatterbot-corpus")
    except importlib.metadata.PackageNotFoundError:
        corpus = "none"
    key = hashlib.sha1(json.dumps({"config": config, "corpus": corpus}, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "data" / f"default-{key}"
    if not (out / "data_report.json").is_file():
        prepare(DataConfig(), out, verbose=False)
    return out


@functools.lru_cache(maxsize=2)
def _default_split(split: str) -> tuple[tuple[dict[str, Any], ...], str]:
    name = "validation" if split == "val" else "training"
    records = read_records(default_data_dir() / f"{split}.jsonl")
    return tuple(records), f"chatterbot:english (lmforge data {name} split)"


def default_split_records(split: str = "val") -> tuple[list[dict[str, Any]], str]:
    """A split of the default data (module docstring) and a description of where it came from.

    Returns:
        ``(records, name)``; the records are copies (callers may edit them).

    Raises:
        DataError: ``split`` is neither ``train`` nor ``val``; the corpus is not installed.
    """
    if split not in SPLITS:
        raise DataError(f"split={split!r}: use 'train' or 'val'")
    records, name = _default_split(split)
    return [json.loads(json.dumps(r)) for r in records], name
