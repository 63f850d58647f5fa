"""lmforge inference engine: paged KV cache with prefix reuse, continuous batching (vLLM-shaped API).

The names below load on first use (PEP 562), so ``import engine.errors`` (what every ``lmforge``
command imports first, ``--help`` included) does not import torch.
"""

import importlib

import engine.library_noise  # noqa: F401  (first: its filters must be in place before torchao is imported)

#: Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "AsyncLLMEngine": "engine.async_engine",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "LoRARequest": "engine.lora",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "EngineStats": "engine.stats",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
