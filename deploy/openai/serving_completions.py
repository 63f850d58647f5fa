"""``POST /v1/completions``: text completions, whole or streamed, with logprobs and usage; ``echo`` puts
the prompt (and, with ``logprobs``, its tokens' logprobs, the first ``null``) before each choice's text."""

from __future__ import annotations

from deploy.openai.prompts import Plan
from deploy.openai.protocol import CompletionRequest
from deploy.openai.serving_common import (
    OpenAIServing,
    StreamState,
    completion_logprobs,
    echo_logprobs,
    finish_reason,
)
from deploy.openai.triton_client import Piece


class OpenAIServingCompletion(OpenAIServing):
    """Completions: a choice per prompt and ``n``; logprobs with ``text_offset`` per choice."""

    request_type = CompletionRequest
    id_prefix = "cmpl"
    object_kind = "text_completion"
    chunk_kind = "text_completion"

    def choice(self, plan: Plan, index: int, piece: Piece) -> dict:
        tokenizer = plan.model.tokenizer
        text, logprobs = piece.text, None
        if plan.echo:
            text = plan.prompt_texts[piece.prompt_index] + text
            if plan.logprobs is not None:
                logprobs = echo_logprobs(tokenizer, plan.prompts[piece.prompt_index], piece.prompt_logprobs, piece)
        elif plan.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, piece, 0)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(piece.finish_reason)}

    def render(self, state: StreamState, piece: Piece) -> bytes:
        plan = state.plan
        key = (piece.prompt_index, piece.index)
        index = piece.prompt_index * plan.n + piece.index
        text, logprobs = piece.text, None
        if plan.echo and index not in state.started:  # a choice's first chunk starts with the prompt
            state.started.add(index)
            text = plan.prompt_texts[piece.prompt_index] + text
            if plan.logprobs is not None:
                prompt = state.prompt_logprobs.get(piece.prompt_index)
                logprobs = echo_logprobs(plan.model.tokenizer, plan.prompts[piece.prompt_index], prompt, piece)
                state.offsets[key] = sum(len(t) for t in logprobs["tokens"])
        elif plan.logprobs is not None:
            logprobs = completion_logprobs(plan.model.tokenizer, piece, state.offsets.get(key, 0))
            state.offsets[key] = state.offsets.get(key, 0) + len(piece.text)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(piece.finish_reason),
        }
        return state.chunk([choice])
