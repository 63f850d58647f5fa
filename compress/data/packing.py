"""Tokenization with the chat template, assistant-only loss masks, and packing.

A dialog is rendered with the tokenizer's chat template; only the tokens of assistant turns
(content and end-of-turn marker) get labels, every other position is ``IGNORE_INDEX`` (-100, what
``torch.nn.functional.cross_entropy`` and ``transformers`` models ignore). A ``{"text"}`` record is
trained on all its tokens plus EOS. Tokenized examples are packed greedily, whole, into rows of
``max_length`` tokens (an example longer than that is truncated); rows are right-padded with the
pad token, label -100, attention mask 0. Packed examples in one row attend to each other, as in
the usual "concat-and-chunk" packing of GPT-style pre-training.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

IGNORE_INDEX = -100


def _render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Render a dialog and find the character spans of its assistant replies.

    Returns:
        ``(text, spans)``: the full rendering and ``[(start, end), ...]`` character ranges that
        cover each assistant reply and its end-of-turn marker.

    Raises:
        ValueError: the chat template does not render a dialog's prefixes as prefixes of the
            whole dialog (needed to locate the replies).
    """
    text = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else None
        upto = _render(tokenizer, messages[: i + 1])
        if head is None or not text.startswith(upto) or not upto.startswith(head):
            raise ValueError(
                "the chat template does not render dialog prefixes as text prefixes; start dialogs with a user "
                "or system turn"
            )
        spans.append((len(head), len(upto)))
    return text, spans


def tokenize_record(tokenizer, record: dict[str, Any], max_length: int) -> tuple[list[int], list[int]]:
    """Token ids and labels of one record, truncated to ``max_length``.

    Returns:
        ``(input_ids, labels)``, equal lengths; labels are ``IGNORE_INDEX`` outside assistant
        replies (dialogs) and equal to the ids for text records.
    """
    if "messages" in record:
        text, spans = assistant_spans(tokenizer, record["messages"])
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        labels = [
            tok if any(start <= s < end for start, end in spans) else IGNORE_INDEX
            for tok, (s, _) in zip(ids, enc["offset_mapping"])
        ]
    else:
        ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        labels = list(ids)
    return ids[:max_length], labels[:max_length]


@dataclasses.dataclass
class PackedData:
    """Packed rows ready for a causal LM.

    Attributes:
        input_ids: ``(num_rows, max_length)`` int64.
        labels: ``(num_rows, max_length)`` int64, ``IGNORE_INDEX`` where no loss is taken.
        attention_mask: ``(num_rows, max_length)`` int64, 0 on padding.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, rows: list[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows ``rows`` as a model batch (``input_ids``, ``labels``, ``attention_mask``)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        return {
            "input_ids": self.input_ids[rows],
            "labels": self.labels[rows],
            "attention_mask": self.attention_mask[rows],
        }

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def pack(examples: list[tuple[list[int], list[int]]], max_length: int, pad_token_id: int) -> PackedData:
    """Pack tokenized examples greedily, in order, whole, into rows of ``max_length`` tokens.

    Raises:
        ValueError: no example has a label token (nothing to train on).
    """
    rows: list[tuple[list[int], list[int]]] = []
    ids, labels = [], []
    for ex_ids, ex_labels in examples:
        if ids and len(ids) + len(ex_ids) > max_length:
            rows.append((ids, labels))
            ids, labels = [], []
        ids, labels = ids + ex_ids, labels + ex_labels
    if ids:
        rows.append((ids, labels))
    input_ids = torch.full((len(rows), max_length), pad_token_id, dtype=torch.long)
    label_t = torch.full((len(rows), max_length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), max_length), dtype=torch.long)
    for r, (row_ids, row_labels) in enumerate(rows):
        n = len(row_ids)
        input_ids[r, :n] = torch.tensor(row_ids)  # (n,)
        label_t[r, :n] = torch.tensor(row_labels)
        mask[r, :n] = 1
    packed = PackedData(input_ids, label_t, mask)
    if packed.num_label_tokens == 0:
        raise ValueError("no label tokens after tokenization: the data has no assistant replies or text")
    return packed


def tokenize_and_pack(tokenizer, records: list[dict[str, Any]], max_length: int) -> PackedData:
    """``tokenize_record`` every record, then ``pack`` them (see the module docstring)."""
    if max_length < 8:
        raise ValueError(f"max_length={max_length}: use at least 8 tokens")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pack([tokenize_record(tokenizer, r, max_length) for r in records], max_length, pad)
