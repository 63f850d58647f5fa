"""``POST /v1/completions``: text completions, whole or streamed, with logprobs and usage."""

from __future__ import annotations

from deploy.openai.prompts import Plan
from deploy.openai.protocol import CompletionRequest
from deploy.openai.serving_common import OpenAIServing, StreamState, completion_logprobs, finish_reason
from deploy.openai.triton_client import Piece


class OpenAIServingCompletion(OpenAIServing):
    """Completions: a choice per prompt and ``n``; logprobs with ``text_offset`` per choice."""

    request_type = CompletionRequest
    id_prefix = "cmpl"
    object_kind = "text_completion"
    chunk_kind = "text_completion"

    def choice(self, plan: Plan, index: int, piece: Piece) -> dict:
        tokenizer = plan.model.tokenizer
        return {
            "index": index,
            "text": piece.text,
            "logprobs": completion_logprobs(tokenizer, piece, 0) if plan.logprobs is not None else None,
            "finish_reason": finish_reason(piece.finish_reason),
        }

    def render(self, state: StreamState, piece: Piece) -> bytes:
        plan = state.plan
        key = (piece.prompt_index, piece.index)
        logprobs = None
        if plan.logprobs is not None:
            logprobs = completion_logprobs(plan.model.tokenizer, piece, state.offsets.get(key, 0))
        state.offsets[key] = state.offsets.get(key, 0) + len(piece.text)
        choice = {
            "index": piece.prompt_index * plan.n + piece.index,
            "text": piece.text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(piece.finish_reason),
        }
        return state.chunk([choice])
