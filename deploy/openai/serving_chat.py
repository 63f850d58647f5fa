"""``POST /v1/chat/completions``: chat completions, whole or streamed, with logprobs, usage and tool calls.

With tools (``deploy.openai.tools``) each choice's text goes through its tool-call parser: a whole
message gets ``tool_calls`` (``content`` null when the model wrote only calls) and a stream gets
``delta.tool_calls`` entries; a choice that called tools and ended normally finishes with
``tool_calls``.
"""

from __future__ import annotations

from deploy.openai.prompts import Plan
from deploy.openai.protocol import ChatCompletionRequest
from deploy.openai.serving_common import OpenAIServing, StreamState, chat_logprobs, finish_reason
from deploy.openai.triton_client import Piece


def _tool_finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason of a choice that called tools: ``tool_calls``, unless it was cut (``length``)."""
    return "tool_calls" if called and reason == "stop" else reason


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
        message = {"role": "assistant", "content": piece.text}
        reason = finish_reason(piece.finish_reason)
        parser = plan.tools.new_parser() if plan.tools is not None else None
        if parser is not None:
            content, calls = parser.extract(piece.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = _tool_finish(reason, True)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def render(self, state: StreamState, piece: Piece) -> bytes:
        plan = state.plan
        index = piece.prompt_index * plan.n + piece.index
        out = []
        if index not in state.started:  # the first chunk of a choice names the role
            state.started.add(index)
            opening = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            out.append(state.chunk([{**opening, "finish_reason": None}]))
            if plan.tools is not None:
                state.tool_parsers[index] = plan.tools.new_parser()
        logprobs = None
        if plan.logprobs is not None:
            logprobs = chat_logprobs(plan.model.tokenizer, piece, plan.logprobs or 0)
        delta = {"content": piece.text} if piece.text else {}
        reason = finish_reason(piece.finish_reason)
        parser = state.tool_parsers.get(index)
        if parser is not None:
            parsed = parser.feed(piece.text)
            if piece.finish_reason is not None:
                parsed = parsed.merge(parser.finish())
                reason = _tool_finish(reason, bool(parser.calls))
            delta = {"content": parsed.content} if parsed.content else {}
            if parsed.tool_calls:
                delta["tool_calls"] = parsed.tool_calls
            if not delta and reason is None and logprobs is None:
                return b"".join(out)  # the parser holds this text back (a call's start, maybe)
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        out.append(state.chunk([choice]))
        return b"".join(out)
