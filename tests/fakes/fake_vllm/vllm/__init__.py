"""A stand-in for vLLM's offline API (``LLM``, ``llm_engine`` stepping, ``SamplingParams``),
for the engine benchmark's adapter tests: it runs under any interpreter put first on
``PYTHONPATH``.

Each ``step()`` gives every unfinished request one more token; token ``i`` of a request is
``(sum of the prompt ids + i + offset) % 1000`` where ``offset`` is 0 for ``float32`` and 1 for
``bfloat16``, so a test can check the dtype and the token-id prompt that arrived. It refuses
what the benchmark must not send: prefix caching off, sampling. With EOS not ignored (the
speculative benchmark's requests served alone) a request also ends at token 0, the fake's EOS.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False


@dataclasses.dataclass
class CompletionOutput:
    token_ids: list[int]


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


class _Engine:
    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.requests: dict[str, tuple[int, int, list[int]]] = {}

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> str:
        if params.temperature != 0.0:
            raise ValueError(f"fake vLLM: greedy expected, got {params}")
        ids = prompt["prompt_token_ids"]
        self.requests[request_id] = (sum(ids), params.max_tokens, [], params.ignore_eos)
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        outs = []
        for request_id, (base, max_tokens, tokens, ignore_eos) in list(self.requests.items()):
            tokens.append((base + len(tokens) + self.offset) % 1000)
            finished = len(tokens) >= max_tokens or (not ignore_eos and tokens[-1] == 0)
            outs.append(RequestOutput(request_id, [CompletionOutput(list(tokens))], finished))
            if finished:
                del self.requests[request_id]
        return outs


class _Tokenizer:
    def __call__(self, text: str):
        return type("Encoding", (), {"input_ids": [ord(c) % 1000 for c in text]})()


class LLM:
    def __init__(
        self, model: str, dtype: str = "auto", enable_prefix_caching: bool = False, seed: int = 0, **kwargs
    ) -> None:
        if not enable_prefix_caching:
            raise ValueError("fake vLLM: the benchmark runs vLLM with prefix caching on")
        if not os.path.isdir(model):
            raise ValueError(f"fake vLLM: {model} is not a checkpoint directory")
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            raise ValueError("fake vLLM: VLLM_CPU_KVCACHE_SPACE is not set")
        self.llm_engine = _Engine({"float32": 0, "bfloat16": 1}[dtype])

    def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer()
