"""Shared fixtures: the real checkpoint (converted once per cache) and tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct checkpoint, converted from the shipped GGUF (cached)."""
    from compress.checkpoints import resolve_checkpoint

    return resolve_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama with grouped-query attention (4 heads, 2 KV heads) and the SmolLM2 tokenizer."""
    from compress.checkpoints import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)
