"""Incremental detokenization that never emits half of a multi-byte character.

Scheme (as in Hugging Face text-generation-inference and vLLM): decode a short window of
tokens twice, with and without the newest tokens; the difference is the new text. A window
that ends in U+FFFD (an incomplete UTF-8 sequence of byte-level BPE) is held back until the
next token completes it.
"""

from __future__ import annotations

#: Prompt tokens kept as left context so the first output token decodes with its leading space.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        prompt_token_ids: the prompt (its last few tokens give left context).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._decode = _window_decoder(tokenizer)

    def add_token(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        decode = self._decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""


def _window_decoder(tokenizer):
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=True)``.

    A fast (Rust) tokenizer is called directly, with the wrapper's clean-up applied where the
    tokenizer asks for it: the same text without the Python wrapper's per-call work (about 2 ms
    per step at 64 requests, two calls per request).
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: tokenizer.clean_up_tokenization(backend.decode(ids, skip_special_tokens=True))
    return lambda ids: backend.decode(ids, skip_special_tokens=True)
