"""Fixtures shared by the engine tests."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from engine import cpu_ops
from engine.model import rotate


@pytest.fixture
def rope_and_cache_step():
    """``step(cache, dtype=bf16)``: ``cpu_ops.rope_and_cache`` of 7 tokens of ``dtype`` (9 query heads, 3 KV heads,
    head_dim 64, one padding slot ``-1``) into ``cache`` (``[2, 6, 4, 3, D]``, D >= 64); returns the inputs, the
    kernel's query and the torch path's rotation of queries and keys (``rotated [7, 12, 64]``, same roundings)."""

    def step(cache: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> types.SimpleNamespace:
        torch.manual_seed(0)
        n, num_heads, num_kv, hd = 7, 9, 3, 64
        qkv = torch.randn(n, (num_heads + 2 * num_kv) * hd).to(dtype)
        angles = torch.rand(n, hd // 2) * 6
        cos = torch.cat((angles.cos(), angles.cos()), -1)  # float32 tables, as the model holds them
        sin = torch.cat((-angles.sin(), angles.sin()), -1)
        slots = torch.tensor([0, 5, 6, 13, 22, -1, 9])  # -1: padding, not stored
        q = cpu_ops.rope_and_cache(qkv, cos, sin, cache, slots, num_heads, num_kv)
        qk = qkv[:, : (num_heads + num_kv) * hd].view(n, num_heads + num_kv, hd)
        rotated = rotate(qk, cos[:, None], sin[:, None])  # float32, one rounding to dtype
        v = qkv[:, (num_heads + num_kv) * hd :].view(n, num_kv, hd)
        return types.SimpleNamespace(
            qkv=qkv, cos=cos, sin=sin, slots=slots, q=q, rotated=rotated, v=v, num_heads=num_heads, num_kv=num_kv
        )

    return step


@pytest.fixture
def engine_is_clean_after(request):
    """After the test, the engine of the module's ``llm`` fixture (when the test used it) holds no request and no
    block, and its invariants hold (free + cached + used == total)."""
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        engine.check_invariants()
        assert not engine.has_unfinished_requests() and not engine.groups and not engine.requests
        assert engine.block_manager.usage == 0.0


@pytest.fixture
def gpt2_like_dir(tiny_llama_dir, tmp_path):
    """A copy of the tiny Llama whose ``config.json`` says ``model_type: gpt2`` (an architecture we do not run)."""
    other = tmp_path / "gpt2-like"
    shutil.copytree(tiny_llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(config))
    return other


@pytest.fixture(scope="module")
def cpu_kernels():
    """The engine's C++ CPU kernels, built and switched on for the module (skipped where
    ``--cpu-kernel-path=torch`` holds them off; a build failure fails the module)."""
    if cpu_ops.KERNELS.forbidden:
        pytest.skip("--cpu-kernel-path=torch holds the engine's C++ kernels off")
    cpu_ops.use_cpu_kernels(True)
    if not cpu_ops.use_cpu_kernels():
        pytest.fail(f"engine CPU kernels did not build: {cpu_ops.KERNELS.reason}")
    yield
    cpu_ops.use_cpu_kernels(True)


@pytest.fixture
def shared_prefix_block_table():
    """``table(lens, block_size)``: a ``[B, max_blocks]`` block table in which every request starts with the
    shared prefix blocks 1, 2, 3 and then has its own blocks (numbered on from 4, padded with 0); returns
    ``(block_table, number of blocks used)``."""

    def table(lens: list[int], block_size: int) -> tuple[torch.Tensor, int]:
        prefix = [1, 2, 3]
        tables, nxt = [], 4
        for n in lens:
            own = -(-n // block_size) - len(prefix)
            tables.append(prefix + list(range(nxt, nxt + own)))
            nxt += own
        width = max(map(len, tables))
        return torch.tensor([t + [0] * (width - len(t)) for t in tables]), nxt

    return table
