"""lmforge inference engine: paged KV cache with prefix reuse, continuous batching (vLLM-shaped API)."""

import engine.library_noise  # noqa: F401  (first: its filters must be in place before torchao is imported)
from engine.config import EngineConfig
from engine.llm_engine import LLM, LLMEngine
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "EngineConfig",
    "SamplingParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "EngineStats",
]


def __getattr__(name: str):
    if name == "AsyncLLMEngine":  # imports asyncio/threading only when used
        from engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)
