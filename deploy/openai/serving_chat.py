"""``POST /v1/chat/completions``: chat completions, whole or streamed, with logprobs and usage."""

from __future__ import annotations

from deploy.openai.prompts import Plan
from deploy.openai.protocol import ChatCompletionRequest
from deploy.openai.serving_common import OpenAIServing, StreamState, chat_logprobs, finish_reason
from deploy.openai.triton_client import Piece


class OpenAIServingChat(OpenAIServing):
    """Chat completions: an assistant message per choice; a stream opens each choice with its role."""

    request_type = ChatCompletionRequest
    id_prefix = "chatcmpl"
    object_kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"

    def choice(self, plan: Plan, index: int, piece: Piece) -> dict:
        logprobs = None
        if plan.logprobs is not None:
            logprobs = chat_logprobs(plan.model.tokenizer, piece, plan.logprobs or 0)
        return {
            "index": index,
            "message": {"role": "assistant", "content": piece.text},
            "logprobs": logprobs,
            "finish_reason": finish_reason(piece.finish_reason),
        }

    def render(self, state: StreamState, piece: Piece) -> bytes:
        plan = state.plan
        index = piece.prompt_index * plan.n + piece.index
        out = []
        if index not in state.started:  # the first chunk of a choice names the role
            state.started.add(index)
            opening = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            out.append(state.chunk([{**opening, "finish_reason": None}]))
        logprobs = None
        if plan.logprobs is not None:
            logprobs = chat_logprobs(plan.model.tokenizer, piece, plan.logprobs or 0)
        choice = {
            "index": index,
            "delta": {"content": piece.text} if piece.text else {},
            "logprobs": logprobs,
            "finish_reason": finish_reason(piece.finish_reason),
        }
        out.append(state.chunk([choice]))
        return b"".join(out)
