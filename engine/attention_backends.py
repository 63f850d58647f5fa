"""The attention backend of a run, chosen by name (``EngineConfig.attention_backend``).

It sits above ``engine.attention`` (the metadata, the base class, the torch backend) and
``engine.attention_triton`` (the Triton kernels, a subclass of that base), so the two never
import each other both ways.
"""

from __future__ import annotations

from engine.attention import AttentionBackend, TorchAttentionBackend
from engine.config import ATTENTION_BACKENDS


def get_attention_backend(
    device: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None,
    name: str | None = None,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """The attention backend ``name`` (``None``: ``triton`` on CUDA, ``torch`` elsewhere); ``batch_invariant``
    (torch backend only, ``EngineConfig.batch_invariant``) computes every token alike whatever its batch.

    ``triton`` (``engine.attention_triton``) needs the ``triton`` package; on CPU it runs under
    Triton's interpreter (``TRITON_INTERPRET=1``), for tests only.

    Raises:
        ValueError: an unknown ``name``.
    """
    name = name or ("triton" if device.startswith("cuda") else "torch")
    if name == "torch":
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window, batch_invariant)
    if name == "triton":
        from engine.attention_triton import TritonAttentionBackend  # optional dependency: imported only when chosen

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window)
    raise ValueError(f"attention_backend={name!r}; use one of {ATTENTION_BACKENDS} or None")
