"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's bodies and answers, on the tokenizer the
frontend itself uses for the served LLM (so the ids are those ``/v1/completions`` and
``/v1/chat/completions`` send to the engine).

* ``{"model", "prompt", "add_special_tokens"}`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``;
* ``{"model", "messages", "add_generation_prompt", "tools", "tool_choice", ...}``: the messages and
  tools through the model's chat template first (as the chat endpoint renders them);
* ``{"model", "tokens"}`` -> ``{"prompt"}``;
* ``GET /tokenizer_info``: the tokenizer's special tokens, chat template and ``model_max_length``
  (what lm-evaluation-harness' remote tokenizer reads before it tokenizes through ``/tokenize``).

``model`` may be left out when one LLM is served (lm-evaluation-harness probes ``/tokenize`` so);
a LoRA adapter's name gives its base's tokenizer.
"""

from __future__ import annotations

import orjson
from pydantic import ValidationError

from deploy.openai.models import ServedModel
from deploy.openai.prompts import render_chat, template_dicts
from deploy.openai.protocol import (
    DetokenizeRequest,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    validation_error,
)
from deploy.openai.tools import tool_plan


class OpenAIServingTokenization:
    """vLLM's tokenizer routes for the served LLMs."""

    def __init__(self, models: dict[str, ServedModel]) -> None:
        self.models = models

    def tokenize(self, body: bytes) -> dict:
        """Raises: OpenAIError: 400 a bad body or messages the chat template refuses; 404 an unknown model."""
        try:
            fields = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise OpenAIError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from exc
        chat = isinstance(fields, dict) and "messages" in fields
        try:
            request = (TokenizeChatRequest if chat else TokenizeCompletionRequest).model_validate(fields)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        model = self._find(request.model)
        tokenizer = model.tokenizer
        if chat:
            text = self._render_chat(request, model)
        else:
            text = request.prompt
        ids = list(tokenizer(text, add_special_tokens=request.add_special_tokens).input_ids)
        return {
            "count": len(ids),
            "max_model_len": model.max_model_len,
            "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None,
        }

    def detokenize(self, body: bytes) -> dict:
        """Raises: OpenAIError: 400 a bad body or a token id outside the vocabulary; 404 an unknown model."""
        try:
            request = DetokenizeRequest.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        model = self._find(request.model)
        for i, token in enumerate(request.tokens):
            if not 0 <= token < model.vocab_size:
                param = f"tokens.{i}"
                message = f"{param}: token id {token} is outside the vocabulary [0, {model.vocab_size})"
                raise OpenAIError(400, message, param=param)
        return {"prompt": model.tokenizer.decode(request.tokens)}

    def tokenizer_info(self, name: str | None) -> dict:
        """Raises: OpenAIError: 400 no ``model`` while several are served; 404 an unknown model."""
        model = self._find(name)
        tokenizer = model.tokenizer
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "chat_template": tokenizer.chat_template,
            "model_max_length": model.max_model_len,
        }

    def _find(self, name: str | None) -> ServedModel:
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise OpenAIError(400, f"model: several models are served ({sorted(self.models)}); name one", param="model")
        model = self.models.get(name) or next((m for m in self.models.values() if name in m.adapters), None)
        if model is None:
            served = sorted([*self.models, *(a for m in self.models.values() for a in m.adapters)])
            raise OpenAIError(
                404, f"the model `{name}` does not exist; served: {served}", param="model", code="model_not_found"
            )
        return model

    @staticmethod
    def _render_chat(request: TokenizeChatRequest, model: ServedModel) -> str:
        """The messages and tools through the model's chat template (as the chat endpoint renders them), as
        text (tokenized after, like vLLM)."""
        if request.add_generation_prompt and request.continue_final_message:
            raise OpenAIError(
                400,
                "continue_final_message: set add_generation_prompt=false with it (both cannot hold)",
                param="continue_final_message",
            )
        return render_chat(
            model,
            template_dicts(request.messages),
            tool_plan(request, model.tool_call_parser),
            "send `prompt`",
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tokenize=False,
            **(request.chat_template_kwargs or {}),
        )
